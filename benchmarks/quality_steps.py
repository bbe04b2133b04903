"""Quality per step: PowerSGD configurations against allreduce on the demo's tasks, same steps, data order
and initial weights for every run (``gradpress.workloads.training.train``, the demo's code path).

One run per call, its JSON kept in ``--out`` (default ``benchmarks/results/quality``)::

    python3 benchmarks/quality_steps.py --task charlm --workers 2 --steps 800 --start-iter 80 \\
        --method allreduce --lr 0.5 --momentum 0.9 --label charlm-w2-allreduce-lr0.5
    python3 benchmarks/quality_steps.py --task charlm --workers 2 --steps 800 --start-iter 80 \\
        --method powersgd:4 --lr 0.5 --momentum 0.9 --options '{"num_iters_per_step": 2}' --label ...
    python3 benchmarks/quality_steps.py --table --baseline charlm-w2-allreduce-lr0.5 [--match charlm-w2]

``--options`` is a JSON object of further ``PowerSGDState`` arguments (``rank_policy``,
``num_iters_per_step``, ``adaptive_rank`` as ``{"low": 2, "high": 8, "every": 40}``, ...). The table
gives, per run: perplexity at mid-run and at the end, the steps it needs to reach the baseline's mid-run
perplexity relative to the baseline's (interpolated between evaluations), the final perplexity against
the baseline's, and the bytes per step after warm-up relative to allreduce's (as PowerSGDState counted
them). Not part of CI: a run of charlm, 800 steps on 2 workers takes 2-3 minutes on 2 cores.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
DEFAULT_OUT = HERE / "results" / "quality"


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _worker(rank: int, args: argparse.Namespace, port: int) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    import torch
    import torch.distributed as dist

    from gradpress import AdaptiveRank
    from gradpress.workloads.training import DemoConfig, parse_methods, train

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=args.workers)
    options = json.loads(args.options) if args.options else None
    if options and isinstance(options.get("adaptive_rank"), dict):
        options["adaptive_rank"] = AdaptiveRank(**options["adaptive_rank"])
    config = DemoConfig(task=args.task, steps=args.steps, start_iter=args.start_iter, evals=args.evals,
                        seed=args.seed, lr=args.lr, momentum=args.momentum, powersgd_options=options)
    result = train(rank, args.workers, parse_methods(args.method, [1])[0], config)
    if rank == 0:
        counted = result.get("counted") or {}
        compressed = counted.get("compressed_steps")
        after = counted.get("bytes_after")
        per_step = (after / compressed if compressed else result["bytes_per_step"]) if after else result["bytes_per_step"]
        record = {"label": args.label, "task": args.task, "workers": args.workers, "steps": args.steps,
                  "start_iter": args.start_iter, "method": args.method, "lr": args.lr, "momentum": args.momentum,
                  "options": args.options, "seed": args.seed, "command": " ".join(sys.argv),
                  "bytes_per_step": per_step, "bytes_allreduce_per_step": result["bytes_allreduce_per_step"],
                  "final": result["metric"], "time_per_step_s": result["time_per_step_s"],
                  "approximation_error": result.get("approximation_error"),
                  "approximation_errors": result.get("approximation_errors"), "curve": result["curve"]}
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / f"{args.label}.json").write_text(json.dumps(record, indent=1))
        print(f"{args.label}: final {result['metric']:.3f}, {per_step:,.0f} B/step", flush=True)
    dist.destroy_process_group()


def _at(curve: list[dict[str, Any]], step: int) -> float:
    """The metric at ``step``, interpolated between evaluations."""
    points = [(p["step"], p["metric"]) for p in curve]
    for (s0, m0), (s1, m1) in zip(points, points[1:]):
        if s0 <= step <= s1:
            return m0 + (m1 - m0) * (step - s0) / (s1 - s0)
    return points[-1][1]


def steps_to_reach(curve: list[dict[str, Any]], target: float) -> float | None:
    """The first step at which the (lower-is-better) metric reaches ``target``, interpolated linearly
    between the two evaluations around the crossing; ``None`` if it never does."""
    points = [(p["step"], p["metric"]) for p in curve]
    for (s0, m0), (s1, m1) in zip(points, points[1:]):
        if m1 <= target:
            if m0 <= target or m0 == m1:
                return float(s1 if m0 > target else s0)
            return s0 + (s1 - s0) * (m0 - target) / (m0 - m1)
    return None


def table(folder: Path, baseline: str, match: str) -> str:
    runs = {p.stem: json.loads(p.read_text()) for p in sorted(folder.glob("*.json"))}
    runs = {label: r for label, r in runs.items() if {"lr", "method", "curve"} <= set(r)}  # this script's records
    base = runs[baseline]
    mid = base["steps"] // 2
    target = _at(base["curve"], mid)
    base_steps = steps_to_reach(base["curve"], target) or float(mid)
    lines = [f"Baseline {baseline}: perplexity {target:.3f} at step {mid}, {base['final']:.3f} at the end.", "",
             "| run | method | lr | momentum | options | ppl mid | ppl end | steps to baseline's mid / its | "
             "end vs baseline | bytes/step fewer |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for label, r in runs.items():
        if match not in label:
            continue
        reach = steps_to_reach(r["curve"], target)
        ratio = "never" if reach is None else f"{reach / base_steps:.2f}x"
        fewer = r["bytes_allreduce_per_step"] / r["bytes_per_step"] if r["bytes_per_step"] else float("inf")
        lines.append(f"| {label} | {r['method']} | {r['lr']} | {r['momentum']} | {r['options'] or ''} | "
                     f"{_at(r['curve'], mid):.3f} | {r['final']:.3f} | {ratio} | "
                     f"{100 * (r['final'] / base['final'] - 1):+.1f}% | {fewer:.1f}x |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--task", default="charlm")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--steps", type=int, default=800)
    parser.add_argument("--start-iter", type=int, default=80)
    parser.add_argument("--evals", type=int, default=20)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--lr", type=float, default=None)
    parser.add_argument("--momentum", type=float, default=0.9)
    parser.add_argument("--method", default="allreduce")
    parser.add_argument("--options", default=None, help="JSON object of further PowerSGDState arguments")
    parser.add_argument("--label", default=None)
    parser.add_argument("--out", default=str(DEFAULT_OUT))
    parser.add_argument("--table", action="store_true", help="print the table of the runs in --out")
    parser.add_argument("--baseline", default=None, help="--table: the label of the baseline run")
    parser.add_argument("--match", default="", help="--table: only labels containing this")
    args = parser.parse_args()
    if args.table:
        if not args.baseline:
            parser.error("--table needs --baseline LABEL")
        print(table(Path(args.out), args.baseline, args.match))
        return
    if args.label is None:
        parser.error("--label is required for a run (the JSON's name)")
    import torch.multiprocessing as mp

    mp.start_processes(_worker, args=(args, _free_port()), nprocs=args.workers, start_method="spawn")


if __name__ == "__main__":
    main()

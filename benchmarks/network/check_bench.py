"""Does ``gradpress check``'s advice hold? Its predicted step times against measured ones, per link rate.

For each ``--rates``, builds 2 ranks in network namespaces (``netns.py``: veth + ``tc tbf`` both ways),
runs the check's own code (:func:`gradpress.tools.check.report.collect`: correctness, link, hook compute, the
predictions) on ``--task``, then trains the task for ``--steps`` steps with each of ``--methods``
(``gradpress.tools.workloads.training.train``, the demo's loop) and records the measured time per step. Needs
root and iproute2. Not part of CI.

    sudo python3 benchmarks/network/check_bench.py --rates 100mbit,10gbit --task charlm-wide \\
        --json benchmarks/results/network/check-charlm-wide.json

The measured step includes the optimizer step and data handling, which the prediction leaves out, and
``start_iter`` allreduce steps before PowerSGD and local SGD start (kept small: 2).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from netns import Network, NetworkError, check_can_build  # noqa: E402

#: Demo method spec -> the name ``gradpress check`` predicts it under.
#: PowerSGD runs as docs/tuning.md recommends (rank 22 on an fp16 wire), which the check also predicts.
METHODS = {"allreduce": "allreduce", "fp16": "fp16", "powersgd:22": "powersgd-r22-fp16", "localsgd:8": "local-sgd-h8"}
POWERSGD_OPTIONS = {"bytes_per_weight": 2}


def worker(args: argparse.Namespace) -> None:
    """One rank: the check, then a short training run per method; rank 0 writes the results."""
    import torch
    import torch.distributed as dist

    from gradpress.tools.check.compute import step_ms
    from gradpress.tools.check.loader import load_model
    from gradpress.tools.check.report import collect
    from gradpress.tools.workloads import DemoConfig, parse_methods, train

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://{os.environ['MASTER_ADDR']}:{args.port}",
                            rank=args.rank, world_size=args.world_size)
    device = torch.device("cpu")
    report = collect(args.task, device, iters=3)
    model, batch, loss = load_model(args.task, device)
    measured, compute_now = {}, {}
    config = DemoConfig(task=args.task, steps=args.steps, start_iter=2, evals=1, seed=0,
                        powersgd_options=POWERSGD_OPTIONS)
    for method in parse_methods(",".join(METHODS), [22]):
        # The compute step again, just before this method trains: on a busy machine it drifts between
        # the check and the run, and this separates that drift from the link model's error.
        now = torch.tensor([step_ms(model, batch, loss, device)], dtype=torch.float64)
        dist.all_reduce(now, op=dist.ReduceOp.MAX)
        result = train(args.rank, args.world_size, method, config)
        measured[METHODS[method.spec]] = 1000 * result["time_per_step_s"]
        compute_now[METHODS[method.spec]] = float(now)
    dist.destroy_process_group()
    if args.rank == 0:
        Path(args.json).write_text(json.dumps({"check": report, "measured_ms": measured,
                                               "compute_ms_before_run": compute_now}))


def markdown(results: dict[str, Any]) -> str:
    """Per rate and method: the check's prediction, the measured step, and the prediction with the compute
    step re-measured just before that method's run (same hook compute and link time)."""
    lines = ["| link | method | predicted ms | measured ms | measured / predicted | predicted, compute re-measured "
             "| measured / that | recommended |", "|---|---|---|---|---|---|---|---|"]
    for rate, result in results["rates"].items():
        check = result["check"]
        rows = {p["name"]: p for p in check["predictions"]}
        best = check["recommendation"]["method"]
        for name, ms in result["measured_ms"].items():
            row = rows[name]
            again = result["compute_ms_before_run"][name] + row["hook_ms"] + row["comm_ms"]
            lines.append(f"| {rate} | {name} | {row['predicted_ms']:.0f} | {ms:.0f} | {ms / row['predicted_ms']:.2f} "
                         f"| {again:.0f} | {ms / again:.2f} | {'yes' if name == best else ''} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="gradpress check's predictions against measured steps (root).")
    parser.add_argument("--rates", default="100mbit,10gbit")
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--task", default="charlm-wide")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--timeout", type=float, default=1200)
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--rank", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.rank is not None:
        worker(args)
        return 0
    try:
        check_can_build()
    except NetworkError as exc:
        print(f"check_bench.py: error: {exc}", file=sys.stderr)
        return 2
    from run import run_workers

    rates = [r.strip() for r in args.rates.split(",") if r.strip()]
    results: dict[str, Any] = {"command": " ".join(["python3", "benchmarks/network/check_bench.py",
                                                     *(argv if argv is not None else sys.argv[1:])]),
                               "task": args.task, "world_size": args.world_size, "rates": {}}
    forwarded = ["--task", args.task, "--steps", str(args.steps)]
    with Network(args.world_size, rates[0]) as net:
        for rate in rates:
            net.set_rate(rate)
            print(f"== {args.world_size} ranks, {rate} ==", file=sys.stderr, flush=True)
            results["rates"][rate] = run_workers(net, Path(__file__), forwarded, args.timeout)
            print(markdown({"rates": {rate: results["rates"][rate]}}), file=sys.stderr, flush=True)
    print(markdown(results))
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

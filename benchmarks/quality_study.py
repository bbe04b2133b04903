"""Quality per step of PowerSGD configurations against a tuned allreduce, on the demo's tasks.

Every run goes through ``gradpress.tools.workloads.training.train`` (the demo's code path) with the same
``DemoConfig`` fields but the method, lr, momentum and PowerSGD options, so every run sees the same data
in the same order from the same initial weights. One run per call, ``--workers`` gloo processes on this
machine (OMP_NUM_THREADS=1, one torch thread each), one JSON per run in ``--out``::

    python3 benchmarks/quality_study.py --task charlm --workers 2 --steps 800 --start-iter 80 --evals 20 \\
        --methods allreduce --lr 2.0 --momentum 0.9 --label study-charlm-w2-allreduce-m0.9-lr2.0
    python3 benchmarks/quality_study.py --methods powersgd:8 --lr 2.0 \\
        --powersgd-options '{"num_iters_per_step": 2}' --label study-charlm-w2-powersgd8-iters2-lr2.0
    python3 benchmarks/quality_study.py --table [--out DIR] [--baseline LABEL]

``--table`` reads every JSON in ``--out`` (including the older records without ``config``) and prints
a markdown table: perplexity at mid-run and at the end; the steps a run needs to reach the baseline's
mid-run perplexity over the steps the baseline needs (interpolated linearly between evaluations), and
the same on curves smoothed over 3 evaluations (one evaluation's swing moves a crossing by an eval
interval); the final perplexity against the baseline's, and the mean of the last 3 evaluations against
the baseline's; the lowest perplexity of the run against the baseline's lowest (:func:`best`); the
bytes per step after warm-up, as ``PowerSGDState`` counted them, against allreduce's; the whole run's
bytes (``start_iter`` allreduce steps included) against allreduce's.
The baseline of each (task, workers, steps, seed) is the allreduce run with the lowest final perplexity
(its lr tuned over the runs in the folder), or the one ``--baseline`` names (a comma-separated list,
one label per group). Not part of CI: a charlm run of 800 steps on 2 workers takes 2-5 minutes on 2
shared cores. ``--device cuda`` puts every worker on a GPU (several runs can share one: an H100 ran ten
2-worker gpt runs at 2 x 256 sequences at once in ~3 minutes); a run's baseline is then allreduce on the
same device. ``--outer-lr``/``--outer-momentum`` set DiLoCo's outer optimizer, as in replica_study.py.
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


def metric_at(curve: list[dict[str, Any]], step: float) -> float:
    """The metric at ``step``, interpolated linearly between the evaluations around it (clamped to the
    first/last evaluation outside them).

    >>> metric_at([{"step": 0, "metric": 10.0}, {"step": 40, "metric": 6.0}], 30)
    7.0
    """
    points = [(p["step"], p["metric"]) for p in curve]
    if step <= points[0][0]:
        return points[0][1]
    for (s0, m0), (s1, m1) in zip(points, points[1:]):
        if s0 <= step <= s1:
            return m0 + (m1 - m0) * (step - s0) / (s1 - s0)
    return points[-1][1]


def steps_to_reach(curve: list[dict[str, Any]], target: float) -> float | None:
    """The first step at which the (lower-is-better) metric is <= ``target``, interpolated linearly
    between the two evaluations around the crossing; ``None`` if it never gets there.

    >>> curve = [{"step": 0, "metric": 10.0}, {"step": 40, "metric": 6.0}, {"step": 80, "metric": 4.0}]
    >>> steps_to_reach(curve, 5.0), steps_to_reach(curve, 10.0), steps_to_reach(curve, 3.0)
    (60.0, 0.0, None)
    """
    points = [(p["step"], p["metric"]) for p in curve]
    if points[0][1] <= target:
        return float(points[0][0])
    for (s0, m0), (s1, m1) in zip(points, points[1:]):
        if m1 <= target:
            return s0 + (s1 - s0) * (m0 - target) / (m0 - m1)
    return None


def smoothed(curve: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The curve with each metric replaced by the mean of it and its neighbours (3 evaluations; 2 at the
    ends): single evaluations swing by a few percent, enough to move a crossing by an eval interval.

    >>> [p["metric"] for p in smoothed([{"step": 0, "metric": 9.0}, {"step": 1, "metric": 3.0},
    ...                                  {"step": 2, "metric": 6.0}])]
    [6.0, 6.0, 4.5]
    """
    out = []
    for i, point in enumerate(curve):
        near = curve[max(0, i - 1):i + 2]
        out.append({"step": point["step"], "metric": sum(p["metric"] for p in near) / len(near)})
    return out


def tail_mean(curve: list[dict[str, Any]], n: int = 3) -> float:
    """The mean metric of the last ``n`` evaluations: less noisy than the last one alone.

    >>> tail_mean([{"metric": 9.0}, {"metric": 4.0}, {"metric": 3.0}, {"metric": 5.0}])
    4.0
    """
    return sum(p["metric"] for p in curve[-n:]) / len(curve[-n:])


def normalize(record: dict[str, Any], name: str) -> dict[str, Any]:
    """One run's JSON, this script's current or older layout, as the fields the table uses."""
    if "config" in record:  # this script's
        config = record["config"]
        return {"label": record["label"], "task": config["task"], "workers": record["workers"],
                "steps": config["steps"], "seed": config["seed"], "start_iter": config["start_iter"],
                "lr": config["lr"], "momentum": config["momentum"], "method": record["method"],
                "optimizer": config.get("optimizer", "sgd"), "batch": config.get("batch_size"),
                "device": record.get("device", "cpu"),
                "options": {k: v for k, v in (("powersgd_options", config.get("powersgd_options")),
                                              ("warm_up_beta", config.get("warm_up_beta")),
                                              ("clip_grad_norm", config.get("clip_grad_norm")),
                                              ("clip_before_averaging", config.get("clip_before_averaging") or None))
                            if v is not None},
                "curve": record["curve"], "final": record["curve"][-1]["metric"],
                "bytes_per_step": record["bytes_per_step"],
                "bytes_allreduce_per_step": record["bytes_allreduce_per_step"], "command": record["command"]}
    options = json.loads(record["options"]) if record.get("options") else {}
    return {"label": record.get("label", name), "task": record["task"], "workers": record["workers"],
            "steps": record["steps"], "seed": record["seed"], "start_iter": record["start_iter"],
            "lr": record["lr"], "momentum": record["momentum"], "method": record["method"],
            "optimizer": "sgd", "batch": None,
            "options": {"powersgd_options": options} if options else {}, "curve": record["curve"],
            "final": record["curve"][-1]["metric"], "bytes_per_step": record["bytes_per_step"],
            "bytes_allreduce_per_step": record["bytes_allreduce_per_step"],
            "command": "python3 " + record["command"]}


def group(run: dict[str, Any]) -> tuple:
    """The runs one baseline serves: same task, workers, steps, seed, optimizer, batch size and device (a
    GPU rounds differently from the CPU, and a GPU machine's Python may ship another text: a run is compared
    with allreduce on its own device)."""
    return (run["task"], run["workers"], run["steps"], run["seed"], run.get("optimizer", "sgd"), run.get("batch"),
            run.get("device", "cpu"))


def optimizer_name(run: dict[str, Any]) -> str:
    optimizer = run.get("optimizer", "sgd")
    return f"sgd m{run['momentum']:g}" if optimizer == "sgd" else optimizer


def pick_baselines(runs: list[dict[str, Any]]) -> dict[tuple, dict[str, Any]]:
    """Per :func:`group`: the allreduce run with the lowest final metric."""
    best: dict[tuple, dict[str, Any]] = {}
    for run in runs:
        key = group(run)
        if run["method"] == "allreduce" and (key not in best or run["final"] < best[key]["final"]):
            best[key] = run
    return best


def best(curve: list[dict[str, Any]]) -> float:
    """The lowest metric of the curve: the held-out perplexity a run that keeps its best checkpoint ends
    with. Where the data is seen many times over (large global batches on the demo's 465k characters)
    the held-out perplexity turns up before the end, and the final one measures that overfitting too.

    >>> best([{"step": 0, "metric": 9.0}, {"step": 1, "metric": 3.0}, {"step": 2, "metric": 4.0}])
    3.0
    """
    return min(p["metric"] for p in curve)


def table(runs: list[dict[str, Any]], baseline: str | None = None) -> str:
    """The markdown table of ``runs`` (normalized), each against its group's baseline: the runs labelled in
    ``baseline`` (comma-separated), else the group's best allreduce by final metric."""
    named = {r["label"]: r for r in runs}
    baselines = pick_baselines(runs)
    for label in (baseline.split(",") if baseline else []):  # chosen ones, one per group
        chosen = named[label]
        baselines[group(chosen)] = chosen
    lines, seen = [], set()
    rows = ["| label | task | workers | optimizer | batch | lr | method | options | start | ppl@mid | ppl@end | "
            "steps to base mid / base's | same, smoothed curves | end vs base | last 3 evals vs base's | "
            "best vs base's best | bytes/step after warm-up: x fewer | "
            "whole run's bytes: x fewer |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    order = sorted(runs, key=lambda r: (r["task"], r["workers"], r.get("optimizer", "sgd"), r.get("batch") or 0,
                                        r["method"] != "allreduce", -r["momentum"], r["method"], r["lr"], r["label"]))
    for run in order:
        base = baselines.get(group(run))
        if base is None:
            continue
        mid = base["steps"] // 2
        target = metric_at(base["curve"], mid)
        base_steps = steps_to_reach(base["curve"], target)
        if base["label"] not in seen:
            seen.add(base["label"])
            where = "" if base.get("device", "cpu") == "cpu" else f", on {base['device']}"
            lines.append(f"Baseline {base['label']} ({base['task']}, {base['workers']} workers{where}, "
                         f"{optimizer_name(base)}, lr {base['lr']}): ppl {target:.2f} at step {mid} (reached at step "
                         f"{base_steps:.1f}), {base['final']:.2f} at the end; within 1.5%: <= "
                         f"{1.015 * base['final']:.4f}.")
        reach = steps_to_reach(run["curve"], target)
        ratio = "never" if reach is None else _ratio(reach, base_steps)
        smooth_target = metric_at(smoothed(base["curve"]), mid)
        smooth_reach = steps_to_reach(smoothed(run["curve"]), smooth_target)
        smooth_base = steps_to_reach(smoothed(base["curve"]), smooth_target)
        smooth_ratio = "never" if smooth_reach is None or smooth_base is None else _ratio(smooth_reach, smooth_base)
        fewer = run["bytes_allreduce_per_step"] / run["bytes_per_step"]
        start = min(run["start_iter"], run["steps"])
        # What the run sent (its curve counts every step, a half-precision warm-up at its own size); where
        # it sent nothing (one worker), what a full-precision warm-up and the compressed steps would send.
        total = run["curve"][-1].get("bytes") or (
            start * run["bytes_allreduce_per_step"] + (run["steps"] - start) * run["bytes_per_step"]
            if run["method"] != "allreduce" else run["steps"] * run["bytes_allreduce_per_step"])
        tail = tail_mean(run["curve"]) / tail_mean(base["curve"]) - 1
        opts = ", ".join(f"{k}={json.dumps(v)}" for k, v in run["options"].items())
        end_vs_base = 100 * (run["final"] / base["final"] - 1)
        best_vs_base = 100 * (best(run["curve"]) / best(base["curve"]) - 1)
        whole_run_fewer = run["steps"] * run["bytes_allreduce_per_step"] / total
        rows.append(f"| {run['label']} | {run['task']} | {run['workers']} | {optimizer_name(run)} | "
                    f"{run.get('batch') or 'task'} | {run['lr']:g} | "
                    f"{run['method']} | {opts} | {run['start_iter']} | {metric_at(run['curve'], mid):.2f} | "
                    f"{run['final']:.2f} | {ratio} | {smooth_ratio} | {end_vs_base:+.2f}% | "
                    f"{100 * tail:+.2f}% | {best_vs_base:+.2f}% | {fewer:.2f}x | {whole_run_fewer:.2f}x |")
    return "\n".join(lines + [""] + rows)


def _ratio(steps: float, base_steps: float) -> str:
    """``steps / base_steps``; "-" when the baseline starts at its target (a run too short to learn)."""
    return f"{steps / base_steps:.3f}" if base_steps > 0 else "-"


def load(folder: Path) -> list[dict[str, Any]]:
    return [normalize(json.loads(p.read_text()), p.stem) for p in sorted(folder.glob("*.json"))]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def powersgd_options(text: str | None) -> dict[str, Any] | None:
    """``--powersgd-options`` as ``PowerSGDState`` keyword arguments: a JSON object, where
    ``adaptive_rank`` may be given as the keyword arguments of :class:`gradpress.AdaptiveRank`.

    >>> powersgd_options('{"adaptive_rank": {"low": 2, "high": 8, "every": 40}}')["adaptive_rank"].high
    8
    """
    if not text:
        return None
    options = json.loads(text)
    if not isinstance(options, dict):
        raise ValueError(f"--powersgd-options must be a JSON object, got {text!r}")
    if isinstance(options.get("adaptive_rank"), dict):
        from gradpress import AdaptiveRank

        options["adaptive_rank"] = AdaptiveRank(**options["adaptive_rank"])
    return options


def _worker(rank: int, args: argparse.Namespace, port: int, command: str) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    import torch
    import torch.distributed as dist

    from gradpress.tools.workloads import DemoConfig, parse_methods, train

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=args.workers)
    config = DemoConfig(task=args.task, steps=args.steps, start_iter=args.start_iter, seed=args.seed,
                        lr=args.lr, momentum=args.momentum, evals=args.evals, warm_up_beta=args.warm_up_beta,
                        powersgd_options=with_orthogonalization(powersgd_options(args.powersgd_options),
                                                                args.orthogonalization),
                        clip_grad_norm=args.clip_grad_norm, clip_before_averaging=args.clip_before_averaging,
                        optimizer=args.optimizer, batch_size=args.batch_size, schedule=args.schedule,
                        **outer_options(args))
    method = parse_methods(args.methods, [1])
    if len(method) != 1:
        raise SystemExit(f"--methods must name one method, got {args.methods!r}")
    device = (torch.device("cuda", rank % torch.cuda.device_count()) if args.device == "cuda"
              else torch.device("cpu"))

    def progress(label: str, step: int, steps: int, loss: float) -> None:
        print(f"{label} on {args.workers} workers: step {step}/{steps}, train loss {loss:.4f}", flush=True)

    result = train(rank, args.workers, method[0], config, progress, device=device)
    dist.destroy_process_group()
    if rank != 0:
        return
    record = run_record(result, config, label=args.label, command=command, workers=args.workers,
                        device=args.device, **({"orthogonalization": args.orthogonalization}
                                               if args.orthogonalization != "auto" else {}))
    per_step = record["bytes_per_step"]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{args.label}.json").write_text(json.dumps(record, indent=1) + "\n")
    print(f"{args.label}: ppl {record['ppl_mid']:.2f} at step {args.steps // 2}, {record['ppl_end']:.2f} at the "
          f"end, {per_step:,.0f} B/step after warm-up ({record['bytes_allreduce_per_step'] / per_step:.2f}x fewer "
          f"than allreduce)", flush=True)


def with_orthogonalization(options: dict[str, Any] | None, method: str) -> dict[str, Any] | None:
    """``options`` with ``PowerSGDState(orthogonalization=method)`` where ``method`` is not ``"auto"``: the
    CPU then runs the accelerator path's Cholesky-QR (or the reverse), on the same data and weights, to
    measure what that rounding does to quality.

    >>> with_orthogonalization(None, "cholesky")
    {'orthogonalization': 'cholesky'}
    >>> with_orthogonalization({"bytes_per_weight": 2}, "auto")
    {'bytes_per_weight': 2}
    """
    if method == "auto":
        return options
    return {**(options or {}), "orthogonalization": method}


def run_record(result: dict[str, Any], config: Any, *, label: str, command: str, workers: int,
               **extra: Any) -> dict[str, Any]:
    """Rank 0's ``train()`` result as this script's JSON record: the fields ``--table`` reads (``extra``:
    what a caller adds, e.g. replica_study's ``replicas``; keys after ``method``)."""
    counted = result.get("counted") or {}
    if counted.get("compressed_steps"):  # PowerSGD: what PowerSGDState handed to the collectives
        per_step = counted["bytes_after"] / counted["compressed_steps"]
    else:
        per_step = result["bytes_per_step"]
    curve = result["curve"]
    return {"label": label, "command": command, "workers": workers, "method": result["method"], **extra,
            "config": config.to_dict() | {"lr": config.resolved_lr()},
            "ppl_mid": metric_at(curve, config.steps // 2), "ppl_end": curve[-1]["metric"],
            "bytes_per_step": per_step, "bytes_allreduce_per_step": result["bytes_allreduce_per_step"],
            "bytes_per_step_predicted": result["bytes_per_step"], "counted": counted,
            "link_bytes_per_step": result.get("link_bytes_per_step"),
            "link_bytes_allreduce_per_step": result.get("link_bytes_allreduce_per_step"),
            "time_per_step_s": result["time_per_step_s"], "approximation_error": result["approximation_error"],
            "global_residual": result.get("global_residual"), "global_residuals": result.get("global_residuals"),
            **({"auto_rank": result["auto_rank"]} if result.get("auto_rank") else {}),
            "checksum": result["checksum"], "digest": result["digest"], "curve": curve}


def add_run_arguments(parser: argparse.ArgumentParser, per: str) -> None:
    """The training arguments this script shares with ``replica_study.py`` (``per``: what one
    ``--batch-size`` is for, a worker or a replica)."""
    parser.add_argument("--task", default="charlm")
    parser.add_argument("--schedule", choices=("auto", "all-gather", "two-shot"), default="auto",
                        help="the compressed DiLoCo methods' schedule (default: auto)")
    parser.add_argument("--steps", type=int, default=800)
    parser.add_argument("--start-iter", type=int, default=80)
    parser.add_argument("--evals", type=int, default=20)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--lr", type=float, default=None, help="default: the task's")
    parser.add_argument("--momentum", type=float, default=0.9)
    parser.add_argument("--optimizer", choices=("sgd", "adamw"), default="sgd",
                        help="adamw: nanoGPT's (betas 0.9/0.95, weight decay 0.1 on matrices, warm-up, cosine)")
    parser.add_argument("--batch-size", type=int, default=None, help=f"per {per} per step (default: the task's)")
    parser.add_argument("--outer-lr", type=float, default=None, help="diloco's outer lr (default: DemoConfig's)")
    parser.add_argument("--outer-momentum", type=float, default=None,
                        help="diloco's outer Nesterov momentum (default: DemoConfig's)")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                        help=f"cuda: every {per} on a GPU (round-robin over the machine's GPUs; gloo carries "
                             "CUDA tensors). Runs on different devices get different baselines in --table")


def outer_options(args: argparse.Namespace) -> dict[str, float]:
    """``DemoConfig``'s outer-optimizer fields the arguments set (``--outer-lr``, ``--outer-momentum``)."""
    return {k: v for k, v in (("outer_lr", args.outer_lr), ("outer_momentum", args.outer_momentum)) if v is not None}


def command_line(script: str, argv: list[str]) -> str:
    """The command that reproduces a run, recorded in its JSON (arguments with shell characters quoted).

    >>> print(command_line("quality_study.py", ["--lr", "0.1", "--powersgd-options", '{"a": 1}']))
    python3 benchmarks/quality_study.py --lr 0.1 --powersgd-options '{"a": 1}'
    """
    return f"python3 benchmarks/{script} " + " ".join(
        a if a.replace("-", "").replace(".", "").replace("_", "").replace(":", "").replace("/", "").isalnum()
        else "'" + a + "'" for a in argv)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workers", type=int, default=2)
    add_run_arguments(parser, "worker")
    parser.add_argument("--methods", "--method", default="allreduce", help="one method, e.g. allreduce or powersgd:4")
    parser.add_argument("--powersgd-options", "--options", default=None,
                        help='JSON object of further PowerSGDState arguments, e.g. \'{"num_iters_per_step": 2}\'')
    parser.add_argument("--warm-up-beta", type=float, default=None, help="PowerSGDState(warm_up_beta_factor=...)")
    parser.add_argument("--clip-grad-norm", type=float, default=None, metavar="NORM",
                        help="clip the averaged gradient to this norm every step (after the hook: for PowerSGD, "
                             "after error feedback)")
    parser.add_argument("--clip-before-averaging", action="store_true",
                        help="with --clip-grad-norm: clip each worker's own gradient before the hook instead "
                             "(before PowerSGD's error feedback)")
    parser.add_argument("--orthogonalization", choices=("auto", "householder", "cholesky"), default="auto",
                        help="PowerSGD's orthogonalization on every device (auto: the step's own choice, "
                             "Householder QR on the CPU, Cholesky-QR on an accelerator)")
    parser.add_argument("--label", default=None, help="the run's name (its JSON is LABEL.json in --out)")
    parser.add_argument("--out", default=str(DEFAULT_OUT))
    parser.add_argument("--table", action="store_true", help="print the markdown table of the runs in --out")
    parser.add_argument("--match", default="", help="--table: only the runs whose label contains this")
    parser.add_argument("--baseline", default=None,
                        help="--table: comma-separated labels of the baselines, one per (task, workers, steps, "
                             "seed); the others: the allreduce run with the lowest final metric")
    args = parser.parse_args(argv)
    if args.table:
        print(table([run for run in load(Path(args.out)) if args.match in run["label"]], args.baseline))
        return 0
    if not args.label:
        parser.error("--label is required for a run")
    try:
        powersgd_options(args.powersgd_options)  # fail here, not in the workers
    except (ValueError, TypeError) as exc:
        parser.error(f"--powersgd-options: {exc}")
    if args.clip_grad_norm is not None and not args.clip_grad_norm > 0:
        parser.error(f"--clip-grad-norm must be > 0, got {args.clip_grad_norm}")
    if args.clip_before_averaging and args.clip_grad_norm is None:
        parser.error("--clip-before-averaging needs --clip-grad-norm (the norm to clip to)")
    command = command_line("quality_study.py", argv if argv is not None else sys.argv[1:])
    import torch.multiprocessing as mp

    mp.start_processes(_worker, args=(args, _free_port(), command), nprocs=args.workers, start_method="spawn")
    return 0


if __name__ == "__main__":
    sys.exit(main())

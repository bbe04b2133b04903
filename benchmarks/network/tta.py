"""Time-to-accuracy over real, rate-limited links: the demo's training, each rank in its own namespace.

Builds ``--world-size`` ranks in network namespaces on a bridge (``netns.py``: veth + ``tc tbf`` both
ways), and for each ``--rates`` trains the demo's ``--task`` with every ``--methods`` through
``gradpress.tools.workloads.training.train`` (the code path of ``gradpress demo`` and ``examples/train.py``:
same data order, same initial weights, same hooks), then tears everything down. Needs root and
iproute2. Not part of CI. ``--device cuda`` trains each rank on a GPU (round-robin over the machine's
GPUs; gloo still carries the bytes over the shaped links). Where a link is too slow to run every method
whole, ``--from-json SHORT --steps-from FULL`` composes the seconds to the target from a short run's step
times on that link and the steps a whole run at another rate took (the steps do not depend on the link).

    sudo python3 benchmarks/network/tta.py --rates 100mbit,1gbit --task charlm --steps 600 \\
        --methods allreduce,fp16,powersgd:4,localsgd:8 --target 6.0 \\
        --json benchmarks/network/tta-charlm.json --plot benchmarks/network/tta-charlm.png

``--task`` is any of the demo's tasks (``gradpress demo --help``): ``charlm-wide`` and ``gpt-wide`` are the
models whose fp32 gradients take longer than their compute on a 100 Mbit/s link, e.g.

    sudo python3 benchmarks/network/tta.py --rates 100mbit,1gbit --task gpt-wide --steps 400 --evals 20 \
        --methods allreduce,fp16,powersgd:4,localsgd:8 --target 5.0 \
        --json benchmarks/network/tta-gpt-wide.json --plot benchmarks/network/tta-gpt-wide.png

Per method and rate: the training time (rank 0's loop, evaluations excluded, as ``time_s`` in the
curve) at which the held-out metric first reaches ``--target`` (linear interpolation between the two
evaluations around the crossing; "not reached" otherwise), the final metric, ms per step and bytes per
step. The plot shows the metric against training seconds, one panel per rate.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from netns import Network, NetworkError, check_can_build, parse_rate  # noqa: E402

DEFAULT_METHODS = "allreduce,fp16,powersgd:4,localsgd:8"


def worker(args: argparse.Namespace) -> None:
    """One rank: train every method in turn in one process group; rank 0 writes the results."""
    import torch
    import torch.distributed as dist

    from gradpress.tools.workloads import DemoConfig, parse_methods, train

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://{os.environ['MASTER_ADDR']}:{args.port}",
                            rank=args.rank, world_size=args.world_size)
    config = DemoConfig(task=args.task, steps=args.steps, start_iter=args.start_iter, evals=args.evals,
                        seed=args.seed, lr=args.lr, momentum=args.momentum, optimizer=args.optimizer,
                        batch_size=args.batch_size,
                        powersgd_options=json.loads(args.powersgd_options) if args.powersgd_options else None)
    # Every rank on a GPU shares the machine's GPUs round-robin (gloo moves CUDA tensors through the host).
    device = (torch.device("cuda", args.rank % torch.cuda.device_count()) if args.device == "cuda"
              else torch.device("cpu"))
    results = []
    for method in parse_methods(args.methods, [1]):
        result = train(args.rank, args.world_size, method, config, device=device)
        results.append({key: result[key] for key in ("method", "label", "metric_name", "metric", "wall_time_s",
                                                     "time_per_step_s", "bytes_per_step", "curve")})
        if args.rank == 0:
            print(f"  {method.label}: {result['metric_name']} {result['metric']:.3f}, "
                  f"{1000 * result['time_per_step_s']:.1f} ms/step", file=sys.stderr, flush=True)
    dist.destroy_process_group()
    if args.rank == 0:
        Path(args.json).write_text(json.dumps(results))


def time_to_target(curve: list[dict[str, Any]], target: float, lower_is_better: bool,
                   key: str = "time_s") -> float | None:
    """Training seconds (or another ``key`` of the curve: ``"step"``) at which the metric first reaches
    ``target``, interpolated linearly between the evaluations on either side of the crossing; ``None`` if
    it never does.

    >>> curve = [{"time_s": 0.0, "metric": 10.0}, {"time_s": 2.0, "metric": 6.0}, {"time_s": 4.0, "metric": 4.0}]
    >>> time_to_target(curve, 5.0, lower_is_better=True)
    3.0
    >>> time_to_target(curve, 3.0, lower_is_better=True) is None
    True
    """
    sign = 1.0 if lower_is_better else -1.0
    for before, after in zip(curve, curve[1:]):
        if sign * (after["metric"] - target) <= 0:
            span = after["metric"] - before["metric"]
            share = 1.0 if span == 0 else (target - before["metric"]) / span
            share = min(1.0, max(0.0, share))
            return before[key] + share * (after[key] - before[key])
    return None


def step_times(curve: list[dict[str, Any]], start_iter: int) -> tuple[float, float]:
    """``(seconds per warm-up step, seconds per step after it)`` from a short run's curve that has an
    evaluation at ``start_iter``: the warm-up's mean, and the median over the later evaluation intervals
    but the first (whose first step builds the method's state; a closing point adds no steps).

    >>> curve = [{"step": s, "time_s": t} for s, t in [(0, 0.0), (4, 4.0), (8, 5.0), (12, 5.4), (16, 5.8)]]
    >>> [round(x, 3) for x in step_times(curve, 4)]
    [1.0, 0.1]
    """
    times = {point["step"]: point["time_s"] for point in curve if point["step"] <= start_iter}
    if start_iter not in times or start_iter < 1:
        raise ValueError(f"the short run has no evaluation at its warm-up's end (step {start_iter}): "
                         "give it --start-iter and --evals so that one falls there")
    later = [(a, b) for a, b in zip(curve, curve[1:]) if a["step"] >= start_iter and b["step"] > a["step"]]
    rates = sorted((b["time_s"] - a["time_s"]) / (b["step"] - a["step"]) for a, b in later[1:] or later)
    return times[start_iter] / start_iter, rates[len(rates) // 2]


def report_start_iter(report: dict[str, Any]) -> int:
    """The warm-up length a report's run used (``start_iter``; older reports: from their command).

    >>> report_start_iter({"command": "python3 benchmarks/network/tta.py --steps 24 --start-iter 4"})
    4
    """
    if "start_iter" in report:
        return int(report["start_iter"])
    words = report["command"].split()
    if "--start-iter" not in words:
        raise ValueError("the report names no --start-iter")
    return int(words[words.index("--start-iter") + 1])


def composed_markdown(short: dict[str, Any], full: dict[str, Any], target: float) -> str:
    """Seconds to ``target`` on each rate of ``short`` (a few steps per method, for their times), composed
    from the steps each method took to reach it in ``full`` (the same methods run to the end at another
    rate: the steps do not depend on the link) and the full run's warm-up, ``w`` steps:
    ``w x warm-up step + (steps to target - w) x step after it``."""
    start_iter, short_start = report_start_iter(full), report_start_iter(short)
    full_rate, full_rows = next(iter(full["rates"].items()))
    lower = full_rows[0]["metric_name"] != "accuracy"
    steps = {row["method"]: time_to_target(row["curve"], target, lower, key="step") for row in full_rows}
    lines = []
    for rate, rows in short["rates"].items():
        seconds: dict[str, float | None] = {}
        cells = {}
        for row in rows:
            warm, after = step_times(row["curve"], short_start)
            needed = steps.get(row["method"])
            seconds[row["method"]] = (None if needed is None
                                      else min(needed, start_iter) * warm + max(0.0, needed - start_iter) * after)
            cells[row["method"]] = (row["label"], warm, after, needed)
        base = seconds.get("allreduce")
        lines += ["", f"{short['task']}, {short['world_size']} ranks, {rate}: seconds to {full_rows[0]['metric_name']} "
                      f"{'<=' if lower else '>='} {target:g}, composed from this rate's step times and the "
                      f"steps to the target at {full_rate}:", "",
                  "| method | ms/step, warm-up | ms/step, after | steps to target | seconds to target | vs allreduce |",
                  "|---|---|---|---|---|---|"]
        for method, (label, warm, after, needed) in cells.items():
            time = seconds[method]
            speedup = f"{base / time:.2f}x" if base and time else "n/a"
            lines.append(f"| {label} | {1000 * warm:.1f} | {1000 * after:.1f} | "
                         f"{'not reached' if needed is None else f'{needed:.1f}'} | "
                         f"{'n/a' if time is None else f'{time:.1f}'} | {speedup} |")
    return "\n".join(lines)


def markdown(report: dict[str, Any]) -> str:
    """One table per rate: seconds to the target and the speed-up over allreduce."""
    target, lines = report["target"], []
    for rate, rows in report["rates"].items():
        lower = rows[0]["metric_name"] != "accuracy"
        times = {r["method"]: time_to_target(r["curve"], target, lower) for r in rows}
        base = times.get("allreduce")
        lines += ["", f"{report['task']}, {report['world_size']} ranks, {rate}, target {rows[0]['metric_name']} "
                      f"{'<=' if lower else '>='} {target:g}:", "",
                  f"| method | seconds to target | vs allreduce | final {rows[0]['metric_name']} | "
                  "ms/step | bytes/step |", "|---|---|---|---|---|---|"]
        for r in rows:
            seconds = times[r["method"]]
            reached = "not reached" if seconds is None else f"{seconds:.1f}"
            speedup = f"{base / seconds:.2f}x" if base and seconds else "n/a"
            lines.append(f"| {r['label']} | {reached} | {speedup} | {r['metric']:.3f} | "
                         f"{1000 * r['time_per_step_s']:.1f} | {r['bytes_per_step'] / 1e3:.1f} kB |")
    return "\n".join(lines)


def plot(report: dict[str, Any], path: Path) -> None:
    """Metric against training seconds, one panel per rate, the target as a dashed line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import LogLocator, NullFormatter, ScalarFormatter

    rates = list(report["rates"])
    fig, axes = plt.subplots(1, len(rates), figsize=(6 * len(rates), 4.2), squeeze=False)
    for ax, rate in zip(axes[0], rates):
        rows = report["rates"][rate]
        for r in rows:
            ax.plot([c["time_s"] for c in r["curve"]], [c["metric"] for c in r["curve"]], marker=".", label=r["label"])
        ax.axhline(report["target"], color="grey", linestyle="--", linewidth=1, label=f"target {report['target']:g}")
        name = rows[0]["metric_name"]
        if name != "accuracy":
            ax.set_yscale("log")
            ax.yaxis.set_major_locator(LogLocator(subs=(1.0, 2.0, 5.0)))
            ax.yaxis.set_major_formatter(ScalarFormatter())
            ax.yaxis.set_minor_formatter(NullFormatter())
        ax.set_title(f"{report['task']}, {report['world_size']} ranks, {rate} link")
        ax.set_xlabel("training seconds (evaluations excluded)")
        ax.set_ylabel(f"held-out {name}")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Time-to-accuracy over rate-limited links (needs root).")
    parser.add_argument("--rates", default="100mbit,1gbit", help="comma-separated tc rates (default: %(default)s)")
    parser.add_argument("--world-size", type=int, default=2)
    from gradpress.tools.workloads.tasks import task_names

    parser.add_argument("--task", default="charlm", choices=task_names(),
                        help="a demo task (default: %(default)s)")
    parser.add_argument("--methods", default=DEFAULT_METHODS, help="default: %(default)s")
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--start-iter", type=int, default=None, help="default: a tenth of --steps, as the demo")
    parser.add_argument("--evals", type=int, default=30)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--lr", type=float, default=None,
                        help="every method's learning rate, AdamW's peak (default: the task's, or 1e-3 for AdamW)")
    parser.add_argument("--momentum", type=float, default=0.9)
    parser.add_argument("--optimizer", choices=("sgd", "adamw"), default="sgd",
                        help="adamw: nanoGPT's (betas 0.9/0.95, weight decay 0.1 on matrices, warm-up, cosine)")
    parser.add_argument("--batch-size", type=int, default=None, help="per worker per step (default: the task's)")
    parser.add_argument("--powersgd-options", default=None, metavar="JSON",
                        help="further PowerSGDState arguments for the PowerSGD methods, "
                             'e.g. \'{"bytes_per_weight": 2}\'')
    parser.add_argument("--target", type=float, required=True, help="the metric value to reach")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                        help="where each rank trains; cuda: the GPUs round-robin, the links still gloo over "
                             "the shaped veths (default: %(default)s)")
    parser.add_argument("--timeout", type=float, default=3600)
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--plot", type=Path, default=None)
    parser.add_argument("--from-json", type=Path, default=None, help="only print/plot a previous --json")
    parser.add_argument("--steps-from", type=Path, default=None, metavar="JSON",
                        help="with --from-json of a short run: compose each method's seconds to --target from "
                             "the short run's step times and the steps this full run's JSON took to it "
                             "(with the full run's warm-up)")
    # worker mode (started by run_workers inside a namespace)
    parser.add_argument("--rank", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.start_iter is None:
        from gradpress.tools.workloads import default_start_iter

        args.start_iter = default_start_iter(args.steps)
    if args.rank is not None:
        worker(args)
        return 0
    if args.steps_from is not None:
        if args.from_json is None:
            parser.error("--steps-from needs --from-json (the short run whose step times it reads)")
        print(composed_markdown(json.loads(args.from_json.read_text()), json.loads(args.steps_from.read_text()),
                                args.target))
        return 0
    if args.from_json is not None:
        report = json.loads(args.from_json.read_text())
        report["target"] = args.target
    else:
        try:
            check_can_build()
        except NetworkError as exc:
            print(f"tta.py: error: {exc}", file=sys.stderr)
            return 2
        from run import run_workers

        rates = [r.strip() for r in args.rates.split(",") if r.strip()]
        for rate in rates:
            parse_rate(rate)
        started = time.time()
        report = {"command": " ".join(["python3", "benchmarks/network/tta.py", *(argv or sys.argv[1:])]),
                  "task": args.task, "device": args.device, "world_size": args.world_size, "target": args.target,
                  "start_iter": args.start_iter, "rates": {}}
        forwarded = ["--task", args.task, "--methods", args.methods, "--steps", str(args.steps), "--start-iter",
                     str(args.start_iter), "--evals", str(args.evals), "--seed", str(args.seed),
                     "--target", str(args.target), "--momentum", str(args.momentum), "--optimizer", args.optimizer,
                     "--device", args.device]
        forwarded += ["--batch-size", str(args.batch_size)] if args.batch_size is not None else []
        forwarded += ["--lr", str(args.lr)] if args.lr is not None else []
        forwarded += ["--powersgd-options", args.powersgd_options] if args.powersgd_options else []
        with Network(args.world_size, rates[0]) as net:
            for rate in rates:
                net.set_rate(rate)
                print(f"== {args.world_size} ranks, {rate} ==", file=sys.stderr, flush=True)
                report["rates"][rate] = run_workers(net, Path(__file__), forwarded, args.timeout)
        report["seconds"] = time.time() - started
    print(markdown(report))
    if args.json is not None and args.from_json is None:
        args.json.write_text(json.dumps(report, indent=1) + "\n")
    if args.plot is not None:
        plot(report, args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Time-to-accuracy over real, rate-limited links: the demo's training, each rank in its own namespace.

Builds ``--world-size`` ranks in network namespaces on a bridge (``netns.py``: veth + ``tc tbf`` both
ways), and for each ``--rates`` trains the demo's ``--task`` with every ``--methods`` through
``gradpress.tools.workloads.training.train`` (the code path of ``gradpress demo`` and ``examples/train.py``:
same data order, same initial weights, same hooks), then tears everything down. Needs root and
iproute2. Not part of CI.

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
    results = []
    for method in parse_methods(args.methods, [1]):
        result = train(args.rank, args.world_size, method, config)
        results.append({key: result[key] for key in ("method", "label", "metric_name", "metric", "wall_time_s",
                                                     "time_per_step_s", "bytes_per_step", "curve")})
        if args.rank == 0:
            print(f"  {method.label}: {result['metric_name']} {result['metric']:.3f}, "
                  f"{1000 * result['time_per_step_s']:.1f} ms/step", file=sys.stderr, flush=True)
    dist.destroy_process_group()
    if args.rank == 0:
        Path(args.json).write_text(json.dumps(results))


def time_to_target(curve: list[dict[str, Any]], target: float, lower_is_better: bool) -> float | None:
    """Training seconds at which the metric first reaches ``target``, interpolated linearly between the
    evaluations on either side of the crossing; ``None`` if it never does.

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
            return before["time_s"] + share * (after["time_s"] - before["time_s"])
    return None


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
    parser.add_argument("--timeout", type=float, default=3600)
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--plot", type=Path, default=None)
    parser.add_argument("--from-json", type=Path, default=None, help="only print/plot a previous --json")
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
                  "task": args.task, "world_size": args.world_size, "target": args.target, "rates": {}}
        forwarded = ["--task", args.task, "--methods", args.methods, "--steps", str(args.steps), "--start-iter",
                     str(args.start_iter), "--evals", str(args.evals), "--seed", str(args.seed),
                     "--target", str(args.target), "--momentum", str(args.momentum), "--optimizer", args.optimizer]
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

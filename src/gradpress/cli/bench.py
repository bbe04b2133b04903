"""``gradpress bench``: per-step overhead of gradpress's PowerSGD hook vs PyTorch's, over plain allreduce.

Runs :func:`gradpress.bench.overhead.run_benchmark` (one process, world size 1, gloo; each hook timed in
its own worker processes against the allreduce baseline) and prints, per model and rank, the median
allreduce step, each hook's overhead (median hook step minus median allreduce step, in ms) and the ratio
of our overhead to PyTorch's. The default (``--quick``) is one model, rank 1, one round: seconds. ``--full``
is the configuration of BENCHMARKS.md (about a minute on 2 cores). Explicit flags override either preset.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from .args import int_at_least, int_list
from .table import format_table

__all__ = ["PRESETS", "format_results", "register", "run"]

#: ``--quick`` (the default) and ``--full`` settings: models, ranks, rounds, block, warmup.
PRESETS: dict[str, dict[str, Any]] = {
    "quick": {"models": ["resnet18-cifar"], "ranks": [1], "rounds": 1, "block": 3, "warmup": 2},
    "full": {"models": ["resnet18-cifar", "resnet50"], "ranks": [1, 2, 4], "rounds": 3, "block": 5, "warmup": 3},
}


def _models(text: str) -> list[str]:
    from ..bench.overhead import model_names

    models = list(dict.fromkeys(m.strip() for m in text.split(",") if m.strip()))
    unknown = [m for m in models if m not in model_names()]
    if not models or unknown:
        raise argparse.ArgumentTypeError(f"unknown model {', '.join(map(repr, unknown)) or repr(text)}; "
                                         f"choose from {', '.join(model_names())} (comma-separated)")
    return models


def _ms(value: float) -> str:
    return f"{value:.1f}"


def _ratio(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.2f}x"


def format_results(results: list[dict[str, Any]]) -> list[str]:
    """Table lines for :func:`gradpress.bench.overhead.summarize` results: allreduce step, overheads, ratios."""
    mib = 1 << 20
    rows = [[r["model"], str(r["rank"]), _ms(r["median_ms"]["allreduce"]), _ms(r["overhead_ms"]["ours"]),
             _ms(r["overhead_ms"]["torch_batched"]), _ms(r["overhead_ms"]["torch"]),
             _ratio(r["ratio_ours_vs_torch_batched"]), _ratio(r["ratio_ours_vs_torch"]),
             f"{r['memory']['ours']['total'] / mib:.1f} / {r['memory']['torch_batched']['total'] / mib:.1f}"]
            for r in results]
    headers = ["model", "r", "allreduce ms", "ours +ms", "torch batched +ms", "torch +ms",
               "ours/torch batched", "ours/torch", "state MiB ours / torch"]
    return format_table(headers, rows, "<>>>>>>>>")


def register(subparsers: Any) -> argparse.ArgumentParser:
    """Add the ``bench`` subcommand to ``subparsers`` (an ``add_subparsers()`` result)."""
    quick, full = PRESETS["quick"], PRESETS["full"]
    parser: argparse.ArgumentParser = subparsers.add_parser(
        "bench", help="time our PowerSGD hook against PyTorch's (overhead over plain allreduce)",
        description="Time gradpress's powerSGD_hook and PyTorch's (batched and unbatched) on a real model's "
                    "gradient buckets, each against plain allreduce in the same worker process (world size 1, "
                    "gloo), and print the overhead in ms (median hook step - median allreduce step) and the "
                    "ratio ours/torch (< 1: ours is cheaper). Default --quick: "
                    f"{','.join(quick['models'])}, r={quick['ranks'][0]}, {quick['rounds']} round (seconds). "
                    f"--full: {','.join(full['models'])}, r=1,2,4, {full['rounds']} rounds (about a minute on 2 "
                    "cores; the BENCHMARKS.md setting). Flags override the preset.")
    preset = parser.add_mutually_exclusive_group()
    preset.add_argument("--quick", dest="preset", action="store_const", const="quick",
                        help="the quick preset (the default)")
    preset.add_argument("--full", dest="preset", action="store_const", const="full",
                        help="the BENCHMARKS.md preset")
    parser.add_argument("--models", type=_models, default=None, metavar="LIST",
                        help="comma-separated model names (gradpress.zoo built-ins; resnet18 = resnet18-cifar)")
    parser.add_argument("--ranks", type=int_list(1), default=None, metavar="R[,R...]",
                        help="PowerSGD ranks (integers >= 1)")
    parser.add_argument("--rounds", type=int_at_least(1), default=None, metavar="N",
                        help="timed rounds, each a fresh worker process per hook (integer >= 1)")
    parser.add_argument("--block", type=int_at_least(1), default=None, metavar="N",
                        help="timed steps per hook per round (integer >= 1)")
    parser.add_argument("--warmup", type=int_at_least(0), default=None, metavar="N",
                        help="untimed compressed steps first (integer >= 0)")
    parser.add_argument("--threads", type=int_at_least(1), default=None, metavar="N",
                        help="torch.set_num_threads in the workers (default: torch's default)")
    parser.add_argument("--json", type=Path, default=None, metavar="FILE",
                        help="also write the full report (timings, memory, environment) as JSON here")
    parser.set_defaults(func=run, preset="quick")
    return parser


def run(args: argparse.Namespace) -> int:
    """``gradpress bench``: 0 on success, 1 if writing ``--json`` fails. Progress goes to stderr."""
    from ..bench.overhead import run_benchmark

    settings = {key: getattr(args, key) if getattr(args, key) is not None else value
                for key, value in PRESETS[args.preset].items()}
    command = (f"gradpress bench --models {','.join(settings['models'])} --ranks "
               f"{','.join(map(str, settings['ranks']))} --rounds {settings['rounds']} --block {settings['block']} "
               f"--warmup {settings['warmup']}" + ("" if args.threads is None else f" --threads {args.threads}"))
    report = run_benchmark(threads=args.threads, command=command, **settings)
    print("\n".join(format_results(report["results"])))
    print(f"\n+ms: a hook's median step minus plain allreduce's, same worker process (world size 1, gloo).\n"
          f"ours/torch: ratio of the overheads (< 1: ours is cheaper). {report['total_seconds']:.0f} s, "
          f"{report['environment']['num_threads']} torch threads; reproduce: {report['command']}")
    if args.json is not None:
        try:
            args.json.write_text(json.dumps(report, indent=2) + "\n")
        except OSError as exc:
            print(f"gradpress bench: error: --json: could not write {str(args.json)!r}: {exc}", file=sys.stderr)
            return 1
        print(f"wrote {args.json}")
    return 0

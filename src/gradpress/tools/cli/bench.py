"""``gradpress bench``: per-step overhead of gradpress's PowerSGD hook vs PyTorch's, over plain allreduce.

Runs :func:`gradpress.tools.bench.overhead.run_benchmark` (world size 1, gloo, DDP's bucket layout) and prints,
per model and rank, the allreduce step, each hook's overhead (its step minus allreduce's, in ms) and the
ratio of our overhead to PyTorch's, each as the median over rounds with its interquartile range, then a
warning line when the result cannot be trusted (machine busier than its cores, more intra-op threads
than cores, a spread not below the difference between ours and torch's).

Both presets time all hooks interleaved in one worker process with one intra-op thread. More threads
than idle cores make every OpenMP fork/join wait for a descheduled thread, and the hooks differ in how
many ops they fork (ours 47 per ResNet-18 step, PyTorch's unbatched 9): with the machine's default of
one thread per core, a busy machine gave anything from 0.4x to 5x. ``--threads N --isolate`` measures
with more threads, each hook in its own processes.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from .args import int_at_least, int_list
from .table import format_table

__all__ = ["PRESETS", "format_results", "process_seconds", "register", "run"]

#: ``--quick`` (the default) and ``--full`` settings: models, ranks, rounds, block, warmup, threads, isolate.
PRESETS: dict[str, dict[str, Any]] = {
    "quick": {"models": ["resnet18-cifar"], "ranks": [1], "rounds": 8, "block": 3, "warmup": 2, "threads": 1,
              "isolate": False},
    "full": {"models": ["resnet18-cifar", "resnet50"], "ranks": [1, 2, 4], "rounds": 5, "block": 3, "warmup": 3,
             "threads": 1, "isolate": False},
}


def _models(text: str) -> list[str]:
    """Built-in names or ``module.path:factory`` (the user's own model, as ``gradpress inspect --model``
    takes it: built here on the meta device, so a bad one fails before any measurement)."""
    from ..bench.buckets import model_names
    from ..zoo import build_model, import_from_current_folder

    models = list(dict.fromkeys(m.strip() for m in text.split(",") if m.strip()))
    unknown = [m for m in models if m not in model_names() and ":" not in m]
    if not models or unknown:
        raise argparse.ArgumentTypeError(f"unknown model {', '.join(map(repr, unknown)) or repr(text)}; "
                                         f"choose from {', '.join(model_names())} (comma-separated), or "
                                         "module.path:factory for your own")
    for model in models:
        if ":" in model:
            import_from_current_folder()
            try:
                build_model(model)
            except ValueError as exc:
                raise argparse.ArgumentTypeError(str(exc)) from None
    return models


def _ms(stats: dict[str, Any]) -> str:
    if stats["median"] is None:
        return "n/a"
    q1, q3 = stats["iqr"]
    return f"{stats['median']:.1f} [{q1:.1f}, {q3:.1f}]"


def _ratio(stats: dict[str, Any]) -> str:
    if stats["median"] is None:
        return "n/a"
    q1, q3 = stats["iqr"]
    return f"{stats['median']:.2f}x [{q1:.2f}, {q3:.2f}]"


def format_results(results: list[dict[str, Any]]) -> list[str]:
    """Table lines for :func:`gradpress.tools.bench.summary.summarize` results: allreduce step, overheads and
    ratios over rounds, each as ``median [first quartile, third quartile]`` (its ``by_round``)."""
    mib = 1 << 20
    rows = []
    for r in results:
        steps, overheads, ratios = (r["by_round"][key] for key in ("step_ms", "overhead_ms", "ratio_ours_vs"))
        rows.append([r["model"], str(r["rank"]), _ms(steps["allreduce"]), _ms(overheads["ours"]),
                     _ms(overheads["torch_batched"]), _ms(overheads["torch"]), _ratio(ratios["torch_batched"]),
                     _ratio(ratios["torch"]),
                     f"{r['memory']['ours']['total'] / mib:.1f} / {r['memory']['torch_batched']['total'] / mib:.1f}"])
    headers = ["model", "r", "allreduce ms", "ours +ms", "torch batched +ms", "torch +ms",
               "ours/torch batched", "ours/torch", "state MiB ours / torch"]
    return format_table(headers, rows, "<>>>>>>>>")


def process_seconds() -> float | None:
    """Wall-clock seconds since this process started (interpreter and torch start-up included), where
    the OS says (Linux ``/proc``); else ``None``."""
    try:
        with open("/proc/self/stat") as f:
            start_ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        return uptime - start_ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, AttributeError):
        return None


def register(subparsers: Any) -> argparse.ArgumentParser:
    """Add the ``bench`` subcommand to ``subparsers`` (an ``add_subparsers()`` result)."""
    quick, full = PRESETS["quick"], PRESETS["full"]
    parser: argparse.ArgumentParser = subparsers.add_parser(
        "bench", help="time our PowerSGD hook against PyTorch's (overhead over plain allreduce)",
        description="Time gradpress's powerSGD_hook and PyTorch's (batched and unbatched) on a real model's "
                    "gradient buckets against plain allreduce (world size 1, gloo), all interleaved in one worker "
                    "process with one intra-op thread, and print the overhead in ms (hook step - allreduce step) "
                    "and the ratio ours/torch (< 1: ours is cheaper), each as the median over rounds with its "
                    "interquartile range [q1, q3], then a warning when the result cannot be trusted. Default "
                    f"--quick: {','.join(quick['models'])}, r={quick['ranks'][0]}, {quick['rounds']} rounds of "
                    f"{quick['block']} timed steps per hook (about 15 s on 2 cores, 25 s when they are busy). "
                    f"--full: {','.join(full['models'])}, r=1,2,4, {full['rounds']} rounds (about 70 s). "
                    "Flags override the preset.")
    preset = parser.add_mutually_exclusive_group()
    preset.add_argument("--quick", dest="preset", action="store_const", const="quick",
                        help="the quick preset (the default)")
    preset.add_argument("--full", dest="preset", action="store_const", const="full",
                        help="both models, ranks 1, 2, 4")
    parser.add_argument("--models", type=_models, default=None, metavar="LIST",
                        help="comma-separated models: gradpress.tools.zoo built-ins (resnet18 = resnet18-cifar) or "
                             "module.path:factory, a function taking no arguments that returns your nn.Module "
                             "(as for gradpress inspect --model)")
    parser.add_argument("--ranks", type=int_list(1), default=None, metavar="R[,R...]",
                        help="PowerSGD ranks (integers >= 1)")
    parser.add_argument("--rounds", type=int_at_least(1), default=None, metavar="N",
                        help="timed rounds; the spread is over rounds, fewer than 3 give none (integer >= 1)")
    parser.add_argument("--block", type=int_at_least(1), default=None, metavar="N",
                        help="timed steps per hook per round, after one untimed step (integer >= 1)")
    parser.add_argument("--warmup", type=int_at_least(0), default=None, metavar="N",
                        help="untimed compressed steps first (integer >= 0)")
    parser.add_argument("--threads", type=int_at_least(1), default=None, metavar="N",
                        help="torch.set_num_threads in the workers (default 1; more than the idle cores make "
                             "OpenMP's fork/joins, not the hooks' work, decide the times)")
    parser.add_argument("--isolate", action=argparse.BooleanOptionalAction, default=None,
                        help="time each hook in its own worker processes, one per round (default: all hooks in "
                             "one worker; isolate when --threads is above 1)")
    parser.add_argument("--json", type=Path, default=None, metavar="FILE",
                        help="also write the full report (timings, spreads, trust, memory, environment) as JSON")
    parser.set_defaults(func=run, preset="quick")
    return parser


def run(args: argparse.Namespace) -> int:
    """``gradpress bench``: 0 on success (also when the result cannot be trusted: the warning says so),
    1 if writing ``--json`` fails. Progress goes to stderr."""
    from ..bench.overhead import run_benchmark

    settings = {key: getattr(args, key) if getattr(args, key) is not None else value
                for key, value in PRESETS[args.preset].items()}
    command = (f"gradpress bench --models {','.join(settings['models'])} --ranks "
               f"{','.join(map(str, settings['ranks']))} --rounds {settings['rounds']} --block {settings['block']} "
               f"--warmup {settings['warmup']} --threads {settings['threads']}"
               + (" --isolate" if settings["isolate"] else ""))
    started = time.perf_counter()
    report = run_benchmark(command=command, **settings)
    elapsed = process_seconds()
    report["command_seconds"] = elapsed if elapsed is not None else time.perf_counter() - started
    steps = report["results"][0]["steps"]["ours"] if report["results"] else 0
    print("\n".join(format_results(report["results"])))
    print(f"\nmedian [first quartile, third quartile] over {settings['rounds']} rounds; {steps} timed steps per hook "
          f"and config.\n+ms: per round, a hook's median step minus plain allreduce's, same worker process (world "
          f"size 1, gloo). ours/torch: per round, ratio of the overheads (< 1: ours is cheaper).\n"
          f"{report['command_seconds']:.0f} s in all ({report['total_seconds']:.0f} s measuring), "
          f"{report['trust']['threads']} intra-op thread(s), {report['trust']['cores']} cores, 1-minute load "
          f"{_load_text(report['trust']['load_avg_1min'])}; reproduce: {report['command']}")
    for warning in report["trust"]["warnings"]:
        print(f"WARNING: this result cannot be trusted: {warning}")
    if args.json is not None:
        try:
            args.json.write_text(json.dumps(report, indent=2) + "\n")
        except OSError as exc:
            print(f"gradpress bench: error: --json: could not write {str(args.json)!r}: {exc}", file=sys.stderr)
            return 1
        print(f"wrote {args.json}")
    return 0


def _load_text(load: dict[str, float | None]) -> str:
    if load.get("start") is None or load.get("end") is None:
        return "unknown"
    return f"{load['start']:.1f} -> {load['end']:.1f}"

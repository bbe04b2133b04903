"""Per-step overhead of PowerSGD comm hooks over plain allreduce: gradpress vs. PyTorch.

One process, world size 1, gloo. The hooks are called the way DDP calls them: one call per bucket, in
bucket order, then every future is waited on. Buckets mimic DDP's initial layout
(``torch.distributed._compute_bucket_assignment_by_size`` with caps ``[1 MB, 25 MB]`` over the
parameters in definition order, bucket list reversed, so bucket 0 holds the last layers and the 1 MB
bucket with the stem is the last one). Each bucket has a flat buffer whose gradients are views into it
(:mod:`.buckets`).

Variants:
  * ``allreduce``: ``gradpress.allreduce_hook`` (the baseline);
  * ``ours``: ``gradpress.powerSGD_hook``;
  * ``torch_batched``: PyTorch's ``powerSGD_hook`` with ``batch_tensors_with_same_shape=True``;
  * ``torch``: PyTorch's ``powerSGD_hook`` with ``batch_tensors_with_same_shape=False``.

Where the hooks run (``--isolate``, the script's default, or ``--no-isolate``):
  * ``--no-isolate``: one worker process times all four variants, interleaved: for ``--rounds`` rounds
    every variant runs a block of ``--block`` + 1 steps (the first is not timed), the starting variant
    rotating. ``gradpress bench`` does this, with one intra-op thread;
  * ``--isolate``: each compared hook is timed in its own worker processes (one per round and hook),
    interleaved with the baseline in that process, the processes alternating between the hooks.

Intra-op threads decide which is fair (see :func:`_measure_isolated`). With one thread (``--threads 1``)
no op forks, the variants cannot disturb each other and one process is fair. With more, PyTorch's
hooks leave their process with extra OpenMP teams (they compute on gloo's threads), which changes how
OpenMP waits for everything that runs there afterwards, so each hook needs its own processes. And with
more threads than idle cores an OpenMP fork/join can wait a scheduler time slice for a thread that is
not running: a hook's time then tracks how many ops it forks (ours 47 per ResNet-18 step, PyTorch's
unbatched 9), not its work.

Overhead = median(hook step) - median(allreduce step), each median over all workers' timed steps. The
spread is over rounds: per round, the hook's median step minus allreduce's median step in the same
process and round, and ours' over torch's; ``by_round`` holds those, their medians and interquartile
ranges (:func:`.summary.summarize`). :func:`.summary.trust_warnings` says when a result cannot be trusted
(machine busier than its cores, more threads than cores, a spread wider than the difference between ours
and torch's).
Gradients are refilled from fixed random values before every step of every variant (hooks write in
place); the refill is not timed. Each variant runs ``start_powerSGD_iter=2`` allreduce steps and
``--warmup`` compressed steps untimed first.

All variants communicate over one extra world-size-1 gloo group with ``buckets + 2`` worker threads
(:func:`.harness.make_group`), not over the default group: PyTorch's ``powerSGD_hook`` blocks inside future
callbacks, which run on gloo's worker threads (2 by default), and deadlocks as soon as more buckets are
in flight than there are free threads (ResNet-18 has 3 buckets, ResNet-50 5).

Memory: bytes of the tensors each state holds after the run (gradpress: its ``memory_report()``,
``error_memory`` of the compressed matrices, ``p`` (P and the uncompressed tensors), ``q``, ...; PyTorch:
``error_dict``, ``p_memory_dict``, ``q_memory_dict``), against the target "gradients + P + Q + one bucket".

    python -m gradpress.tools.bench.overhead --models resnet18,resnet50 --ranks 1,2,4 --json out.json
    python benchmarks/overhead.py ...          # the same, from a source checkout
    gradpress bench --full                     # the same models and ranks, one intra-op thread,
                                               # all hooks in one worker, summarized as a table

This module runs the worker processes and reports: :func:`run_benchmark` measures and returns the report;
:func:`main` is the script (JSON + markdown). The parts: :mod:`.buckets` (models and DDP's bucket layout),
:mod:`.harness` (what one worker times), :mod:`.summary` (medians, verdicts, tables).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import sys
import time
from collections.abc import Sequence
from typing import Any

import torch

from ..processes import usable_cores
from .buckets import DEFAULT_BUCKET_CAPS, make_buckets, model_names, model_parameters
from .harness import MIN_COMPRESSION_RATE, START_POWERSGD_ITER, measure_all
from .summary import COMPARED, load_average, markdown_rows, memory_rows, summarize, trust_warnings

__all__ = ["main", "parse_args", "run_benchmark"]


def parse_args(argv: Sequence[str] | None, prog: str = "overhead") -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog=prog, description="Per-step overhead of gradpress's vs PyTorch's PowerSGD hook over "
                               "plain allreduce (one process, world size 1, gloo).")
    parser.add_argument("--models", default="resnet18,resnet50",
                        help=f"comma-separated, from {', '.join(model_names())} (default: %(default)s)")
    parser.add_argument("--ranks", default="1,2,4", help="comma-separated PowerSGD ranks (default: %(default)s)")
    parser.add_argument("--rounds", type=int, default=3,
                        help="timed rounds (the spread is over rounds); with --isolate, worker processes per "
                             "hook (default: %(default)s)")
    parser.add_argument("--block", type=int, default=5,
                        help="timed steps per variant per round, after one untimed step "
                             "(default: %(default)s; rounds x block steps are timed per variant)")
    parser.add_argument("--warmup", type=int, default=3,
                        help="untimed compressed steps after the start_powerSGD_iter=2 allreduce steps "
                             "(default: %(default)s)")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch.set_num_threads (default: torch's default)")
    parser.add_argument("--gloo-threads", type=int, default=None,
                        help="gloo worker threads of the benchmark group (default: buckets + 2; PyTorch's "
                             "hook deadlocks with fewer than buckets + 1)")
    parser.add_argument("--isolate", action=argparse.BooleanOptionalAction, default=True,
                        help="time each hook in its own worker processes, alternating (default); "
                             "--no-isolate times all hooks interleaved in one worker process (fair with "
                             "--threads 1)")
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--json", default=None, help="write the JSON results here (default: stdout)")
    args = parser.parse_args(argv)
    args.model_list = [m.strip() for m in args.models.split(",") if m.strip()]
    for m in args.model_list:
        if m not in model_names() and ":" not in m:
            parser.error(f"unknown model {m!r}; choose from {', '.join(model_names())}, or module.path:factory")
    try:
        args.rank_list = [int(r) for r in args.ranks.split(",") if r.strip()]
    except ValueError:
        parser.error(f"--ranks must be comma-separated integers, got {args.ranks!r}")
    if not args.rank_list or min(args.rank_list) < 1:
        parser.error("--ranks must be integers >= 1")
    if args.rounds < 1 or args.block < 1 or args.warmup < 0:
        parser.error("--rounds and --block must be >= 1 and --warmup >= 0")
    return args



def _run_worker(names: Sequence[str], models: Sequence[str], ranks: Sequence[int], rounds: int, block: int,
                warmup: int, threads: int | None, gloo_threads: int, out: str) -> list[dict[str, Any]]:
    """One worker process (``python -m gradpress.tools.bench.overhead --worker HOOK[,HOOK...]``): it times the
    ``names`` hooks and allreduce, interleaved, and writes its :func:`measure` parts to ``out``."""
    import subprocess

    command = [sys.executable, "-m", "gradpress.tools.bench.overhead", "--worker", ",".join(names),
               "--models", ",".join(models), "--ranks", ",".join(map(str, ranks)),
               "--rounds", str(rounds), "--block", str(block),
               "--warmup", str(warmup), "--gloo-threads", str(gloo_threads), "--json", out]
    if threads is not None:
        command += ["--threads", str(threads)]
    env = None
    if any(":" in model for model in models):  # the user's module must import in the worker as it does here
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(path for path in sys.path if path)}
    subprocess.run(command, check=True, env=env)
    with open(out) as f:
        parts: list[dict[str, Any]] = json.load(f)["parts"]
    return parts


def _measure_interleaved(models: Sequence[str], ranks: Sequence[int], rounds: int, block: int, warmup: int,
                         threads: int | None, gloo_threads: int) -> list[dict[str, Any]]:
    """One worker process times every hook and allreduce, interleaved block by block (see :func:`measure`).

    Fair when the worker runs one intra-op thread (``threads=1``): then no op forks, and no hook can
    change the conditions the others run in. With more threads see :func:`_measure_isolated`.
    """
    import tempfile

    with tempfile.TemporaryDirectory(prefix="gradpress-overhead-") as tmp:
        t0 = time.perf_counter()
        parts = _run_worker(COMPARED, models, ranks, rounds, block, warmup, threads, gloo_threads,
                            f"{tmp}/all.json")
        print(f"[overhead] one worker, {rounds} rounds of every hook ({time.perf_counter() - t0:.0f} s)",
              file=sys.stderr, flush=True)
    return parts


def _measure_isolated(models: Sequence[str], ranks: Sequence[int], rounds: int, block: int, warmup: int,
                      threads: int | None, gloo_threads: int) -> list[dict[str, Any]]:
    """One worker process (``python -m gradpress.tools.bench.overhead --worker HOOK``) per (round, compared
    hook), each timing that hook against allreduce.

    With more than one intra-op thread, running PyTorch's hook in a process changes the conditions of
    everything that runs there afterwards (on the 2-core VM used for BENCHMARKS.md, 2 threads: gradpress's
    hook went from 38 to 60 ms per step on ResNet-50 at r=4 after 5 steps of PyTorch's on an idle machine;
    on a busy one, at r=1, from 400-460 to 62-68 ms). PyTorch's hook computes in future callbacks, on
    gloo's worker threads; each of those threads that enters an OpenMP parallel region gets its own
    OpenMP team (ResNet-50: the process goes from 16 to 23 threads), and with more OpenMP threads than
    cores GNU OpenMP throttles its spin-waits and sleeps almost at once (as with OMP_WAIT_POLICY=passive):
    slower fork/joins on an idle machine, much faster ones on a busy machine. So the hooks are not timed in
    one process. Worker processes alternate between the hooks round after round, which keeps the comparison
    side by side in time.
    """
    import tempfile

    parts: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="gradpress-overhead-") as tmp:
        for round_index in range(rounds):
            shift = round_index % len(COMPARED)
            for name in COMPARED[shift:] + COMPARED[:shift]:
                t0 = time.perf_counter()
                worker_parts = _run_worker([name], models, ranks, 1, block, warmup, threads, gloo_threads,
                                           f"{tmp}/{round_index}-{name}.json")
                print(f"[overhead] round {round_index + 1}/{rounds}: {name} "
                      f"({time.perf_counter() - t0:.0f} s)", file=sys.stderr, flush=True)
                for part in worker_parts:
                    part["round_offset"] = round_index
                parts.extend(worker_parts)
    return parts


def _gloo_threads(models: Sequence[str]) -> int:
    return 2 + max(len(make_buckets(model_parameters(m))) for m in models)


def run_benchmark(models: Sequence[str], ranks: Sequence[int], rounds: int = 3, block: int = 5, warmup: int = 3,
                  threads: int | None = None, gloo_threads: int | None = None, isolate: bool = True,
                  command: str = "") -> dict[str, Any]:
    """Measure every (model, rank) and return the report: ``results`` (one :func:`summarize` dict per
    config, in ``models x ranks`` order), ``environment``, ``settings``, ``markdown`` and
    ``markdown_memory`` tables, ``total_seconds`` and ``command`` (recorded as given).

    ``isolate=True``: one worker process per round and hook (:func:`_measure_isolated`);
    ``isolate=False``: one worker process for all hooks, interleaved (:func:`_measure_interleaved`).
    ``threads``: ``torch.set_num_threads`` in the workers (``None``: torch's default there).
    ``trust`` says whether the result can be trusted: ``trusted``, ``warnings`` (:func:`trust_warnings`,
    fed with the larger 1-minute load average of the start and the end), ``load_avg_1min`` (``start``,
    ``end``), ``cores`` (:func:`usable_cores`) and ``threads``. Progress goes to stderr.
    """
    for model in models:
        model_parameters(model)  # fail early, with the list of names, on an unknown model
    if not ranks or min(ranks) < 1 or rounds < 1 or block < 1 or warmup < 0:
        raise ValueError(f"need ranks >= 1, rounds >= 1, block >= 1, warmup >= 0; got ranks={list(ranks)}, "
                         f"rounds={rounds}, block={block}, warmup={warmup}")
    started = time.perf_counter()
    load_start = load_average()
    gloo_threads = gloo_threads or _gloo_threads(models)
    configs = [(model, rank) for model in models for rank in ranks]
    measure_in = _measure_isolated if isolate else _measure_interleaved
    parts = measure_in(models, ranks, rounds, block, warmup, threads, gloo_threads)
    load_end = load_average()
    results = []
    for model, rank in configs:
        res = summarize([part for part in parts if (part["model"], part["rank"]) == (model, rank)])
        results.append(res)
        print(f"[overhead] {model} r={rank}: allreduce {res['median_ms']['allreduce']:.1f} ms, "
              f"ours +{res['overhead_ms']['ours']:.1f} ms, torch(batched) "
              f"+{res['overhead_ms']['torch_batched']:.1f} ms, torch(unbatched) "
              f"+{res['overhead_ms']['torch']:.1f} ms", file=sys.stderr, flush=True)
    num_threads = torch.get_num_threads() if threads is None else threads
    cores = usable_cores()
    loads = [load for load in (load_start, load_end) if load is not None]
    warnings = trust_warnings(results, max(loads) if loads else None, cores, num_threads)

    import gradpress
    return {
        "command": command,
        "environment": {
            "torch": torch.__version__,
            "gradpress": gradpress.__version__,
            "python": platform.python_version(),
            "machine": platform.machine(),
            "processor": platform.processor(),
            "num_threads": num_threads,
            "cores": cores,
            "cpu_count": os.cpu_count(),
            "backend": "gloo",
            "world_size": 1,
            "gloo_threads": gloo_threads,
        },
        "settings": {
            "isolate": isolate,
            "rounds": rounds,
            "block": block,
            "warmup": warmup,
            "start_powerSGD_iter": START_POWERSGD_ITER,
            "min_compression_rate": MIN_COMPRESSION_RATE,
            "bucket_caps_bytes": list(DEFAULT_BUCKET_CAPS),
            "baseline": "gradpress.allreduce_hook",
        },
        "total_seconds": time.perf_counter() - started,
        "trust": {
            "trusted": not warnings,
            "warnings": warnings,
            "load_avg_1min": {"start": load_start, "end": load_end},
            "cores": cores,
            "threads": num_threads,
        },
        "results": results,
        "markdown": markdown_rows(results),
        "markdown_memory": memory_rows(results),
    }


def main(argv: Sequence[str] | None = None, prog: str = "python -m gradpress.tools.bench.overhead") -> int:
    """The benchmark script: JSON report to ``--json`` (or stdout), command + markdown tables to stderr.

    ``prog`` is how the command is recorded in the report (``benchmarks/overhead.py`` passes its own).
    """
    args = parse_args(argv, prog=prog.split()[-1])
    command = prog + " " + " ".join(shlex.quote(a) for a in (sys.argv[1:] if argv is None else argv))
    if args.worker is not None:
        if args.threads is not None:
            torch.set_num_threads(args.threads)
        configs = [(model, rank) for model in args.model_list for rank in args.rank_list]
        parts = measure_all(configs, args.worker.split(","), args.rounds, args.block, args.warmup,
                            args.gloo_threads or _gloo_threads(args.model_list))
        with open(args.json, "w") as f:
            json.dump({"parts": parts}, f)
        # Leave without running destructors: gloo's worker threads of the extra group (which PyTorch
        # cannot destroy) sometimes abort the interpreter's shutdown with "terminate called without an
        # active exception", after the results are safely written.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    report = run_benchmark(args.model_list, args.rank_list, args.rounds, args.block, args.warmup, args.threads,
                           args.gloo_threads, args.isolate, command.rstrip())
    text = json.dumps(report, indent=2)
    if args.json:
        with open(args.json, "w") as f:
            f.write(text + "\n")
    else:
        print(text)
    print("\n" + report["command"] + "\n\n" + report["markdown"] + "\n\n" + report["markdown_memory"],
          file=sys.stderr)
    for warning in report["trust"]["warnings"]:
        print(f"WARNING: cannot be trusted: {warning}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())

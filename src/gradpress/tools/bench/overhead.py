"""Per-step overhead of PowerSGD comm hooks over plain allreduce: gradpress vs. PyTorch.

One process, world size 1, gloo. The hooks are called the way DDP calls them: one call per bucket, in
bucket order, then every future is waited on. Buckets mimic DDP's initial layout
(``torch.distributed._compute_bucket_assignment_by_size`` with caps ``[1 MB, 25 MB]`` over the
parameters in definition order, bucket list reversed, so bucket 0 holds the last layers and the 1 MB
bucket with the stem is the last one). Each bucket has a flat buffer whose gradients are views into it.

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
ranges (:func:`summarize`). :func:`trust_warnings` says when a result cannot be trusted (machine busier
than its cores, more threads than cores, a spread wider than the difference between ours and torch's).
Gradients are refilled from fixed random values before every step of every variant (hooks write in
place); the refill is not timed. Each variant runs ``start_powerSGD_iter=2`` allreduce steps and
``--warmup`` compressed steps untimed first.

All variants communicate over one extra world-size-1 gloo group with ``buckets + 2`` worker threads
(:func:`make_group`), not over the default group: PyTorch's ``powerSGD_hook`` blocks inside future
callbacks, which run on gloo's worker threads (2 by default), and deadlocks as soon as more buckets are
in flight than there are free threads (ResNet-18 has 3 buckets, ResNet-50 5).

Memory: bytes of the tensors each state holds after the run (gradpress: its ``memory_report()``,
``error_memory`` of the compressed matrices, ``p`` (P and the uncompressed tensors), ``q``, ...; PyTorch:
``error_dict``,
``p_memory_dict``, ``q_memory_dict``), against the target "gradients + P + Q + one bucket".

    python -m gradpress.tools.bench.overhead --models resnet18,resnet50 --ranks 1,2,4 --json out.json
    python benchmarks/overhead.py ...          # the same, from a source checkout
    gradpress bench --full                     # the same models and ranks, one intra-op thread,
                                               # all hooks in one worker, summarized as a table

:func:`run_benchmark` measures and returns the report; :func:`main` is the script (JSON + markdown).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import shlex
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from .. import zoo
from ...hooks.bucket import DenseBucket
from ..processes import free_port, usable_cores
from .summary import (COMPARED, MB, MEMORY_HEADER, MIN_ROUNDS_FOR_SPREAD, TABLE_HEADER, iqr, load_average,
                      markdown_rows, memory_rows, summarize, trust_warnings)

__all__ = ["COMPARED", "MIN_ROUNDS_FOR_SPREAD", "MODELS", "FakeBucket", "iqr", "main", "make_buckets",
           "model_names", "model_parameters", "run_benchmark", "summarize", "trust_warnings", "usable_cores"]

DEFAULT_BUCKET_CAPS = (1 * MB, 25 * MB)  # DDP: _DEFAULT_FIRST_BUCKET_BYTES, bucket_cap_mb=25
START_POWERSGD_ITER = 2
MIN_COMPRESSION_RATE = 2


# --------------------------------------------------------------------------------------------------
# Models (from gradpress.tools.zoo, built on the meta device: only the parameter shapes are used)
# --------------------------------------------------------------------------------------------------
#: Short names used in BENCHMARKS.md -> :mod:`gradpress.tools.zoo` names. Every zoo built-in is accepted too.
MODELS: dict[str, str] = {"resnet18": "resnet18-cifar", "resnet50": "resnet50"}


def model_names() -> list[str]:
    """Names :func:`model_parameters` accepts: the short names, then :func:`gradpress.tools.zoo.model_names`."""
    return list(MODELS) + [name for name in zoo.model_names() if name not in MODELS]


def model_parameters(name: str) -> list[Tensor]:
    """The model's parameters (meta tensors), in definition order (tied weights once). ``name``: a built-in
    (:func:`model_names`) or ``module.path:factory``, the user's own model as ``gradpress inspect`` takes it."""
    if name not in MODELS and name not in zoo.MODELS and ":" not in name:
        raise ValueError(f"unknown model {name!r}; choose from {', '.join(model_names())}, or module.path:factory")
    return [p.detach() for p in zoo.build_model(MODELS.get(name, name)).parameters()]


# --------------------------------------------------------------------------------------------------
# Buckets
# --------------------------------------------------------------------------------------------------
class FakeBucket(DenseBucket):
    """A ``dist.GradBucket`` stand-in: a new flat buffer of ``dtype`` and per-parameter gradient views into it."""

    __slots__ = ()

    def __init__(self, index: int, params: list[Tensor], is_last: bool, dtype: torch.dtype) -> None:
        super().__init__(index, is_last, params, torch.empty(sum(p.numel() for p in params), dtype=dtype))


def make_buckets(params: list[Tensor], caps: Sequence[int] = DEFAULT_BUCKET_CAPS,
                 dtype: torch.dtype = torch.float32) -> list[FakeBucket]:
    """DDP's initial bucket layout: assignment by size in definition order, bucket list reversed."""
    indices, _ = dist._compute_bucket_assignment_by_size(params, list(caps))
    indices = list(reversed(indices))
    return [FakeBucket(i, [params[j] for j in idx], i == len(indices) - 1, dtype)
            for i, idx in enumerate(indices)]


# --------------------------------------------------------------------------------------------------
# Variants
# --------------------------------------------------------------------------------------------------
def _torch_powersgd():
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as m
    return m


def make_variants(rank: int, group: Any) -> dict[str, tuple[Any, Callable[[Any, Any], torch.futures.Future]]]:
    import gradpress

    tp = _torch_powersgd()
    common: dict[str, Any] = dict(matrix_approximation_rank=rank, start_powerSGD_iter=START_POWERSGD_ITER,
                  min_compression_rate=MIN_COMPRESSION_RATE)
    return {
        "allreduce": (group, gradpress.allreduce_hook),
        "ours": (gradpress.PowerSGDState(group, **common), gradpress.powerSGD_hook),
        "torch_batched": (tp.PowerSGDState(group, batch_tensors_with_same_shape=True, **common),
                          tp.powerSGD_hook),
        "torch": (tp.PowerSGDState(group, batch_tensors_with_same_shape=False, **common), tp.powerSGD_hook),
    }


def run_step(state: Any, hook: Callable, buckets: list[FakeBucket]) -> float:
    """One DDP-style communication step: a hook call per bucket, then wait on every future. Seconds."""
    start = time.perf_counter()
    futures = [hook(state, bucket) for bucket in buckets]
    for fut in futures:
        fut.wait()
    return time.perf_counter() - start


def _nbytes(t: Tensor) -> int:
    return t.numel() * t.element_size()


def ours_state_bytes(state: Any) -> dict[str, int]:
    """From :meth:`gradpress.PowerSGDState.memory_report`: ``error_memory``, the factors ``p`` and ``q``,
    ``saved_factors`` (the warm-start factors of the iteration in flight, put back if it is not finite:
    "non-finite steps"), ``workspace`` (the one scratch buffer the segments share), ``total``."""
    report = state.memory_report().as_dict()
    return {key: report[key] for key in ("error_memory", "p", "q", "saved_factors", "workspace", "total")}


def torch_state_bytes(state: Any) -> dict[str, int]:
    out = {
        "error": sum(_nbytes(t) for t in state.error_dict.values()),
        "p": sum(_nbytes(t) for t in state.p_memory_dict.values()),
        "q": sum(_nbytes(t) for t in state.q_memory_dict.values()),
    }
    out["total"] = out["error"] + out["p"] + out["q"]
    return out


def measure(model: str, rank: int, names: Sequence[str], rounds: int, block: int, warmup: int,
            group: Any, seed: int = 0) -> dict[str, Any]:
    """Time ``allreduce`` and the ``names`` variants side by side in this process (raw times, state bytes)."""
    params = model_parameters(model)
    buckets = make_buckets(params)
    threads = group._get_backend(torch.device("cpu")).options._threads
    if threads <= len(buckets):
        raise ValueError(f"{model}: {len(buckets)} buckets need more than {threads} gloo threads, or "
                         "PyTorch's powerSGD_hook deadlocks (see make_group)")
    gen = torch.Generator().manual_seed(seed)
    sources = [torch.randn(b.buffer().numel(), generator=gen) for b in buckets]

    def refill() -> None:
        for bucket, src in zip(buckets, sources):
            bucket.buffer().copy_(src)

    all_variants = make_variants(rank, group)
    variants = {name: all_variants[name] for name in ("allreduce", *names)}
    times: dict[str, list[float]] = {name: [] for name in variants}
    rounds_ms: dict[str, list[list[float]]] = {name: [] for name in variants}  # [round][step]
    order = list(variants)
    # Warm-up: the allreduce steps before compression starts, then ``warmup`` compressed steps.
    for _ in range(START_POWERSGD_ITER + warmup):
        for name in order:
            refill()
            run_step(*variants[name], buckets)
    total_steps = START_POWERSGD_ITER + warmup + rounds * (block + 1)
    gc_was_enabled = gc.isenabled()
    gc.collect()
    gc.disable()
    try:
        # In each round every variant runs ``block + 1`` consecutive steps; the first is not timed (it
        # pays for switching from another variant: caches, thread wake-ups). The starting variant
        # rotates, so slow drifts of the machine hit all variants alike.
        for round_index in range(rounds):
            shift = round_index % len(order)
            for name in order[shift:] + order[:shift]:
                state, hook = variants[name]
                block_ms = []
                for position in range(block + 1):
                    refill()
                    elapsed = run_step(state, hook, buckets)
                    if position > 0:
                        block_ms.append(elapsed * 1e3)
                times[name].extend(block_ms)
                rounds_ms[name].append(block_ms)
    finally:
        if gc_was_enabled:
            gc.enable()

    out: dict[str, Any] = {"model": model, "rank": rank, "times_ms": times, "rounds_ms": rounds_ms,
                           "round_offset": 0, "state_bytes": {}}
    for name in names:
        state = variants[name][0]
        if state.iter != total_steps:
            raise AssertionError(f"{name}: state.iter={state.iter}, expected {total_steps}")
        out["state_bytes"][name] = ours_state_bytes(state) if name == "ours" else torch_state_bytes(state)
        if name == "ours":
            report = state.memory_report()
            out["plan"] = {"sent": report.sent, "p": report.p_numel, "q": report.q_numel}
    grad_numel = sum(p.numel() for p in params)
    out["params"] = grad_numel
    out["buckets"] = [b.buffer().numel() for b in buckets]
    return out


def make_group(threads: int) -> dist.ProcessGroup:
    """A world-size-1 gloo group like the default one, but with ``threads`` gloo worker threads.

    PyTorch's ``powerSGD_hook`` calls ``dist.all_reduce(...).wait()`` *inside* future callbacks, which
    run on gloo's worker threads (2 by default, and ``init_process_group`` ignores ``pg_options`` for
    gloo). With more buckets in flight than free worker threads, every worker blocks in a callback
    waiting for an allreduce queued behind it: a deadlock (observed with 3 buckets and 2 threads). One
    thread per bucket plus one avoids it. All variants use this group, so the comparison stays fair.
    """
    import datetime

    store = dist.PrefixStore("gradpress_bench/", dist.distributed_c10d._get_default_store())
    opts = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]
    opts._threads = threads
    opts._timeout = datetime.timedelta(seconds=600)
    opts._devices = [dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")]
    backend = dist.ProcessGroupGloo(store, dist.get_rank(), dist.get_world_size(), opts)
    group = dist.ProcessGroup(store, dist.get_rank(), dist.get_world_size())
    group._set_default_backend(dist.ProcessGroup.BackendType.GLOO)
    group._register_backend(torch.device("cpu"), dist.ProcessGroup.BackendType.GLOO, backend)
    return group


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


def _measure_all(configs: Sequence[tuple[str, int]], names: Sequence[str], rounds: int, block: int,
                 warmup: int, gloo_threads: int) -> list[dict[str, Any]]:
    """Run :func:`measure` for every config in this process, over a private world-size-1 gloo group."""
    own_group = not dist.is_initialized()
    if own_group:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        group = make_group(gloo_threads)
        return [measure(model, rank, names, rounds, block, warmup, group) for model, rank in configs]
    finally:
        if own_group:
            dist.destroy_process_group()


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
    slower fork/joins on an idle machine, much faster ones on a busy machine. So the hooks are not timed in one process. Worker processes alternate
    between the hooks round after round, which keeps the comparison side by side in time.
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
        parts = _measure_all(configs, args.worker.split(","), args.rounds, args.block, args.warmup,
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

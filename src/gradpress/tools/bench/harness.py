"""One process's side of the overhead benchmark: the four variants, one DDP-style step, the timed
interleaved rounds (:func:`measure`), the state bytes, and the extra gloo group they all communicate over
(:func:`make_group`). :mod:`gradpress.tools.bench.overhead` runs this in worker processes and reports.

Gradients are refilled from fixed random values before every step of every variant (hooks write in place);
the refill is not timed. Each variant runs ``start_powerSGD_iter=2`` allreduce steps and ``warmup``
compressed steps untimed first.
"""

from __future__ import annotations

import gc
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from ..processes import free_port
from .buckets import FakeBucket, make_buckets, model_parameters

__all__ = ["MIN_COMPRESSION_RATE", "START_POWERSGD_ITER", "make_group", "make_variants", "measure", "measure_all",
           "ours_state_bytes", "run_step", "torch_state_bytes"]

START_POWERSGD_ITER = 2
MIN_COMPRESSION_RATE = 2


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
    """From :meth:`gradpress.PowerSGDState.memory_report`: ``error_memory``, ``m_buffer`` (where a step
    builds M = g + e), the factors ``p`` and ``q``,
    ``saved_factors`` (the warm-start factors of the iteration in flight, put back if it is not finite:
    "non-finite steps"), ``workspace`` (the one scratch buffer the segments share), ``total``."""
    report = state.memory_report().as_dict()
    return {key: report[key] for key in ("error_memory", "m_buffer", "p", "q", "saved_factors", "workspace",
                                         "total")}


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


def measure_all(configs: Sequence[tuple[str, int]], names: Sequence[str], rounds: int, block: int,
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


"""How many kernels a compressed step issues: the ATen ops a DDP PowerSGD hook dispatches, counted with a
``TorchDispatchMode`` around every call of the hook during one steady-state compressed iteration.

On a GPU each op that is not a view (or an allocation, or a metadata change) is about one kernel launch,
7-10 us of host time, so for a step whose arithmetic takes ~1 ms the count is the cost. Two paths:

* ``"cpu"``: a real one-rank gloo DDP model whose parameters have the model's shapes (DDP's own buckets,
  rebuilt after the first iteration, the public hook API), CPU tensors;
* ``"meta"``: the same hook on the accelerator code path (no value is ever read on the host there), fed
  fake buckets of ``meta`` tensors in DDP's initial layout (:mod:`gradpress.tools.bench.buckets`) over a
  one-worker communicator.

>>> from gradpress.tools.bench.kernels import is_kernel
>>> import torch
>>> is_kernel(torch.ops.aten.view.default), is_kernel(torch.ops.aten.bmm.default)
(False, True)
"""

from __future__ import annotations

import contextlib
import os
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.utils._python_dispatch import TorchDispatchMode

from ..processes import free_port
from .buckets import DEFAULT_BUCKET_CAPS, make_buckets, model_parameters

__all__ = ["KernelCount", "count_aggregator_kernels", "count_hook_kernels", "is_kernel"]

#: Ops that launch nothing on a device: allocations, metadata, aliasing.
_NO_KERNEL = frozenset({
    "aten.empty", "aten.empty_like", "aten.empty_strided", "aten.new_empty", "aten.new_empty_strided",
    "aten.detach", "aten.lift_fresh", "aten.alias", "aten.set_", "aten.resize_", "aten._reshape_alias",
    "aten.is_same_size", "aten.sym_size", "aten.sym_stride", "aten.sym_numel", "aten.sym_storage_offset",
    "aten._local_scalar_dense", "aten.record_stream",
})


def is_kernel(func: Any) -> bool:
    """Whether an ATen op launches work on a device: not a view, an allocation or a metadata change."""
    if getattr(func, "is_view", False):
        return False
    return str(func.overloadpacket) not in _NO_KERNEL


class _Counting(TorchDispatchMode):
    def __init__(self, counter: Counter[str]) -> None:
        super().__init__()
        self.counter = counter

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        if is_kernel(func):
            self.counter[str(func.overloadpacket)] += 1
        return func(*args, **(kwargs or {}))


@dataclass
class KernelCount:
    """One count: ``ops`` (kernel-launching ATen ops in one compressed iteration, collectives included),
    ``collectives`` (of those, the ``c10d`` ones), ``by_op`` (each op's count), ``buckets`` (hook calls)."""

    hook: str
    path: str
    wire: str
    rank: int
    buckets: int
    ops: int
    collectives: int
    by_op: dict[str, int] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return {"hook": self.hook, "path": self.path, "wire": self.wire, "rank": self.rank,
                "buckets": self.buckets, "ops": self.ops, "collectives": self.collectives, "by_op": self.by_op}


class _Shapes(nn.Module):
    """Parameters of the given shapes; ``forward()`` is ``sum(p * p) / 2``, so each gradient is the
    parameter itself (full rank, as a real gradient is)."""

    def __init__(self, shapes: Sequence[Sequence[int]], generator: torch.Generator) -> None:
        super().__init__()
        self.weights = nn.ParameterList(
            nn.Parameter(torch.randn(*shape, generator=generator) / max(1, shape[-1]) ** 0.5) for shape in shapes)

    def forward(self) -> Tensor:
        return sum((p * p).sum() for p in self.weights) / 2  # type: ignore[return-value]


def _state(hook: str, rank: int, fp16_wire: bool, process_group: Any, warm_up: bool = False,
           num_iters: int | None = None, orient: bool | None = None) -> tuple[Any, Callable[..., Any]]:
    if hook == "torch":
        from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as tp
        state = tp.PowerSGDState(process_group=process_group, matrix_approximation_rank=rank, start_powerSGD_iter=2,
                                 min_compression_rate=2, use_error_feedback=True, warm_start=True)
        return state, tp.powerSGD_hook
    import gradpress
    extra: dict[str, Any] = {"bytes_per_weight": 2} if fp16_wire else {}
    if fp16_wire and warm_up:
        extra["warm_up_bytes_per_weight"] = 2
    if orient is not None:
        extra["orient_matrices"] = orient
    ours = gradpress.PowerSGDState(process_group=process_group, matrix_approximation_rank=rank,
                                   start_powerSGD_iter=2, min_compression_rate=2, num_iters_per_step=num_iters,
                                   **extra)
    return ours, gradpress.powerSGD_hook


def _counted(hook: Callable[..., Any], counter: Counter[str], calls: list[int], on: list[bool]) -> Callable[..., Any]:
    def counted(state: Any, bucket: dist.GradBucket) -> torch.futures.Future[Tensor]:
        if not on[0]:
            return hook(state, bucket)
        calls[0] += 1
        with _Counting(counter):
            return hook(state, bucket)
    # DDP checks the annotations themselves (strings under ``from __future__ import annotations``).
    counted.__annotations__ = {"bucket": dist.GradBucket, "return": torch.futures.Future[Tensor]}
    return counted


@contextlib.contextmanager
def _one_rank_group() -> Iterator[Any]:
    if dist.is_initialized():
        yield None
        return
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    store = dist.TCPStore("127.0.0.1", free_port(), 1, True)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        yield None
    finally:
        dist.destroy_process_group()


def _count_cpu(shapes: Sequence[Sequence[int]], hook: str, rank: int, fp16_wire: bool,
               iterations: int, warm_up: bool, num_iters: int | None, orient: bool | None) -> KernelCount:
    from torch.nn.parallel import DistributedDataParallel as DDP

    with _one_rank_group():
        model = DDP(_Shapes(shapes, torch.Generator().manual_seed(0)))
        state, function = _state(hook, rank, fp16_wire, None, warm_up, num_iters, orient)
        counter: Counter[str] = Counter()
        calls, on = [0], [False]
        model.register_comm_hook(state, _counted(function, counter, calls, on))
        counted = 1 if warm_up else iterations - 1
        for iteration in range(iterations):
            on[0] = iteration == counted
            model().backward()
            model.zero_grad(set_to_none=False)
    return _result(hook, "cpu" + (" warm-up" if warm_up else ""), fp16_wire, rank, calls[0], counter)


def _count_meta(shapes: Sequence[Sequence[int]], hook: str, rank: int, fp16_wire: bool,
                iterations: int, warm_up: bool, num_iters: int | None, orient: bool | None) -> KernelCount:
    from ...comm import LocalCommunicator

    if hook == "torch":
        raise ValueError("path='meta' counts gradpress's hook only (PyTorch's needs a process group)")
    params = [torch.empty(*shape, device="meta") for shape in shapes]
    buckets = make_buckets(params, DEFAULT_BUCKET_CAPS)
    for bucket in buckets:
        bucket.set_buffer(torch.empty(bucket.buffer().numel(), device="meta"))
    state, function = _state(hook, rank, fp16_wire, None, warm_up, num_iters, orient)
    state._comm = LocalCommunicator()
    counter: Counter[str] = Counter()
    calls, on = [0], [False]
    hook_counted = _counted(function, counter, calls, on)
    counted = 1 if warm_up else iterations - 1
    for iteration in range(iterations):
        on[0] = iteration == counted
        futures = [hook_counted(state, bucket) for bucket in buckets]
        for future in futures:
            future.wait()
    return _result(hook, "meta" + (" warm-up" if warm_up else ""), fp16_wire, rank, calls[0], counter)


def _result(hook: str, path: str, fp16_wire: bool, rank: int, calls: int, counter: Counter[str]) -> KernelCount:
    collectives = sum(n for name, n in counter.items() if name.startswith("c10d"))
    return KernelCount(hook=hook, path=path, wire="fp16" if fp16_wire else "fp32", rank=rank, buckets=calls,
                       ops=sum(counter.values()), collectives=collectives,
                       by_op=dict(sorted(counter.items(), key=lambda item: -item[1])))


def count_hook_kernels(model: str = "gpt2", *, hook: str = "gradpress", path: str = "cpu", rank: int = 32,
                       fp16_wire: bool = False, shapes: Sequence[Sequence[int]] | None = None,
                       iterations: int = 4, warm_up: bool = False, num_iters_per_step: int | None = None,
                       orient_matrices: bool | None = None) -> KernelCount:
    """Kernel-launching ATen ops in one compressed iteration of ``hook`` (``"gradpress"`` or ``"torch"``,
    PyTorch's ``powerSGD_hook``) on the gradient shapes of ``model`` (a :func:`model_parameters` name) or
    ``shapes``, at ``rank``, with ``start_powerSGD_iter=2`` and ``min_compression_rate=2``; ``fp16_wire``:
    gradpress's half-precision wire (``bytes_per_weight=2``). The last of ``iterations`` iterations is
    counted (at least two compressed ones come first, so DDP's buckets are rebuilt and the factors drawn).
    ``warm_up``: count the last exact iteration before compression starts instead (its buckets rebuilt),
    on gradpress's half-precision warm-up wire (``warm_up_bytes_per_weight=2``) with ``fp16_wire``.
    ``num_iters_per_step``, ``orient_matrices``: gradpress's options of those names (``None``: the
    default orientation).

    ``path``: ``"cpu"`` (a one-rank gloo DDP model; initializes and destroys a process group unless one
    exists) or ``"meta"`` (the accelerator code path, no values)."""
    if hook not in ("gradpress", "torch"):
        raise ValueError(f"hook must be 'gradpress' or 'torch', got {hook!r}")
    shapes = _checked(model, path, iterations, shapes)
    count = _count_cpu if path == "cpu" else _count_meta
    return count(shapes, hook, rank, fp16_wire, iterations, warm_up, num_iters_per_step, orient_matrices)


def _checked(model: str, path: str, iterations: int, shapes: Sequence[Sequence[int]] | None) -> list[tuple[int, ...]]:
    """The arguments both counts share, checked; the shapes to count (``model``'s unless given)."""
    if path not in ("cpu", "meta"):
        raise ValueError(f"path must be 'cpu' or 'meta', got {path!r}")
    if iterations < 4:
        raise ValueError(f"iterations must be >= 4 (two warm-up, two compressed), got {iterations}")
    if shapes is None:
        return [tuple(p.shape) for p in model_parameters(model)]
    return [tuple(shape) for shape in shapes]


def count_aggregator_kernels(model: str = "gpt2", *, path: str = "cpu", rank: int = 32, fp16_wire: bool = False,
                             num_iters_per_step: int | None = 1, orient_matrices: bool | None = None,
                             shapes: Sequence[Sequence[int]] | None = None, iterations: int = 4) -> KernelCount:
    """Kernel-launching ATen ops in one compressed ``aggregate_`` call of the :class:`~gradpress.PowerSGD`
    aggregator (``Config(rank=rank, num_iters_per_step=..., start_compressing_after_num_steps=2)``: its
    default scheme is ``num_iters_per_step=1``) on the gradients of ``model`` or ``shapes``, the last of
    ``iterations`` calls. ``path``: ``"cpu"`` (CPU tensors over a one-rank gloo group, set up unless one
    exists) or ``"meta"`` (the accelerator code path, no values, one worker)."""
    import gradpress

    shapes = _checked(model, path, iterations, shapes)
    extra: dict[str, Any] = {"bytes_per_weight": 2} if fp16_wire else {}
    if orient_matrices is not None:
        extra["orient_matrices"] = orient_matrices
    config = gradpress.Config(rank=rank, num_iters_per_step=num_iters_per_step, start_compressing_after_num_steps=2,
                              **extra)
    device = torch.device(path)
    counter: Counter[str] = Counter()
    group = _one_rank_group() if path == "cpu" else contextlib.nullcontext()
    with group:
        generator = torch.Generator().manual_seed(0)
        params = [torch.empty(shape, device=device) for shape in shapes]
        aggregator = gradpress.PowerSGD(params, config, init_sync=False)
        drawn = [torch.empty(shape, device=device) if path == "meta" else torch.randn(shape, generator=generator)
                 for shape in shapes]  # (drawn once: the counts do not depend on the values, only on finiteness)
        for iteration in range(iterations):
            grads = [g.clone() for g in drawn]
            with _Counting(counter) if iteration == iterations - 1 else contextlib.nullcontext():
                aggregator.aggregate_(grads)
    wire = "fp16" if fp16_wire else "fp32"
    count = _result("aggregator", path, fp16_wire, rank, 1, counter)
    count.wire = wire if num_iters_per_step is None else f"{wire}, {num_iters_per_step} iteration(s)"
    return count

"""The one place that talks to a process group: every ``torch.distributed`` collective gradpress issues.

The engine only sees the :class:`Communicator` protocol, so it can run under DDP hooks, under the
standalone aggregator, or with no ``torch.distributed`` at all (:class:`LocalCommunicator`). The rest of
the package calls the functions below: blocking collectives (:func:`all_reduce`, :func:`broadcast`,
:func:`barrier`, the object collectives), asynchronous ones returning a :class:`Work` (whose ``wait()``
describes a failure as a :class:`CollectiveError`), and the parameter-level helpers built on them
(:func:`broadcast_parameters`, :func:`average_tensors_`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from functools import partial
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch import Tensor, nn

__all__ = ["CollectiveError", "Communicator", "Handle", "LocalCommunicator", "ProcessGroupCommunicator", "Work",
           "all_gather_async", "all_gather_objects", "all_reduce", "all_reduce_async", "average_tensors_", "barrier",
           "broadcast", "broadcast_async", "broadcast_parameters", "check_process_group", "collective_error",
           "describe_collective", "flat_groups", "gather_objects", "is_distributed", "make_communicator",
           "reduce_scatter_async", "scatter_objects"]


class CollectiveError(RuntimeError):
    """A collective failed (a peer died, hung past the process group's timeout, or the link broke); the
    message says which collective, issued by which gradpress component, and the backend's own error.
    A ``RuntimeError``, as the backend's errors are; the original is its ``__cause__``."""


def collective_error(what: str, error: BaseException) -> CollectiveError:
    """``error`` from a collective, described: ``"<what> failed: <error>"`` (``what`` names the
    collective, its size and the component that issued it), with a hint when a peer timed out."""
    text = str(error).strip()
    hint = ""
    if "timed out" in text.lower() or "timeout" in text.lower():
        hint = (" (a peer did not take part within the process group's timeout: it died, is stuck, or is "
                "far behind)")
    return CollectiveError(f"{what} failed{hint}: {type(error).__name__}: {text}")


def describe_collective(op: str, buffer: Tensor, world_size: int, issuer: str) -> str:
    """``"allreduce (sum) of 1,234 float32 values over 2 ranks in powerSGD_hook"``."""
    dtype = str(buffer.dtype).replace("torch.", "")
    return f"{op} of {buffer.numel():,} {dtype} values over {world_size} ranks in {issuer}"


def check_process_group(value: object, where: str, hint: str = "") -> None:
    """Raise a ``TypeError`` naming ``where`` unless ``value`` is ``None`` or a ``ProcessGroup``.

    A hook's state argument and a state's first argument are easy to fill with something else (a rank
    given as the first positional argument of ``PowerSGDState``, a ``PowerSGDState`` handed to a plain
    hook); without this check such a value only fails deep inside the first collective. ``hint`` is
    appended to the message (what the caller probably meant).
    """
    if value is None or (dist.is_available() and isinstance(value, dist.ProcessGroup)):
        return
    raise TypeError(f"{where} must be None (the default group) or a torch.distributed.ProcessGroup, got "
                    f"{type(value).__name__} {value!r}" + (f"; {hint}" if hint else ""))


class Handle(Protocol):
    """An in-flight collective. ``wait()`` blocks until the buffer holds the result and returns it."""

    def wait(self) -> Tensor: ...


class Communicator(Protocol):
    """Sums flat buffers across the workers of a group."""

    @property
    def world_size(self) -> int: ...

    def allreduce_sum(self, buffer: Tensor) -> Handle:
        """Start summing ``buffer`` (1-d, contiguous) over all workers, in place."""
        ...

    def allreduce_max(self, buffer: Tensor) -> Handle:
        """Start taking the elementwise maximum of ``buffer`` over all workers, in place."""
        ...


class _Done:
    __slots__ = ("buffer",)

    def __init__(self, buffer: Tensor) -> None:
        self.buffer = buffer

    def wait(self) -> Tensor:
        return self.buffer


class LocalCommunicator:
    """A single worker: the sum over one worker is the buffer itself."""

    world_size = 1

    def allreduce_sum(self, buffer: Tensor) -> Handle:
        return _Done(buffer)

    def allreduce_max(self, buffer: Tensor) -> Handle:
        return _Done(buffer)


class ProcessGroupCommunicator:
    """Sum-allreduce over ``process_group`` (``None``: the default group).

    ``comm_device``: where buffers travel. ``None`` keeps them where they are; e.g. ``"cpu"`` moves
    CUDA buffers to the CPU for a gloo group and copies the result back when the collective is waited on.
    ``issuer``: who sends (e.g. ``"powerSGD_hook"``), named with the collective when one fails
    (:class:`CollectiveError`).
    """

    __slots__ = ("process_group", "comm_device", "issuer", "_world_size")

    def __init__(self, process_group: dist.ProcessGroup | None = None,
                 comm_device: torch.device | str | None = None, issuer: str = "gradpress") -> None:
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError(
                "ProcessGroupCommunicator needs torch.distributed to be initialized "
                "(call torch.distributed.init_process_group first)"
            )
        self.process_group = process_group
        self.comm_device = None if comm_device is None else torch.device(comm_device)
        self.issuer = issuer
        self._world_size = dist.get_world_size(process_group)

    @property
    def world_size(self) -> int:
        return self._world_size

    def allreduce_sum(self, buffer: Tensor) -> Handle:
        return self._allreduce(buffer, dist.ReduceOp.SUM)

    def allreduce_max(self, buffer: Tensor) -> Handle:
        return self._allreduce(buffer, dist.ReduceOp.MAX)

    def _allreduce(self, buffer: Tensor, op: dist.ReduceOp) -> Handle:
        staging = None
        if self.comm_device is not None and buffer.device != self.comm_device:
            staging = buffer.to(self.comm_device)
        describe = partial(self._describe, op, buffer)  # called only if the collective fails
        work = _described(describe, dist.all_reduce, buffer if staging is None else staging, op=op,
                          group=self.process_group)
        return Work(work, buffer, describe, staging)

    def _describe(self, op: dist.ReduceOp, buffer: Tensor) -> str:
        name = f"allreduce ({'sum' if op == dist.ReduceOp.SUM else 'max'})"
        return describe_collective(name, buffer, self._world_size, self.issuer)


def make_communicator(process_group: dist.ProcessGroup | None = None,
                      comm_device: torch.device | str | None = None, issuer: str = "gradpress") -> Communicator:
    """A :class:`ProcessGroupCommunicator` when ``torch.distributed`` is initialized, else local."""
    if dist.is_available() and dist.is_initialized():
        return ProcessGroupCommunicator(process_group, comm_device, issuer)
    if process_group is not None:
        raise RuntimeError("a process_group was given but torch.distributed is not initialized")
    return LocalCommunicator()


def gather_objects(obj: object, dst: int = 0, process_group: dist.ProcessGroup | None = None) -> list[object] | None:
    """Every rank's ``obj`` (picklable) on rank ``dst`` of ``process_group``, in rank order; ``None`` on the
    other ranks. A collective: every rank of the group calls it. Failures are :class:`CollectiveError`."""
    world = dist.get_world_size(process_group)
    mine = dist.get_rank(process_group)
    gathered: list[object] | None = [None] * world if mine == dst else None
    try:
        dist.gather_object(obj, gathered, dst=dist.get_global_rank(process_group, dst) if process_group else dst,
                           group=process_group)
    except RuntimeError as error:
        raise collective_error(f"gather of one object per rank to rank {dst} over {world} ranks", error) from error
    return gathered


def scatter_objects(objs: list[object] | None, src: int = 0, process_group: dist.ProcessGroup | None = None) -> object:
    """Rank ``src`` hands ``objs[r]`` to rank ``r`` of ``process_group`` (the others pass ``None``); returns
    this rank's object. A collective: every rank of the group calls it."""
    world = dist.get_world_size(process_group)
    out: list[object] = [None]
    try:
        dist.scatter_object_list(out, objs if dist.get_rank(process_group) == src else None,
                                 src=dist.get_global_rank(process_group, src) if process_group else src,
                                 group=process_group)
    except RuntimeError as error:
        raise collective_error(f"scatter of one object per rank from rank {src} over {world} ranks", error) from error
    return out[0]


# -- the collectives the rest of the package issues --------------------------------------------------

_OPS = {"sum": "SUM", "max": "MAX", "min": "MIN"}


def is_distributed() -> bool:
    """Whether ``torch.distributed`` is available and a default process group is initialized."""
    return dist.is_available() and dist.is_initialized()


def _op(op: str) -> dist.ReduceOp:
    if op not in _OPS:
        raise ValueError(f"op must be one of {sorted(_OPS)}, got {op!r}")
    return getattr(dist.ReduceOp, _OPS[op])


def _start(collective: Any, *args: Any, **kwargs: Any) -> Any:
    """``collective(*args, async_op=True, **kwargs)``: its ``dist.Work``, never ``None``."""
    work = collective(*args, async_op=True, **kwargs)
    if work is None:  # torch's answer to a rank outside the group: nothing to wait on, nothing received
        raise RuntimeError("this rank is not a member of the process group")
    return work


def _global_rank(process_group: dist.ProcessGroup | None, rank: int) -> int:
    return rank if process_group is None else dist.get_global_rank(process_group, rank)


class Work:
    """An in-flight collective started by this module: ``wait()`` blocks until ``result`` holds the
    outcome and returns it; a failure is raised as a :class:`CollectiveError` saying what failed.
    ``get_future()`` is the backend's future (for DDP hooks); :meth:`error` describes an exception taken
    from it the same way.

    ``what`` describes the collective: a string, or a function making it, called only on failure (no
    string building on the hot path). ``staging``: where the collective really runs (e.g. a CPU copy
    of a CUDA ``result`` for gloo), copied into ``result`` by ``wait()``.
    """

    __slots__ = ("work", "result", "_what", "staging")

    def __init__(self, work: Any, result: Tensor, what: str | Callable[[], str],
                 staging: Tensor | None = None) -> None:
        self.work = work
        self.result = result
        self._what = what
        self.staging = staging

    @property
    def what(self) -> str:
        return self._what if isinstance(self._what, str) else self._what()

    def wait(self) -> Tensor:
        try:
            self.work.wait()
        except RuntimeError as error:
            raise self.error(error) from error
        if self.staging is not None:
            self.result.copy_(self.staging)
            self.staging = None
        return self.result

    def get_future(self) -> torch.futures.Future:
        return self.work.get_future()

    def error(self, error: BaseException) -> CollectiveError:
        """``error`` (from this collective's future) as a :class:`CollectiveError` naming it."""
        return collective_error(self.what, error)


def _described(what: str | Callable[[], str], collective: Any, *args: Any, **kwargs: Any) -> Any:
    try:
        return _start(collective, *args, **kwargs)
    except RuntimeError as error:
        raise collective_error(what if isinstance(what, str) else what(), error) from error


def all_reduce_async(tensor: Tensor, process_group: dist.ProcessGroup | None = None, issuer: str = "gradpress",
                     op: str = "sum", what: str | None = None) -> Work:
    """Start reducing ``tensor`` in place over ``process_group`` (``op``: ``"sum"``, ``"max"``, ``"min"``).
    ``what`` replaces the default description (``"allreduce (sum) of N <dtype> values over W ranks in
    <issuer>"``) in a :class:`CollectiveError`."""
    described = what or (lambda: describe_collective(f"allreduce ({op})", tensor, dist.get_world_size(process_group),
                                                     issuer))
    return Work(_described(described, dist.all_reduce, tensor, op=_op(op), group=process_group), tensor, described)


def all_reduce(tensor: Tensor, process_group: dist.ProcessGroup | None = None, issuer: str = "gradpress",
               op: str = "sum") -> Tensor:
    """Reduce ``tensor`` in place over ``process_group`` and return it; a failure is a
    :class:`CollectiveError` naming the collective, its size, the world size and ``issuer``."""
    try:
        dist.all_reduce(tensor, op=_op(op), group=process_group)
    except RuntimeError as error:
        what = describe_collective(f"allreduce ({op})", tensor, dist.get_world_size(process_group), issuer)
        raise collective_error(what, error) from error
    return tensor


def broadcast(tensor: Tensor, src: int = 0, process_group: dist.ProcessGroup | None = None,
              issuer: str = "gradpress") -> Tensor:
    """Overwrite ``tensor`` in place with its value on ``src`` (a rank *within* ``process_group``)."""
    try:
        dist.broadcast(tensor, src=_global_rank(process_group, src), group=process_group)
    except RuntimeError as error:
        raise collective_error(_describe_broadcast(tensor, src, process_group, issuer), error) from error
    return tensor


def broadcast_async(tensor: Tensor, src: int = 0, process_group: dist.ProcessGroup | None = None,
                    issuer: str = "gradpress") -> Work:
    """Start overwriting ``tensor`` in place with its value on ``src`` (a rank *within* ``process_group``;
    ``torch.distributed.get_group_rank`` turns a global rank into one)."""
    described = partial(_describe_broadcast, tensor, src, process_group, issuer)
    return Work(_described(described, dist.broadcast, tensor, src=_global_rank(process_group, src),
                           group=process_group), tensor, described)


def _describe_broadcast(tensor: Tensor, src: int, process_group: dist.ProcessGroup | None, issuer: str) -> str:
    return describe_collective(f"broadcast from rank {src}", tensor, dist.get_world_size(process_group), issuer)


def all_gather_async(out: Tensor, tensor: Tensor, process_group: dist.ProcessGroup | None = None,
                     issuer: str = "gradpress", what: str | None = None) -> Work:
    """Start gathering every rank's ``tensor`` into ``out`` (``world_size * tensor.numel()`` values,
    in rank order)."""
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor  # name since torch 2.13
    described = what or (lambda: describe_collective("all-gather", tensor, dist.get_world_size(process_group), issuer))
    return Work(_described(described, gather, out, tensor, group=process_group), out, described)


def reduce_scatter_async(out: Tensor, tensor: Tensor, process_group: dist.ProcessGroup | None = None,
                         issuer: str = "gradpress", what: str | None = None) -> Work:
    """Start summing ``tensor`` over the ranks, ``out`` receiving this rank's chunk (rank order)."""
    scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    described = what or (lambda: describe_collective("reduce-scatter (sum)", tensor,
                                                     dist.get_world_size(process_group), issuer))
    return Work(_described(described, scatter, out, tensor, group=process_group), out, described)


def barrier(process_group: dist.ProcessGroup | None = None, issuer: str = "gradpress") -> None:
    """Wait until every rank of ``process_group`` reaches this call."""
    try:
        dist.barrier(group=process_group)
    except RuntimeError as error:
        raise collective_error(f"barrier over {dist.get_world_size(process_group)} ranks in {issuer}",
                               error) from error


def all_gather_objects(obj: object, process_group: dist.ProcessGroup | None = None,
                       issuer: str = "gradpress") -> list[Any]:
    """Every rank's ``obj`` (picklable), in rank order, on every rank of ``process_group``."""
    world = dist.get_world_size(process_group)
    everyone: list[Any] = [None] * world
    try:
        dist.all_gather_object(everyone, obj, group=process_group)
    except RuntimeError as error:
        raise collective_error(f"all-gather of one object per rank over {world} ranks in {issuer}", error) from error
    return everyone


# -- parameters: one collective per (device, dtype) ---------------------------------------------------

def flat_groups(tensors: list[Tensor], wire_dtype: torch.dtype | None = None) -> Iterator[tuple[list[Tensor], Tensor]]:
    """For each (device, dtype) group of ``tensors``: ``(members, flat)`` where ``flat`` is their
    concatenation (in ``wire_dtype`` if given); after the caller resumes, ``flat`` is copied back."""
    groups: dict[tuple[torch.device, torch.dtype], list[Tensor]] = {}
    for t in tensors:
        groups.setdefault((t.device, t.dtype), []).append(t)
    with torch.no_grad():
        for (_, dtype), members in groups.items():
            flat = torch.cat([t.detach().reshape(-1) for t in members]).to(wire_dtype or dtype)
            yield members, flat
            offset = 0
            for t in members:
                t.detach().copy_(flat[offset: offset + t.numel()].view_as(t))
                offset += t.numel()


def average_tensors_(tensors: list[Tensor], process_group: dist.ProcessGroup | None = None,
                     wire_dtype: torch.dtype | None = None, issuer: str = "average_tensors_") -> int:
    """Replace each tensor by its mean over ``process_group``, in place; return the bytes sent.

    One allreduce per (device, dtype) group, in that dtype (or ``wire_dtype``), of ``tensor / size``.
    A failed collective raises :class:`CollectiveError` naming it and ``issuer``.
    """
    size = dist.get_world_size(process_group)
    if size == 1 or not tensors:
        return 0
    sent = 0
    for _, flat in flat_groups(tensors, wire_dtype):
        flat.div_(size)
        all_reduce(flat, process_group, issuer)
        sent += flat.numel() * flat.element_size()
    return sent


def broadcast_parameters(params: nn.Module | Iterable[Tensor], process_group: dist.ProcessGroup | None = None,
                         src: int = 0) -> None:
    """Overwrite ``params`` on every worker, in place, with their values on ``src`` (a rank *within*
    ``process_group``; ``None``: the default group), as ``DistributedDataParallel`` does at construction.

    A collective: every worker of the group calls it with tensors of the same shapes and dtypes. One
    broadcast per (device, dtype). For a module, all its parameters (frozen ones too) and buffers. Nothing
    happens when ``torch.distributed`` is not initialised or the group has one worker.

    >>> broadcast_parameters(model)          # after init_process_group, on every rank  # doctest: +SKIP
    """
    if not is_distributed() or dist.get_world_size(process_group) == 1:
        return
    if isinstance(params, nn.Module):
        tensors = list(params.parameters()) + list(params.buffers())
    else:
        tensors = list(params)
    for _, flat in flat_groups(tensors):
        broadcast(flat, src, process_group, "broadcast_parameters")

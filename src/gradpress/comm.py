"""The one place that talks to a process group: asynchronous sum-allreduce of a flat buffer.

The engine only sees the :class:`Communicator` protocol, so it can run under DDP hooks, under the
standalone aggregator, or with no ``torch.distributed`` at all (:class:`LocalCommunicator`).
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.distributed as dist
from torch import Tensor

__all__ = ["CollectiveError", "Communicator", "Handle", "LocalCommunicator", "ProcessGroupCommunicator",
           "check_process_group", "collective_error", "gather_objects", "make_communicator", "scatter_objects"]


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


class _Pending:
    __slots__ = ("work", "buffer", "staging", "owner", "op")

    def __init__(self, work: dist.Work, buffer: Tensor, staging: Tensor | None,
                 owner: ProcessGroupCommunicator, op: dist.ReduceOp) -> None:
        self.work = work
        self.buffer = buffer
        self.staging = staging
        self.owner = owner  # described only if it fails: no string building on the hot path
        self.op = op

    def wait(self) -> Tensor:
        try:
            self.work.wait()
        except RuntimeError as error:
            raise collective_error(self.owner._describe(self.op, self.buffer), error) from error
        if self.staging is not None:
            self.buffer.copy_(self.staging)
            self.staging = None
        return self.buffer


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
        try:
            work = dist.all_reduce(buffer if staging is None else staging,
                                   op=op, group=self.process_group, async_op=True)
        except RuntimeError as error:
            raise collective_error(self._describe(op, buffer), error) from error
        assert work is not None
        return _Pending(work, buffer, staging, self, op)

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

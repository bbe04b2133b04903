"""The communicators the engine is given: sum or max of a flat buffer, asynchronously, over a process group
(:class:`ProcessGroupCommunicator`) or a single worker (:class:`LocalCommunicator`). They satisfy the
engine's :class:`gradpress.powersgd.transport.Communicator` protocol structurally: the engine defines what it
consumes, this layer below it never imports it."""

from __future__ import annotations

from functools import partial

import torch
import torch.distributed as dist
from torch import Tensor

from .collectives import Work, is_member, start_described
from .errors import describe_collective

__all__ = ["LocalCommunicator", "ProcessGroupCommunicator", "make_communicator"]


class _Done:
    __slots__ = ("buffer",)

    def __init__(self, buffer: Tensor) -> None:
        self.buffer = buffer

    def wait(self) -> Tensor:
        return self.buffer


class LocalCommunicator:
    """A single worker: the sum over one worker is the buffer itself."""

    world_size = 1

    def allreduce_sum(self, buffer: Tensor) -> _Done:
        return _Done(buffer)

    def allreduce_max(self, buffer: Tensor) -> _Done:
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
        if not is_member(process_group):
            raise ValueError(f"process_group: this rank (global rank {dist.get_rank()}) is not a member of it; "
                             f"{issuer} needs a group this rank belongs to (or None, the default group)")
        self.process_group = process_group
        self.comm_device = None if comm_device is None else torch.device(comm_device)
        self.issuer = issuer
        self._world_size = dist.get_world_size(process_group)

    @property
    def world_size(self) -> int:
        return self._world_size

    def allreduce_sum(self, buffer: Tensor) -> Work:
        return self._allreduce(buffer, dist.ReduceOp.SUM)

    def allreduce_max(self, buffer: Tensor) -> Work:
        return self._allreduce(buffer, dist.ReduceOp.MAX)

    def _allreduce(self, buffer: Tensor, op: dist.ReduceOp.RedOpType) -> Work:
        staging = None
        if self.comm_device is not None and buffer.device != self.comm_device:
            staging = buffer.to(self.comm_device)
        describe = partial(self._describe, op, buffer)  # called only if the collective fails
        work = start_described(describe, dist.all_reduce, buffer if staging is None else staging, op=op,
                          group=self.process_group)
        return Work(work, buffer, describe, staging)

    def _describe(self, op: dist.ReduceOp.RedOpType, buffer: Tensor) -> str:
        name = f"allreduce ({'sum' if op == dist.ReduceOp.SUM else 'max'})"
        return describe_collective(name, buffer, self._world_size, self.issuer)


def make_communicator(process_group: dist.ProcessGroup | None = None,
                      comm_device: torch.device | str | None = None,
                      issuer: str = "gradpress") -> ProcessGroupCommunicator | LocalCommunicator:
    """A :class:`ProcessGroupCommunicator` when ``torch.distributed`` is initialized, else local."""
    if dist.is_available() and dist.is_initialized():
        return ProcessGroupCommunicator(process_group, comm_device, issuer)
    if process_group is not None:
        raise RuntimeError("a process_group was given but torch.distributed is not initialized")
    return LocalCommunicator()

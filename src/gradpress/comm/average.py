"""Exact averaging of tensor lists: the one primitive every uncompressed average in gradpress goes through.

The tensors are grouped by (device, dtype), each group is flattened into one buffer (cast to
``wire_dtype`` if given, moved to ``comm_device`` if given), divided by the world size *before* the sum
(house rule: fp16 cannot overflow, the sum of W terms of ``value / W``), and summed in one allreduce per
group; the mean is then copied back into the tensors (cast back to their dtype). Three forms:

* blocking: :func:`average_tensors_` (returns the bytes sent);
* asynchronous: :func:`start_average` returns a :class:`PendingAverage`, whose ``wait()`` finishes the
  average into the tensors (and ``get_future()`` gives DDP's future for a bucket);
* pipeline: :func:`average_task`, a generator for an ordered pipeline of tasks over a communicator (it
  yields the collective's handle and, resumed, copies the mean back).

>>> import torch
>>> tensors = [torch.ones(2, 2), torch.full((3,), 2.0)]
>>> pending = start_average(tensors, world_size=1)     # one worker: nothing to sum with
>>> [b.numel() for b in pending.buffers], pending.bytes_sent
([7], 28)
>>> pending.wait()[1]
tensor([2., 2., 2.])
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Sequence
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch import Tensor

from .collectives import Work, all_reduce_async, is_member, require_member

__all__ = ["PendingAverage", "average_task", "average_tensors_", "device_groups", "start_average"]

def device_groups(tensors: Sequence[Tensor]) -> list[list[int]]:
    """Positions of ``tensors`` grouped by (device, dtype), groups in first-seen order: the groups (and the
    order of the buffers) of every average here."""
    groups: dict[tuple[torch.device, torch.dtype], list[int]] = {}
    for i, t in enumerate(tensors):
        groups.setdefault((t.device, t.dtype), []).append(i)
    return list(groups.values())


def _flatten(members: list[Tensor], wire_dtype: torch.dtype | None, device: torch.device | None) -> Tensor:
    """The members as one flat buffer in ``wire_dtype`` on ``device``. A lone contiguous member that
    needs no cast nor move is its own buffer (a DDP bucket is averaged in place, as PyTorch's hooks do)."""
    first = members[0]
    dtype = wire_dtype or first.dtype
    target = first.device if device is None else device
    if len(members) == 1 and first.is_contiguous() and first.dtype == dtype and first.device == target:
        return first.detach().view(-1)
    flat = torch.cat([t.detach().reshape(-1) for t in members]) if len(members) > 1 else first.detach().reshape(-1)
    return flat.to(device=target, dtype=dtype)  # a copy: the lone member above is the only alias


def _copy_back(members: list[Tensor], flat: Tensor) -> None:
    """Write ``flat`` (the mean, in the wire dtype) into ``members`` (cast back to their dtype)."""
    if len(members) == 1 and flat.data_ptr() == members[0].data_ptr() and flat.dtype == members[0].dtype:
        return  # averaged in place
    views = [s.view_as(t) for s, t in zip(flat.split([t.numel() for t in members]), members)]
    if flat.dtype == members[0].dtype and flat.device == members[0].device:
        torch._foreach_copy_([t.detach() for t in members], views)
    else:
        for t, view in zip(members, views):
            t.detach().copy_(view)


class PendingAverage:
    """An exact average started by :func:`start_average`: ``buffers`` (one flat wire buffer per (device,
    dtype) group of ``tensors``, which the collectives sum in place), ``works`` (their handles; empty
    once waited on, or when nothing was sent) and ``bytes_sent`` (the buffers' bytes).

    :meth:`wait` finishes the average: every collective completes, then each buffer is copied back into
    its group's tensors; it returns ``tensors``. A :class:`PendingAverage` built from saved ``buffers``
    and no ``works`` (``PendingAverage(tensors, buffers)``) finishes from them without communicating.
    """

    __slots__ = ("tensors", "buffers", "works", "bytes_sent", "_groups")

    def __init__(self, tensors: Sequence[Tensor], buffers: Sequence[Tensor], works: Sequence[Work] = ()) -> None:
        self.tensors = list(tensors)
        self._groups = device_groups(self.tensors)
        if len(buffers) != len(self._groups):
            raise ValueError(f"PendingAverage: {len(buffers)} buffers for {len(self._groups)} (device, dtype) "
                             "groups of tensors")
        self.buffers = list(buffers)
        self.works = list(works)
        self.bytes_sent = sum(b.numel() * b.element_size() for b in self.buffers)

    def wait_collectives(self) -> list[Tensor]:
        """Wait for the collectives only (``buffers`` then hold the mean); returns ``buffers``."""
        for work in self.works:
            work.wait()
        self.works = []
        return self.buffers

    def wait(self) -> list[Tensor]:
        """Finish the average into ``tensors`` and return them. A failed collective raises its
        :class:`~gradpress.comm.CollectiveError`."""
        self.wait_collectives()
        for group, flat in zip(self._groups, self.buffers):
            _copy_back([self.tensors[i] for i in group], flat)
        return self.tensors

    def finite(self, device: torch.device | None = None) -> Tensor:
        """A 0-dim bool tensor (on ``device``, default the first tensor's): whether every value of the
        buffers is finite, decided on the device (no host read). Call after the collectives completed."""
        device = self.tensors[0].device if device is None else device
        return torch.stack([torch.isfinite(b).all().to(device) for b in self.buffers]).all()

    def get_future(self) -> torch.futures.Future:
        """For an average of one tensor (a DDP bucket): a future whose value is that tensor holding the
        mean, completed when the collective has; the completion callback only copies. If the collective
        fails, the future's error is a :class:`~gradpress.comm.CollectiveError` naming it."""
        if len(self.tensors) != 1:
            raise ValueError(f"get_future: an average of one tensor (a bucket), got {len(self.tensors)} tensors")
        if not self.works:
            future: torch.futures.Future = torch.futures.Future()
            future.set_result(self.wait()[0])
            return future
        work, tensor, flat = self.works[0], self.tensors[0], self.buffers[0]

        def done(f: torch.futures.Future) -> Tensor:
            try:
                f.value()
            except RuntimeError as error:  # described here, where the collective is known
                raise work.error(error) from error
            _copy_back([tensor], flat)
            return tensor

        return work.get_future().then(done)


def start_average(tensors: Sequence[Tensor], process_group: dist.ProcessGroup | None = None, *,
                  wire_dtype: torch.dtype | None = None, comm_device: torch.device | str | None = None,
                  issuer: str = "gradpress", what: str | Callable[[int], str] | None = None,
                  world_size: int | None = None) -> PendingAverage:
    """Start averaging ``tensors`` over ``process_group``: one allreduce per (device, dtype) group of
    ``buffer / world_size``, the buffer in ``wire_dtype`` (default: the group's dtype) on ``comm_device``
    (default: where the tensors are). Nothing is written into ``tensors`` before :meth:`PendingAverage.wait`
    (but a lone contiguous tensor that needs no cast is its own buffer, averaged in place).

    With one worker (``world_size`` 1, which may be given instead of asking the group) the buffers are
    built (cast, as the wire would) and nothing is sent. ``what``: how a failed collective is described
    (a function receives the average's bytes); default ``"allreduce (sum) of N <dtype> values over W ranks
    in <issuer>"``. A rank outside ``process_group`` gets a :class:`~gradpress.comm.CollectiveError`.
    """
    tensors = list(tensors)
    if world_size is None:
        require_member(process_group, lambda: f"allreduce (sum) in {issuer}")
        world_size = dist.get_world_size(process_group)
    device = None if comm_device is None else torch.device(comm_device)
    buffers = []
    with torch.no_grad():
        for group in device_groups(tensors):
            buffers.append(_flatten([tensors[i] for i in group], wire_dtype, device))
        if world_size == 1:
            return PendingAverage(tensors, buffers)
        for flat in buffers:
            flat.div_(world_size)
    pending = PendingAverage(tensors, buffers)
    described: Any = what
    if callable(what):
        described = lambda: what(pending.bytes_sent)  # noqa: E731 - built only if a collective fails
    pending.works = [all_reduce_async(flat, process_group, issuer, what=described) for flat in buffers]
    return pending


def average_tensors_(tensors: list[Tensor], process_group: dist.ProcessGroup | None = None,
                     wire_dtype: torch.dtype | None = None, issuer: str = "average_tensors_") -> int:
    """Replace each tensor by its mean over ``process_group``, in place; return the bytes sent.

    One allreduce per (device, dtype) group, in that dtype (or ``wire_dtype``), of ``tensor / size``
    (:func:`start_average`, waited on). A failed collective raises :class:`CollectiveError` naming it and
    ``issuer``. With one worker, or on a rank that is not a member of ``process_group``, nothing changes
    and 0 is returned (as PyTorch's ``average_parameters``).
    """
    if not is_member(process_group) or not tensors or dist.get_world_size(process_group) == 1:
        return 0
    pending = start_average(tensors, process_group, wire_dtype=wire_dtype, issuer=issuer)
    pending.wait()
    return pending.bytes_sent


class _Summing(Protocol):
    """What :func:`average_task` needs of a communicator (``gradpress.powersgd.transport.Communicator``)."""

    @property
    def world_size(self) -> int: ...

    def allreduce_sum(self, buffer: Tensor) -> Any: ...


def average_task(tensors: Sequence[Tensor], comm: _Summing) -> Generator[Any, None, Tensor | None]:
    """The pipeline form, for tensors of one device and dtype: a task that divides their concatenation by
    ``comm.world_size``, yields the handle of its sum-allreduce (``comm.allreduce_sum``), and, resumed
    once it completed, copies the mean back into ``tensors``. It returns the averaged flat buffer (``yield
    from`` gives it to the caller), or ``None`` when nothing was sent (no tensors, or one worker).

    >>> def task(tensors, comm, done):            # a caller's task around it  # doctest: +SKIP
    ...     flat = yield from average_task(tensors, comm)
    ...     done(flat)
    """
    tensors = list(tensors)
    if not tensors or comm.world_size == 1:
        return None
    with torch.no_grad():
        flat = torch.cat([t.detach().reshape(-1) for t in tensors])
        flat.div_(comm.world_size)
    yield comm.allreduce_sum(flat)
    with torch.no_grad():
        _copy_back(tensors, flat)
    return flat

"""Exact averaging of tensor lists: the one primitive every uncompressed average in gradpress goes through.

The tensors are grouped by (device, dtype), each group is flattened into one buffer (cast to
``wire_dtype`` if given, moved to ``comm_device`` if given), divided by the world size *before* the sum
(house rule: fp16 cannot overflow, the sum of W terms of ``value / W``), and summed in one allreduce per
group; the mean is then copied back into the tensors (cast back to their dtype). With ``scaled=True`` and
an fp16 wire, each tensor is also divided by its own power of two before the cast (see
:func:`start_average`), so that small values keep fp16's precision instead of falling into its
subnormals. Three forms:

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

import math
from collections.abc import Callable, Generator, Sequence
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch import Tensor

from .collectives import Work, all_reduce_async, is_member, require_member

__all__ = ["PendingAverage", "average_task", "average_tensors_", "device_groups", "start_average"]

#: Scaled fp16 wire: each rank's ``value / W`` is divided by ``2^(ceil(log2(bound)) - FP16_HEADROOM)``,
#: ``bound`` the tensor's largest magnitude over all ranks, so the sum of W such terms is at most ``2^14``
#: (fp16's largest finite value is 65504) and the tensor's largest values use fp16's full precision.
FP16_HEADROOM = 14


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


def _upload(values: list[int], device: torch.device) -> Tensor:
    """``values`` (built on the host) as an int64 tensor on ``device``, without making the host wait for
    the device: through pinned memory, asynchronously, on CUDA; a non-blocking ``to`` elsewhere (the
    engine's ``seeding.upload``, which this layer may not import)."""
    tensor = torch.tensor(values, dtype=torch.int64)
    if device.type == "cpu":
        return tensor
    if device.type == "cuda":
        tensor = tensor.pin_memory()
    return tensor.to(device, non_blocking=True)


def _spans(members: list[Tensor]) -> list[int]:
    """The lengths of the spans that carry one scale each: the members' sizes, empty members left out
    (their infinity norm is undefined); ``[0]`` when every member is empty (one scale, for no element)."""
    return [t.numel() for t in members if t.numel()] or [0]


def _spread(scales: Tensor, members: list[Tensor], flat: Tensor) -> Tensor:
    """Each element's scale for ``flat`` (the members' concatenation): ``scales`` (one per span of
    :func:`_spans`) repeated over their spans, on ``flat``'s device (lengths uploaded, no per-element
    table built on the host)."""
    lengths = _upload(_spans(members), flat.device)
    return torch.repeat_interleave(scales.to(flat.device), lengths, output_size=flat.numel())


def _scales(bound: Tensor) -> Tensor:
    """Per span, the power of two the scaled fp16 wire divides by: ``2^(ceil(log2(bound)) - 14)``, never
    below the smallest normal number of ``bound``'s dtype (a bound among the subnormals would otherwise
    give a scale of zero, and the wire inf and NaN), or 1 where ``bound`` (the largest magnitude over all
    ranks) is zero or not finite (the wire then carries the zeros, or the inf/NaN that makes the average
    non-finite)."""
    usable = torch.isfinite(bound) & (bound > 0)
    floor = math.log2(torch.finfo(bound.dtype).tiny) + FP16_HEADROOM
    powers = torch.exp2(torch.ceil(torch.log2(bound)).clamp_(min=floor) - FP16_HEADROOM)
    return torch.where(usable, powers, torch.ones_like(bound))


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
    dtype) group of ``tensors``, which the collectives sum in place), ``scales`` (a scaled fp16 wire's
    powers of two, one tensor per group holding one scale per non-empty tensor of the group, on the
    buffer's device; empty when the wire is not scaled), ``works`` (their handles; empty once waited on,
    or when nothing was sent) and ``bytes_sent`` (the buffers' bytes).

    :meth:`wait` finishes the average: every collective completes, then each buffer (multiplied back by
    its scales, in the tensors' working dtype, if scaled) is copied back into its group's tensors; it
    returns ``tensors``. A :class:`PendingAverage` built from saved ``buffers`` (and ``scales``) and no
    ``works`` (``PendingAverage(tensors, buffers, scales=scales)``) finishes from them without
    communicating.
    """

    __slots__ = ("tensors", "buffers", "scales", "works", "bytes_sent", "_groups")

    def __init__(self, tensors: Sequence[Tensor], buffers: Sequence[Tensor], works: Sequence[Work] = (), *,
                 scales: Sequence[Tensor] = ()) -> None:
        self.tensors = list(tensors)
        self._groups = device_groups(self.tensors)
        if len(buffers) != len(self._groups):
            raise ValueError(f"PendingAverage: {len(buffers)} buffers for {len(self._groups)} (device, dtype) "
                             "groups of tensors")
        if len(scales) not in (0, len(self._groups)):
            raise ValueError(f"PendingAverage: {len(scales)} scale tensors for {len(self._groups)} (device, "
                             "dtype) groups of tensors (one per group, or none)")
        self.buffers = list(buffers)
        self.scales = list(scales)
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
        for g, (group, flat) in enumerate(zip(self._groups, self.buffers)):
            members = [self.tensors[i] for i in group]
            if self.scales:  # by powers of two: exact, in the working dtype (the scales')
                scales = self.scales[g]
                flat = torch.mul(flat.to(scales.dtype), _spread(scales, members, flat))
            _copy_back(members, flat)
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
        if self.scales:
            raise ValueError("get_future: an average with a scaled fp16 wire finishes through wait()")
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
                  world_size: int | None = None, scaled: bool = False) -> PendingAverage:
    """Start averaging ``tensors`` over ``process_group``: one allreduce per (device, dtype) group of
    ``buffer / world_size``, the buffer in ``wire_dtype`` (default: the group's dtype) on ``comm_device``
    (default: where the tensors are). Nothing is written into ``tensors`` before :meth:`PendingAverage.wait`
    (but a lone contiguous tensor that needs no cast is its own buffer, averaged in place).

    ``scaled`` (only with ``wire_dtype=torch.float16``): each group is flattened in its working dtype
    (fp64 for fp64 tensors, else fp32), one max-allreduce per group of each tensor's largest magnitude
    (one float per non-empty tensor, one ``_foreach_norm`` for all) gives ``bound``, and each tensor is
    divided by the world size and by its own ``scale = 2^(ceil(log2(bound)) - 14)`` (exact) *before* the
    cast to fp16: the sum cannot overflow, and a tensor of small values keeps fp16's relative precision
    (2^-11) instead of falling into its subnormals. A tensor that is all zero or not finite keeps scale 1.
    :meth:`PendingAverage.wait` multiplies the sum back by the scales (``PendingAverage.scales``, kept
    with the buffers). Waits for the max-allreduce before the sum is issued (a stream wait on a GPU, no
    host read); ``bytes_sent`` counts the wire buffers only. The default (``False``) is PyTorch's
    ``fp16_compress_hook`` recipe: cast, divide, sum.

    With one worker (``world_size`` 1, which may be given instead of asking the group) the buffers are
    built (cast and scaled, as the wire would) and nothing is sent. ``what``: how a failed collective is
    described (a function receives the average's bytes); default ``"allreduce (sum) of N <dtype> values
    over W ranks in <issuer>"``. A rank outside ``process_group`` gets a
    :class:`~gradpress.comm.CollectiveError`; ``scaled`` without an fp16 wire a ``ValueError``.
    """
    tensors = list(tensors)
    if scaled and wire_dtype != torch.float16:
        raise ValueError(f"start_average: scaled=True needs wire_dtype=torch.float16, got wire_dtype={wire_dtype}")
    if world_size is None:
        require_member(process_group, lambda: f"allreduce (sum) in {issuer}")
        world_size = dist.get_world_size(process_group)
    device = None if comm_device is None else torch.device(comm_device)
    with torch.no_grad():
        if scaled:
            buffers, scales = _scaled_buffers(tensors, process_group, device, issuer, world_size)
            pending = PendingAverage(tensors, buffers, scales=scales)
            if world_size == 1:
                return pending
        else:
            buffers = [_flatten([tensors[i] for i in group], wire_dtype, device) for group in device_groups(tensors)]
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


def _scaled_buffers(tensors: list[Tensor], process_group: dist.ProcessGroup | None, device: torch.device | None,
                    issuer: str, world_size: int) -> tuple[list[Tensor], list[Tensor]]:
    """The fp16 wire buffers of a scaled average (:func:`start_average`) and their scales, per (device,
    dtype) group. Issues (and waits for) one max-allreduce per group when ``world_size > 1``; every rank
    issues the same ones in the same order (the groups depend on the tensors' devices and dtypes only).
    A constant number of ops per group, whatever the number of tensors."""
    flats, peaks, spans = [], [], []
    for group in device_groups(tensors):
        members = [tensors[i] for i in group]
        working = torch.float64 if members[0].dtype == torch.float64 else torch.float32
        target = members[0].device if device is None else device
        flat = torch.cat([t.detach().reshape(-1) for t in members]).to(device=target, dtype=working)  # a copy
        pieces = [piece for piece in flat.split([t.numel() for t in members]) if piece.numel()]
        peak = torch.stack(torch._foreach_norm(pieces, ord=float("inf"))) if pieces else flat.new_zeros(1)
        flats.append(flat)
        peaks.append(peak)
        spans.append(members)
    if world_size > 1:
        works = [all_reduce_async(peak, process_group, issuer, op="max") for peak in peaks]
        for work in works:  # the scales need every rank's peaks
            work.wait()
    buffers, scales = [], []
    for flat, peak, members in zip(flats, peaks, spans):
        scale = _scales(peak)
        divisor = _spread(scale, members, flat)
        if world_size > 1:
            divisor.mul_(world_size)  # W · 2^k is exact, and x / (W · 2^k) rounds as (x / W) / 2^k
        buffers.append(flat.div_(divisor).to(torch.float16))
        scales.append(scale)
    return buffers, scales


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

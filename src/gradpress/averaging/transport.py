"""How DiLoCo's averagers send an outer gradient and get its average back: one family of transports,
accepted as ``compression=`` by :class:`~gradpress.OuterOptimizerAverager` and
:class:`~gradpress.StreamingDiLoCoAverager` alike (as torchft's fragments send theirs).

A transport does two things for one fragment (the whole model for ``OuterOptimizerAverager``):
:meth:`OuterTransport.send` starts the collectives of the outer gradient ``x - θ_i`` (``x`` the anchor,
``θ_i`` this rank's parameters) and returns what is in flight (:class:`Sent`); :meth:`OuterTransport.mean`
waits and returns the average ``Δ`` per anchor tensor with a 0-dim ``finite`` flag decided on the
device. A :class:`Sent` is plain data once waited on (``buffers``, ``residual``), so a checkpoint can store
it and :meth:`~OuterTransport.mean` finish it after a resume, with no collective issued again.

The family (:func:`transport_for` turns every accepted ``compression=`` value into one):

* :class:`Exact` (``None``, ``"fp16"``, ``"bf16"``): one allreduce per (device, dtype) of ``δ / W`` in
  the tensors' dtype or the given one (:func:`gradpress.comm.start_average`); on an fp16 wire each
  tensor is divided by its own power of two before the cast (``scaled=True``: one max-allreduce of one
  float per tensor first), so that an outer gradient of small values keeps fp16's precision (it has no
  error feedback to carry what the cast drops);
* :class:`Compressed` (a :class:`~gradpress.averaging.compress.Compressor`: ``QuantizeInt8``,
  ``QuantizeInt4``, ``TopK``): ``e = δ + β·residual`` encoded, the payloads all-gathered, every rank's
  decoded and summed in fp32/fp64, divided by ``W``; the rank keeps ``e - decode(own payload)`` as its
  residual (error feedback);
* :class:`PowerSGD` (a :class:`gradpress.Config`): the :class:`gradpress.PowerSGD` aggregator over the
  anchor, its error memory per rank (:meth:`~OuterTransport.bind` gives each anchor its own); blocking.

>>> transport_for("bf16")
Exact(wire_dtype=torch.bfloat16)
>>> transport_for("int8")  # doctest: +NORMALIZE_WHITESPACE
Traceback (most recent call last):
...
ValueError: compression must be None (exact), 'fp16', 'bf16', a gradpress.Config (PowerSGD), QuantizeInt8(...),
QuantizeInt4(...), TopK(...) or an OuterTransport, got 'int8'
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from ..aggregator import Config, PowerSGD as PowerSGDAggregator
from ..comm import PendingAverage, Work, all_gather_async, device_groups, start_average
from .compress import Compressor, rounding_generator

__all__ = ["Compressed", "Exact", "Link", "OuterTransport", "PowerSGD", "Sent", "sync_seed", "transport_for"]

ALLOWED = ("None (exact), 'fp16', 'bf16', a gradpress.Config (PowerSGD), QuantizeInt8(...), QuantizeInt4(...), "
           "TopK(...) or an OuterTransport")


def sync_seed(seed: int, rank: int, fragment: int, count: int) -> int:
    """Seed of the stochastic rounding of one sync: a pure function of counters kept in the averager's
    state, so that a resumed run draws the same numbers; different on every rank (independent rounding
    noise averages out across ranks instead of adding up). :class:`Compressed` seeds a generator on the
    outer gradient's device with it (:func:`~gradpress.averaging.compress.rounding_generator`)."""
    mixed = seed
    for part in (rank, fragment, count):
        mixed = (mixed * 0x9E3779B1 + part + 1) % (2 ** 61 - 1)
    return mixed


@dataclass(frozen=True)
class Link:
    """Where and what one sync sends: the group, this rank and the world size, the fragment and how many
    syncs it started before (they seed stochastic rounding), ``issuer`` (named by a failed collective)
    and ``describe(op, bytes)``, how a failed collective is named (``None``: the default description)."""

    process_group: dist.ProcessGroup | None
    rank: int
    world: int
    fragment: int = 0
    sync: int = 0
    issuer: str = "gradpress"
    describe: Callable[[str, int], str] | None = None

    def what(self, op: str) -> Callable[[int], str] | None:
        describe = self.describe
        return None if describe is None else (lambda sent: describe(op, sent))


class Sent:
    """An outer gradient handed to collectives: their handles (``works``, empty once waited on or after a
    resume), the ``buffers`` they fill (what a checkpoint stores), this rank's new ``residual`` (error
    feedback, kept if the average is finite; ``None`` without), the ``bytes_sent`` and, where the
    transport decided it at send time, a ``finite`` flag."""

    __slots__ = ("works", "buffers", "residual", "bytes_sent", "finite", "pending")

    def __init__(self, works: Sequence[Work], buffers: Sequence[Tensor], residual: Tensor | None = None,
                 bytes_sent: int = 0, finite: Tensor | None = None, pending: PendingAverage | None = None) -> None:
        self.works = list(works)
        self.buffers = list(buffers)
        self.residual = residual
        self.bytes_sent = bytes_sent
        self.finite = finite
        self.pending = pending

    def wait(self) -> None:
        """Wait for the collectives (every rank issued them: this cannot deadlock)."""
        for work in self.works:
            work.wait()
        self.works = []


class OuterTransport(ABC):
    """What DiLoCo's averagers need of a transport (see the module docstring). Implementations are
    small frozen dataclasses: their ``repr`` names them in checkpoints and errors."""

    #: Whether :meth:`send` returns a per-rank residual (error feedback) to keep.
    error_feedback: bool = False

    def bind(self, anchor: list[Tensor], process_group: dist.ProcessGroup | None) -> OuterTransport:
        """The transport for one anchor (one fragment): ``self``, or a stateful copy (PowerSGD's error
        memory). Issues no collective."""
        return self

    @abstractmethod
    def send(self, anchor: list[Tensor], params: list[Tensor], residual: Tensor | None, link: Link) -> Sent:
        """Start sending ``anchor - params`` (plus ``residual`` where the transport feeds errors back);
        ``params`` are not modified."""

    @abstractmethod
    def mean(self, sent: Sent, anchor: list[Tensor]) -> tuple[list[Tensor], Tensor]:
        """Wait for ``sent`` and return ``Δ`` per anchor tensor (its shape and dtype) and a 0-dim bool
        ``finite`` on the first anchor tensor's device (no host read)."""

    def state_dict(self) -> dict[str, Any] | None:
        """Per-rank state of a bound transport (``None``: none)."""
        return None

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict`'s output (the caller checked its placement)."""


@dataclass(frozen=True)
class Exact(OuterTransport):
    """One allreduce per (device, dtype) of ``δ / W``, in the tensors' dtype or ``wire_dtype``.

    With ``wire_dtype=torch.float16`` the average is scaled (:func:`gradpress.comm.start_average` with
    ``scaled=True``): ``δ`` is divided by ``W`` in fp32 (fp64 for fp64 tensors), then each tensor by its
    own power of two (from a max-allreduce of one float per tensor, issued and waited on in :meth:`send`),
    then cast; relative error about fp16's 2^-11 per value whatever the tensor's magnitude. The
    :class:`Sent`'s ``buffers`` are the wire buffers followed by their scales (one tensor per (device,
    dtype) group), so that a checkpoint of an average in flight finishes exactly."""

    wire_dtype: torch.dtype | None = None

    def send(self, anchor: list[Tensor], params: list[Tensor], residual: Tensor | None, link: Link) -> Sent:
        with torch.no_grad():
            deltas = [a - t.detach() for a, t in zip(anchor, params)]
            pending = start_average(deltas, link.process_group, wire_dtype=self.wire_dtype, issuer=link.issuer,
                                    what=link.what("allreduce (sum)"), world_size=link.world,
                                    scaled=self.wire_dtype == torch.float16)
        return Sent(pending.works, pending.buffers + pending.scales, None, pending.bytes_sent, pending=pending)

    def mean(self, sent: Sent, anchor: list[Tensor]) -> tuple[list[Tensor], Tensor]:
        pending = sent.pending
        if pending is None:  # resumed from a checkpoint: finish from the stored buffers (and scales)
            groups = len(device_groups(anchor))
            pending = PendingAverage([torch.empty_like(a) for a in anchor], sent.buffers[:groups],
                                     scales=sent.buffers[groups:])
        else:
            pending.works = sent.works
        with torch.no_grad():
            means = pending.wait()
        sent.works = []
        return means, pending.finite(anchor[0].device)


@dataclass(frozen=True)
class Compressed(OuterTransport):
    """A :class:`~gradpress.averaging.compress.Compressor`'s payloads all-gathered (see the module
    docstring), with error feedback."""

    compressor: Compressor
    error_feedback = True

    @staticmethod
    def work_dtype(anchor: list[Tensor]) -> torch.dtype:
        """fp64 if an anchor tensor is, else fp32: where the outer gradient is encoded and decoded."""
        return torch.float64 if any(a.dtype == torch.float64 for a in anchor) else torch.float32

    def send(self, anchor: list[Tensor], params: list[Tensor], residual: Tensor | None, link: Link) -> Sent:
        compressor = self.compressor
        dtype, device = self.work_dtype(anchor), anchor[0].device
        with torch.no_grad():
            outer_grad = torch.cat([(a.to(dtype) - t.detach().to(dtype)).reshape(-1).to(device)
                                    for a, t in zip(anchor, params)])
            if residual is not None:  # e = δ + β·residual (β = 1 but for SparseLoCo's TopK(error_decay=))
                outer_grad.add_(residual, alpha=getattr(compressor, "error_decay", 1.0))
            generator = None
            if compressor.rounding == "stochastic":  # drawn on the outer gradient's device
                generator = rounding_generator(sync_seed(compressor.seed, link.rank, link.fragment, link.sync),
                                               device)
            payload = compressor.encode(outer_grad, generator)
            new_residual = outer_grad - compressor.decode(payload.unsqueeze(0), outer_grad.numel(), dtype)[0]
        works: list[Work] = []
        gathered = payload
        if link.world > 1:
            gathered = payload.new_empty(link.world * payload.numel())
            works = [all_gather_async(gathered, payload, link.process_group, link.issuer,
                                      what=link.what("all-gather"))]  # type: ignore[arg-type]
        return Sent(works, [gathered], new_residual, payload.numel())

    def mean(self, sent: Sent, anchor: list[Tensor]) -> tuple[list[Tensor], Tensor]:
        sent.wait()
        dtype = self.work_dtype(anchor)
        numel = sum(a.numel() for a in anchor)
        with torch.no_grad():
            # One row per rank; an empty shard encodes to nothing, one empty row then.
            payload_bytes = self.compressor.payload_bytes(numel)
            rows = sent.buffers[0].numel() // payload_bytes if payload_bytes else 1
            payloads = sent.buffers[0].view(rows, payload_bytes)
            mean = self.compressor.decode(payloads, numel, dtype).sum(dim=0).div_(payloads.shape[0])
            finite = torch.isfinite(mean).all()
            means, offset = [], 0
            for a in anchor:
                means.append(mean[offset: offset + a.numel()].view_as(a).to(a.device, a.dtype))
                offset += a.numel()
        return means, finite


@dataclass(frozen=True)
class PowerSGD(OuterTransport):
    """The outer gradient through a :class:`gradpress.PowerSGD` aggregator built over the anchor with
    ``config`` (its error feedback carries what compression dropped to the next sync). Blocking: the
    aggregator's collectives complete inside :meth:`send`."""

    config: Config

    def bind(self, anchor: list[Tensor], process_group: dist.ProcessGroup | None) -> OuterTransport:
        # The anchor is identical on every rank, so building the aggregator issues no collective.
        return _BoundPowerSGD(self.config, PowerSGDAggregator(anchor, self.config, process_group=process_group,
                                                              init_sync=False))

    def send(self, anchor: list[Tensor], params: list[Tensor], residual: Tensor | None, link: Link) -> Sent:
        return self.bind(anchor, link.process_group).send(anchor, params, residual, link)

    def mean(self, sent: Sent, anchor: list[Tensor]) -> tuple[list[Tensor], Tensor]:
        return _finished(sent, anchor)


class _BoundPowerSGD(OuterTransport):
    """:class:`PowerSGD` bound to one anchor: its aggregator (error memory) is the state."""

    def __init__(self, config: Config, aggregator: PowerSGDAggregator) -> None:
        self.config = config
        self.aggregator = aggregator

    def __repr__(self) -> str:
        return f"PowerSGD(config={self.config!r})"

    def send(self, anchor: list[Tensor], params: list[Tensor], residual: Tensor | None, link: Link) -> Sent:
        with torch.no_grad():
            deltas = [a - t.detach() for a, t in zip(anchor, params)]
        before = self.aggregator.total_bytes_sent
        with torch.no_grad():
            self.aggregator.aggregate_(deltas)
        finite = self.aggregator.finite
        flag = None if finite is None else torch.as_tensor(finite, device=anchor[0].device).bool()
        return Sent([], deltas, None, self.aggregator.total_bytes_sent - before, flag)

    def mean(self, sent: Sent, anchor: list[Tensor]) -> tuple[list[Tensor], Tensor]:
        return _finished(sent, anchor)

    def state_dict(self) -> dict[str, Any] | None:
        return self.aggregator.local_state_dict()  # inside the averager's state, which is per rank itself

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.aggregator.load_state_dict(state, allow_other_rank=True)  # placement checked by the caller


def _finished(sent: Sent, anchor: list[Tensor]) -> tuple[list[Tensor], Tensor]:
    """``Δ`` held in ``sent.buffers`` (one tensor per anchor tensor, already averaged)."""
    sent.wait()
    device = anchor[0].device
    with torch.no_grad():
        means = [b.to(a.dtype) for b, a in zip(sent.buffers, anchor)]
        flags = [torch.isfinite(b).all().to(device) for b in sent.buffers]
        if sent.finite is not None:
            flags.append(sent.finite.to(device))
    return means, torch.stack(flags).all()


def transport_for(compression: Any) -> OuterTransport:
    """The transport a ``compression=`` value means: ``None``, ``"fp16"``, ``"bf16"`` (:class:`Exact`), a
    :class:`~gradpress.averaging.compress.Compressor` (:class:`Compressed`), a :class:`gradpress.Config`
    (:class:`PowerSGD`) or an :class:`OuterTransport` itself; ``ValueError`` listing them otherwise."""
    if isinstance(compression, OuterTransport):
        return compression
    if compression is None:
        return Exact()
    if isinstance(compression, str) and compression in ("fp16", "bf16"):
        return Exact(torch.float16 if compression == "fp16" else torch.bfloat16)
    if isinstance(compression, Compressor):
        return Compressed(compression)
    if isinstance(compression, Config):
        return PowerSGD(compression)
    raise ValueError(f"compression must be {ALLOWED}, got {compression!r}")

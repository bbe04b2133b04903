"""How DiLoCo's averagers send an outer gradient and get its average back: one family of transports,
accepted as ``compression=`` by :class:`~gradpress.OuterOptimizerAverager` and
:class:`~gradpress.StreamingDiLoCoAverager` alike (as torchft's fragments send theirs).

A transport does two things for one fragment (the whole model for ``OuterOptimizerAverager``):
:meth:`OuterTransport.send` starts the collectives of the outer gradient ``x - θ_i`` (``x`` the anchor,
``θ_i`` this rank's parameters) and returns what is in flight (:class:`Sent`); :meth:`OuterTransport.mean`
waits and returns the average ``Δ`` per anchor tensor with a 0-dim ``finite`` flag decided on the
device. A transport of two phases (two-shot) issues its second in :meth:`OuterTransport.progress`, which
the averager calls at a step of its schedule between the two (the same step on every rank). A
:class:`Sent` is plain data once waited on (``buffers``, ``residual``, ``phase``), so a checkpoint can
store it and the averager finish it after a resume: the phases already issued are not issued again.

Every :class:`Sent` counts two figures: ``bytes_sent``, the payload this rank hands to its collectives, and
``link_bytes``, what this rank's link carries for them at this world size (ring-equivalent,
:func:`gradpress.comm.link_bytes`).

The family (:func:`transport_for` turns every accepted ``compression=`` value into one):

* :class:`Exact` (``None``, ``"fp16"``, ``"bf16"``): one allreduce per (device, dtype) of ``δ / W`` in
  the tensors' dtype or the given one (:func:`gradpress.comm.start_average`); on an fp16 wire each
  tensor is divided by its own power of two before the cast (``scaled=True``: one max-allreduce of one
  float per tensor first), so that an outer gradient of small values keeps fp16's precision (it has no
  error feedback to carry what the cast drops);
* :class:`Compressed` (a :class:`~gradpress.averaging.compress.Compressor`: ``QuantizeInt8``,
  ``QuantizeInt4``, ``TopK``): ``e = δ + β·residual`` encoded; the rank keeps ``e - decode(own payload)``
  as its residual (error feedback). By its ``schedule``: ``"all-gather"``, the payloads all-gathered,
  every rank's decoded and summed in fp32/fp64, divided by ``W`` (each rank's link carries ``(W - 1)·P``);
  ``"two-shot"`` (:mod:`gradpress.averaging.twoshot`), an all-to-all of regions to their owners, each
  owner's decoded sum requantized with its own residual, then an all-gather of the owners' rows
  (``2 (W - 1) / W`` of the padded payload); ``"auto"``, two-shot for int8/int4 from 3 ranks;
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

import logging
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from ..aggregator import Config, PowerSGD as PowerSGDAggregator
from ..comm import GroupExchange, PayloadExchange, PendingAverage, device_groups, link_bytes, start_average
from .compress import Compressor, rounding_generator
from .twoshot import check_schedule, decode_regions, encode_regions, owner_reduce, regions, resolve_schedule

__all__ = ["Compressed", "Exact", "Link", "OuterTransport", "OwnerResidual", "PowerSGD", "Sent", "sync_seed",
           "transport_for"]

logger = logging.getLogger("gradpress.averaging")

ALLOWED = ("None (exact), 'fp16', 'bf16', a gradpress.Config (PowerSGD), QuantizeInt8(...), QuantizeInt4(...), "
           "TopK(...) or an OuterTransport")


def sync_seed(seed: int, rank: int, fragment: int, count: int, stream: int = 0) -> int:
    """Seed of the stochastic rounding of one sync: a pure function of counters kept in the averager's
    state, so that a resumed run draws the same numbers; different on every rank (independent rounding
    noise averages out across ranks instead of adding up). :class:`Compressed` seeds a generator on the
    outer gradient's device with it (:func:`~gradpress.averaging.compress.rounding_generator`).
    ``stream=1``: the owner's requantization of a two-shot sync (another stream than the rank's own)."""
    mixed = seed
    for part in (rank, fragment, count):
        mixed = (mixed * 0x9E3779B1 + part + 1) % (2 ** 61 - 1)
    if stream:
        mixed = (mixed * 0x9E3779B1 + stream + 1) % (2 ** 61 - 1)
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
    #: Who carries compressed payloads (``None``: :class:`gradpress.comm.GroupExchange` over
    #: ``process_group``).
    exchange: PayloadExchange | None = None

    def what(self, op: str) -> Callable[[int], str] | None:
        describe = self.describe
        return None if describe is None else (lambda sent: describe(op, sent))

    def what_sent(self, op: str, tensor: Tensor) -> str | Callable[[], str]:
        """How a failed collective ``op`` of ``tensor`` is named (built only if it fails)."""
        describe = self.describe
        if describe is None:
            return lambda: (f"{op} of {tensor.numel():,} bytes over {self.world} ranks in {self.issuer}")
        return lambda: describe(op, tensor.numel())

    def payloads(self) -> PayloadExchange:
        return self.exchange if self.exchange is not None else GroupExchange(self.process_group, self.issuer)


class Sent:
    """An outer gradient handed to collectives: their handles (``works``, empty once waited on or after a
    resume), the ``buffers`` they fill (what a checkpoint stores), this rank's new ``residual`` (error
    feedback, kept if the average is finite; ``None`` without), the ``bytes_sent`` (payload handed to the
    collectives) and ``link_bytes`` (what this rank's link carries for them) and, where the transport
    decided it at send time, a ``finite`` flag. A compressed sync names its ``schedule``; a two-shot one
    has its ``phase`` (1: the all-to-all issued, ``buffers`` its output; 2: the all-gather issued,
    ``buffers`` the owners' rows), ``owner``, the ``(rank, world)`` it was sent as (its region), and from
    phase 2 the owner's new residual ``owner_residual``."""

    __slots__ = ("works", "buffers", "residual", "bytes_sent", "finite", "pending", "link_bytes", "schedule",
                 "phase", "owner_residual", "owner")

    def __init__(self, works: Sequence[Any], buffers: Sequence[Tensor], residual: Tensor | None = None,
                 bytes_sent: int = 0, finite: Tensor | None = None, pending: PendingAverage | None = None,
                 link_bytes: float = 0.0, schedule: str | None = None, phase: int = 1,
                 owner_residual: Tensor | None = None, owner: tuple[int, int] | None = None) -> None:
        self.works = list(works)
        self.buffers = list(buffers)
        self.residual = residual
        self.bytes_sent = bytes_sent
        self.finite = finite
        self.pending = pending
        self.link_bytes = float(link_bytes)
        self.schedule = schedule
        self.phase = phase
        self.owner_residual = owner_residual
        self.owner = owner

    @property
    def needs_progress(self) -> bool:
        """Whether a phase remains to be issued (:meth:`OuterTransport.progress`): a two-shot sync whose
        all-gather is not issued yet."""
        return self.schedule == "two-shot" and self.phase == 1

    def wait(self) -> None:
        """Wait for the collectives (every rank issued them: this cannot deadlock)."""
        for work in self.works:
            work.wait()
        self.works = []


class OwnerResidual:
    """This rank's error feedback as an owner of two-shot syncs (one per fragment): ``tensor``, what the
    requantized mean of its region failed to carry, and ``at``, the ``(rank, world)`` it was computed at
    (its region depends on both).

    It is **dropped**, exactly (its values are lost to the run, nothing else changes; logged at INFO with
    their size), when the rank or the world size changes (a resume elsewhere, or a load of another rank's
    state with ``allow_other_rank=True``), and when a sync of its fragment is all-gathered (another
    schedule): folding it elsewhere would need every owner's share of a region that moved."""

    __slots__ = ("tensor", "at")

    def __init__(self, tensor: Tensor | None = None, at: tuple[int, int] | None = None) -> None:
        self.tensor = tensor
        self.at = at

    def drop(self, owner: str, why: str) -> None:
        if self.tensor is not None:
            logger.info("%s: the owner residual (%d values, max |value| %.3g) is dropped: %s", owner,
                        self.tensor.numel(), float(self.tensor.abs().max()) if self.tensor.numel() else 0.0, why)
        self.tensor = self.at = None

    def usable(self, link: Link, owner: str) -> Tensor | None:
        """The residual to add at this sync's owner reduction, or ``None`` (zero): dropped first if it was
        computed at another rank or world size."""
        if self.tensor is not None and self.at != (link.rank, link.world):
            self.drop(owner, f"it was computed as rank {self.at[0]} of {self.at[1]} and this sync runs as rank "
                             f"{link.rank} of {link.world}" if self.at else "it has no placement")
        return self.tensor

    def take(self, sent: Sent, finite: Tensor | None = None) -> None:
        """Keep ``sent``'s new owner residual (a two-shot sync's): always (``finite=None``: the caller
        decided on the host that the sync is finite), or where the 0-dim ``finite`` holds, the old
        residual otherwise (decided on the device)."""
        new = sent.owner_residual
        if new is None:
            return
        if finite is not None:
            old = self.tensor if self.at == sent.owner and self.tensor is not None else torch.zeros_like(new)
            new = torch.where(finite.to(new.device), new, old)
        self.tensor, self.at = new, sent.owner

    def state_dict(self) -> dict[str, Any]:
        """``{"owner_residual": tensor, "owner_at": [rank, world]}`` (empty without one)."""
        if self.tensor is None or self.at is None:
            return {}
        return {"owner_residual": self.tensor.clone(), "owner_at": list(self.at)}

    def load(self, own: Mapping[str, Any], current: Mapping[str, int], device: torch.device, owner: str) -> None:
        """Restore :meth:`state_dict`'s keys from ``own`` where they were saved at this rank and world size
        (``current``: :func:`gradpress.checkpoint.placement`); dropped (logged) otherwise."""
        self.tensor = self.at = None
        saved, at = own.get("owner_residual"), own.get("owner_at")
        if saved is None:
            return
        here = (int(current["rank"]), int(current["world_size"]))
        self.tensor, self.at = saved.to(device, copy=True), (int(at[0]), int(at[1])) if at is not None else None
        if self.at != here:
            self.drop(owner, f"it was saved as rank {self.at[0]} of {self.at[1]} and is loaded as rank {here[0]} "
                             f"of {here[1]}" if self.at else "it has no placement")


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

    def progress(self, sent: Sent, anchor: list[Tensor], owner_residual: Tensor | None, link: Link) -> None:
        """Issue the next phase of ``sent`` where one remains (``sent.needs_progress``): two-shot's
        all-gather, after its owner's reduction (with ``owner_residual``, this rank's residual as owner:
        ``None`` for zero). A collective: every rank calls it at the same point of its schedule. The
        transports of one phase have nothing to do."""

    @abstractmethod
    def mean(self, sent: Sent, anchor: list[Tensor]) -> tuple[list[Tensor], Tensor]:
        """Wait for ``sent`` (every phase issued) and return ``Δ`` per anchor tensor (its shape and dtype)
        and a 0-dim bool ``finite`` on the first anchor tensor's device (no host read)."""

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
        return Sent(pending.works, pending.buffers + pending.scales, None, pending.bytes_sent, pending=pending,
                    link_bytes=link_bytes("allreduce", pending.bytes_sent, link.world))

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
    """A :class:`~gradpress.averaging.compress.Compressor`'s payloads, all-gathered or reduced in two shots
    by ``schedule`` (see the module docstring; ``"auto"``: two-shot for int8/int4 from 3 ranks), with
    error feedback at the rank and, under two-shot, at the owner. ``ValueError`` for a schedule outside
    :data:`~gradpress.averaging.twoshot.SCHEDULES` or two-shot with a compressor that cannot be requantized."""

    compressor: Compressor
    schedule: str = "auto"
    error_feedback = True

    def __post_init__(self) -> None:
        check_schedule(self.schedule, self.compressor, self.compressor)

    @staticmethod
    def work_dtype(anchor: list[Tensor]) -> torch.dtype:
        """fp64 if an anchor tensor is, else fp32: where the outer gradient is encoded and decoded."""
        return torch.float64 if any(a.dtype == torch.float64 for a in anchor) else torch.float32

    def schedule_at(self, world: int) -> str:
        """The schedule a sync over ``world`` ranks takes: ``"all-gather"`` or ``"two-shot"``."""
        return resolve_schedule(self.schedule, self.compressor, world)

    def send(self, anchor: list[Tensor], params: list[Tensor], residual: Tensor | None, link: Link) -> Sent:
        compressor = self.compressor
        dtype, device = self.work_dtype(anchor), anchor[0].device
        two_shot = self.schedule_at(link.world) == "two-shot"
        with torch.no_grad():
            outer_grad = torch.cat([(a.to(dtype) - t.detach().to(dtype)).reshape(-1).to(device)
                                    for a, t in zip(anchor, params)])
            if residual is not None:  # e = δ + β·residual (β = 1 but for SparseLoCo's TopK(error_decay=))
                outer_grad.add_(residual, alpha=getattr(compressor, "error_decay", 1.0))
            generator = None
            if compressor.rounding == "stochastic":  # drawn on the outer gradient's device
                generator = rounding_generator(sync_seed(compressor.seed, link.rank, link.fragment, link.sync),
                                               device)
            if two_shot:
                plan = regions(compressor, outer_grad.numel(), link.world)
                rows = encode_regions(compressor, outer_grad, plan, generator)
                new_residual = outer_grad - decode_regions(compressor, rows, plan, dtype)
            else:
                payload = compressor.encode(outer_grad, generator)
                new_residual = outer_grad - compressor.decode(payload.unsqueeze(0), outer_grad.numel(), dtype)[0]
        if two_shot:  # phase 1: every region's row to its owner (one all-to-all)
            received = torch.empty_like(rows)
            flat = rows.view(-1)
            works = [link.payloads().all_to_all(received.view(-1), flat, link.what_sent("all-to-all", flat))]
            return Sent(works, [received], new_residual, flat.numel(),
                        link_bytes=link_bytes("all-to-all", flat.numel(), link.world), schedule="two-shot",
                        owner=(link.rank, link.world))
        works = []
        gathered = payload
        if link.world > 1:
            gathered = payload.new_empty(link.world * payload.numel())
            works = [link.payloads().all_gather(gathered, payload, link.what_sent("all-gather", payload))]
        return Sent(works, [gathered], new_residual, payload.numel(),
                    link_bytes=link_bytes("all-gather", payload.numel(), link.world), schedule="all-gather")

    def progress(self, sent: Sent, anchor: list[Tensor], owner_residual: Tensor | None, link: Link) -> None:
        if not sent.needs_progress:
            return
        if sent.owner != (link.rank, link.world):
            sender = f"rank {sent.owner[0]} of {sent.owner[1]}" if sent.owner else "another rank"
            raise ValueError(f"a two-shot sync sent as {sender} cannot be finished as rank {link.rank} of "
                             f"{link.world}: its all-to-all delivered that rank's region")
        sent.wait()
        compressor = self.compressor
        dtype, device = self.work_dtype(anchor), anchor[0].device
        numel = sum(a.numel() for a in anchor)
        plan = regions(compressor, numel, link.world)
        length = plan.length(link.rank)
        if owner_residual is not None and owner_residual.numel() != length:
            owner_residual = None  # another region's (the caller drops it): start from zero
        generator = None
        if compressor.rounding == "stochastic":
            generator = rounding_generator(sync_seed(compressor.seed, link.rank, link.fragment, link.sync, stream=1),
                                           device)
        with torch.no_grad():
            received = sent.buffers[0].view(link.world, plan.row_bytes)
            row, new_owner = owner_reduce(compressor, received, length, owner_residual, dtype, generator)
            gathered = row.new_empty(link.world * plan.row_bytes)
        # Phase 2: every owner's row to every rank (one all-gather).
        sent.works = [link.payloads().all_gather(gathered, row, link.what_sent("all-gather", row))]
        sent.buffers = [gathered]
        sent.phase = 2
        sent.owner_residual = new_owner
        sent.bytes_sent += row.numel()
        sent.link_bytes += link_bytes("all-gather", row.numel(), link.world)

    def mean(self, sent: Sent, anchor: list[Tensor]) -> tuple[list[Tensor], Tensor]:
        if sent.needs_progress:
            raise RuntimeError("Compressed.mean: this two-shot sync's all-gather was never issued "
                               "(call progress() first, on every rank)")
        sent.wait()
        dtype = self.work_dtype(anchor)
        numel = sum(a.numel() for a in anchor)
        with torch.no_grad():
            if sent.schedule == "two-shot":
                assert sent.owner is not None  # set with phase 2
                plan = regions(self.compressor, numel, sent.owner[1])
                mean = decode_regions(self.compressor, sent.buffers[0].view(plan.world, plan.row_bytes), plan, dtype)
            else:
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
        sent = self.aggregator.total_bytes_sent - before
        return Sent([], deltas, None, sent, flag, link_bytes=link_bytes("allreduce", sent, link.world))

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


def transport_for(compression: Any, schedule: str = "auto") -> OuterTransport:
    """The transport a ``compression=`` value means: ``None``, ``"fp16"``, ``"bf16"`` (:class:`Exact`), a
    :class:`~gradpress.averaging.compress.Compressor` (:class:`Compressed`, with ``schedule``), a
    :class:`gradpress.Config` (:class:`PowerSGD`) or an :class:`OuterTransport` itself; ``ValueError``
    listing them otherwise, and for a ``schedule`` the compression cannot take
    (:func:`~gradpress.averaging.twoshot.check_schedule`: ``"auto"`` for every one; ``"all-gather"`` and
    ``"two-shot"`` for compressors only, two-shot for those that can be requantized; an
    :class:`OuterTransport` carries its own)."""
    if schedule not in ("auto", "all-gather", "two-shot"):
        check_schedule(schedule, None, compression)  # raises, naming the allowed values
    if isinstance(compression, OuterTransport):
        if schedule != "auto":
            raise ValueError(f"schedule={schedule!r} applies to a compressor; the OuterTransport {compression!r} "
                             "carries its own (Compressed(compressor, schedule=...)): leave schedule='auto'")
        return compression
    if isinstance(compression, Compressor):
        return Compressed(compression, check_schedule(schedule, compression, compression))
    if compression is None:
        transport: OuterTransport = Exact()
    elif isinstance(compression, str) and compression in ("fp16", "bf16"):
        transport = Exact(torch.float16 if compression == "fp16" else torch.bfloat16)
    elif isinstance(compression, Config):
        transport = PowerSGD(compression)
    else:
        raise ValueError(f"compression must be {ALLOWED}, got {compression!r}")
    check_schedule(schedule, None, compression)  # "auto" only
    return transport

"""Bytes per step of every communication method: the one byte model the tools use.

What ONE worker hands to its collectives, counted the way the code that sends counts it:

* **allreduce** (DDP's default, ``fp16_compress_hook``, ``bf16_compress_hook``): every gradient element,
  in the gradients' dtype or the hook's cast dtype (:func:`allreduce_bytes`);
* **PowerSGD** at rank r: the plan's elements (``r(n + m)`` per compressed matrix, the rest as they are;
  one factor per step for the multi-iteration scheme) at the wire dtype the engine picks from
  ``bytes_per_weight`` and the gradients' dtype, added up by an :class:`~gradpress.powersgd.EngineSession`'s
  own ``count``, as ``PowerSGDState.bytes_stats()`` counts them (:func:`powersgd_bytes`);
* **local SGD / DiLoCo**, per synchronization (:func:`sync_bytes`): each fragment's outer gradient as its
  transport (:mod:`gradpress.averaging.transport`) sends it: exact in the parameters' dtype or fp16/bf16,
  a compressor's ``payload_bytes(n)`` (int8, int4, top-k: what the streaming averager counts), or
  PowerSGD's plan; DiLoCo's anchor is one broadcast of the parameters (:func:`anchor_bytes`).

Wire labels are the names of the dtypes really sent (:func:`dtype_name`), so a bf16 wire reads ``bf16``.

Beside that payload, what ONE rank's **link** carries at world size ``W``, ring-equivalent, for the
collective actually used (:func:`gradpress.comm.link_bytes`): an allreduce of ``S`` bytes (the gradient
methods, PowerSGD's factors, exact DiLoCo) ``2 (W - 1) / W · S`` (:meth:`StepBytes.link_bytes`); an
all-gathered compressed outer gradient of ``P`` bytes ``(W - 1) · P``; a two-shot one
``2 (W - 1) / W`` of its padded payload ``W · row`` (:func:`sync_link_bytes`; which schedule a sync takes
at ``W``: :func:`schedule_at`); the anchor's broadcast ``S`` (:func:`anchor_link_bytes`). PowerSGD pads each
factor to a 64-byte line on its wire: the padding is sent and not counted, here as in
``PowerSGDState.bytes_stats()`` (none at ranks that are multiples of 16 in fp32).

>>> shapes, fp32 = [(512, 256), (512,)], [torch.float32] * 2
>>> a, h = allreduce_bytes(shapes, fp32), allreduce_bytes(shapes, fp32, torch.bfloat16)
>>> (a.bytes_sent, a.wire), (h.bytes_sent, h.wire)
((526336, 'fp32'), (263168, 'bf16'))
>>> p = powersgd_bytes(shapes, fp32, rank=4, min_compression_rate=2, bytes_per_weight=2)
>>> p.bytes_in, p.bytes_sent, p.wire
(526336, 7168, 'fp16')
>>> from gradpress import QuantizeInt4
>>> sync_bytes(shapes, fp32, QuantizeInt4(chunk_size=1024)), anchor_bytes(shapes, fp32)
([66308], 526336)
>>> a.link_bytes(8), sync_link_bytes(shapes, fp32, QuantizeInt4(chunk_size=1024), world=8, schedule="all-gather")
(921088.0, [464156.0])
>>> sync_link_bytes(shapes, fp32, QuantizeInt4(chunk_size=1024), world=8)   # auto: two-shot from 3 ranks
[122808.0]
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ..averaging.compress import QuantizeInt4, QuantizeInt8
from ..averaging.transport import Compressed, Exact, PowerSGD, transport_for
from ..averaging.twoshot import regions
from ..comm import link_bytes
from ..powersgd import EngineConfig, EngineSession, make_plan
from ..streaming.fragments import split_by_size

__all__ = ["REPORTED_WORLDS", "StepBytes", "allreduce_bytes", "anchor_bytes", "anchor_link_bytes", "diloco_links",
           "dtype_name", "fragments", "powersgd_bytes", "reported_worlds", "schedule_at", "sync_bytes",
           "sync_link_bytes", "sync_phases"]

#: The world sizes ``gradpress check`` and ``gradpress inspect`` print beside the one they are given.
REPORTED_WORLDS = (8, 64, 512)

_NAMES = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32", torch.float64: "fp64"}
Shapes = Sequence[Sequence[int]]


def dtype_name(dtype: torch.dtype) -> str:
    """``fp16``, ``bf16``, ``fp32``, ``fp64``; else torch's own name (``float8_e4m3fn``)."""
    return _NAMES.get(dtype, str(dtype).removeprefix("torch."))


@dataclass(frozen=True)
class StepBytes:
    """One step of one worker: elements and bytes in (the gradients, what a plain allreduce sends) and
    sent (at the wire's precision); ``gradients`` and ``wire``: the dtypes' names (comma-separated where
    the model holds several gradient dtypes)."""

    numel: int
    numel_sent: int
    bytes_in: int
    bytes_sent: int
    gradients: str
    wire: str

    @property
    def rate(self) -> float:
        """``bytes_in / bytes_sent``: the rate of ``PowerSGDState.bytes_stats()``."""
        return self.bytes_in / self.bytes_sent if self.bytes_sent else 0.0

    @property
    def numel_rate(self) -> float:
        """``numel / numel_sent``: the rate of ``PowerSGDState.compression_stats()``."""
        return self.numel / self.numel_sent if self.numel_sent else 0.0

    def link_bytes(self, world: int) -> float:
        """What one rank's link carries for this step at world size ``world``: its allreduce of
        ``bytes_sent``, ``2 (W - 1) / W · bytes_sent`` (the gradient methods and PowerSGD all-reduce)."""
        return link_bytes("allreduce", self.bytes_sent, world)


def _by_dtype(shapes: Shapes, dtypes: Sequence[torch.dtype]) -> dict[torch.dtype, list[tuple[int, ...]]]:
    if len(shapes) != len(dtypes):
        raise ValueError(f"dtypes: one per shape, got {len(dtypes)} dtypes for {len(shapes)} shapes")
    out: dict[torch.dtype, list[tuple[int, ...]]] = {}
    for shape, dtype in zip(shapes, dtypes):
        out.setdefault(dtype, []).append(tuple(int(d) for d in shape))
    return out


def _numel(shape: Sequence[int]) -> int:
    numel = 1
    for size in shape:
        numel *= int(size)
    return numel


def allreduce_bytes(shapes: Shapes, dtypes: Sequence[torch.dtype], wire_dtype: torch.dtype | None = None) -> StepBytes:
    """One exact average of gradients of ``shapes`` and ``dtypes``: every element in its dtype, or in
    ``wire_dtype`` (``torch.float16``: ``fp16_compress_hook``; ``torch.bfloat16``: ``bf16_compress_hook``),
    as :func:`gradpress.comm.start_average` builds its buffers."""
    by_dtype = _by_dtype(shapes, dtypes)
    numel = bytes_in = bytes_sent = 0
    for dtype, group in by_dtype.items():
        n = sum(_numel(s) for s in group)
        numel += n
        bytes_in += n * dtype.itemsize
        bytes_sent += n * (wire_dtype or dtype).itemsize
    wires = [dtype_name(wire_dtype or d) for d in by_dtype]
    return StepBytes(numel, numel, bytes_in, bytes_sent, ", ".join(dtype_name(d) for d in by_dtype),
                     ", ".join(dict.fromkeys(wires)))


def powersgd_bytes(shapes: Shapes, dtypes: Sequence[torch.dtype], rank: int, min_compression_rate: float = 2.0,
                   bytes_per_weight: int | None = 4, num_iters_per_step: int | None = None,
                   iteration: int = 0, orient_matrices: bool = False) -> StepBytes:
    """One compressed step of PowerSGD (``PowerSGDState(matrix_approximation_rank=rank,
    min_compression_rate=..., bytes_per_weight=..., num_iters_per_step=...)``, or the aggregator's
    :class:`gradpress.Config`) for gradients of ``shapes`` and ``dtypes`` (one per shape), as the state
    counts it: ``num_iters_per_step=None`` is classic PowerSGD (P and Q), ``k`` the alternating scheme
    whose step starts at one-sided iteration ``iteration`` (even: P, odd: Q; ``orient_matrices``: P is the
    longer side's factor, as the engine compresses a wide matrix on an accelerator, ``orient_matrices="auto"``).

    The tensors are planned per gradient dtype, as DDP buckets hold one dtype each; whether a tensor is
    compressed does not depend on its bucket, so these are the sums of the per-bucket counts. Invalid
    ``rank``, ``min_compression_rate`` or ``bytes_per_weight``: the engine's ``ValueError`` naming it.
    """
    by_dtype = _by_dtype(shapes, dtypes)
    session = EngineSession(EngineConfig(rank=rank, min_compression_rate=min_compression_rate,
                                         bytes_per_weight=bytes_per_weight))
    wires = []
    for dtype, group in by_dtype.items():
        plan = make_plan(group, rank, min_compression_rate, orient=orient_matrices)
        wire = session.wire_dtype(dtype)
        session.count(plan.numel, plan.numel_sent_per_step(num_iters_per_step, iteration), dtype, wire)
        wires.append(dtype_name(wire))
    return StepBytes(session.numel_in, session.numel_sent, session.bytes_in, session.bytes_sent,
                     ", ".join(dtype_name(d) for d in by_dtype), ", ".join(dict.fromkeys(wires)))


def fragments(shapes: Shapes, dtypes: Sequence[torch.dtype], num_fragments: int = 1) -> list[list[int]]:
    """Tensor positions of each fragment, as :class:`gradpress.StreamingDiLoCoAverager` splits them
    (consecutive runs balanced by bytes)."""
    layout = split_by_size([_numel(s) * d.itemsize for s, d in zip(shapes, dtypes)], num_fragments)
    return [[i for i, f in enumerate(layout) if f == k] for k in range(num_fragments)]


def schedule_at(compression: Any, world: int, schedule: str = "auto") -> str:
    """The collective a DiLoCo sync with ``compression`` and ``schedule`` takes at world size ``world``:
    ``"allreduce"`` (exact, fp16/bf16, PowerSGD), ``"all-gather"`` or ``"two-shot"`` (a compressor,
    :func:`gradpress.averaging.twoshot.resolve_schedule`). ``ValueError`` as the averagers raise it for a
    value they refuse.

    >>> from gradpress import QuantizeInt8, TopK
    >>> [schedule_at(QuantizeInt8(), w) for w in (2, 3)], schedule_at(TopK(), 64), schedule_at("bf16", 64)
    (['all-gather', 'two-shot'], 'all-gather', 'allreduce')
    """
    transport = transport_for(compression, schedule)
    if isinstance(transport, Compressed):
        return transport.schedule_at(world)
    if isinstance(transport, (Exact, PowerSGD)):
        return "allreduce"
    raise ValueError(f"compression: no byte model for {compression!r}")


def sync_phases(shapes: Shapes, dtypes: Sequence[torch.dtype], compression: Any = None, num_fragments: int = 1,
                world: int = 2, schedule: str = "auto", sync: int = 0) -> list[list[tuple[int, float]]]:
    """Per fragment, its sync's phases as ``(payload, link bytes)``: one (its allreduce or all-gather), or
    two-shot's two, the all-to-all of the padded rows ``W · row`` and the all-gather of one row (a
    streaming averager issues the second ``(τ + 1) // 2`` steps after the first). Their sums are
    :func:`sync_bytes` and :func:`sync_link_bytes`.

    >>> from gradpress import QuantizeInt8
    >>> sync_phases([(1024,)], [torch.float32], QuantizeInt8(chunk_size=256), world=4)
    [[(1040, 780.0), (260, 780.0)]]
    """
    out = []
    for collective, payload, link in _sync_counts(shapes, dtypes, compression, num_fragments, sync, world, schedule):
        if collective != "two-shot":
            out.append([(payload, link)])
            continue
        row = payload // (world + 1)  # W rows, then one
        out.append([(world * row, link / 2), (row, link / 2)])
    return out


def _sync_counts(shapes: Shapes, dtypes: Sequence[torch.dtype], compression: Any, num_fragments: int, sync: int,
                 world: int | None, schedule: str) -> list[tuple[str, int, float]]:
    """Per fragment: ``(collective, payload handed, bytes on one rank's link at world)``."""
    transport = transport_for(compression, schedule)
    out = []
    for members in fragments(shapes, dtypes, num_fragments):
        part = [shapes[i] for i in members], [dtypes[i] for i in members]
        if isinstance(transport, (Exact, PowerSGD)):
            if isinstance(transport, Exact):
                payload = allreduce_bytes(*part, transport.wire_dtype).bytes_sent
            else:
                config = transport.config
                iterations = config.num_iters_per_step
                payload = powersgd_bytes(*part, config.rank, config.min_compression_rate, config.bytes_per_weight,
                                         iterations, sync * (iterations or 0)).bytes_sent
            out.append(("allreduce", payload, link_bytes("allreduce", payload, world or 1)))
        elif isinstance(transport, Compressed):
            numel = sum(_numel(s) for s in part[0])
            if world is not None and transport.schedule_at(world) == "two-shot":
                plan = regions(transport.compressor, numel, world)
                out.append(("two-shot", plan.padded_bytes + plan.row_bytes,
                            link_bytes("all-to-all", plan.padded_bytes, world)
                            + link_bytes("all-gather", plan.row_bytes, world)))
            else:
                payload = transport.compressor.payload_bytes(numel)
                out.append(("all-gather", payload, link_bytes("all-gather", payload, world or 1)))
        else:
            raise ValueError(f"compression: no byte model for {compression!r}")
    return out


def sync_bytes(shapes: Shapes, dtypes: Sequence[torch.dtype], compression: Any = None, num_fragments: int = 1,
               sync: int = 0, world: int | None = None, schedule: str = "auto") -> list[int]:
    """Bytes each fragment's outer gradient hands to its collectives at one synchronization of DiLoCo
    (:class:`gradpress.OuterOptimizerAverager` is one fragment; plain local SGD is ``compression=None``),
    with any ``compression=`` the averagers accept: exact (the parameters' dtypes, or fp16/bf16), a
    compressor's payload, PowerSGD's compressed step (``sync``: how many syncs came before, for the
    multi-iteration scheme's parity). This is the payload the averagers' ``bytes_sent`` counts, not what a
    rank's link carries (:func:`sync_link_bytes`).

    A compressor's payload depends on the schedule a sync takes at world size ``world``
    (:func:`schedule_at`): all-gathered, ``payload_bytes(n)``; two-shot, ``W · row + row`` (its all-to-all's
    padded rows and its all-gather's one row). ``world=None`` (the default, as before) is
    ``payload_bytes(n)``, the all-gather's.

    >>> sync_bytes([(64, 64)] * 4, [torch.float32] * 4, "bf16", num_fragments=2)
    [16384, 16384]
    """
    return [payload for _, payload, _ in _sync_counts(shapes, dtypes, compression, num_fragments, sync, world,
                                                      schedule)]


def sync_link_bytes(shapes: Shapes, dtypes: Sequence[torch.dtype], compression: Any = None, num_fragments: int = 1,
                    world: int = 2, schedule: str = "auto", sync: int = 0) -> list[float]:
    """What one rank's link carries for each fragment's outer gradient at one synchronization over
    ``world`` ranks, by the collective its schedule takes there: allreduce ``2 (W - 1) / W · S``,
    all-gather ``(W - 1) · P``, two-shot ``2 (W - 1) · row`` (``2 (W - 1) / W`` of the padded payload
    ``W · row``). What the averagers' ``link_bytes`` count per sync.

    >>> from gradpress import QuantizeInt8
    >>> sync_link_bytes([(1024,)], [torch.float32], QuantizeInt8(chunk_size=256), world=4)
    [1560.0]
    """
    return [link for _, _, link in _sync_counts(shapes, dtypes, compression, num_fragments, sync, world, schedule)]


def anchor_bytes(shapes: Shapes, dtypes: Sequence[torch.dtype]) -> int:
    """DiLoCo's anchor: one broadcast of every averaged tensor, in its dtype."""
    return allreduce_bytes(shapes, dtypes).bytes_in


def anchor_link_bytes(shapes: Shapes, dtypes: Sequence[torch.dtype], world: int) -> float:
    """What one rank's link carries for DiLoCo's anchor at world size ``world``: a broadcast, its bytes
    (none alone)."""
    return link_bytes("broadcast", anchor_bytes(shapes, dtypes), world)



def reported_worlds(world: int) -> list[int]:
    """``world`` and :data:`REPORTED_WORLDS`, in order, once each.

    >>> reported_worlds(8), reported_worlds(2)
    ([8, 64, 512], [2, 8, 64, 512])
    """
    return list(dict.fromkeys([int(world), *REPORTED_WORLDS]))


def diloco_links(shapes: Shapes, dtypes: Sequence[torch.dtype], worlds: Sequence[int]) -> dict[str, list[float]]:
    """What one rank's link carries for one DiLoCo synchronization of the whole model (one fragment) at
    each of ``worlds``: exact in the parameters' dtype (an allreduce), then int8 and int4 outer gradients
    (``QuantizeInt8()``, ``QuantizeInt4()``: chunks of 1024) all-gathered and in two shots, by
    :func:`sync_link_bytes`. Keys: ``"exact"``, ``"int8 all-gather"``, ``"int8 two-shot"``, ``"int4
    all-gather"``, ``"int4 two-shot"``.

    >>> rows = diloco_links([(1 << 20,)], [torch.float32], [1024])
    >>> {k: round(v[0] / (1 << 20), 3) for k, v in rows.items()}  # per parameter  # doctest: +NORMALIZE_WHITESPACE
    {'exact': 7.992, 'int8 all-gather': 1026.996, 'int8 two-shot': 2.006, 'int4 all-gather': 515.496,
     'int4 two-shot': 1.007}
    """
    out: dict[str, list[float]] = {"exact": [sum(sync_link_bytes(shapes, dtypes, None, world=w)) for w in worlds]}
    for name, compressor in (("int8", QuantizeInt8()), ("int4", QuantizeInt4())):
        for schedule in ("all-gather", "two-shot"):
            out[f"{name} {schedule}"] = [sum(sync_link_bytes(shapes, dtypes, compressor, world=w, schedule=schedule))
                                         for w in worlds]
    return out

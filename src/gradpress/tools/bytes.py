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
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ..averaging.transport import Compressed, Exact, PowerSGD, transport_for
from ..powersgd import EngineConfig, EngineSession, make_plan
from ..streaming.fragments import split_by_size

__all__ = ["StepBytes", "allreduce_bytes", "anchor_bytes", "dtype_name", "fragments", "powersgd_bytes", "sync_bytes"]

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


def sync_bytes(shapes: Shapes, dtypes: Sequence[torch.dtype], compression: Any = None, num_fragments: int = 1,
               sync: int = 0) -> list[int]:
    """Bytes each fragment's outer gradient hands to its collectives at one synchronization of DiLoCo
    (:class:`gradpress.OuterOptimizerAverager` is one fragment; plain local SGD is ``compression=None``),
    with any ``compression=`` the averagers accept: exact (the parameters' dtypes, or fp16/bf16), a
    compressor's ``payload_bytes`` of the fragment's elements, PowerSGD's compressed step (``sync``: how
    many syncs came before, for the multi-iteration scheme's parity).

    >>> sync_bytes([(64, 64)] * 4, [torch.float32] * 4, "bf16", num_fragments=2)
    [16384, 16384]
    """
    transport = transport_for(compression)
    out = []
    for members in fragments(shapes, dtypes, num_fragments):
        part = [shapes[i] for i in members], [dtypes[i] for i in members]
        if isinstance(transport, Exact):
            out.append(allreduce_bytes(*part, transport.wire_dtype).bytes_sent)
        elif isinstance(transport, Compressed):
            out.append(transport.compressor.payload_bytes(sum(_numel(s) for s in part[0])))
        elif isinstance(transport, PowerSGD):
            config = transport.config
            iterations = config.num_iters_per_step
            out.append(powersgd_bytes(*part, config.rank, config.min_compression_rate, config.bytes_per_weight,
                                      iterations, sync * (iterations or 0)).bytes_sent)
        else:
            raise ValueError(f"compression: no byte model for {compression!r}")
    return out


def anchor_bytes(shapes: Shapes, dtypes: Sequence[torch.dtype]) -> int:
    """DiLoCo's anchor: one broadcast of every averaged tensor, in its dtype."""
    return allreduce_bytes(shapes, dtypes).bytes_in


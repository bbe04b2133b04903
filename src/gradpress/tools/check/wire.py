"""The bytes one compressed PowerSGD step puts on the wire, counted by the engine's own arithmetic.

:class:`gradpress.PowerSGDState` counts ``bytes_stats()`` in its :class:`~gradpress.powersgd.EngineSession`:
each bucket adds ``numel x`` the gradients' bytes before and ``numel_sent x`` the wire dtype's bytes after,
the wire dtype picked from ``bytes_per_weight`` and the gradients' dtype (2: bf16 for bf16 gradients, else
fp16). :func:`step_bytes` feeds a model's plan through a session's ``count`` and ``wire_dtype`` in the same
way, so ``gradpress inspect`` and ``gradpress check`` report what the state reports, not a second formula.

>>> counts = step_bytes([(512, 256), (512,)], [torch.float32] * 2, rank=4, min_compression_rate=2,
...                     bytes_per_weight=2)
>>> counts.bytes_in, counts.bytes_sent, counts.wire
(526336, 7168, 'fp16')
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ...powersgd import EngineConfig, EngineSession, make_plan

__all__ = ["StepBytes", "dtype_name", "step_bytes"]

_NAMES = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32", torch.float64: "fp64"}


def dtype_name(dtype: torch.dtype) -> str:
    """``fp16``, ``bf16``, ``fp32``, ``fp64``; else torch's own name (``float8_e4m3fn``)."""
    return _NAMES.get(dtype, str(dtype).removeprefix("torch."))


@dataclass(frozen=True)
class StepBytes:
    """One compressed step of one worker: elements and bytes in (the gradients, what allreduce sends) and
    sent (P, Q and the tensors sent exactly, at the wire's precision); ``gradients`` and ``wire``: the
    dtypes' names (comma-separated where the model holds several gradient dtypes)."""

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


def step_bytes(shapes: Sequence[Sequence[int]], dtypes: Sequence[torch.dtype], rank: int,
               min_compression_rate: float, bytes_per_weight: int | None) -> StepBytes:
    """What one compressed step of ``PowerSGDState(matrix_approximation_rank=rank, min_compression_rate=...,
    bytes_per_weight=...)`` counts for gradients of ``shapes`` and ``dtypes`` (one per shape).

    The tensors are planned per gradient dtype, as DDP buckets hold one dtype each; whether a tensor is
    compressed does not depend on its bucket, so these are the sums of the per-bucket counts. Invalid
    ``rank``, ``min_compression_rate`` or ``bytes_per_weight``: the engine's ``ValueError`` naming it.
    """
    if len(shapes) != len(dtypes):
        raise ValueError(f"dtypes: one per shape, got {len(dtypes)} dtypes for {len(shapes)} shapes")
    session = EngineSession(EngineConfig(rank=rank, min_compression_rate=min_compression_rate,
                                         bytes_per_weight=bytes_per_weight))
    by_dtype: dict[torch.dtype, list[tuple[int, ...]]] = {}
    for shape, dtype in zip(shapes, dtypes):
        by_dtype.setdefault(dtype, []).append(tuple(int(d) for d in shape))
    wires = []
    for dtype, group in by_dtype.items():
        plan = make_plan(group, rank, min_compression_rate)
        wire = session.wire_dtype(dtype)
        session.count(plan.numel, plan.numel_sent, dtype, wire)
        wires.append(dtype_name(wire))
    return StepBytes(session.numel_in, session.numel_sent, session.bytes_in, session.bytes_sent,
                     ", ".join(dtype_name(d) for d in by_dtype), ", ".join(dict.fromkeys(wires)))

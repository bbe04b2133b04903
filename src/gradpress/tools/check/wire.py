"""The bytes one compressed PowerSGD step puts on the wire, counted by the engine's own arithmetic: the
names :mod:`gradpress.tools.check` uses, from the one byte model of the tools (:mod:`gradpress.tools.bytes`).

:class:`gradpress.PowerSGDState` counts ``bytes_stats()`` in its :class:`~gradpress.powersgd.EngineSession`:
each bucket adds ``numel x`` the gradients' bytes before and ``numel_sent x`` the wire dtype's bytes after,
the wire dtype picked from ``bytes_per_weight`` and the gradients' dtype (2: bf16 for bf16 gradients, else
fp16). :func:`step_bytes` feeds a model's plan through a session's ``count`` and ``wire_dtype`` in the same
way (:func:`gradpress.tools.bytes.powersgd_bytes`), so ``gradpress inspect`` and ``gradpress check``
report what the state reports, not a second formula.

>>> counts = step_bytes([(512, 256), (512,)], [torch.float32] * 2, rank=4, min_compression_rate=2,
...                     bytes_per_weight=2)
>>> counts.bytes_in, counts.bytes_sent, counts.wire
(526336, 7168, 'fp16')
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..bytes import StepBytes, dtype_name, powersgd_bytes

__all__ = ["StepBytes", "dtype_name", "step_bytes"]


def step_bytes(shapes: Sequence[Sequence[int]], dtypes: Sequence[torch.dtype], rank: int,
               min_compression_rate: float, bytes_per_weight: int | None) -> StepBytes:
    """What one compressed step of ``PowerSGDState(matrix_approximation_rank=rank, min_compression_rate=...,
    bytes_per_weight=...)`` counts for gradients of ``shapes`` and ``dtypes`` (one per shape): classic
    PowerSGD's :func:`gradpress.tools.bytes.powersgd_bytes`."""
    return powersgd_bytes(shapes, dtypes, rank, min_compression_rate, bytes_per_weight)

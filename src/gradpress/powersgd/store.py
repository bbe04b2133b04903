"""The segments of one PowerSGD state and the per-parameter pool between them (:class:`SegmentStore`).

Memory follows parameters, never positions: a segment is the fast, flat form of some parameters'
memory while their slot (a bucket, a dtype group) keeps its layout; :class:`~gradpress.powersgd.memory.ParamMemory`
in the pool is the form between two layouts and in checkpoints.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
from torch import Tensor

from .config import EngineConfig
from .memory import ParamMemory, Segment, Workspace
from .plan import make_plan

__all__ = ["SegmentStore", "read_norms"]


class SegmentStore:
    """The segments of one PowerSGD state, by slot (a bucket index, a dtype group), and a per-parameter
    pool holding the memory of parameters that are in no segment right now.

    When the tensors of a slot change (DDP rebuilt its buckets, a parameter got no gradient this step),
    the memory of every affected segment goes back to the pool first and the new segment takes its
    parameters' memory from there: memory follows parameters, never positions.
    """

    __slots__ = ("config", "segments", "pool", "workspace", "oriented")

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        #: Whether the segments compress wide matrices as their transpose: ``config.orient`` resolved for the
        #: first segment's device, then kept for every segment (the memory means one thing); ``None`` before.
        self.oriented: bool | None = None
        self.segments: dict[object, Segment] = {}
        self.pool: dict[int, ParamMemory] = {}
        self.workspace = Workspace()  # shared by the segments (see Workspace)

    def get(self, slot: object, keys: tuple[int, ...], shapes: Sequence[Sequence[int]],
            device: torch.device, dtype: torch.dtype, ranks: Sequence[int | None] | None = None) -> Segment:
        """The segment of ``slot`` for parameters ``keys`` (with gradient ``shapes``), built if needed.
        ``ranks``: a rank (or ``None``: sent exactly) per parameter, fixed per key (a rank policy);
        ``None``: the configuration's rank for all."""
        segment = self.segments.get(slot)
        if segment is not None and segment.keys == keys and segment.dtype == dtype and segment.device == device:
            return segment
        wanted = set(keys)
        for other in [s for s, seg in self.segments.items() if s == slot or wanted & set(seg.keys)]:
            self.pool.update(self.segments.pop(other).export(self.config))
        if self.oriented is None:
            self.oriented = self.config.orientation(device)
        plan = make_plan(shapes, self.config.rank, self.config.min_compression_rate, ranks, orient=self.oriented)
        segment = Segment(plan, keys, device, dtype, self.workspace)
        segment.load(self.pool, self.config)
        for key in keys:
            self.pool.pop(key, None)
        self.segments[slot] = segment
        return segment

    def export(self) -> dict[int, ParamMemory]:
        """Per-parameter copies of all memory (pool and segments)."""
        memory = dict(self.pool)
        for segment in self.segments.values():
            memory.update(segment.export(self.config))
        return memory

    def approximation_norms(self) -> dict[int, tuple[float, float]]:
        """Per parameter key, ``(||M||, ||M - P Q^T||)`` of its last measured step, for the compressed
        matrices of the segments in use that measured one (see :meth:`Segment.approximation_norms`).
        Reads the values on the host: one transfer per device."""
        return read_norms([(segment, segment.norms) for segment in self.segments.values()])

    def global_residual_norms(self) -> dict[int, tuple[float, float]]:
        """Per parameter key, the sketched ``(||mean M||, ||mean M - P Q^T||)`` of its last measured step
        (see :meth:`Segment.global_residual_norms`), as :meth:`approximation_norms`."""
        return read_norms([(segment, segment.global_norms) for segment in self.segments.values()])

    def ranks(self) -> dict[int, int]:
        """Per parameter key, the rank it is compressed at now: its segment's plan, or the width of the
        warm-start factor waiting in the pool (between two segments, after an adaptive switch). Keys sent
        exactly, or not seen yet, are left out."""
        result: dict[int, int] = {}
        for segment in self.segments.values():
            for index in segment.compressed_order:
                result[segment.keys[index]] = segment.plan.tensors[index].rank
        for key, entry in self.pool.items():
            factor = entry.q if entry.q is not None else entry.p  # (a transposed matrix's warm start is its p)
            if factor is not None:
                result.setdefault(key, int(factor.shape[1]))
        return result

    def signals(self) -> dict[int, Tensor]:
        """Per parameter key, its adaptive-rank signal (a 0-d tensor on its device; nothing is read)."""
        result = {key: entry.signal for key, entry in self.pool.items() if entry.signal is not None}
        for segment in self.segments.values():
            if segment.signals is not None:
                for position, index in enumerate(segment.compressed_order):
                    result[segment.keys[index]] = segment.signals[position]
        return result

    def reset_signals(self) -> None:
        """Start a new adaptive-rank interval: every signal to zero."""
        for segment in self.segments.values():
            if segment.signals is not None:
                segment.signals.zero_()
        for entry in self.pool.values():
            if entry.signal is not None:
                entry.signal = torch.zeros_like(entry.signal)

    def resize(self, ranks: Mapping[int, int], seed: int, draw: int) -> None:
        """Change the rank of parameters ``{key: effective rank}``: the segments holding them return their
        memory to the pool (rebuilt at their next use with the caller's new ranks) and the pool's
        warm-start factors are resized (:meth:`ParamMemory.resize`)."""
        for slot in [s for s, seg in self.segments.items() if set(ranks) & set(seg.keys)]:
            self.pool.update(self.segments.pop(slot).export(self.config))
        for key, rank in ranks.items():
            entry = self.pool.get(key)
            if entry is not None:
                entry.resize(rank, self.config.random_seed, key, draw)

    def scale_errors(self, factor: float) -> None:
        """Multiply all error memory (segments and pool) by ``factor``."""
        for segment in self.segments.values():
            segment.error_memory.mul_(factor)
        for entry in self.pool.values():
            if entry.error is not None:
                entry.error = entry.error * factor

    def replace(self, memory: dict[int, ParamMemory]) -> None:
        """Drop every segment and make ``memory`` the pool (segments are rebuilt from it on use)."""
        self.segments.clear()
        self.pool = dict(memory)


def read_norms(measured: Sequence[tuple[Segment, Tensor | None]]) -> dict[int, tuple[float, float]]:
    """``{key: (whole, residual)}`` from per-segment ``(C, 2)`` norms (``None``: never measured; NaN rows: not
    measured yet). Reads the values on the host: one transfer per device."""
    by_device: dict[torch.device, list[tuple[list[int], Tensor]]] = {}
    for segment, norms in measured:
        if norms is not None:
            keys = [segment.keys[i] for i in segment.compressed_order]
            by_device.setdefault(segment.device, []).append((keys, norms))
    result: dict[int, tuple[float, float]] = {}
    for entries in by_device.values():
        values = torch.cat([norms for _, norms in entries]).tolist()
        keys = [key for entry_keys, _ in entries for key in entry_keys]
        for key, (whole, residual) in zip(keys, values):
            if whole == whole:  # NaN: not measured yet
                result[key] = (whole, residual)
    return result

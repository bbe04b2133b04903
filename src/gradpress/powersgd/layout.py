"""Where a segment's numbers live: aligned matrix blocks, the wire's regions, the scratch workspace.

Every matrix a product reads or writes starts on an :data:`ALIGNMENT_BYTES` line: its error memory, its
M, and (here) each of its factors on the wire. BLAS may round differently when an operand starts at
another alignment (MKL's sgemm on some CPUs: offsets of 1-3 floats change the last bits of M Q), so
without it a matrix's numbers would depend on where it sits in its bucket, and a resumed run, whose first
DDP iteration lays the buckets out differently, would not equal one that never stopped, bit for bit.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .plan import GroupPlan, Plan
from .seeding import upload

__all__ = ["ALIGNMENT_BYTES", "WireLayout", "WireSpans", "Workspace", "aligned_offset", "aligned_stride"]

#: Every matrix block starts at a multiple of this many bytes (PyTorch's CPU allocations are aligned the
#: same way).
ALIGNMENT_BYTES = 64


def aligned_stride(numel: int, dtype: torch.dtype) -> tuple[int, int]:
    """``(stride, per_line)``: ``numel`` rounded up to whole :data:`ALIGNMENT_BYTES` lines of ``dtype``."""
    per_line = max(1, ALIGNMENT_BYTES // torch.empty((), dtype=dtype).element_size())
    return -(-numel // per_line) * per_line, per_line


def aligned_offset(flat: Tensor) -> int:
    """Elements to skip in ``flat`` to reach an :data:`ALIGNMENT_BYTES` boundary (0 for PyTorch's own
    CPU and CUDA allocations; the extra line callers allocate keeps the layout valid otherwise)."""
    return ((-flat.data_ptr()) % ALIGNMENT_BYTES) // flat.element_size()


def batch_view(flat: Tensor, offset: int, batch: int, stride: int, rows: int, cols: int) -> Tensor:
    """A ``(batch, rows, cols)`` view of ``flat`` from ``offset``, one matrix every ``stride`` elements."""
    return flat[offset: offset + batch * stride].view(batch, stride)[:, : rows * cols].view(batch, rows, cols)


class WireLayout:
    """The regions of a segment's wire, ``[P | uncompressed | Q]``, each matrix's factor on its own line.

    ``p_strides`` / ``q_strides``: per shape group, the elements from one matrix's P (``n r``) or Q^T
    (``r m``) to the next's (rounded up to whole lines: the padding is zero, sent, and never read).
    ``p_offsets`` / ``q_offsets``: where each group's factors start (Q's from the start of the Q region).
    ``p_numel``: the P region; ``unsent_end``: where the uncompressed tensors end; ``q_start``: where
    the Q region starts (the next line); ``numel``: the whole wire. A function of the plan and the dtype.
    """

    __slots__ = ("p_strides", "q_strides", "p_offsets", "q_offsets", "p_numel", "unsent_end", "q_start", "numel")

    def __init__(self, plan: Plan, dtype: torch.dtype) -> None:
        line = aligned_stride(1, dtype)[1]
        self.p_strides = [aligned_stride(g.n * g.rank, dtype)[0] for g in plan.groups]
        self.q_strides = [aligned_stride(g.m * g.rank, dtype)[0] for g in plan.groups]
        self.p_offsets, self.q_offsets = [], []
        p = q = 0
        for group, p_stride, q_stride in zip(plan.groups, self.p_strides, self.q_strides):
            self.p_offsets.append(p)
            self.q_offsets.append(q)
            p += group.batch * p_stride
            q += group.batch * q_stride
        self.p_numel = p
        self.unsent_end = p + plan.uncompressed_numel
        self.q_start = -(-self.unsent_end // line) * line if q else self.unsent_end
        self.numel = self.q_start + q

    def group_views(self, wire: Tensor, index: int, group: GroupPlan) -> tuple[Tensor, Tensor]:
        """Group ``index``'s ``(B, n, r)`` P and ``(B, r, m)`` Q^T in ``wire`` (or a buffer laid out as it)."""
        b, n, m, r = group.batch, group.n, group.m, group.rank
        p = batch_view(wire, self.p_offsets[index], b, self.p_strides[index], n, r)
        q = batch_view(wire, self.q_start + self.q_offsets[index], b, self.q_strides[index], r, m)
        return p, q


class Workspace:
    """One reusable scratch buffer per (device, dtype), for matrices that a step builds and consumes
    between two of its collectives (a candidate memory of one shape group).

    Nothing in it lives across a collective, so every segment of a state shares one: the state holds
    one more buffer of the largest shape group it compresses, not one per segment. Each matrix of a
    :meth:`matrices` view starts on an :data:`ALIGNMENT_BYTES` line, as in ``Segment.error_memory``.
    """

    __slots__ = ("_buffers",)

    def __init__(self) -> None:
        self._buffers: dict[tuple[torch.device, torch.dtype], Tensor] = {}

    def matrices(self, batch: int, n: int, m: int, device: torch.device, dtype: torch.dtype) -> Tensor:
        """A ``(batch, n, m)`` view of the buffer (contents undefined), valid until the next call."""
        stride, per_line = aligned_stride(n * m, dtype)
        need = batch * stride + per_line
        key = (torch.device(device), dtype)
        flat = self._buffers.get(key)
        if flat is None or flat.numel() < need:
            self._buffers.pop(key, None)  # free the smaller one first
            flat = torch.empty(need, device=device, dtype=dtype)
            self._buffers[key] = flat
        return batch_view(flat, aligned_offset(flat), batch, stride, n, m)

    @property
    def nbytes(self) -> int:
        return sum(flat.numel() * flat.element_size() for flat in self._buffers.values())


class WireSpans:
    """Where a segment's wire holds each tensor: its non-empty spans, in wire order, that tile the wire:
    the P factor of each compressed matrix (group order, with its line's padding), each uncompressed
    tensor (plan order), the padding before the Q region, the Q factor of each compressed matrix.

    ``sizes``: each span's length; ``lengths``: the same as an ``(S,)`` int64 tensor on the segment's
    device (uploaded once, ``Segment.wire_spans()``), for an accelerator's per-element scale
    ``repeat_interleave(scales, lengths[a:b], output_size=...)`` on the device, so no per-element table
    is ever built. ``first``: wire offset -> number of the first span at or after it, for the offsets
    where phases begin or end (0, the end of P, the end of the uncompressed tensors, the start of Q, the
    end). ``q_lengths``: the Q spans' lengths alone, on the device (the warm start's rescaling).
    """

    __slots__ = ("sizes", "lengths", "first", "q_lengths")

    def __init__(self, plan: Plan, layout: WireLayout, device: torch.device) -> None:
        p_spans = [stride for group, stride in zip(plan.groups, layout.p_strides) for _ in range(group.batch)]
        unsent = [plan.tensors[i].numel for i in plan.uncompressed]
        pad = [layout.q_start - layout.unsent_end]
        q_spans = [stride for group, stride in zip(plan.groups, layout.q_strides) for _ in range(group.batch)]
        counts = [len([s for s in spans if s]) for spans in (p_spans, unsent, pad, q_spans)]
        spans = [length for length in p_spans + unsent + pad + q_spans if length]
        assert sum(spans) == layout.numel
        bounds = [0, layout.p_numel, layout.unsent_end, layout.q_start, layout.numel]
        self.first = {bound: sum(counts[:i]) for i, bound in enumerate(bounds)}
        self.sizes = spans
        self.lengths = upload(torch.tensor(spans, dtype=torch.int64), device)
        self.q_lengths = upload(torch.tensor([s for s in q_spans if s], dtype=torch.int64), device)

"""The batched kernels of a PowerSGD step over a segment: a fixed number of ops per shape group or per
segment, never per matrix (house rule: one collective per phase, no per-tensor loops a batched op can
replace). Both schemes use them; how each runs on a device is its backend's (:mod:`gradpress.powersgd.backend`).

A *piece* is one low-rank term ``P Q^T`` of a step's output: classic PowerSGD has one, the alternating
scheme one per iteration. Pieces are given per shape group, as the ``(B, n, r)`` P and ``(B, r, m)`` Q^T
views of a wire (:meth:`Segment.factor_group_views <gradpress.powersgd.memory.Segment.factor_group_views>`).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from .backend import Backend
from .memory import Segment

__all__ = ["GroupPieces", "build_m", "first_products", "left_products", "outer", "outer_sum", "rescale_warm_start_",
           "right_products"]

#: The pieces of one shape group: ``[(P, Q^T), ...]``, each ``(B, n, r)`` and ``(B, r, m)``.
GroupPieces = Sequence[tuple[Tensor, Tensor]]


def build_m(segment: Segment, matrices: list[Tensor], with_memory: bool) -> None:
    """M = g + e (``with_memory``) or g, once, into the segment's M buffer (:meth:`Segment.ensure_m_buffer`):
    a fused copy and a fused add for all matrices, or on the CPU one add per matrix (one pass over M
    instead of two; the same sums)."""
    segment.ensure_m_buffer()
    if matrices:
        segment.backend.add_into(segment.m_views, matrices, segment.error_views if with_memory else None)


def right_products(segment: Segment, inputs: list[Tensor], outputs: list[Tensor],
                   earlier: Sequence[GroupPieces] = ()) -> None:
    """Per shape group, ``P = R Q`` into ``outputs`` (``(B, n, r)``) for ``inputs`` Q^T (``(B, r, m)``),
    where R = M minus the ``earlier`` pieces (per group): ``M Q - sum_j P_j (Q_j^T Q)``, the correction
    through ``(r, r)`` products, so R is never built."""
    backend = segment.backend
    for index, (m, qt, p) in enumerate(zip(segment.m_group_views, inputs, outputs)):
        q = qt.transpose(1, 2)
        backend.product(m, q, p)
        for pieces in earlier:
            earlier_p, earlier_qt = pieces[index]
            backend.product_add(earlier_p, torch.bmm(earlier_qt, q), p, -1.0)


def first_products(segment: Segment) -> None:
    """Classic PowerSGD's ``P = M Q`` for every shape group, with the warm-start Q; at full rank (``r`` = the
    matrix's columns, so Q is square) ``P = M`` itself: ``M Q`` spans M's columns exactly only as well as
    Q is conditioned, and no warm start helps a full-rank approximation, which is then exact whatever Q."""
    backend = segment.backend
    for (group, _, p, qt), m in zip(segment.group_views, segment.m_group_views):
        if group.rank == group.m:
            p.copy_(m)
        else:
            backend.product(m, qt.transpose(1, 2), p)


def left_products(segment: Segment, inputs: list[Tensor], outputs: list[Tensor],
                  earlier: Sequence[GroupPieces] = ()) -> None:
    """Per shape group, ``Q^T = P^T R`` into ``outputs`` (``(B, r, m)``) for ``inputs`` P (``(B, n, r)``), R
    as in :func:`right_products`: ``P^T M - sum_j (P^T P_j) Q_j^T``."""
    backend = segment.backend
    for index, (m, p, qt) in enumerate(zip(segment.m_group_views, inputs, outputs)):
        pt = p.transpose(1, 2)
        backend.product(pt, m, qt)
        for pieces in earlier:
            earlier_p, earlier_qt = pieces[index]
            backend.product_add(torch.bmm(pt, earlier_p), earlier_qt, qt, -1.0)


def outer_sum(p: Tensor, qt: Tensor, out: Tensor, accumulate: bool = False, alpha: float = 1.0) -> None:
    """One matrix: ``out = p @ qt`` (``accumulate``: ``out += alpha * p @ qt``) as r fused multiply-adds
    (elementwise: the same numbers wherever the operands sit in memory); for the CPU's small ranks."""
    first = 0
    if not accumulate:
        torch.mul(p[:, :1], qt[:1], out=out)
        first = 1
    for k in range(first, p.shape[1]):
        out.addcmul_(p[:, k:k + 1], qt[k:k + 1], value=alpha)


def outer(backend: Backend, pieces: GroupPieces, out: Tensor) -> None:
    """``out = sum_j P_j Q_j^T`` for one shape group ``(B, n, m)``: one product per piece (``bmm``, then
    ``baddbmm``), or where the backend fuses small ranks, r multiply-adds per matrix and piece."""
    p0 = pieces[0][0]
    if backend.fused_outer(p0.shape[2], out.shape[1] * out.shape[2]):
        for i, target in enumerate(out.unbind(0)):
            for j, (p, qt) in enumerate(pieces):
                outer_sum(p[i], qt[i], target, accumulate=j > 0)
        return
    for j, (p, qt) in enumerate(pieces):
        if j == 0:
            backend.product(p, qt, out)
        else:
            backend.product_add(p, qt, out, 1.0)


def rescale_warm_start_(segment: Segment) -> None:
    """Multiply each matrix's warm-start Q by the power of two that puts its largest |value| in [0.5, 1)
    (an all-zero Q is left alone). Q comes from ``M^T P`` with P orthonormal, so it carries M's scale;
    without this ``P = M Q`` carries M's scale squared, which over- or underflows fp32 from singular values
    of about 1e19 or 1e-19 on (a loss-scaled or a vanishing gradient). Exact: the product, hence P after
    orthogonalization and everything after, rounds exactly as without it, scaled (house rule: fp32
    numerics). A fixed number of ops for the whole segment."""
    q = segment.q
    if not q.numel():
        return
    spans = segment.wire_spans()
    first = spans.first[segment.layout.q_start]
    views = list(q.split(spans.sizes[first:]))
    exponent = torch.frexp(torch.stack(torch._foreach_norm(views, float("inf")))).exponent
    scales = torch.exp2(exponent.neg_()).to(segment.dtype)
    if segment.backend.span_tables:
        q.mul_(torch.repeat_interleave(scales, spans.q_lengths, output_size=q.numel()))
    else:
        torch._foreach_mul_(views, list(scales.unbind(0)))

"""One PowerSGD step on a segment: the algorithm, as a task of two communication phases.

Vogels, Karimireddy & Jaggi, "PowerSGD: Practical Low-Rank Gradient Compression for Distributed
Optimization", NeurIPS 2019, Algorithm 1 (one power iteration, warm start) with error feedback (Alg. 2).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from ..comm import Communicator
from ..linalg import orthogonalize_
from ..pipeline import Task
from .config import EngineConfig
from .memory import Segment

__all__ = ["power_step"]


def power_step(segment: Segment, grads: Sequence[Tensor], comm: Communicator, config: EngineConfig,
               step: int) -> Task:
    """Replace ``grads`` (the segment's tensors, in plan order) by their PowerSGD-compressed mean.

    A generator task (see :mod:`gradpress.pipeline`): it yields after starting each collective and must
    be resumed only once that collective is complete. Every rank must run it with the same plan.

    Steps, for the compressed matrices M_i (grouped by shape, one ``bmm`` per group):
      1. M = g + e (error feedback) — accumulated in place in the error memory ``segment.work``;
      2. P = M Q, with Q the warm-start factor (or a fresh seeded draw);
      3. allreduce ``[P / W | uncompressed / W]`` (one collective; dividing first keeps fp16 finite);
      4. P = orthogonalize(P) in fp32;  Q = M^T P;
      5. allreduce ``Q / W`` — now Q is the mean over workers;
      6. g <- P Q^T (identical on every rank), e <- M - P Q^T.

    Mutates ``grads`` in place, the segment's buffers, and nothing else. ``step`` numbers fresh Q draws
    when warm start is off. Non-finite gradients give non-finite outputs (so an AMP GradScaler still
    skips the step) but never survive in the error memory or the warm-start Q.
    """
    plan = segment.plan
    world_size = comm.world_size
    order = segment.compressed_order
    matrices = [grads[i].view(plan.tensors[i].matrix) for i in order]
    unsent = [grads[i].view(-1) for i in plan.uncompressed]
    unsent_buffer = segment.phase1[plan.p_numel:]

    # 1. M = g + e.
    if matrices and config.use_error_feedback:
        torch._foreach_add_(segment.work_views, matrices)
    elif matrices:
        torch._foreach_copy_(segment.work_views, matrices)
    # 2. P = M Q.
    if not config.warm_start:
        segment.unsent_q = list(range(len(segment.q_views)))
    if segment.unsent_q:
        segment.draw_q(segment.unsent_q, config.random_seed, 0 if config.warm_start else step + 1)
        segment.unsent_q = []
    for _, work, p, qt in segment.group_views:
        _matmul(work, qt.transpose(1, 2), p)
    # 3. One collective for all P's and all uncompressed tensors.
    if unsent:
        torch._foreach_copy_(list(unsent_buffer.split([t.numel() for t in unsent])), unsent)
    segment.phase1.div_(world_size)
    yield comm.allreduce_sum(segment.phase1)

    if unsent:
        torch._foreach_copy_(unsent, list(unsent_buffer.split([t.numel() for t in unsent])))
    if not segment.group_views:
        return
    # 4. Orthogonalize P, then Q = M^T P.
    for _, work, p, qt in segment.group_views:
        orthogonalize_(p, config.orthogonalization_epsilon)
        _matmul(p.transpose(1, 2), work, qt)
    # 5. Mean of Q.
    segment.q.div_(world_size)
    yield comm.allreduce_sum(segment.q)

    # 6. Decompress into the gradients (one write per tensor, straight into the bucket's views); the
    # residual M - PQ^T stays in the error memory. The residual is taken against what was written, so
    # with fp16/bf16 gradients the rounding of the approximation is fed back too.
    same_dtype = all(m.dtype == segment.dtype for m in matrices)
    for matrix, p, qt in zip(matrices, segment.p_views, segment.q_views):
        _outer_sum(p, qt, matrix, same_dtype)
    if config.use_error_feedback:
        torch._foreach_sub_(segment.work_views, matrices)
    _discard_non_finite(segment, config)


def _matmul(a: Tensor, b: Tensor, out: Tensor) -> None:
    """``out = a @ b`` for a group ``(B, ., .)``.

    On CPU, one ``mm`` per matrix when the group holds one matrix or the product is rank-1 (a
    matrix-vector product, which MKL's batched path handles poorly); otherwise, and on GPUs, one ``bmm``.
    """
    if out.device.type == "cpu" and (a.shape[0] == 1 or min(out.shape[1], out.shape[2]) == 1):
        for x, y, o in zip(a.unbind(0), b.unbind(0), out.unbind(0)):
            torch.mm(x, y, out=o)
    else:
        torch.bmm(a, b, out=out)


def _outer_sum(p: Tensor, qt: Tensor, out: Tensor, same_dtype: bool) -> None:
    """``out = p @ qt`` for ``p`` of shape (n, r) and ``qt`` (r, m): a GEMM with inner dimension r.

    On CPU, for large matrices and r <= 4, that GEMM is 2-3x slower than r fused multiply-adds over the
    output (measured with MKL; see BENCHMARKS.md), so those take the elementwise path.
    """
    rank = p.shape[1]
    numel = out.numel()
    if out.device.type == "cpu" and ((rank <= 2 and numel >= 1 << 16) or (rank <= 4 and numel >= 1 << 20)):
        torch.mul(p[:, :1], qt[:1], out=out)
        for k in range(1, rank):
            out.addcmul_(p[:, k:k + 1], qt[k:k + 1])
    elif same_dtype:
        torch.mm(p, qt, out=out)
    else:
        out.copy_(p @ qt)


def _discard_non_finite(segment: Segment, config: EngineConfig) -> None:
    """Drop the memory of matrices whose Q came back non-finite (design rule 5).

    Q is the allreduced mean, so every rank takes the same branch. ``bool()`` on a tiny tensor is a
    host sync of the current stream only (no device-wide sync), and only that one flag is read.
    """
    if bool(torch.isfinite(segment.q).all()):
        return
    positions = []
    start = 0
    for _, work, _, q in segment.group_views:
        bad = ~torch.isfinite(q).flatten(1).all(dim=1)
        work[bad] = 0
        positions.extend(start + int(i) for i in bad.nonzero().flatten())
        start += q.shape[0]
    # Fresh seeded factors (the same on every rank) instead of NaN for the next warm start.
    segment.draw_q(positions, config.random_seed, 0)

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

__all__ = ["StepCommit", "alternating_step", "compress_step", "power_step"]


class StepCommit:
    """The segments of one step, committed together once all of them have finished (issue 19.3).

    A step is *finite* when every value its segments averaged (factors and uncompressed tensors, after
    the collectives, hence identical on every rank) is finite. A step that is not finite leaves the error
    memory and the warm-start factors of every segment, on every rank, bitwise as they were before it,
    while its outputs stay non-finite, so an AMP ``GradScaler`` skips it on every rank. The callers'
    step counters still advance (see :func:`compress_step`).

    One commit spans what one optimizer step consumes: all buckets of a DDP backward pass, all
    (device, dtype) groups of an aggregator call. Used alone (``commit=None``), a step commits itself.
    """

    __slots__ = ("_staged", "_flags")

    def __init__(self) -> None:
        self._staged: list[Segment] = []
        self._flags: list[Tensor] = []

    def add(self, finite: Tensor, segment: Segment | None = None) -> None:
        """Count ``finite`` (a 0-d bool tensor, the same on every rank) in; ``segment``: staged, to commit."""
        self._flags.append(finite)
        if segment is not None:
            self._staged.append(segment)

    def discard(self) -> None:
        """Forget a step that failed midway: its segments keep their memory as before it."""
        for segment in self._staged:
            segment.staged = None
        self._staged, self._flags = [], []

    def apply(self) -> Tensor | None:
        """Commit every staged segment; return the step's all-finite flag (``None``: nothing was added).

        Where reading a value is free (every segment on the CPU) the flag is read once, for the whole
        step, and a finite step commits by swapping buffers. Elsewhere the choice is a device-side
        ``torch.where``, with no host sync (design rule 6).
        """
        if not self._flags:
            return None
        staged, flags = self._staged, self._flags
        self._staged, self._flags = [], []
        device = flags[0].device
        finite = flags[0] if len(flags) == 1 else torch.stack([f.to(device) for f in flags]).all()
        known = None if any(_reading_waits(f.device) for f in flags) else bool(finite)
        for segment in staged:  # (segments on several devices: the flag is copied to each)
            segment.commit(finite.to(segment.device), known)
        return finite


def power_step(segment: Segment, grads: Sequence[Tensor], comm: Communicator, config: EngineConfig,
               step: int, *, commit: StepCommit | None = None, add_memory: bool = True,
               damping: float | None = None) -> Task:
    """Replace ``grads`` (the segment's tensors, in plan order) by their PowerSGD-compressed mean.

    A generator task (see :mod:`gradpress.pipeline`): it yields after starting each collective and must
    be resumed only once that collective is complete. Every rank must run it with the same plan.

    Steps, for the compressed matrices M_i (grouped by shape, one ``bmm`` per group):
      1. M = g + e (error feedback) — in the segment's scratch (:meth:`Segment.scratch`), the error
         memory ``e`` itself untouched;
      2. P = M Q, with Q the warm-start factor (or a fresh seeded draw);
      3. allreduce ``[P / W | uncompressed / W]`` (one collective; dividing first keeps fp16 finite);
      4. P = orthogonalize(P) in fp32;  Q = M^T P;
      5. allreduce ``Q / W`` — now Q is the mean over workers;
      6. g <- P Q^T (identical on every rank), e' <- M - P Q^T, committed as the new error memory (and
         Q as the warm start) by ``commit`` only if the step is finite (:class:`StepCommit`).

    Mutates ``grads`` in place, the segment's buffers, and nothing else. ``step`` numbers fresh Q draws
    when warm start is off. ``add_memory=False``: M = g, and e' = e + (M - PQ^T) (feedback deferred);
    ``damping``: the residual M - PQ^T is multiplied by it first (warm-up). Non-finite gradients give non-finite outputs (so
    an AMP GradScaler skips the step) and leave the memory as it was.
    """
    plan = segment.plan
    own = commit is None
    commit = StepCommit() if own else commit
    unsent_buffer = segment.phase1[plan.p_numel:]
    group_views, scratch = segment.scratch(config.use_error_feedback)
    # 1. M = g + e.
    matrices, unsent = _load(segment, grads, scratch, config.use_error_feedback and add_memory)
    _draw_missing(segment, config, 0 if config.warm_start else step + 1)
    segment.stage(config.use_error_feedback, False if config.warm_start else None)
    # 2. P = M Q.
    for _, work, p, qt in group_views:
        _matmul(work, qt.transpose(1, 2), p)
    # 3. One collective for all P's and all uncompressed tensors.
    if unsent:
        torch._foreach_copy_(list(unsent_buffer.split([t.numel() for t in unsent])), unsent)
    wire_dtype = config.wire_dtype(grads[0].dtype, segment.dtype) if grads else segment.dtype
    yield from _send(segment.phase1, comm, wire_dtype)

    if unsent:
        torch._foreach_copy_(unsent, list(unsent_buffer.split([t.numel() for t in unsent])))
    if group_views:
        # 4. Orthogonalize P, then Q = M^T P.
        for _, work, p, qt in group_views:
            orthogonalize_(p, config.orthogonalization_epsilon)
            _matmul(p.transpose(1, 2), work, qt)
        # 5. Mean of Q.
        yield from _send(segment.q, comm, wire_dtype)

        # 6. Decompress into the gradients (one write per tensor, straight into the bucket's views); the
        # residual M - PQ^T is the candidate memory. It is taken against what was written, so with
        # fp16/bf16 gradients the rounding of the approximation is fed back too.
        for matrix, p, qt in zip(matrices, segment.p_views, segment.q_views):
            _outer_sum(p, qt, matrix)
        if config.use_error_feedback:
            torch._foreach_sub_(scratch, matrices)
            _adjust_candidate(segment, add_memory, damping)
    _finish(segment, commit, own)


def alternating_step(segment: Segment, grads: Sequence[Tensor], comm: Communicator, config: EngineConfig,
                     first_iteration: int, *, commit: StepCommit | None = None, add_memory: bool = True,
                     damping: float | None = None) -> Task:
    """Multi-iteration PowerSGD: ``config.num_iters_per_step`` one-sided iterations, one collective each.

    As in the PowerSGD authors' reference aggregator (github.com/epfml/powersgd): iteration ``i``
    (counted across steps, starting at ``first_iteration``) multiplies the residual R (initially
    M = g + e) from the right if ``i`` is even and from the left if odd, with the *other* factor of
    the previous iteration as input, orthonormalized:

      * even: P = R Q̂, allreduce P (mean), piece = P Q̂^T;
      * odd:  Q = R^T P̂, allreduce Q (mean), piece = P̂ Q^T;

    then R <- R - piece, and the output accumulates the piece. Every piece is used, so one step's
    approximation has rank up to ``k r`` while each collective carries one rank-r factor: one
    iteration per step sends half of what classic PowerSGD sends, two send the same and are close to
    it in quality (their error is ``(I - P̂P̂^T) M (I - Q̂Q̂^T)``, never larger than the classic
    ``(I - P̂P̂^T) M``). The residual left after the last iteration is the new error memory, and P and
    Q the new warm start, committed as in :func:`power_step` (``commit``, ``add_memory``, ``damping``).

    The pieces are the same on every rank (their factors are means), so ``g + e = output + e'`` holds
    on each rank: error feedback conserves mass. The uncompressed tensors travel with the first
    iteration's factor (``[P | uncompressed]`` or ``[uncompressed | Q]``, contiguous in ``wire``).
    """
    plan = segment.plan
    iterations = config.num_iters_per_step
    assert iterations is not None
    own = commit is None
    commit = StepCommit() if own else commit
    p_end = plan.p_numel
    q_start = plan.p_numel + plan.uncompressed_numel
    unsent_buffer = segment.wire[p_end:q_start]
    epsilon = config.orthogonalization_epsilon
    group_views, scratch = segment.scratch(config.use_error_feedback)
    matrices, unsent = _load(segment, grads, scratch, config.use_error_feedback and add_memory)
    _draw_missing(segment, config, 0)
    segment.stage(config.use_error_feedback, True)
    wire_dtype = config.wire_dtype(grads[0].dtype, segment.dtype) if grads else segment.dtype

    for it in range(iterations):
        right = (first_iteration + it) % 2 == 0  # multiply from the right: P = R Q̂
        for _, work, p, qt in group_views:
            if right:
                orthogonalize_(qt.transpose(1, 2), epsilon)
                _matmul(work, qt.transpose(1, 2), p)
            else:
                orthogonalize_(p, epsilon)
                _matmul(p.transpose(1, 2), work, qt)
        start, end = (0, p_end) if right else (q_start, segment.wire.numel())
        if it == 0 and unsent:
            torch._foreach_copy_(list(unsent_buffer.split([t.numel() for t in unsent])), unsent)
            start, end = (0, q_start) if right else (p_end, segment.wire.numel())
        buffer = segment.wire[start:end]
        if buffer.numel():
            yield from _send(buffer, comm, wire_dtype)
        if it == 0 and unsent:
            torch._foreach_copy_(unsent, list(unsent_buffer.split([t.numel() for t in unsent])))
        if not group_views:
            break
        last = it == iterations - 1
        if it == 0:
            # The output is this piece; the residual is M minus what was written (one pass).
            for matrix, p, qt in zip(matrices, segment.p_views, segment.q_views):
                _outer_sum(p, qt, matrix)
            if config.use_error_feedback or not last:
                torch._foreach_sub_(scratch, matrices)
        else:
            keep_residual = config.use_error_feedback or not last
            for matrix, work, p, qt in zip(matrices, scratch, segment.p_views, segment.q_views):
                if keep_residual and matrix.dtype != work.dtype:
                    # An fp16/bf16 gradient rounds the piece it receives: subtract what was written, as
                    # the first iteration does, so that the mass is conserved to the memory's precision.
                    before = matrix.to(work.dtype)
                    _outer_sum(p, qt, matrix, accumulate=True)
                    work.sub_(matrix.to(work.dtype) - before)
                    continue
                _outer_sum(p, qt, matrix, accumulate=True)
                if keep_residual:
                    _outer_sum(p, qt, work, accumulate=True, alpha=-1.0)
    if group_views and config.use_error_feedback:
        _adjust_candidate(segment, add_memory, damping)
    _finish(segment, commit, own)


def compress_step(segment: Segment, grads: Sequence[Tensor], comm: Communicator, config: EngineConfig,
                  compressed_step: int, commit: StepCommit | None = None) -> tuple[Task, int]:
    """The engine's entry point: the task for step number ``compressed_step`` (0 for the first
    compressed step) of the configured scheme, and the number of elements it will send.

    ``commit``: the :class:`StepCommit` of the optimizer step this task is part of (the caller applies
    it once every task of the step has finished); ``None``: the task commits its own segment.

    A step that is not finite still counts: the caller's counter (hence ``compressed_step``, which picks
    the side the alternating scheme sends first, the fresh draw without warm start, and the warm-up and
    ``feedback_every_n_iters`` windows) advances on every rank alike, which needs no host sync. A run
    that leaves such a step out matches one that ran it exactly when it advances its counter in its
    place (``PowerSGDState.update_state()``).
    """
    k = config.num_iters_per_step
    add_memory = (compressed_step + 1) % config.feedback_every_n_iters == 0
    damping = None
    if config.warm_up_beta_factor is not None and compressed_step < config.warm_up_steps:
        damping = config.warm_up_beta_factor
    options = {"commit": commit, "add_memory": add_memory, "damping": damping}
    if k is None:
        task = power_step(segment, grads, comm, config, compressed_step, **options)
        sent = segment.plan.numel_sent
    else:
        first = compressed_step * k
        task = alternating_step(segment, grads, comm, config, first, **options)
        sent = segment.plan.numel_sent_per_step(k, first)
    return task, sent


def _adjust_candidate(segment: Segment, add_memory: bool, damping: float | None) -> None:
    """Turn the residual in ``spare`` into the candidate memory: ``damping`` times it (warm-up), plus
    the current memory when the step did not feed it back (``add_memory=False``)."""
    for (_, memory, _, _), (_, candidate, _, _) in zip(segment.group_views, segment.spare_group_views):
        if damping is not None:
            candidate.mul_(damping)
        if not add_memory:
            candidate.add_(memory)


def _finish(segment: Segment, commit: StepCommit, own: bool) -> None:
    """Add the segment's all-finite flag (over everything it averaged: identical on every rank) to the
    step; apply the step if it is this segment's alone."""
    commit.add(torch.isfinite(segment.wire).all(), segment)
    if own:
        commit.apply()


def _send(buffer: Tensor, comm: Communicator, wire_dtype: torch.dtype) -> Task:
    """Average ``buffer`` over the workers, in place, sending it as ``wire_dtype``.

    The buffer is divided by the world size first, so a sum of W terms is bounded by W times the largest
    term. For an fp16 wire, that bound is agreed on by a one-element max-allreduce and the buffer is
    scaled by the power of two that puts it at 2^14 (well inside fp16's 65504, and using its precision):
    no overflow whatever the gradients' magnitude. bf16 has fp32's range and needs no scaling.
    """
    buffer.div_(comm.world_size)
    if wire_dtype == buffer.dtype:
        yield comm.allreduce_sum(buffer)
        return
    scale = None
    if wire_dtype == torch.float16:
        peak = buffer.abs().max().reshape(1).float() if buffer.numel() else buffer.new_zeros(1, dtype=torch.float32)
        yield comm.allreduce_max(peak)
        bound = peak * comm.world_size
        usable = torch.isfinite(bound) & (bound > 0)
        scale = torch.where(usable, torch.exp2(torch.ceil(torch.log2(bound.clamp_min(1e-30))) - 14),
                            torch.ones_like(bound)).to(buffer.dtype)
        wire = (buffer / scale).to(wire_dtype)
    else:
        wire = buffer.to(wire_dtype)
    yield comm.allreduce_sum(wire)
    buffer.copy_(wire)
    if scale is not None:
        buffer.mul_(scale)


def _load(segment: Segment, grads: Sequence[Tensor], scratch: Sequence[Tensor],
          add_memory: bool) -> tuple[list[Tensor], list[Tensor]]:
    """The gradients as the segment's compressed matrices (group order) and uncompressed vectors, with
    M = g + e (``add_memory``) or M = g written into ``scratch``, the error memory left as it is."""
    plan = segment.plan
    matrices = [grads[i].view(plan.tensors[i].matrix) for i in segment.compressed_order]
    unsent = [grads[i].view(-1) for i in plan.uncompressed]
    if matrices and add_memory and segment.device.type == "cpu":
        # One pass (a copy then an add take two: on the CPU as costly as a kernel per matrix is not).
        for memory, matrix, out in zip(segment.work_views, matrices, scratch):
            torch.add(memory, matrix, out=out)
    elif matrices and add_memory:  # a fused copy, then one add per shape group
        torch._foreach_copy_(list(scratch), matrices)
        for (_, memory, _, _), (_, out, _, _) in zip(segment.group_views, segment.spare_group_views):
            out.add_(memory)
    elif matrices:
        torch._foreach_copy_(list(scratch), matrices)
    return matrices, unsent


def _draw_missing(segment: Segment, config: EngineConfig, draw: int) -> None:
    """Draw the factors a step needs but the memory does not hold (all of Q when warm start is off)."""
    if not config.warm_start:
        segment.unsent_q = list(range(len(segment.q_views)))
    if segment.unsent_q:
        segment.draw_q(segment.unsent_q, config.random_seed, draw,
                       with_p=config.num_iters_per_step is not None)
        segment.unsent_q = []


def _matmul(a: Tensor, b: Tensor, out: Tensor) -> None:
    """``out = a @ b`` for a group ``(B, ., .)``: one factor (a view into the wire) times the work matrices.

    On CPU, one ``mm`` per matrix when the group holds one matrix or the product is rank-1 (a
    matrix-vector product, which MKL's batched path handles poorly); otherwise, and on GPUs, one ``bmm``.
    The factor is read from, and the product written through, a fresh (so aligned) copy: where a factor
    sits in the wire depends on the bucket's layout, and BLAS rounds differently at other alignments
    (the work matrices are aligned by :class:`Segment`). The copies are the factors' size, not M's.
    """
    if a.numel() <= b.numel():
        a = a.clone()
    else:
        b = b.clone()
    if out.device.type == "cpu" and (a.shape[0] == 1 or min(out.shape[1], out.shape[2]) == 1):
        for x, y, o in zip(a.unbind(0), b.unbind(0), out.unbind(0)):
            o.copy_(torch.mm(x, y))
    else:
        out.copy_(torch.bmm(a, b))


def _outer_sum(p: Tensor, qt: Tensor, out: Tensor, accumulate: bool = False,
               alpha: float = 1.0) -> None:
    """``out = p @ qt`` (or ``out += alpha * p @ qt`` with ``accumulate``), ``p`` (n, r), ``qt`` (r, m).

    On CPU, for large matrices and r <= 4, that GEMM (inner dimension r) is 2-3x slower than r fused
    multiply-adds over the output (measured with MKL; see BENCHMARKS.md), so those take the elementwise
    path (elementwise: the same numbers wherever the operands sit in memory).
    """
    rank = p.shape[1]
    numel = out.numel()
    if out.device.type == "cpu" and ((rank <= 2 and numel >= 1 << 16) or (rank <= 4 and numel >= 1 << 20)):
        first = 0
        if not accumulate:
            torch.mul(p[:, :1], qt[:1], out=out)
            first = 1
        for k in range(first, rank):
            out.addcmul_(p[:, k:k + 1], qt[k:k + 1], value=alpha)
    else:  # a fresh product from fresh factors: BLAS's rounding then does not depend on their addresses
        product = p.clone() @ qt.clone()
        if accumulate:
            out.add_(product, alpha=alpha)
        else:
            out.copy_(product)


def _reading_waits(device: torch.device) -> bool:
    """Whether reading a tensor's value on the host waits for ``device``: everywhere but on the CPU,
    whose ops have finished when they return (so a read there costs nothing and syncs nothing)."""
    return device.type != "cpu"

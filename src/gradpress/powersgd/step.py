"""One PowerSGD step on a segment: the algorithm, as a task of two communication phases.

Vogels, Karimireddy & Jaggi, "PowerSGD: Practical Low-Rank Gradient Compression for Distributed
Optimization", NeurIPS 2019, Algorithm 1 (one power iteration, warm start) with error feedback (Alg. 2).
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Sequence
from typing import NamedTuple

import torch
from torch import Tensor

from .transport import Communicator, Handle
from .linalg import orthogonalize_, orthogonalize_groups_
from .pipeline import Task
from .config import EngineConfig
from .memory import Finiteness, Segment, StagedFactors
from .plan import GroupPlan
from .seeding import seeded_sketch, upload

__all__ = ["StepCommit", "alternating_step", "average_step", "compress_step", "power_step", "step_wire_dtype"]


class StepCommit:
    """The segments of one step, committed together once all of them have finished (docs/design.md, "non-finite steps").

    Until its commit a step writes nothing that a later step reads: the error memory stays as it is
    (M = g + e is rebuilt in the segment's :class:`~gradpress.powersgd.memory.Workspace` for each
    product), the warm-start factors it overwrites are saved first, and the gradients of the compressed
    matrices still hold g. The commit then writes, per segment, the output P Q^T into the gradients
    and, if the step is *finite*, the new error memory e' = M - P Q^T; if it is not, the error memory
    and the warm-start factors of every segment, on every rank, stay bitwise as they were before the
    step, while the outputs are non-finite, so an AMP ``GradScaler`` skips the step on every rank.

    A step is finite when every value its segments averaged (factors and uncompressed tensors, after
    the collectives, hence identical on every rank) is finite. One commit spans what one optimizer step
    consumes: all buckets of a DDP backward pass, all (device, dtype) groups of an aggregator call.
    Used alone (``commit=None``), a step commits itself when it ends. The callers' step counters still
    advance on a step that is not finite (see :func:`compress_step`).
    """

    __slots__ = ("_finishes", "_flags")

    def __init__(self) -> None:
        self._finishes: list[Callable[[Tensor, Finiteness], None]] = []
        self._flags: list[Tensor] = []

    def add(self, finite: Tensor, finish: Callable[[Tensor, Finiteness], None] | None = None) -> None:
        """Count ``finite`` (a 0-d bool tensor, the same on every rank) in; ``finish(finite, finiteness)``:
        what the commit runs (``finite``: the step's all-finite flag, on the first flag's device;
        ``finiteness``: what :meth:`apply` read of it, a :class:`~gradpress.powersgd.memory.Finiteness`)."""
        self._flags.append(finite)
        if finish is not None:
            self._finishes.append(finish)

    def discard(self) -> None:
        """Forget a step that failed midway: its segments keep their memory and factors as before it."""
        self._finishes, self._flags = [], []

    def apply(self) -> Tensor | None:
        """Commit every segment added; return the step's all-finite flag (``None``: nothing was added).

        Where reading a value is free (every flag on the CPU) the flag is read once, for the whole step
        (:attr:`~Finiteness.FINITE` or :attr:`~Finiteness.NOT_FINITE`), and each segment takes the finite
        or the non-finite path. Elsewhere (:attr:`~Finiteness.ON_DEVICE`) the choice is made on the device
        with ``torch.where``, with no host sync ("no host reads on the hot path").
        """
        if not self._flags:
            return None
        finishes, flags = self._finishes, self._flags
        self._finishes, self._flags = [], []
        device = flags[0].device
        finite = flags[0] if len(flags) == 1 else torch.stack([f.to(device) for f in flags]).all()
        if any(_reading_waits(f.device) for f in flags):
            finiteness = Finiteness.ON_DEVICE
        else:
            finiteness = Finiteness.FINITE if bool(finite) else Finiteness.NOT_FINITE
        for finish in finishes:
            finish(finite, finiteness)
        return finite


def power_step(segment: Segment, grads: Sequence[Tensor], comm: Communicator, config: EngineConfig,
               step: int, *, commit: StepCommit | None = None, add_memory: bool = True,
               damping: float | None = None, measure: bool = False, track: bool = False,
               global_residual: bool = False) -> Task:
    """Replace ``grads`` (the segment's tensors, in plan order) by their PowerSGD-compressed mean.

    A generator task (see :mod:`gradpress.powersgd.pipeline`): it yields after starting each collective and must
    be resumed only once that collective is complete. Every rank must run it with the same plan.

    Steps, for the compressed matrices M_i (grouped by shape, one ``bmm`` per group):
      1. M = g + e (error feedback), built in the workspace for each product: the error memory ``e``
         and the gradient ``g`` stay as they are until the commit;
      2. P = M Q, with Q the warm-start factor (or a fresh seeded draw);
      3. allreduce ``[P / W | uncompressed / W]`` (one collective; dividing first keeps fp16 finite);
      4. P = orthogonalize(P) in fp32;  Q = M^T P (M built again);
      5. allreduce ``Q / W`` — now Q is the mean over workers;
      6. at the commit (:class:`StepCommit`, by ``commit``, or at the end of this task without one):
         g <- P Q^T (identical on every rank) and, only if the step is finite, e <- M - P Q^T.

    Mutates ``grads`` (the uncompressed tensors at step 3, the compressed ones at the commit), the
    segment's buffers, and nothing else. ``step`` numbers fresh Q draws when warm start is off.
    ``add_memory=False``: M = g, and e' = e + (M - PQ^T) (feedback deferred); ``damping``: the residual
    M - PQ^T is multiplied by it first (warm-up). Non-finite gradients give non-finite outputs (so an AMP
    GradScaler skips the step) and leave the memory and the factors as they were. ``measure``: record
    ``||M||`` and ``||M - PQ^T||`` of every compressed matrix in the segment at the commit
    (:meth:`Segment.approximation_norms`), on the device; and, after one more all-reduce (of ``M Omega``,
    a seeded sketch: :func:`_global_sketch`), the sketched ``||mean M||`` and ``||mean M - PQ^T||`` over the
    workers (:meth:`Segment.global_residual_norms`). ``track``: add ``||P Q^T||`` of every
    compressed matrix to :meth:`Segment.output_signals` (adaptive rank), on the device.

    Building M twice costs two elementwise passes over the gradients more than building it once and
    keeping it, and saves keeping a second copy of the error memory until the commit (a buffer of the
    gradients' size; the workspace is the size of one shape group).
    """
    plan = segment.plan
    own = commit is None
    if commit is None:
        commit = StepCommit()
    unsent_buffer = segment.phase1[plan.p_numel:]
    matrices, unsent = _views(segment, grads)
    with_memory = config.use_error_feedback and add_memory
    _draw_missing(segment, config, 0 if config.warm_start else step + 1)
    segment.stage(StagedFactors.Q if config.warm_start else StagedFactors.NOTHING)
    segment.ensure_m_buffer()
    # 1. M = g + e, once, in the segment's M buffer: two ops for all matrices, or on the CPU one add per
    #    matrix (one pass over M instead of two; the same sums).
    if matrices:
        if with_memory and segment.device.type == "cpu":
            for target, g, e in zip(segment.m_views, matrices, segment.error_views):
                torch.add(g, e, out=target)
        else:
            torch._foreach_copy_(segment.m_views, matrices)
            if with_memory:
                torch._foreach_add_(segment.m_views, segment.error_views)
    # 2. P = M Q, one bmm per shape group, into the wire.
    for (_, _, p, qt), m in zip(segment.group_views, segment.m_group_views):
        _product(m, qt.transpose(1, 2), p)
    # 3. One collective for all P's and all uncompressed tensors.
    if unsent:
        torch._foreach_copy_(list(unsent_buffer.split([t.numel() for t in unsent])), unsent)
    wire_dtype = step_wire_dtype(segment, grads, config)
    sent = segment.phase1.numel()
    yield from _send(segment, 0, sent, comm, wire_dtype)

    if unsent:
        torch._foreach_copy_(unsent, list(unsent_buffer.split([t.numel() for t in unsent])))
    if segment.group_views:
        # 4. Orthogonalize every P (batched Cholesky-QR), then Q^T = P^T M.
        orthogonalize_groups_([p for _, _, p, _ in segment.group_views], config.orthogonalization_epsilon,
                              "cholesky" if _reading_waits(segment.device) else "householder")
        for (_, _, p, qt), m in zip(segment.group_views, segment.m_group_views):
            _product(p.transpose(1, 2), m, qt)
        # 5. Mean of Q.
        yield from _send(segment, sent, segment.wire.numel(), comm, wire_dtype)
    # Measuring: one more all-reduce, of the sketched M's (the global residual; same steps on every rank).
    sketched = (yield from _global_sketch(segment, matrices, with_memory, [segment.wire], comm, config.random_seed,
                                          step)) if global_residual and segment.group_views else None
    # 6. At the commit.
    finite = _all_finite(segment.wire)
    error_feedback = config.use_error_feedback

    def finish(step_finite: Tensor, finiteness: Finiteness) -> None:
        if segment.group_views:
            _commit_batched(segment, matrices, error_feedback, add_memory, damping, step_finite, finiteness,
                            measure, track)
        if sketched is not None:
            _keep_global_norms(segment, sketched, step_finite, finiteness)
        segment.restore_factors(step_finite.to(segment.device), finiteness)

    commit.add(finite, finish)
    if own:
        commit.apply()


def _commit_batched(segment: Segment, matrices: list[Tensor], error_feedback: bool, add_memory: bool,
                    damping: float | None, finite: Tensor, finiteness: Finiteness, measure: bool,
                    track: bool) -> None:
    """:func:`power_step`'s commit: write ``P Q^T`` into ``matrices`` and, if the step is finite, the new error
    memory ``damping * (M - written)`` (or ``e + damping * (g - written)`` without ``add_memory``), one op
    per shape group or per segment, not per matrix.

    M (or g) is in ``segment.m_memory``. Where the host knows the step is finite and M includes the memory
    (the common case), the output is built in the old error memory (M holds it already), written out, and
    subtracted from M, which then becomes the error memory (:meth:`Segment.swap_memory`): three passes,
    no copy; on the CPU, groups whose outer product is elementwise write it straight into the gradients
    and subtract those from M (:func:`_direct_groups`): two passes, the same bits. Elsewhere the output
    of each group is built in the shared workspace; the new memory is then kept (finite), dropped (not
    finite) or chosen with ``torch.where`` on the device
    (:attr:`~Finiteness.ON_DEVICE`). With fp16/bf16 gradients the output is read back after it is
    written, so the residual is taken against what was written. ``measure``: ``||M||`` and
    ``||M - written||`` per matrix (before damping) into :meth:`Segment.approximation_norms`; ``track``:
    ``||written||`` added to :meth:`Segment.output_signals`; both only where the step is finite.
    """
    norms = segment.approximation_norms() if measure and finiteness is not Finiteness.NOT_FINITE else None
    fresh = None if norms is None else (norms if finiteness is Finiteness.FINITE else torch.empty_like(norms))
    signals = segment.output_signals() if track and finiteness is not Finiteness.NOT_FINITE else None
    new_memory = error_feedback and finiteness is not Finiteness.NOT_FINITE
    rounded = bool(matrices) and matrices[0].dtype != segment.dtype
    flat_m = segment.m_memory
    assert flat_m is not None
    groups = [(group, p, qt, m) for (group, _, p, qt), m in zip(segment.group_views, segment.m_group_views)]
    output_norms = torch.empty(len(matrices), device=segment.device, dtype=segment.dtype) \
        if signals is not None else None

    def measure_m(column: int) -> None:
        if fresh is not None:
            position = 0
            for group, _, _, m in groups:
                torch.linalg.vector_norm(m, dim=(1, 2), out=fresh[position: position + group.batch, column])
                position += group.batch

    if new_memory and add_memory and finiteness is Finiteness.FINITE:
        measure_m(0)
        error_groups = [errors for _, errors, _, _ in segment.group_views]
        direct = _direct_groups(groups, matrices, rounded or output_norms is not None)
        if not any(direct):
            for (_, p, qt, _), errors in zip(groups, error_groups):
                _outer(p, qt, errors)
            torch._foreach_copy_(matrices, segment.error_views)
            if rounded:
                torch._foreach_copy_(segment.error_views, matrices)
            if output_norms is not None:
                _group_norms(groups, error_groups, output_norms)
            flat_m.sub_(segment.error_memory)
        else:  # the CPU: fused outer products written straight into the gradients, one pass fewer each
            position = 0
            for (group, p, qt, m), errors, straight in zip(groups, error_groups, direct):
                members = matrices[position: position + group.batch]
                if straight:
                    for x, y, out in zip(p.unbind(0), qt.unbind(0), members):
                        _outer_sum(x, y, out)
                    torch._foreach_sub_(list(m.unbind(0)), members)
                else:
                    _outer(p, qt, errors)
                    torch._foreach_copy_(members, list(errors.unbind(0)))
                    m.sub_(errors)
                position += group.batch
        measure_m(1)
        if damping is not None:
            flat_m.mul_(damping)
        segment.swap_memory()
    elif not new_memory and fresh is None:
        for group, p, qt, m in groups:
            _outer(p, qt, m)
        torch._foreach_copy_(matrices, segment.m_views)
        if output_norms is not None:
            _group_norms(groups, [m for _, _, _, m in groups], output_norms)
    else:
        measure_m(0)
        position = 0
        for group, p, qt, m in groups:
            b = group.batch
            output = segment.workspace.matrices(b, group.n, group.m, segment.device, segment.dtype)
            _outer(p, qt, output)
            members = matrices[position: position + b]
            torch._foreach_copy_(members, list(output.unbind(0)))
            if rounded:
                torch._foreach_copy_(list(output.unbind(0)), members)
            if output_norms is not None:
                torch.linalg.vector_norm(output, dim=(1, 2), out=output_norms[position: position + b])
            m.sub_(output)
            position += b
        measure_m(1)
        if new_memory:
            if damping is not None:
                flat_m.mul_(damping)
            if not add_memory:
                flat_m.add_(segment.error_memory)
            if finiteness is Finiteness.FINITE:
                segment.swap_memory()
            else:
                torch.where(finite.to(segment.device), flat_m, segment.error_memory, out=segment.error_memory)
    _keep_norms(norms, fresh, finite)
    if signals is not None and output_norms is not None:
        if finiteness is Finiteness.FINITE:
            signals.add_(output_norms)
        else:
            signals.add_(torch.where(finite.to(segment.device), output_norms, torch.zeros_like(output_norms)))


def _product(a: Tensor, b: Tensor, out: Tensor) -> None:
    """``out = a @ b`` for a group ``(B, ., .)``: one ``bmm``, or on the CPU one ``mm`` per matrix where
    :func:`_per_matrix_product` says so (the kernel choice of :func:`_matmul`, without its copies: the
    batched step's layout does not depend on the bucket)."""
    if _per_matrix_product(out):
        for x, y, o in zip(a.unbind(0), b.unbind(0), out.unbind(0)):
            torch.mm(x, y, out=o)
    else:
        torch.bmm(a, b, out=out)


def _outer(p: Tensor, qt: Tensor, out: Tensor) -> None:
    """``out = P Q^T`` for a group: :func:`_product`, or on the CPU, where :func:`_fused_outer` says so, r
    fused multiply-adds per matrix (:func:`_outer_sum`)."""
    if _fused_outer(p.shape[2], out.shape[1] * out.shape[2], out.device):
        for x, y, o in zip(p.unbind(0), qt.unbind(0), out.unbind(0)):
            _outer_sum(x, y, o)
    else:
        _product(p, qt, out)


def _direct_groups(groups: list[tuple[GroupPlan, Tensor, Tensor, Tensor]], matrices: list[Tensor],
                   excluded: bool) -> list[bool]:
    """Per shape group, whether the commit writes ``P Q^T`` straight into the gradients (and takes the
    residual against them) instead of building it in the old error memory and copying it out: on the CPU,
    for groups whose outer product is elementwise (:func:`_fused_outer`, so the same numbers wherever the
    output sits) into contiguous gradients of the segment's dtype; never where ``excluded`` (fp16/bf16
    gradients, or output norms to keep)."""
    if excluded or not matrices or matrices[0].device.type != "cpu":
        return [False] * len(groups)
    direct, position = [], 0
    for group, p, _, _ in groups:
        members = matrices[position: position + group.batch]
        direct.append(_fused_outer(p.shape[2], group.n * group.m, p.device)
                      and all(g.is_contiguous() for g in members))
        position += group.batch
    return direct


def _per_matrix_product(out: Tensor) -> bool:
    """Whether a group's product ``out`` (B, ., .) takes one ``mm`` per matrix: on the CPU, for a group of
    one or a rank-1 product (a matrix-vector product, which MKL's batched path handles poorly)."""
    return out.device.type == "cpu" and (out.shape[0] == 1 or min(out.shape[1], out.shape[2]) == 1)


def _fused_outer(rank: int, numel: int, device: torch.device) -> bool:
    """Whether ``P Q^T`` of rank ``rank`` into ``numel`` elements takes r fused multiply-adds instead of a
    GEMM: on the CPU, for large matrices and r <= 4, where that GEMM (inner dimension r) is 2-3x slower
    (measured with MKL; see BENCHMARKS.md)."""
    return device.type == "cpu" and ((rank <= 2 and numel >= 1 << 16) or (rank <= 4 and numel >= 1 << 20))


def _group_norms(groups: list[tuple[GroupPlan, Tensor, Tensor, Tensor]], outputs: list[Tensor], out: Tensor) -> None:
    """``||output||`` of every matrix, group by group, into ``out`` (group order)."""
    position = 0
    for (group, _, _, _), output in zip(groups, outputs):
        torch.linalg.vector_norm(output, dim=(1, 2), out=out[position: position + group.batch])
        position += group.batch


def alternating_step(segment: Segment, grads: Sequence[Tensor], comm: Communicator, config: EngineConfig,
                     first_iteration: int, *, commit: StepCommit | None = None, add_memory: bool = True,
                     damping: float | None = None, measure: bool = False, track: bool = False,
                     global_residual: bool = False) -> Task:
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
    Q the new warm start, committed as in :func:`power_step` (``commit``, ``add_memory``, ``damping``,
    ``measure``: M minus the sum of the pieces is the residual measured).

    R is rebuilt in the workspace for each iteration's product, as M minus the pieces so far (the
    factors of earlier iterations are kept: each is one P and one Q); the output, the sum of the
    pieces, is written at the commit, and the new memory is M minus what was written.

    The pieces are the same on every rank (their factors are means), so ``g + e = output + e'`` holds
    on each rank: error feedback conserves mass. The uncompressed tensors travel with the first
    iteration's factor (``[P | uncompressed]`` or ``[uncompressed | Q]``, contiguous in ``wire``).
    """
    plan = segment.plan
    iterations = config.num_iters_per_step
    assert iterations is not None
    own = commit is None
    if commit is None:
        commit = StepCommit()
    p_end = plan.p_numel
    q_start = plan.p_numel + plan.uncompressed_numel
    unsent_buffer = segment.wire[p_end:q_start]
    epsilon = config.orthogonalization_epsilon
    matrices, unsent = _views(segment, grads)
    with_memory = config.use_error_feedback and add_memory
    _draw_missing(segment, config, 0)
    segment.stage(StagedFactors.P_AND_Q)
    wire_dtype = step_wire_dtype(segment, grads, config)
    earlier: list[tuple[list[Tensor], list[Tensor]]] = []  # the pieces' factors, in copies of the wire
    copies: list[Tensor] = []

    for it in range(iterations):
        right = (first_iteration + it) % 2 == 0  # multiply from the right: P = R Q̂
        for _, _, p, qt in segment.group_views:
            orthogonalize_(qt.transpose(1, 2) if right else p, epsilon,
                           "cholesky" if _reading_waits(segment.device) else "householder")
        _products(segment, matrices, with_memory, earlier, right)
        start, end = (0, p_end) if right else (q_start, segment.wire.numel())
        if it == 0 and unsent:
            torch._foreach_copy_(list(unsent_buffer.split([t.numel() for t in unsent])), unsent)
            start, end = (0, q_start) if right else (p_end, segment.wire.numel())
        if end > start:
            yield from _send(segment, start, end, comm, wire_dtype)
        if it == 0 and unsent:
            torch._foreach_copy_(unsent, list(unsent_buffer.split([t.numel() for t in unsent])))
        if not segment.group_views:
            break
        if it < iterations - 1:
            copies.append(segment.wire.clone())
            earlier.append(segment.factor_views(copies[-1]))
    pieces = earlier + [(segment.p_views, segment.q_views)] if segment.group_views else []
    # Measuring: one more all-reduce, of the sketched M's (the global residual; same steps on every rank).
    sketched = (yield from _global_sketch(segment, matrices, with_memory, [*copies, segment.wire], comm,
                                          config.random_seed, first_iteration // iterations)) \
        if global_residual and segment.group_views else None
    _finish(segment, commit, own, matrices, pieces, copies, config, add_memory, damping, measure, track, sketched)


def compress_step(segment: Segment, grads: Sequence[Tensor], comm: Communicator, config: EngineConfig,
                  compressed_step: int, commit: StepCommit | None = None, *,
                  measure: bool = False, track: bool = False, global_residual: bool = False) -> tuple[Task, int]:
    """The engine's entry point: the task for step number ``compressed_step`` (0 for the first
    compressed step) of the configured scheme, and the number of elements it will send.

    ``commit``: the :class:`StepCommit` of the optimizer step this task is part of (the caller applies
    it once every task of the step has finished); ``None``: the task commits its own segment.
    ``measure``: also record each compressed matrix's approximation error (free: norms of what the
    commit holds); ``global_residual``: also its global residual, which costs one more all-reduce, of a
    sketch, at the end of the task (a diagnostic, not counted in the number of elements returned; every
    rank measures the same steps, so it is issued in the same order everywhere); ``track``: add the norm
    of each applied approximation to the segment's adaptive-rank signal (see :func:`power_step`).

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
    if k is None:
        task = power_step(segment, grads, comm, config, compressed_step, commit=commit, add_memory=add_memory,
                          damping=damping, measure=measure, track=track, global_residual=global_residual)
        sent = segment.plan.numel_sent
    else:
        first = compressed_step * k
        task = alternating_step(segment, grads, comm, config, first, commit=commit, add_memory=add_memory,
                                damping=damping, measure=measure, track=track, global_residual=global_residual)
        sent = segment.plan.numel_sent_per_step(k, first)
    return task, sent


def step_wire_dtype(segment: Segment, grads: Sequence[Tensor], config: EngineConfig) -> torch.dtype:
    """The dtype the steps of ``segment`` send for ``grads`` (``config.bytes_per_weight``'s wire for the
    gradients' dtype; the working dtype when there is nothing to send)."""
    return config.wire_dtype(grads[0].dtype, segment.dtype) if grads else segment.dtype


def average_step(tensors: Sequence[Tensor], comm: Communicator, commit: StepCommit | None = None,
                 wire_dtype: torch.dtype | None = None, *, flat: Tensor | None = None,
                 lengths: Tensor | None = None, out: Tensor | None = None) -> Task:
    """Replace ``tensors`` (one device and dtype) by their exact mean over the workers, in one collective
    (the iterations before compression starts, and tensors no plan compresses), as a task.

    ``wire_dtype``: what is sent (default: the tensors' dtype). The tensors are divided by the world size
    first, then sent as in a compressed step's phase (:func:`_send`): an fp16 wire from a wider dtype
    scales each tensor by its own power of two, agreed on by a max-allreduce of one float per tensor, so
    that the sum cannot overflow; bf16 is a plain cast. Adds whether the means are finite (identical on
    every rank) to ``commit``; ``None``: the task commits alone. Nothing else is written: there is no memory.

    ``flat``: a contiguous buffer the tensors are views of, back to back (a DDP bucket's): it is sent as
    it is, and each tensor still gets its own fp16 scale. ``lengths``: the tensors' non-zero element
    counts as an int64 tensor on their device, used off the CPU (built and uploaded here if not given; a
    caller that sends the same layout every step keeps it). ``out``: a buffer of ``flat``'s size and the
    wire's dtype to send from (default: a fresh one).
    """
    own = commit is None
    if commit is None:
        commit = StepCommit()
    dtype = tensors[0].dtype
    wire_dtype = dtype if wire_dtype is None else wire_dtype
    if comm.world_size == 1 and wire_dtype == dtype:  # the mean of one worker: nothing to send
        commit.add(_all_finite(flat) if flat is not None else torch.stack([_all_finite(t) for t in tensors]).all())
    else:
        alone = flat is not None or (len(tensors) == 1 and tensors[0].is_contiguous())
        if flat is None:
            flat = tensors[0].view(-1) if alone else torch.cat([t.reshape(-1) for t in tensors])
        spans = None
        if wire_dtype == torch.float16 and dtype != torch.float16:
            sizes = [t.numel() for t in tensors if t.numel()]
            if _reading_waits(flat.device) and lengths is None:
                lengths = upload(torch.tensor(sizes, dtype=torch.int64), flat.device)
            spans = Spans(list(flat.split(sizes)), lengths if _reading_waits(flat.device) else None)
        yield from _mean(flat, comm, wire_dtype, spans, out)
        if not alone:
            torch._foreach_copy_([t.view(-1) for t in tensors], list(flat.split([t.numel() for t in tensors])))
        commit.add(_all_finite(flat))
    if own:
        commit.apply()


def _finish(segment: Segment, commit: StepCommit, own: bool, matrices: list[Tensor],
            pieces: list[tuple[list[Tensor], list[Tensor]]], copies: list[Tensor], config: EngineConfig,
            add_memory: bool, damping: float | None, measure: bool, track: bool,
            sketched: Tensor | None = None) -> None:
    """Add the segment's all-finite flag (over everything it averaged, ``copies`` of earlier iterations'
    factors included: identical on every rank) and its commit to the step; apply the step if it is this
    segment's alone. ``sketched``: the measured step's global-residual norms (:func:`_global_sketch`),
    stored at the commit if the step is finite."""
    finite = torch.isfinite(segment.wire).all()
    for wire in copies:
        finite = finite & torch.isfinite(wire).all()
    error_feedback = config.use_error_feedback

    def finish(step_finite: Tensor, finiteness: Finiteness) -> None:
        _decompress(segment, matrices, pieces, error_feedback, add_memory, damping, step_finite, finiteness,
                    measure)
        if track and pieces and finiteness is not Finiteness.NOT_FINITE:
            _track(segment, matrices, step_finite, finiteness)
        if sketched is not None:
            _keep_global_norms(segment, sketched, step_finite, finiteness)
        segment.restore_factors(step_finite.to(segment.device), finiteness)

    commit.add(finite, finish)
    if own:
        commit.apply()


def _decompress(segment: Segment, matrices: list[Tensor], pieces: list[tuple[list[Tensor], list[Tensor]]],
                error_feedback: bool, add_memory: bool, damping: float | None, finite: Tensor,
                finiteness: Finiteness, measure: bool = False) -> None:
    """Write the output (the sum of the ``pieces``' products) into ``matrices`` and, if ``finite``, the
    new error memory: ``damping * (M - output)`` (M = g + e), or ``e + damping * (g - output)`` without
    ``add_memory``. The residual is taken against what was written, so with fp16/bf16 gradients the
    rounding of the output is fed back too.

    ``finiteness``: what the commit read of ``finite`` (:class:`~gradpress.powersgd.memory.Finiteness`).
    With error feedback: :attr:`~Finiteness.FINITE` updates the memory in place (with ``add_memory``, the
    classic three passes per matrix: ``e += g``, write the output, ``e -= output``);
    :attr:`~Finiteness.NOT_FINITE` writes the output only; :attr:`~Finiteness.ON_DEVICE` builds the new
    memory in the workspace, one shape group at a time, and keeps it or the old one with ``torch.where``.

    ``measure``: also record, per matrix, ``||M||`` and ``||M - output||`` (M as compressed: ``g + e``, or
    ``g`` without error feedback or ``add_memory``; the residual before damping) in the segment's
    :meth:`~Segment.approximation_norms`, from the tensors the commit holds anyway: one norm each, on the
    device. A step that is not finite leaves the recorded norms as they were.
    """
    if not pieces:
        return
    norms = segment.approximation_norms() if measure and finiteness is not Finiteness.NOT_FINITE else None
    fresh = None if norms is None else (norms if finiteness is Finiteness.FINITE else torch.empty_like(norms))
    workspace = segment.workspace
    if not error_feedback or finiteness is Finiteness.NOT_FINITE:
        for i, matrix in enumerate(matrices):
            if fresh is None:
                _write_output(matrix, pieces, i)
                continue
            rows, cols = matrix.shape
            residual = workspace.matrices(1, rows, cols, segment.device, segment.dtype)[0]
            residual.copy_(matrix)
            _write_output(matrix, pieces, i)
            fresh[i, 0] = torch.linalg.vector_norm(residual)
            fresh[i, 1] = torch.linalg.vector_norm(residual.sub_(matrix))
        _keep_norms(norms, fresh, finite)
        return
    if finiteness is Finiteness.FINITE:
        for i, (matrix, memory) in enumerate(zip(matrices, segment.error_views)):
            if add_memory:
                memory.add_(matrix)  # M = e + g
                if fresh is not None:
                    fresh[i, 0] = torch.linalg.vector_norm(memory)
                _write_output(matrix, pieces, i)
                memory.sub_(matrix)
                if fresh is not None:
                    fresh[i, 1] = torch.linalg.vector_norm(memory)
                if damping is not None:
                    memory.mul_(damping)
                continue
            rows, cols = memory.shape
            residual = workspace.matrices(1, rows, cols, segment.device, segment.dtype)[0]
            residual.copy_(matrix)
            _write_output(matrix, pieces, i)
            if fresh is not None:
                fresh[i, 0] = torch.linalg.vector_norm(residual)
            residual.sub_(matrix)
            if fresh is not None:
                fresh[i, 1] = torch.linalg.vector_norm(residual)
            if damping is not None:
                residual.mul_(damping)
            memory.add_(residual)
        return
    flag = finite.to(segment.device)
    position = 0
    for group, memory_group, _, _ in segment.group_views:
        members = matrices[position: position + group.batch]
        candidate = workspace.matrices(group.batch, group.n, group.m, segment.device, segment.dtype)
        _operand(segment, candidate, memory_group, members, add_memory, [], position)
        if fresh is not None:
            torch.linalg.vector_norm(candidate, dim=(1, 2), out=fresh[position: position + group.batch, 0])
        for i, (matrix, residual) in enumerate(zip(members, candidate.unbind(0))):
            _write_output(matrix, pieces, position + i)
            residual.sub_(matrix)
        if fresh is not None:
            torch.linalg.vector_norm(candidate, dim=(1, 2), out=fresh[position: position + group.batch, 1])
        if damping is not None:
            candidate.mul_(damping)
        if not add_memory:
            candidate.add_(memory_group)
        torch.where(flag, candidate, memory_group, out=memory_group)
        position += group.batch
    _keep_norms(norms, fresh, flag)


def _track(segment: Segment, matrices: list[Tensor], finite: Tensor, finiteness: Finiteness) -> None:
    """Add each written output's norm to the segment's adaptive-rank signal, if the step is finite
    (chosen on the device with ``finite`` where ``finiteness`` is :attr:`~Finiteness.ON_DEVICE`)."""
    norms = torch.stack([torch.linalg.vector_norm(matrix).to(segment.dtype) for matrix in matrices])
    signals = segment.output_signals()
    if finiteness is Finiteness.FINITE:
        signals.add_(norms)
    else:
        signals.add_(torch.where(finite.to(segment.device), norms, torch.zeros_like(norms)))


def _keep_norms(norms: Tensor | None, fresh: Tensor | None, finite: Tensor) -> None:
    """Keep the norms measured in ``fresh`` if the step is finite: they were written in place where that
    was read on the host (``fresh is norms``), else chosen on the device."""
    if norms is None or fresh is None or fresh is norms:
        return
    torch.where(finite.to(norms.device), fresh, norms, out=norms)


def _global_sketch(segment: Segment, matrices: list[Tensor], with_memory: bool, wires: list[Tensor],
                   comm: Communicator, seed: int, draw: int) -> Generator[Handle, None, Tensor]:
    """The global-residual diagnostic's phase: one all-reduce, whose ``(C, 2)`` result (per compressed
    matrix, group order) is the sketched ``||mean_i M_i Omega||`` and ``||(mean_i M_i - P Q^T) Omega||``.

    Omega is :func:`~gradpress.powersgd.seeding.seeded_sketch` of ``(seed, m, draw)``, drawn on the CPU
    (identical on every rank) and moved to the device, once per column count. M is built in the
    workspace exactly as the step compressed it (``with_memory``; chunked as in :func:`_products`), and
    only ``S_i = M_i Omega`` (``(n, k)``, k <= 16) is averaged: ``[S / W]`` of every matrix in one buffer of
    the working dtype. Then, per shape group with one ``bmm`` per piece, ``mean S - sum_pieces P (Q^T Omega)``
    where ``wires`` hold the pieces' factors (the segment's wire, after copies of earlier iterations'):
    exactly the ``P Q^T`` every rank applies. Run after the step's last collective, before its commit;
    the gradients still hold g and the error memory e. Nothing is read on the host; the buffer is a
    diagnostic, not counted in the bytes a step sends.
    """
    device, dtype = segment.device, segment.dtype
    omegas: dict[int, Tensor] = {}
    for group, _, _, _ in segment.group_views:
        if group.m not in omegas:
            omegas[group.m] = upload(seeded_sketch(group.m, seed, draw).to(dtype), device)
    sizes = [group.batch * group.n * omegas[group.m].shape[1] for group, _, _, _ in segment.group_views]
    sketch = torch.empty(sum(sizes), device=device, dtype=dtype)
    sketches = [view.view(group.batch, group.n, -1)
                for (group, _, _, _), view in zip(segment.group_views, sketch.split(sizes))]
    workspace = segment.workspace
    position = 0
    for (group, memory, _, _), out in zip(segment.group_views, sketches):
        b, n, m = group.batch, group.n, group.m
        omega = omegas[m]
        one_by_one = device.type == "cpu" and (b == 1 or group.rank == 1)
        for lo, hi in ([(i, i + 1) for i in range(b)] if one_by_one else [(0, b)]):
            operand = workspace.matrices(hi - lo, n, m, device, dtype)
            _operand(segment, operand, memory[lo:hi], matrices[position + lo: position + hi], with_memory, [],
                     position + lo)
            torch.bmm(operand, omega.expand(hi - lo, *omega.shape), out=out[lo:hi])
        position += b
    sketch.div_(comm.world_size)
    yield comm.allreduce_sum(sketch)
    norms = torch.empty(len(matrices), 2, device=device, dtype=dtype)
    factors = [segment.factor_group_views(wire) for wire in wires]
    position = 0
    for index, ((group, _, _, _), mean) in enumerate(zip(segment.group_views, sketches)):
        b = group.batch
        omega = omegas[group.m].expand(b, *omegas[group.m].shape)
        torch.linalg.vector_norm(mean, dim=(1, 2), out=norms[position: position + b, 0])
        for pieces in factors:
            p, qt = pieces[index]
            mean.sub_(torch.bmm(p, torch.bmm(qt, omega)))
        torch.linalg.vector_norm(mean, dim=(1, 2), out=norms[position: position + b, 1])
        position += b
    return norms


def _keep_global_norms(segment: Segment, sketched: Tensor, finite: Tensor, finiteness: Finiteness) -> None:
    """Store the global-residual norms of a measured step in the segment if the step is finite (chosen
    on the device where ``finiteness`` is :attr:`~Finiteness.ON_DEVICE`); a skipped step keeps the last."""
    if finiteness is Finiteness.NOT_FINITE:
        return
    stored = segment.global_residual_norms()
    if finiteness is Finiteness.FINITE:
        stored.copy_(sketched)
    else:
        _keep_norms(stored, sketched, finite)


def _write_output(matrix: Tensor, pieces: list[tuple[list[Tensor], list[Tensor]]], position: int) -> None:
    """``matrix = sum of P Q^T`` over the pieces' factors at ``position``."""
    for j, (ps, qs) in enumerate(pieces):
        _outer_sum(ps[position], qs[position], matrix, accumulate=j > 0)


def _send(segment: Segment, start: int, end: int, comm: Communicator, wire_dtype: torch.dtype) -> Task:
    """Average ``segment.wire[start:end]`` (a phase: its ends are where P, the uncompressed tensors or Q
    begin or end) over the workers, in place, sending it as ``wire_dtype``.

    The buffer is divided by the world size first, so a sum of W terms is bounded by W times the largest
    term. For an fp16 wire each tensor span of the buffer (each P factor, each uncompressed tensor, each
    Q factor: see :class:`~gradpress.powersgd.memory.WireSpans`) is scaled by its own power of two, the one
    that puts W times its largest |value| over the workers below 2^14 (well inside fp16's 65504, and using
    its precision): no overflow whatever the gradients' magnitude, and a value's scale depends on its own
    tensor only, never on which tensors share its bucket (docs/design.md, "numbers that do not depend on the
    bucket layout"). The maxima travel in one max-allreduce of one float per span before the sum (not
    counted as payload). bf16 has fp32's range and needs no scaling. A fixed number of ops per phase,
    whatever the number of spans.
    """
    buffer = segment.wire[start:end]
    spans = None
    if wire_dtype == torch.float16 and buffer.dtype != torch.float16:
        wire_spans = segment.wire_spans()
        first, last = wire_spans.first[start], wire_spans.first[end]
        lengths = wire_spans.lengths[first:last] if _reading_waits(segment.device) else None
        spans = Spans(list(buffer.split(wire_spans.sizes[first:last])), lengths)
    yield from _mean(buffer, comm, wire_dtype, spans)


#: The exponent floor of the fp16 wire's scales (2^(e - 14) stays a normal fp32 number).
_MIN_EXPONENT = -110


class Spans(NamedTuple):
    """The tensor spans that tile a buffer sent on the fp16 wire: ``views`` of the buffer, and ``lengths``,
    their element counts as an int64 tensor on the buffer's device (``None`` where they are not needed:
    the CPU scales each span with one ``_foreach`` op)."""

    views: list[Tensor]
    lengths: Tensor | None


def _mean(buffer: Tensor, comm: Communicator, wire_dtype: torch.dtype, spans: Spans | None,
          out: Tensor | None = None) -> Task:
    """Average ``buffer`` over the workers, in place, sending it as ``wire_dtype`` (see :func:`_send`) from
    ``out`` if given (a buffer of that dtype and size; default: a fresh one).

    ``spans`` (needed for an fp16 wire from a wider dtype): the tensor spans that tile ``buffer``. Each
    span's largest |value| comes from one ``_foreach_norm`` (inf) for all; its scale is ``2^(e - 14)``
    where ``W * max|span| = f 2^e`` with ``f`` in [0.5, 1) (``frexp``), so the scaled sum stays below
    2^14; an all-zero or non-finite span gets some power of two (a non-finite value stays so). Nothing is
    read on the host and no per-element table is built: on the CPU each span is scaled in place by one
    ``_foreach_mul_`` (0-d scales); elsewhere the scales reach the elements by one ``repeat_interleave``
    on the device (a foreach op over spans of different sizes would issue a kernel per span there).
    """
    if comm.world_size != 1:  # (dividing by 1 is exact: one pass saved)
        buffer.div_(comm.world_size)
    if wire_dtype == buffer.dtype:
        yield comm.allreduce_sum(buffer)
        return
    if wire_dtype != torch.float16:
        wire = buffer.to(wire_dtype) if out is None else out.copy_(buffer)
        yield comm.allreduce_sum(wire)
        buffer.copy_(wire)
        return
    assert spans is not None
    if spans.views:  # nothing is read on the host
        peaks = _peaks(spans)
    else:  # nothing to send (the max-allreduce is still issued, as on every rank)
        peaks = buffer.new_zeros(1, dtype=torch.float32)
    yield comm.allreduce_max(peaks)
    exponent = torch.frexp(peaks.mul_(comm.world_size)).exponent
    scales = torch.exp2(exponent.clamp_(min=_MIN_EXPONENT).sub_(14).to(buffer.dtype))
    scale = None
    if spans.views and spans.lengths is None:
        torch._foreach_mul_(spans.views, list(torch.reciprocal(scales).unbind(0)))  # powers of two: exact
    elif spans.views and spans.lengths is not None:
        scale = torch.repeat_interleave(scales, spans.lengths, output_size=buffer.numel())
        buffer.div_(scale)  # by powers of two: exact
    wire = buffer.to(wire_dtype) if out is None else out.copy_(buffer)
    yield comm.allreduce_sum(wire)
    if scale is not None:
        torch.mul(wire, scale, out=buffer)
    else:
        buffer.copy_(wire)
        if spans.views:
            torch._foreach_mul_(spans.views, list(scales.unbind(0)))


#: On the CPU, spans at least this long on average take their largest |value| from one ``aminmax`` each (a
#: vectorized reduction, ~9x faster there than ``_foreach_norm(inf)``, at one op per span).
_CPU_SPAN_REDUCTIONS = 1 << 16


def _peaks(spans: Spans) -> Tensor:
    """Each span's largest |value| (fp32, NaN where the span has one). One ``_foreach_norm(inf)`` for all
    spans; on the CPU, for spans of gradients (long on average), one ``aminmax`` per span instead: the
    CPU's inf-norm reduction is not vectorized (436 ms against 50 ms on GPT-2 small's 124M gradient
    elements, one thread), and a loop over spans costs there what a foreach op does (a loop too)."""
    views = spans.views
    if spans.lengths is None and sum(v.numel() for v in views) >= _CPU_SPAN_REDUCTIONS * len(views):
        smallest, largest = (torch.stack(ends) for ends in zip(*(torch.aminmax(v) for v in views), strict=True))
        return torch.maximum(largest, smallest.neg_()).float()  # propagates NaN, as the norm does
    return torch.stack(torch._foreach_norm(views, float("inf"))).float()


def _views(segment: Segment, grads: Sequence[Tensor]) -> tuple[list[Tensor], list[Tensor]]:
    """The gradients as the segment's compressed matrices (group order) and uncompressed vectors."""
    plan = segment.plan
    matrices = [grads[i].view(plan.tensors[i].matrix) for i in segment.compressed_order]
    unsent = [grads[i].view(-1) for i in plan.uncompressed]
    return matrices, unsent


def _products(segment: Segment, matrices: list[Tensor], with_memory: bool,
              earlier: list[tuple[list[Tensor], list[Tensor]]], right: bool) -> None:
    """For every shape group: P = R Q (``right``) or Q^T = P^T R, into the wire, where R = M minus the
    ``earlier`` pieces, M = g + e (``with_memory``) or g, built in the workspace and dropped after the
    product. On the CPU, where :func:`_matmul` takes one product per matrix (a group of one, or rank 1),
    R is built one matrix at a time: the workspace is then one matrix, and R is still in cache for the
    product."""
    workspace = segment.workspace
    position = 0
    for group, memory, p, qt in segment.group_views:
        b = group.batch
        one_by_one = segment.device.type == "cpu" and (b == 1 or group.rank == 1)
        for lo, hi in ([(i, i + 1) for i in range(b)] if one_by_one else [(0, b)]):
            operand = workspace.matrices(hi - lo, group.n, group.m, segment.device, segment.dtype)
            _operand(segment, operand, memory[lo:hi], matrices[position + lo: position + hi], with_memory, earlier,
                     position + lo)
            if right:
                _matmul(operand, qt[lo:hi].transpose(1, 2), p[lo:hi])
            else:
                _matmul(p[lo:hi].transpose(1, 2), operand, qt[lo:hi])
        position += b


def _operand(segment: Segment, out: Tensor, memory: Tensor, matrices: list[Tensor], with_memory: bool,
             earlier: list[tuple[list[Tensor], list[Tensor]]], position: int) -> None:
    """``out`` (B, n, m) = ``memory + matrices`` (``with_memory``) or ``matrices``, minus the products of
    the ``earlier`` factors at positions ``position ...``. The same sums, in the same order, as building
    M once in the memory would give."""
    views = out.unbind(0)
    if segment.device.type == "cpu":
        # One pass per matrix (a fused copy then an add take two: on the CPU as costly as a kernel per
        # matrix is not).
        for target, e, g in zip(views, memory.unbind(0), matrices):
            if with_memory:
                torch.add(e, g, out=target)
            else:
                target.copy_(g)
    else:  # a fused copy, then one add for the group
        torch._foreach_copy_(list(views), matrices)
        if with_memory:
            out.add_(memory)
    for ps, qs in earlier:
        for i, target in enumerate(views):
            _outer_sum(ps[position + i], qs[position + i], target, accumulate=True, alpha=-1.0)


def _draw_missing(segment: Segment, config: EngineConfig, draw: int) -> None:
    """Draw the factors a step needs but the memory does not hold (all of Q when warm start is off)."""
    if not config.warm_start:
        segment.factors_to_draw = list(range(len(segment.q_views)))
    if segment.factors_to_draw:
        segment.draw_q(segment.factors_to_draw, config.random_seed, draw,
                       with_p=config.num_iters_per_step is not None)
        segment.factors_to_draw = []


def _matmul(a: Tensor, b: Tensor, out: Tensor) -> None:
    """``out = a @ b`` for a group ``(B, ., .)``: one factor (a view into the wire) times the matrices
    M (or R) built in the workspace.

    On CPU, one ``mm`` per matrix when the group holds one matrix or the product is rank-1 (a
    matrix-vector product, which MKL's batched path handles poorly); otherwise, and on GPUs, one ``bmm``.
    The factor is read from, and the product written through, a fresh (so aligned) copy: where a factor
    sits in the wire depends on the bucket's layout, and BLAS rounds differently at other alignments
    (the workspace's matrices are aligned by :class:`~gradpress.powersgd.memory.Workspace`). The copies
    are the factors' size, not M's.
    """
    if a.numel() <= b.numel():
        a = a.clone()
    else:
        b = b.clone()
    if _per_matrix_product(out):
        for x, y, o in zip(a.unbind(0), b.unbind(0), out.unbind(0)):
            o.copy_(torch.mm(x, y))
    else:
        out.copy_(torch.bmm(a, b))


def _outer_sum(p: Tensor, qt: Tensor, out: Tensor, accumulate: bool = False,
               alpha: float = 1.0) -> None:
    """``out = p @ qt`` (or ``out += alpha * p @ qt`` with ``accumulate``), ``p`` (n, r), ``qt`` (r, m).

    Where :func:`_fused_outer` says so, r fused multiply-adds over the output (elementwise: the same
    numbers wherever the operands sit in memory).
    """
    rank = p.shape[1]
    if _fused_outer(rank, out.numel(), out.device):
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


def _all_finite(tensor: Tensor) -> Tensor:
    """Whether every value of ``tensor`` is finite, as a 0-d bool tensor on its device, nothing read. On the
    CPU from its largest and smallest value (two vectorized reductions, which propagate NaN: 6x faster
    there than ``isfinite(...).all()``, which writes a bool per element)."""
    if tensor.device.type == "cpu" and tensor.numel():
        return torch.isfinite(torch.stack([tensor.amax(), tensor.amin()])).all()
    return torch.isfinite(tensor).all()


def _reading_waits(device: torch.device) -> bool:
    """Whether reading a tensor's value on the host waits for ``device``: everywhere but on the CPU,
    whose ops have finished when they return (so a read there costs nothing and syncs nothing)."""
    return device.type != "cpu"

"""The PowerSGD schedules: one step on a segment, as a task that yields after starting each collective.

Vogels, Karimireddy & Jaggi, "PowerSGD: Practical Low-Rank Gradient Compression for Distributed
Optimization", NeurIPS 2019, Algorithm 1 (one power iteration, warm start) with error feedback (Alg. 2),
and the reference aggregator's multi-iteration scheme (github.com/epfml/powersgd). Each schedule is its
phases in order; the batched kernels are :mod:`~gradpress.powersgd.kernels`, the wire
:mod:`~gradpress.powersgd.wire`, the commit :mod:`~gradpress.powersgd.commit`, the diagnostics a
:class:`~gradpress.powersgd.probe.Probe`, and what runs how on a device its
:mod:`~gradpress.powersgd.backend`.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from .backend import backend_for
from .commit import Feedback, StepCommit, commit_pieces
from .config import EngineConfig
from .kernels import GroupPieces, build_m, first_products, left_products, rescale_warm_start_, right_products
from .linalg import orthogonalize_groups_
from .memory import Finiteness, Segment, StagedFactors
from .pipeline import Task
from .probe import NO_PROBE, Probe
from .seeding import upload
from .transport import Communicator
from .wire import WireCodec, span_views, wire_codec

__all__ = ["StartedStep", "StepCommit", "alternating_step", "average_step", "compress_step", "finish_power_steps",
           "power_step", "step_options", "step_wire_dtype"]


def power_step(segment: Segment, grads: Sequence[Tensor], comm: Communicator, config: EngineConfig, step: int, *,
               commit: StepCommit | None = None, add_memory: bool = True, damping: float | None = None,
               probe: Probe = NO_PROBE) -> Task:
    """Replace ``grads`` (the segment's tensors, in plan order) by their PowerSGD-compressed mean.

    Every rank must run it with the same plan; it must be resumed only once the collective it yielded is
    complete (:mod:`gradpress.powersgd.pipeline`). For the compressed matrices, one op per shape group:
      1. M = g + e, once, in the segment's M buffer (``e`` and ``g`` stay as they are until the commit);
      2. P = M Q, with Q the warm start (rescaled by a power of two: exact) or a fresh seeded draw;
      3. allreduce ``[P | uncompressed]`` (mean; one collective);
      4. orthogonalize every P, then Q^T = P^T M;
      5. allreduce Q (mean);
      6. at the commit (``commit``, or at the end of this task without one): g <- P Q^T, and only if the
         step is finite e <- M - P Q^T, Q kept.

    Mutates ``grads`` (the uncompressed tensors at step 3, the compressed ones at the commit) and the
    segment's buffers. ``step`` numbers fresh Q draws when warm start is off. ``add_memory=False``: M = g,
    and e' = e + (M - PQ^T) (feedback deferred); ``damping``: the residual M - PQ^T is multiplied by it
    first (warm-up). ``probe``: what the step records beside its output. Non-finite gradients give
    non-finite outputs (so an AMP GradScaler skips the step) and leave the memory and the factors as they
    were.
    """
    started = StartedStep(segment, grads, config, step, add_memory=add_memory, damping=damping, probe=probe)
    yield from started.send_p(comm)
    yield from finish_power_steps([started], comm, config, commit)


class StartedStep:
    """A classic step on one segment, split where its P all-reduce is in flight: :meth:`send_p` runs
    phases 1-3 of :func:`power_step` (M, P = M Q, the all-reduce of ``[P | uncompressed]``), and
    :func:`finish_power_steps` the rest, for one started step or for several at once (a DDP hook that issues
    each bucket's P as the bucket arrives, and the rest of every bucket's step at the last one)."""

    __slots__ = ("segment", "matrices", "unsent", "feedback", "probe", "codec", "_warm_start")

    def __init__(self, segment: Segment, grads: Sequence[Tensor], config: EngineConfig, step: int, *,
                 add_memory: bool = True, damping: float | None = None, probe: Probe = NO_PROBE) -> None:
        self.segment = segment
        self.feedback = Feedback(config.use_error_feedback, add_memory, damping)
        self.probe = probe
        self.codec = wire_codec(step_wire_dtype(segment, grads, config), segment.dtype)
        self.matrices, self.unsent = segment.gradient_views(grads)
        _draw_missing(segment, config, 0 if config.warm_start else step + 1)
        segment.stage(StagedFactors.Q if config.warm_start else StagedFactors.NOTHING)
        self._warm_start = config.warm_start

    def send_p(self, comm: Communicator) -> Task:
        """Phases 1-3: M = g + e, P = M Q, and the mean of ``[P | uncompressed]`` (one collective)."""
        segment = self.segment
        build_m(segment, self.matrices, self.feedback.error_feedback and self.feedback.add_memory)
        if self._warm_start:
            rescale_warm_start_(segment)
        first_products(segment)
        _copy_unsent_in(segment, self.unsent)
        yield from _send(segment, self.codec, 0, segment.layout.unsent_end, comm)
        _copy_unsent_out(segment, self.unsent)


def finish_power_steps(started: Sequence[StartedStep], comm: Communicator, config: EngineConfig,
                       commit: StepCommit | None = None) -> Task:
    """Phases 4-6 of :func:`power_step` for ``started`` steps whose P all-reduce has completed: every P of
    every segment orthogonalized together (one call; batched by rank across segments), each segment's
    Q^T = P^T M, one all-reduce of every segment's Q (from one buffer when there are several: a copy in and
    out, two ops), each probe's sketch, and their commits (``commit``, or at the end of this task)."""
    ps = [p for part in started for _, _, p, _ in part.segment.group_views]
    if ps:
        orthogonalize_groups_(ps, config.orthogonalization_epsilon, config.orthogonalization)
        for part in started:
            segment = part.segment
            left_products(segment, [p for _, _, p, _ in segment.group_views],
                          [qt for _, _, _, qt in segment.group_views])
        yield from _send_q(started, comm)
    for part in started:
        yield from part.probe.sketch(part.segment, [part.segment.wire], comm)
    joint = StepCommit() if commit is None and len(started) > 1 else commit
    for part in started:
        segment = part.segment
        _join(segment, joint, part.matrices, [segment.factor_group_views(segment.wire)], [], config, part.feedback,
              part.probe)
    if joint is not None and commit is None:
        joint.apply()


def _send_q(started: Sequence[StartedStep], comm: Communicator) -> Task:
    """The mean of every started step's Q region: the segment's own wire for one, else one buffer of all
    (the same wire dtype for all: one DDP dtype group)."""
    with_q = [part for part in started if part.segment.q.numel()]
    if len(with_q) == 1:
        segment = with_q[0].segment
        yield from _send(segment, with_q[0].codec, segment.layout.q_start, segment.layout.numel, comm)
        return
    if not with_q:
        return
    codecs = {(type(part.codec), part.codec.dtype) for part in with_q}
    if len(codecs) != 1:
        raise ValueError(f"started steps of one Q all-reduce send different wires: {sorted(map(str, codecs))}")
    regions = [part.segment.q for part in with_q]
    buffer = torch.cat(regions)
    spans = None
    if with_q[0].codec.needs_spans:
        sizes, lengths = [], []
        for part in with_q:
            wire_spans = part.segment.wire_spans()
            first = wire_spans.first[part.segment.layout.q_start]
            sizes += wire_spans.sizes[first:]
            lengths.append(wire_spans.q_lengths)
        spans = span_views(buffer, sizes, torch.cat(lengths))
    yield from with_q[0].codec.mean(buffer, comm, spans)
    torch._foreach_copy_(regions, list(buffer.split([region.numel() for region in regions])))


def alternating_step(segment: Segment, grads: Sequence[Tensor], comm: Communicator, config: EngineConfig,
                     first_iteration: int, *, commit: StepCommit | None = None, add_memory: bool = True,
                     damping: float | None = None, probe: Probe = NO_PROBE) -> Task:
    """Multi-iteration PowerSGD: ``config.num_iters_per_step`` one-sided iterations, one collective each.

    As in the PowerSGD authors' reference aggregator: iteration ``i`` (counted across steps, from
    ``first_iteration``) multiplies the residual R (initially M = g + e) from the right if ``i`` is even
    and from the left if odd, with the *other* factor of the previous iteration, orthonormalized:

      * even: P = R Q̂, allreduce P (mean), piece = P Q̂^T;
      * odd:  Q = R^T P̂, allreduce Q (mean), piece = P̂ Q^T;

    then R <- R - piece (never built: R's products are M's minus ``(r, r)`` corrections by the earlier
    pieces, :func:`~gradpress.powersgd.kernels.right_products`), and the output is the sum of the pieces.
    So one step's approximation has rank up to ``k r`` while each collective carries one rank-r factor:
    one iteration per step sends half of classic PowerSGD's bytes, two the same with an error
    ``(I - P̂P̂^T) M (I - Q̂Q̂^T)`` never larger than classic's ``(I - P̂P̂^T) M``. The residual left is
    the new error memory and P and Q the new warm start, committed as in :func:`power_step`. The pieces
    are the same on every rank (their factors are means), so ``g + e = output + e'`` holds on each rank.
    The uncompressed tensors travel with the first iteration's factor (``[P | uncompressed]`` or
    ``[uncompressed | Q]``, contiguous in the wire). Batched as the classic step: a fixed number of ops per
    shape group and iteration.
    """
    iterations = config.num_iters_per_step
    assert iterations is not None
    feedback = Feedback(config.use_error_feedback, add_memory, damping)
    codec = wire_codec(step_wire_dtype(segment, grads, config), segment.dtype)
    matrices, unsent = segment.gradient_views(grads)
    layout = segment.layout
    _draw_missing(segment, config, 0)
    segment.stage(StagedFactors.P_AND_Q)
    build_m(segment, matrices, feedback.error_feedback and feedback.add_memory)
    ps = [p for _, _, p, _ in segment.group_views]
    qts = [qt for _, _, _, qt in segment.group_views]
    earlier: list[GroupPieces] = []  # the pieces' factors, in copies of the wire
    copies: list[Tensor] = []
    for it in range(iterations):
        right = (first_iteration + it) % 2 == 0  # multiply from the right: P = R Q̂
        if ps:
            orthogonalize_groups_([qt.transpose(1, 2) for qt in qts] if right else ps,
                                  config.orthogonalization_epsilon, config.orthogonalization)
        if right:
            right_products(segment, qts, ps, earlier)
            start, end = 0, layout.p_numel
        else:
            left_products(segment, ps, qts, earlier)
            start, end = layout.q_start, layout.numel
        if it == 0 and unsent:
            _copy_unsent_in(segment, unsent)
            start, end = (0, layout.unsent_end) if right else (layout.p_numel, layout.numel)
        if end > start:
            yield from _send(segment, codec, start, end, comm)
        if it == 0:
            _copy_unsent_out(segment, unsent)
        if not ps:
            break
        if it < iterations - 1:
            copies.append(segment.wire.clone())
            earlier.append(segment.factor_group_views(copies[-1]))
    yield from probe.sketch(segment, [*copies, segment.wire], comm)
    pieces = [*earlier, segment.factor_group_views(segment.wire)] if ps else []
    _join(segment, commit, matrices, pieces, copies, config, feedback, probe)


def compress_step(segment: Segment, grads: Sequence[Tensor], comm: Communicator, config: EngineConfig,
                  compressed_step: int, commit: StepCommit | None = None, *,
                  measure: bool = False, track: bool = False, global_residual: bool = False) -> tuple[Task, int]:
    """The engine's entry point: the task for step number ``compressed_step`` (0 for the first
    compressed step) of the configured scheme, and the number of elements it will send.

    ``commit``: the :class:`StepCommit` of the optimizer step this task is part of (the caller applies
    it once every task of the step has finished); ``None``: the task commits its own segment.
    ``measure``, ``global_residual``, ``track``: what the step's :class:`~gradpress.powersgd.probe.Probe`
    records (approximation norms, free; the global residual, one more all-reduce of a sketch at the end
    of the task, not counted in the number of elements returned, issued in the same order on every rank;
    the adaptive rank's signal).

    A step that is not finite still counts: the caller's counter (hence ``compressed_step``, which picks
    the side the alternating scheme sends first, the fresh draw without warm start, and the warm-up and
    ``feedback_every_n_iters`` windows) advances on every rank alike, which needs no host sync. A run
    that leaves such a step out matches one that ran it exactly when it advances its counter in its
    place (``PowerSGDState.update_state()``).
    """
    k = config.num_iters_per_step
    add_memory, damping, probe = step_options(config, compressed_step, measure, track, global_residual)
    if k is None:
        task = power_step(segment, grads, comm, config, compressed_step, commit=commit, add_memory=add_memory,
                          damping=damping, probe=probe)
        return task, segment.plan.numel_sent
    first = compressed_step * k
    task = alternating_step(segment, grads, comm, config, first, commit=commit, add_memory=add_memory,
                            damping=damping, probe=probe)
    return task, segment.plan.numel_sent_per_step(k, first)


def step_options(config: EngineConfig, compressed_step: int, measure: bool = False, track: bool = False,
                 global_residual: bool = False) -> tuple[bool, float | None, Probe]:
    """What compressed step number ``compressed_step`` does besides the scheme: whether M includes the
    memory (``feedback_every_n_iters``), the warm-up's damping (``None``: none), and its probe."""
    add_memory = (compressed_step + 1) % config.feedback_every_n_iters == 0
    damping = config.warm_up_beta_factor \
        if config.warm_up_beta_factor is not None and compressed_step < config.warm_up_steps else None
    probe = NO_PROBE
    if measure or track or global_residual:
        probe = Probe(measure, track, global_residual, seed=config.random_seed, draw=compressed_step)
    return add_memory, damping, probe


def step_wire_dtype(segment: Segment, grads: Sequence[Tensor], config: EngineConfig) -> torch.dtype:
    """The dtype the steps of ``segment`` send for ``grads`` (``config.bytes_per_weight``'s wire for the
    gradients' dtype; the working dtype when there is nothing to send)."""
    return config.wire_dtype(grads[0].dtype, segment.dtype) if grads else segment.dtype


def average_step(tensors: Sequence[Tensor], comm: Communicator, commit: StepCommit | None = None,
                 wire_dtype: torch.dtype | None = None, *, flat: Tensor | None = None,
                 lengths: Tensor | None = None, out: Tensor | None = None) -> Task:
    """Replace ``tensors`` (one device and dtype) by their exact mean over the workers, in one collective
    (the iterations before compression starts, and tensors no plan compresses), as a task.

    ``wire_dtype``: what is sent (default: the tensors' dtype), by its codec
    (:func:`~gradpress.powersgd.wire.wire_codec`): an fp16 wire from a wider dtype scales each tensor by its
    own power of two, agreed on by a max-allreduce of one float per tensor, so that the sum cannot
    overflow; bf16 is a plain cast. Adds whether the means are finite (identical on every rank) to
    ``commit``; ``None``: the task commits alone. Nothing else is written: there is no memory.

    ``flat``: a contiguous buffer the tensors are views of, back to back (a DDP bucket's): it is sent as
    it is, and each tensor still gets its own fp16 scale. ``lengths``: the tensors' non-zero element
    counts as an int64 tensor on their device, used where the backend scales through span tables (built
    and uploaded here if not given; a caller that sends the same layout every step keeps it). ``out``: a
    buffer of ``flat``'s size and the wire's dtype to send from (default: a fresh one).
    """
    own = commit is None
    if commit is None:
        commit = StepCommit()
    dtype = tensors[0].dtype
    codec = wire_codec(dtype if wire_dtype is None else wire_dtype, dtype)
    device = tensors[0].device
    backend = backend_for(device)
    if comm.world_size == 1 and codec.dtype == dtype:  # the mean of one worker: nothing to send
        commit.add(backend.all_finite(flat) if flat is not None
                   else torch.stack([backend.all_finite(t) for t in tensors]).all())
    else:
        alone = flat is not None or (len(tensors) == 1 and tensors[0].is_contiguous())
        if flat is None:
            flat = tensors[0].view(-1) if alone else torch.cat([t.reshape(-1) for t in tensors])
        spans = None
        if codec.needs_spans:
            sizes = [t.numel() for t in tensors if t.numel()]
            if backend.span_tables and lengths is None:
                lengths = upload(torch.tensor(sizes, dtype=torch.int64), device)
            spans = span_views(flat, sizes, lengths)
        yield from codec.mean(flat, comm, spans, out)
        if not alone:
            torch._foreach_copy_([t.view(-1) for t in tensors], list(flat.split([t.numel() for t in tensors])))
        commit.add(backend.all_finite(flat))
    if own:
        commit.apply()


# --- the phases' plumbing ----------------------------------------------------------------------------

def _send(segment: Segment, codec: WireCodec, start: int, end: int, comm: Communicator) -> Task:
    """Average ``segment.wire[start:end]`` (a phase: its ends are where the P region, the uncompressed
    tensors or the Q region begin or end) over the workers, in place, by ``codec``, with the wire's tensor
    spans where the codec needs them (each P, each uncompressed tensor, each Q: its own fp16 scale)."""
    spans = None
    if codec.needs_spans:
        wire_spans = segment.wire_spans()
        first, last = wire_spans.first[start], wire_spans.first[end]
        spans = span_views(segment.wire[start:end], wire_spans.sizes[first:last], wire_spans.lengths[first:last])
    yield from codec.mean(segment.wire[start:end], comm, spans)


def _copy_unsent_in(segment: Segment, unsent: list[Tensor]) -> None:
    """The uncompressed tensors into the wire (they travel with the first phase)."""
    if unsent:
        torch._foreach_copy_(list(segment.unsent.split([t.numel() for t in unsent])), unsent)


def _copy_unsent_out(segment: Segment, unsent: list[Tensor]) -> None:
    """The uncompressed tensors' means back into them."""
    if unsent:
        torch._foreach_copy_(unsent, list(segment.unsent.split([t.numel() for t in unsent])))


def _draw_missing(segment: Segment, config: EngineConfig, draw: int) -> None:
    """Draw the factors a step needs but the memory does not hold (all of Q when warm start is off)."""
    if not config.warm_start:
        segment.factors_to_draw = list(range(len(segment.q_views)))
    if segment.factors_to_draw:
        segment.draw_q(segment.factors_to_draw, config.random_seed, draw,
                       with_p=config.num_iters_per_step is not None)
        segment.factors_to_draw = []


def _join(segment: Segment, commit: StepCommit | None, matrices: list[Tensor], pieces: Sequence[GroupPieces],
          copies: list[Tensor], config: EngineConfig, feedback: Feedback, probe: Probe) -> None:
    """Add the segment's all-finite flag (over everything it averaged, ``copies`` of earlier iterations'
    factors included: identical on every rank) and its commit to ``commit``; commit at once without one."""
    own = commit is None
    if commit is None:
        commit = StepCommit()
    backend = segment.backend
    finite = backend.all_finite(segment.wire)
    for wire in copies:
        finite = finite & backend.all_finite(wire)

    def finish(step_finite: Tensor, finiteness: Finiteness) -> None:
        commit_pieces(segment, matrices, pieces, feedback, step_finite, finiteness, probe)
        segment.restore_factors(step_finite.to(segment.device), finiteness)

    commit.add(finite, finish)
    if own:
        commit.apply()

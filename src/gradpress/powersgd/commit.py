"""The commit of a step: write its output into the gradients and, only if the step is finite, its new
error memory and factors; one optimizer step's segments together (docs/design.md, "non-finite steps").

:class:`StepCommit` gathers the segments of one optimizer step and commits them once all have finished.
:func:`commit_pieces` is one segment's commit, for either scheme (its output is the sum of its
*pieces*, the ``P Q^T`` terms: one for classic PowerSGD, one per iteration for the alternating scheme),
made of three named ways to write the output and keep the residual:

* :func:`_through_memory`: the step is known finite and M includes the memory (the common case on the
  CPU): the output is built in the old error memory (M holds it already), written out, and subtracted
  from M, which becomes the error memory (:meth:`Segment.swap_memory`): three passes, no copy; groups
  whose outer product the CPU fuses go straight into the gradients (:func:`_direct_groups`): two passes,
  the same bits;
* :func:`_into_m`: no memory is kept (no error feedback, or a step known not finite): the output is
  built in M and written out;
* :func:`_through_workspace`: everything else (the device, where finiteness is decided there; a
  measured step without memory; deferred feedback): each group's output is built in the shared
  workspace, written out and subtracted from M; the new memory is then kept, dropped, or chosen with
  one ``torch.where`` over the whole buffer.

With fp16/bf16 gradients the written output is read back first, so the residual is taken against what
was applied.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from .backend import backend_for
from .kernels import GroupPieces, outer, outer_sum
from .memory import Finiteness, Segment
from .probe import Probe

__all__ = ["Feedback", "StepCommit", "commit_pieces"]


class StepCommit:
    """The segments of one step, committed together once all of them have finished.

    Until its commit a step writes nothing that a later step reads: the error memory stays as it is
    (M = g + e is built in the segment's M buffer), the warm-start factors it overwrites are saved first,
    and the gradients of the compressed matrices still hold g. The commit then writes, per segment, the
    output into the gradients and, if the step is *finite*, the new error memory; if it is not, the error
    memory and the warm-start factors of every segment, on every rank, stay bitwise as they were before the
    step, while the outputs are non-finite, so an AMP ``GradScaler`` skips the step on every rank.

    A step is finite when every value its segments averaged (factors and uncompressed tensors, after
    the collectives, hence identical on every rank) is finite. One commit spans what one optimizer step
    consumes: all buckets of a DDP backward pass, all (device, dtype) groups of an aggregator call.
    Used alone (``commit=None`` in a schedule), a step commits itself when it ends. The callers' step
    counters still advance on a step that is not finite.
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

    def __len__(self) -> int:
        """How many flags the step in progress has added (0: nothing to commit)."""
        return len(self._flags)

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
        if any(backend_for(f.device).reads_wait for f in flags):
            finiteness = Finiteness.ON_DEVICE
        else:
            finiteness = Finiteness.FINITE if bool(finite) else Finiteness.NOT_FINITE
        for finish in finishes:
            finish(finite, finiteness)
        return finite


@dataclass(frozen=True)
class Feedback:
    """How a step's residual becomes the next error memory. ``error_feedback``: keep one at all;
    ``add_memory``: M included the memory (e' = M - output), else the feedback was deferred
    (e' = e + (g - output)); ``damping``: the residual is multiplied by it first (``None``: 1)."""

    error_feedback: bool = True
    add_memory: bool = True
    damping: float | None = None


def commit_pieces(segment: Segment, matrices: list[Tensor], pieces: Sequence[GroupPieces], feedback: Feedback,
                  finite: Tensor, finiteness: Finiteness, probe: Probe) -> None:
    """One segment's commit (see the module docstring): write ``sum_j P_j Q_j^T`` (``pieces``: per piece, per
    shape group its P and Q^T) into ``matrices`` (the compressed gradients, group order, as compressed),
    and, if the step is finite, the new error memory; ``probe`` records what it asks for. M (built by the
    step) is in ``segment.m_memory``."""
    if not segment.group_views:
        return
    by_group = [[piece[index] for piece in pieces] for index in range(len(segment.group_views))]
    probe.begin(segment, finiteness)
    new_memory = feedback.error_feedback and finiteness is not Finiteness.NOT_FINITE
    if new_memory and feedback.add_memory and finiteness is Finiteness.FINITE:
        _through_memory(segment, matrices, by_group, feedback, probe)
    elif not new_memory and not probe.measuring:
        _into_m(segment, matrices, by_group, probe)
    else:
        _through_workspace(segment, matrices, by_group, feedback, new_memory, finite, finiteness, probe)
    probe.end(segment, finite, finiteness)


def _rounded(segment: Segment, matrices: list[Tensor]) -> bool:
    """Whether the gradients are of another dtype than the memory (fp16/bf16): the written output is read back."""
    return bool(matrices) and matrices[0].dtype != segment.dtype


def _through_memory(segment: Segment, matrices: list[Tensor], by_group: list[list[tuple[Tensor, Tensor]]],
                    feedback: Feedback, probe: Probe) -> None:
    """The step is finite and M = g + e: the output in the old error memory (or straight into the
    gradients), M minus it becomes the memory (:meth:`Segment.swap_memory`)."""
    backend, m_groups = segment.backend, segment.m_group_views
    assert segment.m_memory is not None
    probe.record_m(m_groups, 0)
    error_groups = [errors for _, errors, _, _ in segment.group_views]
    rounded = _rounded(segment, matrices)
    direct = _direct_groups(segment, by_group, matrices, rounded or probe.wants_outputs)
    if not any(direct):
        for pieces, errors in zip(by_group, error_groups):
            outer(backend, pieces, errors)
        torch._foreach_copy_(matrices, segment.error_views)
        if rounded:
            torch._foreach_copy_(segment.error_views, matrices)
        probe.record_outputs(error_groups)
        segment.m_memory.sub_(segment.error_memory)
    else:  # the CPU: fused outer products written straight into the gradients, one pass fewer each
        position = 0
        for (group, _, _, _), pieces, m, errors, straight in zip(segment.group_views, by_group, m_groups,
                                                                 error_groups, direct):
            members = matrices[position: position + group.batch]
            if straight:
                for i, member in enumerate(members):
                    for j, (p, qt) in enumerate(pieces):
                        outer_sum(p[i], qt[i], member, accumulate=j > 0)
                torch._foreach_sub_(list(m.unbind(0)), members)
            else:
                outer(backend, pieces, errors)
                torch._foreach_copy_(members, list(errors.unbind(0)))
                m.sub_(errors)
            position += group.batch
    probe.record_m(m_groups, 1)
    if feedback.damping is not None:
        segment.m_memory.mul_(feedback.damping)
    segment.swap_memory()


def _into_m(segment: Segment, matrices: list[Tensor], by_group: list[list[tuple[Tensor, Tensor]]],
            probe: Probe) -> None:
    """No memory is kept: the output is built in M and written out."""
    for pieces, m in zip(by_group, segment.m_group_views):
        outer(segment.backend, pieces, m)
    torch._foreach_copy_(matrices, segment.m_views)
    probe.record_outputs(segment.m_group_views)


def _through_workspace(segment: Segment, matrices: list[Tensor], by_group: list[list[tuple[Tensor, Tensor]]],
                       feedback: Feedback, new_memory: bool, finite: Tensor, finiteness: Finiteness,
                       probe: Probe) -> None:
    """Each group's output in the workspace, written out and subtracted from M; then the new memory is kept
    (finite), or chosen with ``torch.where`` on the device (:attr:`~Finiteness.ON_DEVICE`)."""
    backend, m_groups = segment.backend, segment.m_group_views
    flat_m = segment.m_memory
    assert flat_m is not None
    rounded = _rounded(segment, matrices)
    probe.record_m(m_groups, 0)
    position = 0
    for (group, _, _, _), pieces, m in zip(segment.group_views, by_group, m_groups):
        b = group.batch
        output = segment.workspace.matrices(b, group.n, group.m, segment.device, segment.dtype)
        outer(backend, pieces, output)
        members = matrices[position: position + b]
        torch._foreach_copy_(members, list(output.unbind(0)))
        if rounded:
            torch._foreach_copy_(list(output.unbind(0)), members)
        probe.record_output(position, output)
        m.sub_(output)
        position += b
    probe.record_m(m_groups, 1)
    if not new_memory:
        return
    if feedback.damping is not None:
        flat_m.mul_(feedback.damping)
    if not feedback.add_memory:
        flat_m.add_(segment.error_memory)
    if finiteness is Finiteness.FINITE:
        segment.swap_memory()
    else:
        torch.where(finite.to(segment.device), flat_m, segment.error_memory, out=segment.error_memory)


def _direct_groups(segment: Segment, by_group: list[list[tuple[Tensor, Tensor]]], matrices: list[Tensor],
                   excluded: bool) -> list[bool]:
    """Per shape group, whether the commit writes the output straight into the gradients (and takes the
    residual against them) instead of building it in the old error memory and copying it out: where the
    backend fuses the group's outer products (elementwise: the same numbers wherever the output sits) into
    contiguous gradients of the segment's dtype; never where ``excluded`` (fp16/bf16 gradients, or output
    norms to keep)."""
    if excluded or not matrices:
        return [False] * len(by_group)
    direct, position = [], 0
    for (group, _, _, _), pieces in zip(segment.group_views, by_group):
        members = matrices[position: position + group.batch]
        direct.append(segment.backend.fused_outer(pieces[0][0].shape[2], group.n * group.m)
                      and all(g.is_contiguous() for g in members))
        position += group.batch
    return direct

"""What a step records beside its output: one :class:`Probe` per step (docs/design.md, "Diagnostics").

* ``measure``: ``||M||`` and ``||M - P Q^T||`` of every compressed matrix, from what the commit holds
  anyway (:meth:`Segment.approximation_norms <gradpress.powersgd.memory.Segment.approximation_norms>`);
* ``global_residual``: the same against the workers' mean of M, sketched (one more all-reduce, of
  ``M Omega``, as the step's last phase: :meth:`Probe.sketch`);
* ``track``: ``||P Q^T||`` added to the adaptive rank's signal (:meth:`Segment.output_signals
  <gradpress.powersgd.memory.Segment.output_signals>`).

All on the device, nothing read on the host; a step that is not finite leaves every record as it was
(written in place where the step is known finite, chosen with ``torch.where`` where that is decided on
the device). The schedules never test these flags: they hand the probe to the commit and to
:meth:`Probe.sketch`.
"""

from __future__ import annotations

from collections.abc import Generator, Sequence

import torch
from torch import Tensor

from .memory import Finiteness, Segment
from .seeding import seeded_sketch, upload
from .transport import Communicator, Handle

__all__ = ["NO_PROBE", "Probe"]


class Probe:
    """The diagnostics one step records (see the module docstring). ``seed``, ``draw``: the sketch's
    draw (the configuration's seed and the compressed step number), the same on every rank.

    Between :meth:`begin` and :meth:`end` (one commit) it holds that commit's fresh records; a probe
    serves one step at a time.
    """

    __slots__ = ("measure", "track", "global_residual", "seed", "draw", "_norms", "_fresh", "_outputs",
                 "_sketched")

    def __init__(self, measure: bool = False, track: bool = False, global_residual: bool = False, *,
                 seed: int = 0, draw: int = 0) -> None:
        self.measure, self.track, self.global_residual = measure, track, global_residual
        self.seed, self.draw = seed, draw
        self._norms: Tensor | None = None
        self._fresh: Tensor | None = None
        self._outputs: Tensor | None = None
        self._sketched: Tensor | None = None

    # --- the sketch phase ------------------------------------------------------------------------------
    def sketch(self, segment: Segment, wires: Sequence[Tensor], comm: Communicator) -> Generator[Handle, None, None]:
        """With ``global_residual``: the step's last phase, one all-reduce of ``[S / W]`` with
        ``S_i = M_i Omega`` (``(n, k)``, k <= 16, Omega :func:`~gradpress.powersgd.seeding.seeded_sketch` of
        ``(seed, m, draw)``, drawn on the CPU and moved once per column count), M as the step compressed it
        (the segment's M buffer); then per shape group ``||mean S||`` and ``||mean S - sum_pieces P (Q^T
        Omega)||``, where ``wires`` hold the pieces' factors (the segment's wire, after copies of earlier
        iterations'): exactly the ``P Q^T`` every rank applies. Kept at the commit if the step is finite.
        A diagnostic: not counted in the bytes a step sends. Without ``global_residual``: nothing."""
        if not self.global_residual or not segment.group_views:
            return
        device, dtype, backend = segment.device, segment.dtype, segment.backend
        omegas: dict[int, Tensor] = {}
        for group, _, _, _ in segment.group_views:
            if group.m not in omegas:
                omegas[group.m] = upload(seeded_sketch(group.m, self.seed, self.draw).to(dtype), device)
        sizes = [group.batch * group.n * omegas[group.m].shape[1] for group, _, _, _ in segment.group_views]
        sketch = torch.empty(sum(sizes), device=device, dtype=dtype)
        sketches = [view.view(group.batch, group.n, -1)
                    for (group, _, _, _), view in zip(segment.group_views, sketch.split(sizes))]
        for (group, _, _, _), m, out in zip(segment.group_views, segment.m_group_views, sketches):
            backend.product(m, omegas[group.m].expand(group.batch, *omegas[group.m].shape), out)
        sketch.div_(comm.world_size)
        yield comm.allreduce_sum(sketch)
        norms = torch.empty(len(segment.error_views), 2, device=device, dtype=dtype)
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
        self._sketched = norms

    # --- the commit's records --------------------------------------------------------------------------
    def begin(self, segment: Segment, finiteness: Finiteness) -> None:
        """Start a commit: where its norms go (in place where the step is known finite, a fresh tensor
        where that is decided on the device; nothing where it is known not finite)."""
        recording = finiteness is not Finiteness.NOT_FINITE
        self._norms = segment.approximation_norms() if self.measure and recording else None
        self._fresh = None if self._norms is None else \
            (self._norms if finiteness is Finiteness.FINITE else torch.empty_like(self._norms))
        self._outputs = torch.empty(len(segment.error_views), device=segment.device, dtype=segment.dtype) \
            if self.track and recording else None

    @property
    def wants_outputs(self) -> bool:
        """Whether this commit records the outputs' norms (adaptive rank)."""
        return self._outputs is not None

    @property
    def measuring(self) -> bool:
        """Whether this commit records ``||M||`` and ``||M - P Q^T||``."""
        return self._fresh is not None

    def record_m(self, groups: Sequence[Tensor], column: int) -> None:
        """Norms of the shape groups' ``(B, n, m)`` M (``column=0``) or residual (``column=1``)."""
        if self._fresh is not None:
            _group_norms(groups, self._fresh[:, column])

    def record_outputs(self, groups: Sequence[Tensor]) -> None:
        """Norms of the shape groups' ``(B, n, m)`` outputs, as written."""
        if self._outputs is not None:
            _group_norms(groups, self._outputs)

    def record_output(self, position: int, output: Tensor) -> None:
        """Norms of one group's ``(B, n, m)`` output, its first matrix at compressed position ``position``."""
        if self._outputs is not None:
            torch.linalg.vector_norm(output, dim=(1, 2), out=self._outputs[position: position + output.shape[0]])

    def end(self, segment: Segment, finite: Tensor, finiteness: Finiteness) -> None:
        """End the commit: keep what it recorded if the step is finite."""
        if self._norms is not None and self._fresh is not None and self._fresh is not self._norms:
            torch.where(finite.to(self._norms.device), self._fresh, self._norms, out=self._norms)
        if self._outputs is not None:
            signals = segment.output_signals()
            if finiteness is Finiteness.FINITE:
                signals.add_(self._outputs)
            else:
                signals.add_(torch.where(finite.to(segment.device), self._outputs, torch.zeros_like(self._outputs)))
        if self._sketched is not None and finiteness is not Finiteness.NOT_FINITE:
            stored = segment.global_residual_norms()
            if finiteness is Finiteness.FINITE:
                stored.copy_(self._sketched)
            else:
                torch.where(finite.to(stored.device), self._sketched, stored, out=stored)
        self._norms = self._fresh = self._outputs = self._sketched = None


def _group_norms(groups: Sequence[Tensor], out: Tensor) -> None:
    """``||matrix||`` of every matrix of the ``(B, n, m)`` groups, group by group, into ``out`` (group order)."""
    position = 0
    for group in groups:
        torch.linalg.vector_norm(group, dim=(1, 2), out=out[position: position + group.shape[0]])
        position += group.shape[0]


#: The probe of a step that records nothing.
NO_PROBE = Probe()

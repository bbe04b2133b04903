"""PowerSGD state: error memory and warm-start factors, per segment for speed, per parameter for checkpoints.

While training, a :class:`Segment` holds the memory of one bucket in flat buffers laid out by its
:class:`~gradpress.powersgd.plan.Plan` (one ``bmm`` per shape group; where each matrix lives:
:mod:`gradpress.powersgd.layout`). Checkpoints and layout changes go through :class:`ParamMemory` (the pool
of :class:`~gradpress.powersgd.store.SegmentStore`), keyed by a stable per-parameter key, so state survives
DDP rebuilding its buckets (which it does after the first iteration of every process: a state keyed by
bucket index, as PyTorch's is, gets applied to the wrong parameters after a resume). ParamMemory keeps
PyTorch's orientation (error ``(n, m)``, ``q`` ``(m, r)``, ``p`` ``(n, r)``) whatever side the engine
compresses a matrix from.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from .backend import Backend, backend_for
from .config import EngineConfig
from .layout import ALIGNMENT_BYTES, WireLayout, WireSpans, Workspace, aligned_offset, aligned_stride, batch_view
from .plan import GroupPlan, Plan
from .seeding import P_DRAW, seeded_normal, upload

__all__ = ["ALIGNMENT_BYTES", "Finiteness", "ParamMemory", "Segment", "StagedFactors", "WireSpans", "Workspace",
           "work_dtype_for"]


class StagedFactors(enum.Enum):
    """Which warm-start factors a segment saved for the step in flight (:meth:`Segment.stage`), hence
    which :meth:`Segment.restore_factors` puts back if the step is not finite."""

    #: Nothing saved: no step is in flight, or no factor is memory (warm start off: the next step draws
    #: fresh factors anyway), so there is nothing to put back.
    NOTHING = enum.auto()
    #: The warm-start Q (classic PowerSGD with warm start).
    Q = enum.auto()
    #: P and Q (the alternating scheme, where P is memory too).
    P_AND_Q = enum.auto()


class Finiteness(enum.Enum):
    """What the host knows, when a step is committed, of the step's all-finite flag (a 0-d bool tensor,
    the same on every rank; see :class:`~gradpress.powersgd.commit.StepCommit`)."""

    #: Read on the host: every value the step averaged is finite (its new memory and factors are kept).
    FINITE = enum.auto()
    #: Read on the host: some value the step averaged is not finite (memory and factors are kept as before).
    NOT_FINITE = enum.auto()
    #: Not read, because reading would wait for the device: each choice between the finite and the
    #: non-finite outcome is made on the device from the flag (``torch.where``), with no host sync.
    ON_DEVICE = enum.auto()


def work_dtype_for(grad_dtype: torch.dtype) -> torch.dtype:
    """Error memory, P and Q are fp32 for fp16/bf16 gradients ("fp32 numerics"), else the gradient's dtype."""
    return torch.float32 if grad_dtype in (torch.float16, torch.bfloat16) else grad_dtype


@dataclass
class ParamMemory:
    """What PowerSGD remembers about one compressed parameter, as plain tensors, in PyTorch's orientation.

    ``error``: the residual not yet applied, shape ``(n, m)`` (``None``: zero / error feedback off).
    ``q``: the right factor, shape ``(m, r)``; ``p``: the left factor, shape ``(n, r)``. Classic PowerSGD
    keeps the factor it starts its power iteration from: ``q``, or ``p`` for a matrix it compresses from
    its transpose (:attr:`~gradpress.powersgd.plan.TensorPlan.transposed`); the alternating scheme keeps
    both. ``None``: not drawn yet.
    ``signal``: a 0-d tensor, the sum of the applied gradient's norm over the steps since an adaptive
    rank last decided (``None``: not tracked).
    """

    shape: tuple[int, ...]
    error: Tensor | None = None
    q: Tensor | None = None
    p: Tensor | None = None
    signal: Tensor | None = None

    def to_dict(self) -> dict[str, object]:
        """The checkpoint form: plain lists and tensors."""
        return {"shape": list(self.shape), "error": self.error, "q": self.q, "p": self.p, "signal": self.signal}

    @classmethod
    def from_dict(cls, entry: Mapping[str, object]) -> ParamMemory:
        """Inverse of :meth:`to_dict` (checkpoints without ``p`` or ``signal`` load with ``None``)."""
        return cls(tuple(entry["shape"]), entry["error"], entry["q"], entry.get("p"),  # type: ignore[arg-type]
                   entry.get("signal"))  # type: ignore[arg-type]

    def resize(self, rank: int, seed: int, key: int, draw: int) -> None:
        """Give the warm-start factors ``rank`` columns: the leading ones are kept; new ones are drawn
        from ``(seed, key, draw)`` (the same on every rank), so an adaptive rank change is identical on
        every worker. The error memory is untouched (nothing of the gradient is lost by a switch)."""
        for name, offset in (("q", 0), ("p", P_DRAW)):
            factor = getattr(self, name)
            if factor is None or factor.shape[1] == rank:
                continue
            if factor.shape[1] > rank:
                setattr(self, name, factor[:, :rank].clone())
                continue
            extra = seeded_normal((factor.shape[0], rank - factor.shape[1]), seed, key, offset | draw)
            setattr(self, name, torch.cat([factor, upload(extra, factor.device).to(factor.dtype)], dim=1))


class Segment:
    """Flat working buffers of one segment (bucket), built from a plan.

    Buffers (all of ``dtype``, on ``device``), each matrix's block on its own :data:`ALIGNMENT_BYTES` line
    (:mod:`gradpress.powersgd.layout`), so that its numbers do not depend on its place in the bucket:
      * ``error_memory``: the error memory e of the compressed matrices, grouped (unused without error
        feedback); ``error_views`` holds one view of it per compressed matrix, in group order, in the
        orientation the plan compresses it in (:attr:`~gradpress.powersgd.plan.TensorPlan.oriented`).
      * ``m_memory`` (:meth:`ensure_m_buffer`): laid out as the error memory; a step builds M = g + e
        there once. Neither the error memory nor the gradient is written before the commit
        (:class:`~gradpress.powersgd.commit.StepCommit`), which writes e' = M - P Q^T only if the step is
        finite: a step whose averages are not finite leaves ``error_memory`` bitwise as it was ("non-finite
        steps"). At a finite commit the two buffers trade roles (:meth:`swap_memory`).
      * ``wire``: what is sent, ``[P | uncompressed | Q]`` (:class:`~gradpress.powersgd.layout.WireLayout`);
        ``p`` (the P region), ``unsent`` (the uncompressed tensors), ``phase1`` (``[P | uncompressed]``) and
        ``q`` (the Q region) are views of it.
      * ``saved_factors``: the warm-start factors as they were before the step in flight (``[Q]``, or
        ``[P | Q]`` in the alternating scheme, where P is memory too), put back if the step is not
        finite. ``None`` until first needed. ``staged`` (a :class:`StagedFactors`) says which of them the
        step in flight saved.
      * ``workspace``: a :class:`Workspace` (scratch space, not memory), shared by the segments of one state.

    ``factors_to_draw``: the compressed positions (group order) whose warm-start factors are not drawn
    yet (a new parameter, or one whose memory holds none): the next step draws them first.

    Q is stored transposed, as ``(r, m)`` per matrix (``(B, r, m)`` per group): the power iteration then
    computes Q^T = P^T M with both operands in their natural layout, and P = M Q reads Q column-major.
    On CPU BLAS this is 2-4x faster than a row-major ``(m, r)`` Q for the skinny products PowerSGD does.
    """

    __slots__ = ("plan", "keys", "dtype", "device", "layout", "error_memory", "wire", "p", "unsent", "phase1", "q",
                 "group_views", "error_views", "p_views", "q_views", "factors_to_draw", "saved_factors", "staged",
                 "workspace", "norms", "global_norms", "signals", "_wire_spans", "_strides", "m_memory",
                 "m_group_views", "m_views", "_rows")

    def __init__(self, plan: Plan, keys: Sequence[int], device: torch.device, dtype: torch.dtype,
                 workspace: Workspace | None = None) -> None:
        if len(keys) != len(plan.tensors):
            raise ValueError(f"{len(keys)} parameter keys for a plan of {len(plan.tensors)} tensors")
        self.plan = plan
        self.keys = tuple(keys)
        self.device = device
        self.dtype = dtype
        self.workspace = workspace if workspace is not None else Workspace()
        self.layout = layout = WireLayout(plan, dtype)
        per_line = aligned_stride(1, dtype)[1]
        buffer = torch.zeros(layout.numel + per_line, device=device, dtype=dtype)
        start = aligned_offset(buffer)
        self.wire = buffer[start: start + layout.numel]
        self.p = self.wire[:layout.p_numel]
        self.unsent = self.wire[layout.p_numel:layout.unsent_end]
        self.phase1 = self.wire[:layout.unsent_end]
        self.q = self.wire[layout.q_start:]
        strides = [aligned_stride(group.n * group.m, dtype)[0] for group in plan.groups]
        self._strides = strides
        self.error_memory = torch.zeros(
            sum(g.batch * stride for g, stride in zip(plan.groups, strides)) + per_line, device=device, dtype=dtype)
        # Per shape group: (group, its (B, n, m) view of the error memory, (B, n, r) of P, (B, r, m) of Q^T).
        # Per compressed tensor, in group order: its (n, m) error memory, (n, r) P and (r, m) Q^T.
        self.group_views: list[tuple[GroupPlan, Tensor, Tensor, Tensor]] = []
        self.error_views: list[Tensor] = []
        self._point_error_memory(self.error_memory)
        # The step's M = g + e, laid out as the error memory: built at the first step (ensure_m_buffer).
        self.m_memory: Tensor | None = None
        self.m_group_views: list[Tensor] = []
        self.m_views: list[Tensor] = []
        self._rows: Tensor | None = None
        self.p_views, self.q_views = self.factor_views(self.wire)
        # Positions (in group order) whose warm-start factors must be drawn before the next step.
        self.factors_to_draw: list[int] = list(range(len(self.q_views)))
        self.saved_factors: Tensor | None = None
        # The factors the step in flight saved in saved_factors.
        self.staged = StagedFactors.NOTHING
        # ||M|| and ||M - P Q^T|| per compressed matrix (group order) at the last measured step; None
        # until a step measures (see approximation_norms).
        self.norms: Tensor | None = None
        # Sketched ||mean M|| and ||mean M - P Q^T|| per compressed matrix (group order) at the last measured
        # step; None until a step measures (see global_residual_norms).
        self.global_norms: Tensor | None = None
        # Sum of ||P Q^T|| per compressed matrix over the finite steps that tracked it (adaptive rank).
        self.signals: Tensor | None = None
        self._wire_spans: WireSpans | None = None  # built at the first use (see wire_spans)

    @property
    def backend(self) -> Backend:
        """How this segment's kernels run: its device's :mod:`~gradpress.powersgd.backend`."""
        return backend_for(self.device)

    def _matrix_views(self, flat: Tensor) -> tuple[list[Tensor], list[Tensor]]:
        """Per shape group its ``(B, n, m)`` view of ``flat`` (a buffer laid out as the error memory), and
        per compressed matrix (group order) its ``(n, m)`` view."""
        offset = aligned_offset(flat)
        groups: list[Tensor] = []
        matrices: list[Tensor] = []
        for group, stride in zip(self.plan.groups, self._strides):
            view = batch_view(flat, offset, group.batch, stride, group.n, group.m)
            offset += group.batch * stride
            groups.append(view)
            matrices.extend(view.unbind(0))
        return groups, matrices

    def _point_error_memory(self, flat: Tensor) -> None:
        self.error_memory = flat
        groups, self.error_views = self._matrix_views(flat)
        self.group_views = [(group, errors, *self.layout.group_views(self.wire, index, group))
                            for index, (group, errors) in enumerate(zip(self.plan.groups, groups))]

    def ensure_m_buffer(self) -> None:
        """Give the segment its second matrix buffer, ``m_memory`` (views ``m_group_views``, ``m_views``),
        laid out as the error memory and allocated with it as one ``(2, size)`` tensor (so both rows have
        the same alignment and whole-buffer elementwise ops line up). Idempotent. Memory: one more buffer
        of the error memory's size."""
        if self._rows is not None:
            return
        rows = torch.zeros(2, self.error_memory.numel(), device=self.device, dtype=self.dtype)
        if aligned_offset(rows[0]) != aligned_offset(rows[1]):  # never with PyTorch's allocators
            raise RuntimeError("the error memory's two rows are aligned differently")
        rows[0].copy_(self.error_memory)
        self._rows = rows
        self._point_error_memory(rows[0])
        self.m_memory = rows[1]
        self.m_group_views, self.m_views = self._matrix_views(rows[1])

    def swap_memory(self) -> None:
        """Make ``m_memory`` the error memory and the old error memory the next step's ``m_memory`` (no
        copy: the step builds the new memory in ``m_memory``)."""
        assert self.m_memory is not None
        old = self.error_memory
        self._point_error_memory(self.m_memory)
        self.m_memory = old
        self.m_group_views, self.m_views = self._matrix_views(old)

    def wire_spans(self) -> WireSpans:
        """Where the wire holds each tensor (:class:`WireSpans`), built at the first call and kept."""
        if self._wire_spans is None:
            self._wire_spans = WireSpans(self.plan, self.layout, self.device)
        return self._wire_spans

    def factor_group_views(self, wire: Tensor) -> list[tuple[Tensor, Tensor]]:
        """Per shape group, its ``(B, n, r)`` P and ``(B, r, m)`` Q^T in ``wire`` (or in a copy of it)."""
        return [self.layout.group_views(wire, index, group) for index, group in enumerate(self.plan.groups)]

    def factor_views(self, wire: Tensor) -> tuple[list[Tensor], list[Tensor]]:
        """Per compressed tensor, in group order, its ``(n, r)`` P and ``(r, m)`` Q^T in ``wire`` (or in a
        copy of it: the factors of an earlier iteration, kept by the alternating scheme)."""
        ps: list[Tensor] = []
        qs: list[Tensor] = []
        for p, q in self.factor_group_views(wire):
            ps.extend(p.unbind(0))
            qs.extend(q.unbind(0))
        return ps, qs

    @property
    def compressed_order(self) -> list[int]:
        """Tensor indices of the compressed tensors, in group order (the order of ``error_views``)."""
        return [i for group in self.plan.groups for i in group.members]

    def gradient_views(self, grads: Sequence[Tensor]) -> tuple[list[Tensor], list[Tensor]]:
        """``grads`` (the plan's tensors, in plan order) as the compressed matrices, in group order and in
        the orientation they are compressed in (a transposed view where the plan says so), and the
        uncompressed tensors as vectors."""
        plan = self.plan
        matrices = []
        for i in self.compressed_order:
            view = grads[i].view(plan.tensors[i].matrix)
            matrices.append(view.t() if plan.tensors[i].transposed else view)
        return matrices, [grads[i].view(-1) for i in plan.uncompressed]

    def approximation_norms(self) -> Tensor:
        """``(C, 2)`` in the working dtype, on the segment's device: per compressed matrix (in the order
        of :attr:`compressed_order`), ``||M||_F`` and ``||M - P Q^T||_F`` at the last step that measured
        them (M: the matrix compressed, gradient plus error memory; P Q^T: the approximation applied),
        NaN before any. Allocated at the first call; written on the device, never read here."""
        if self.norms is None:
            self.norms = torch.full((len(self.error_views), 2), float("nan"), device=self.device, dtype=self.dtype)
        return self.norms

    def global_residual_norms(self) -> Tensor:
        """``(C, 2)`` in the working dtype, on the segment's device: per compressed matrix (in the order of
        :attr:`compressed_order`), the sketched ``||mean_i M_i Omega||_F`` and ``||(mean_i M_i - P Q^T) Omega||_F``
        at the last step that measured them (M_i: worker i's compressed matrix; P Q^T: the approximation
        every worker applied; Omega: :func:`~gradpress.powersgd.seeding.seeded_sketch`), NaN before any.
        Allocated at the first call; written on the device, never read here."""
        if self.global_norms is None:
            self.global_norms = torch.full((len(self.error_views), 2), float("nan"), device=self.device,
                                           dtype=self.dtype)
        return self.global_norms

    def output_signals(self) -> Tensor:
        """``(C,)``: per compressed matrix (group order), the sum of the applied approximation's norm
        ``||P Q^T||_F`` over the steps that tracked it (adaptive rank's signal). Zeros at first call."""
        if self.signals is None:
            self.signals = torch.zeros(len(self.error_views), device=self.device, dtype=self.dtype)
        return self.signals

    def draw_q(self, positions: Sequence[int], seed: int, draw: int, with_p: bool = False) -> None:
        """Fill the Q (and, with ``with_p``, the P) of the given compressed positions with seeded normals,
        the same on every rank. (Not orthonormalized, unlike PyTorch's first Q: ``span(M Q)`` does not
        depend on Q's basis, P is orthogonalized after, and at full rank, where a square Q's conditioning
        would cost digits, the classic step takes ``P = M``: :func:`~gradpress.powersgd.kernels.first_products`.)"""
        order = self.compressed_order
        for position in positions:
            key = self.keys[order[position]]
            view = self.q_views[position].t()
            view.copy_(upload(seeded_normal(view.shape, seed, key, draw), view.device))
            if with_p:
                view = self.p_views[position]
                view.copy_(upload(seeded_normal(view.shape, seed, key, P_DRAW | draw), view.device))

    def stage(self, factors: StagedFactors) -> None:
        """Begin a step: save the factors that :meth:`restore_factors` may have to put back (``factors``:
        which ones are memory, see :class:`StagedFactors`). Called after the step drew the factors it
        lacked (first use): a step that is rolled back keeps those, the draw the next step would make anyway."""
        if factors is not StagedFactors.NOTHING:
            with_p = factors is StagedFactors.P_AND_Q
            p_numel = self.p.numel() if with_p else 0
            if self.saved_factors is None or self.saved_factors.numel() != p_numel + self.q.numel():
                self.saved_factors = torch.empty(p_numel + self.q.numel(), device=self.device, dtype=self.dtype)
            for saved, current in self._factor_pairs(with_p):
                saved.copy_(current)
        self.staged = factors

    def restore_factors(self, finite: Tensor, finiteness: Finiteness) -> None:
        """End the staged step's factors: kept if ``finite`` (a 0-d bool tensor on this device, the same on
        every rank), else put back bitwise. ``finiteness``: what the caller read of ``finite`` (see
        :class:`Finiteness`); :attr:`Finiteness.ON_DEVICE`: the choice is a device-side ``torch.where``,
        no host sync."""
        factors, self.staged = self.staged, StagedFactors.NOTHING
        if factors is StagedFactors.NOTHING or finiteness is Finiteness.FINITE:
            return
        for saved, current in self._factor_pairs(factors is StagedFactors.P_AND_Q):
            if finiteness is Finiteness.ON_DEVICE:
                torch.where(finite, current, saved, out=current)
            else:
                current.copy_(saved)

    def _factor_pairs(self, with_p: bool) -> list[tuple[Tensor, Tensor]]:
        """``(saved, current)`` views: Q, and with ``with_p`` first P, in ``saved_factors`` and ``wire``."""
        assert self.saved_factors is not None
        p_numel = self.p.numel() if with_p else 0
        pairs = [(self.saved_factors[p_numel:], self.q)]
        if with_p:
            pairs.insert(0, (self.saved_factors[:p_numel], self.p))
        return pairs

    def _oriented_factors(self, position: int, index: int) -> tuple[tuple[Tensor, str], tuple[Tensor, str]]:
        """Compressed position ``position`` (tensor ``index``): its oriented ``(m', r)`` Q and ``(n', r)`` P
        views, each with the :class:`ParamMemory` field that holds it in PyTorch's orientation."""
        transposed = self.plan.tensors[index].transposed
        q_view, p_view = self.q_views[position].t(), self.p_views[position]
        return (q_view, "p" if transposed else "q"), (p_view, "q" if transposed else "p")

    def load(self, memory: Mapping[int, ParamMemory], config: EngineConfig) -> None:
        """Fill the buffers from per-parameter memory (missing keys: zero error, Q drawn at first use)."""
        order = self.compressed_order
        exact = set(range(len(self.keys))) - set(order)
        for index in exact:
            entry = memory.get(self.keys[index])
            if entry is not None and entry.error is not None and config.use_error_feedback \
                    and bool(entry.error.any()):
                raise ValueError(
                    f"PowerSGD memory holds error memory for parameter #{self.keys[index]}, which this "
                    "configuration sends exactly, so that memory would be lost: was the checkpoint taken "
                    "with another rank_policy or min_compression_rate?")
        self.factors_to_draw = []
        alternating = config.num_iters_per_step is not None
        for position, index in enumerate(order):
            key = self.keys[index]
            tensor = self.plan.tensors[index]
            entry = memory.get(key)
            if entry is not None and tuple(entry.shape) != tensor.shape:
                raise ValueError(
                    f"PowerSGD memory for parameter #{key} has shape {tuple(entry.shape)}, but the gradient "
                    f"has shape {tensor.shape}: the checkpoint belongs to a different model")
            if entry is not None and entry.error is not None and config.use_error_feedback:
                error = entry.error.reshape(tensor.matrix)
                self.error_views[position].copy_(error.t() if tensor.transposed else error)
            if entry is not None and entry.signal is not None:
                self.output_signals()[position].copy_(entry.signal)
            first, second = self._oriented_factors(position, index)
            wanted = [first, second] if alternating else [first]
            saved = [(getattr(entry, field), view, field) for view, field in wanted] if entry is not None else []
            if entry is None or not config.warm_start or any(factor is None for factor, _, _ in saved):
                self.factors_to_draw.append(position)
                continue
            for factor, view, field in saved:
                if tuple(factor.shape) != tuple(view.shape):
                    raise ValueError(
                        f"PowerSGD warm-start {field.upper()} for parameter #{key} has shape {tuple(factor.shape)}, "
                        f"expected {tuple(view.shape)}: was the checkpoint taken with another "
                        f"matrix_approximation_rank?")
                view.copy_(factor)

    def export(self, config: EngineConfig) -> dict[int, ParamMemory]:
        """Per-parameter copies of the memory (independent of this segment's buffers), in PyTorch's
        orientation."""
        out: dict[int, ParamMemory] = {}
        drawn = set(range(len(self.q_views))) - set(self.factors_to_draw)
        alternating = config.num_iters_per_step is not None
        for position, index in enumerate(self.compressed_order):
            tensor = self.plan.tensors[index]
            keep = config.warm_start and position in drawn
            factors: dict[str, Tensor | None] = {"q": None, "p": None}
            first, second = self._oriented_factors(position, index)
            for view, field in ([first, second] if alternating else [first]) if keep else []:
                factors[field] = view.clone(memory_format=torch.contiguous_format)
            error = self.error_views[position]
            out[self.keys[index]] = ParamMemory(
                shape=tensor.shape,
                error=(error.t() if tensor.transposed else error).clone(memory_format=torch.contiguous_format)
                if config.use_error_feedback else None,
                q=factors["q"], p=factors["p"],
                signal=None if self.signals is None else self.signals[position].clone(),
            )
        return out

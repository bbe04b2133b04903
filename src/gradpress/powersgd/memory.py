"""PowerSGD state: error memory and warm-start Q, per segment for speed, per parameter for checkpoints.

While training, a :class:`Segment` holds the memory of one bucket in flat buffers laid out by its
:class:`~gradpress.powersgd.plan.Plan` (one ``bmm`` per shape group). Checkpoints and layout changes go
through :class:`ParamMemory` (the pool of :class:`~gradpress.powersgd.store.SegmentStore`), keyed by a stable
per-parameter key, so state survives DDP rebuilding its buckets (which it does after the first iteration of
every process: a state keyed by bucket index, as PyTorch's is, gets applied to the wrong parameters after a
resume).
"""

from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from .config import EngineConfig
from .plan import GroupPlan, Plan
from .seeding import P_DRAW, seeded_normal, upload

__all__ = ["ALIGNMENT_BYTES", "Finiteness", "ParamMemory", "Segment", "StagedFactors", "WireSpans", "Workspace",
           "work_dtype_for"]

#: Every matrix's error memory starts at a multiple of this many bytes (PyTorch's CPU allocations are
#: aligned the same way). BLAS rounds differently when an operand starts at another alignment (MKL's
#: sgemm, measured: offsets of 1-3 floats change the last bits of M Q), so without it a matrix's numbers
#: would depend on where it sits in its bucket, and DDP's first bucket layout after a restart differs
#: from the rebuilt one an uninterrupted run uses: resuming would not equal never stopping, bit for bit.
ALIGNMENT_BYTES = 64


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
    the same on every rank; see :class:`~gradpress.powersgd.step.StepCommit`)."""

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
    """What PowerSGD remembers about one compressed parameter, as plain tensors.

    ``error``: the residual not yet applied, shape ``(n, m)`` (``None``: zero / error feedback off).
    ``q``: the warm-start right factor, shape ``(m, r)`` (``None``: not drawn yet).
    ``p``: the left factor, shape ``(n, r)``; kept by the alternating scheme only (``None`` otherwise).
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


def _aligned_stride(numel: int, dtype: torch.dtype) -> tuple[int, int]:
    """``(stride, per_line)``: ``numel`` rounded up to whole :data:`ALIGNMENT_BYTES` lines of ``dtype``."""
    per_line = max(1, ALIGNMENT_BYTES // torch.empty((), dtype=dtype).element_size())
    return -(-numel // per_line) * per_line, per_line


def _aligned_offset(flat: Tensor) -> int:
    """Elements to skip in ``flat`` to reach an :data:`ALIGNMENT_BYTES` boundary (0 for PyTorch's own
    CPU and CUDA allocations; the extra line callers allocate keeps the layout valid otherwise)."""
    return ((-flat.data_ptr()) % ALIGNMENT_BYTES) // flat.element_size()


class Workspace:
    """One reusable scratch buffer per (device, dtype), for matrices that a step builds and consumes
    between two of its collectives: M = g + e of one shape group (or one matrix), a candidate memory.

    Nothing in it lives across a collective, so every segment of a state shares one: the state holds
    one more buffer of the largest shape group it compresses (at most one bucket), not one per segment.
    Each matrix of a :meth:`matrices` view starts on an :data:`ALIGNMENT_BYTES` line, as in
    ``Segment.error_memory``, so a product's rounding never depends on where a gradient sits in its bucket.
    """

    __slots__ = ("_buffers",)

    def __init__(self) -> None:
        self._buffers: dict[tuple[torch.device, torch.dtype], Tensor] = {}

    def matrices(self, batch: int, n: int, m: int, device: torch.device, dtype: torch.dtype) -> Tensor:
        """A ``(batch, n, m)`` view of the buffer (contents undefined), valid until the next call."""
        stride, per_line = _aligned_stride(n * m, dtype)
        need = batch * stride + per_line
        key = (torch.device(device), dtype)
        flat = self._buffers.get(key)
        if flat is None or flat.numel() < need:
            self._buffers.pop(key, None)  # free the smaller one first
            flat = torch.empty(need, device=device, dtype=dtype)
            self._buffers[key] = flat
        offset = _aligned_offset(flat)
        return flat[offset: offset + batch * stride].view(batch, stride)[:, : n * m].view(batch, n, m)

    @property
    def nbytes(self) -> int:
        return sum(flat.numel() * flat.element_size() for flat in self._buffers.values())


class WireSpans:
    """Where a segment's wire holds each tensor: its non-empty spans, in wire order, the P factor of each
    compressed matrix (group order), each uncompressed tensor (plan order), the Q factor of each
    compressed matrix (group order). They tile the wire (it has no padding: only the error memory's
    matrices are aligned), so every element has one span.

    ``sizes``: each span's length; ``lengths``: the same as an ``(S,)`` int64 tensor on the segment's
    device (uploaded once, :meth:`Segment.wire_spans`), for an accelerator's per-element scale
    ``repeat_interleave(scales, lengths[a:b], output_size=...)`` on the device, so no per-element table
    is ever built. ``first``: wire offset -> number of the first span at or after it,
    for the offsets where phases begin or end (0, end of P, start of Q, the end).
    """

    __slots__ = ("sizes", "lengths", "first")

    def __init__(self, segment: Segment) -> None:
        plan = segment.plan
        p_spans = [group.n * group.rank for group in plan.groups for _ in range(group.batch)]
        unsent = [plan.tensors[i].numel for i in plan.uncompressed]
        q_spans = [group.m * group.rank for group in plan.groups for _ in range(group.batch)]
        spans = [length for length in p_spans + unsent + q_spans if length]
        assert sum(spans) == segment.wire.numel()
        p_count = len([length for length in p_spans if length])
        unsent_count = len([length for length in unsent if length])
        self.first = {0: 0, plan.p_numel: p_count, plan.p_numel + plan.uncompressed_numel: p_count + unsent_count,
                      segment.wire.numel(): len(spans)}
        self.sizes = spans
        self.lengths = upload(torch.tensor(spans, dtype=torch.int64), segment.device)


class Segment:
    """Flat working buffers of one segment (bucket), built from a plan.

    Buffers (all of ``dtype``, on ``device``):
      * ``error_memory``: the error memory e of the compressed matrices, grouped (unused without error
        feedback); ``error_views`` holds one ``(n, m)`` view of it per compressed matrix, in group order.
        A step reads it and writes it only when the step is committed (:class:`~gradpress.powersgd.step.StepCommit`):
        M = g + e is built in the shared :class:`Workspace` for each product, and e' = M - P Q^T is
        written at the commit, only if the step is finite. So a step whose averages are not finite
        leaves ``error_memory`` bitwise as it was, with no second copy of the memory ("non-finite
        steps"). Each matrix starts at a multiple of :data:`ALIGNMENT_BYTES` (zero padding between
        matrices, never read), so its numbers do not depend on its place in the bucket.
      * ``wire``: what is sent, ``[P | uncompressed | Q]`` (see :class:`~gradpress.powersgd.plan.Plan`);
        ``phase1`` (``[P | uncompressed]``) and ``q`` are views of it.
      * ``saved_factors``: the warm-start factors as they were before the step in flight (``[Q]``, or
        ``[P | Q]`` in the alternating scheme, where P is memory too), put back if the step is not
        finite. ``None`` until first needed. Memory: one more Q (and P). ``staged`` (a
        :class:`StagedFactors`) says which of them the step in flight saved.
      * ``workspace``: a :class:`Workspace` (scratch space, not memory), shared by the segments of one state.

    ``factors_to_draw``: the compressed positions (group order) whose warm-start factors are not drawn
    yet (a new parameter, or one whose memory holds none): the next step draws them first.

    Q is stored transposed, as ``(r, m)`` per matrix (``(B, r, m)`` per group): the power iteration then
    computes Q^T = P^T M with both operands in their natural layout, and P = M Q reads Q column-major.
    On CPU BLAS this is 2-4x faster than a row-major ``(m, r)`` Q for the skinny products PowerSGD does.
    Checkpoints (:class:`ParamMemory`) keep PyTorch's ``(m, r)`` orientation.
    """

    __slots__ = ("plan", "keys", "dtype", "device", "error_memory", "wire", "phase1", "q", "group_views",
                 "error_views", "p_views", "q_views", "factors_to_draw", "saved_factors", "staged", "workspace",
                 "norms", "global_norms", "signals", "_wire_spans", "_strides", "m_memory", "m_group_views", "m_views",
                 "_rows")

    def __init__(self, plan: Plan, keys: Sequence[int], device: torch.device, dtype: torch.dtype,
                 workspace: Workspace | None = None) -> None:
        if len(keys) != len(plan.tensors):
            raise ValueError(f"{len(keys)} parameter keys for a plan of {len(plan.tensors)} tensors")
        self.plan = plan
        self.keys = tuple(keys)
        self.device = device
        self.dtype = dtype
        self.workspace = workspace if workspace is not None else Workspace()
        sent = plan.p_numel + plan.uncompressed_numel
        self.wire = torch.zeros(sent + plan.q_numel, device=device, dtype=dtype)
        self.phase1 = self.wire[:sent]
        self.q = self.wire[sent:]
        strides = [_aligned_stride(group.n * group.m, dtype)[0] for group in plan.groups]
        per_line = _aligned_stride(1, dtype)[1]
        self._strides = strides
        self.error_memory = torch.zeros(
            sum(g.batch * stride for g, stride in zip(plan.groups, strides)) + per_line, device=device, dtype=dtype)
        # Per shape group: (group, its (B, n, m) view of the error memory, (B, n, r) of P, (B, r, m) of Q^T).
        # Per compressed tensor, in group order: its (n, m) error memory, (n, r) P and (r, m) Q^T.
        self.group_views: list[tuple[GroupPlan, Tensor, Tensor, Tensor]] = []
        self.error_views: list[Tensor] = []
        self._point_error_memory(self.error_memory)
        # The batched step's M = g + e, laid out as the error memory: built at the first such step (see
        # ensure_m_buffer).
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
        self._wire_spans: WireSpans | None = None  # built at the first fp16 send (see wire_spans)

    def _matrix_views(self, flat: Tensor) -> tuple[list[Tensor], list[Tensor]]:
        """Per shape group its ``(B, n, m)`` view of ``flat`` (a buffer laid out as the error memory), and
        per compressed matrix (group order) its ``(n, m)`` view."""
        offset = _aligned_offset(flat)
        groups: list[Tensor] = []
        matrices: list[Tensor] = []
        for group, stride in zip(self.plan.groups, self._strides):
            b, n, m = group.batch, group.n, group.m
            view = flat[offset: offset + b * stride].view(b, stride)[:, : n * m].view(b, n, m)
            offset += b * stride
            groups.append(view)
            matrices.extend(view.unbind(0))
        return groups, matrices

    def _point_error_memory(self, flat: Tensor) -> None:
        self.error_memory = flat
        groups, self.error_views = self._matrix_views(flat)
        self.group_views = [(group, errors, *self._factor_group_views(self.wire, group))
                            for group, errors in zip(self.plan.groups, groups)]

    def ensure_m_buffer(self) -> None:
        """Give the segment its second matrix buffer, ``m_memory`` (views ``m_group_views``, ``m_views``),
        laid out as the error memory and allocated with it as one ``(2, size)`` tensor (so both rows have
        the same alignment and whole-buffer elementwise ops line up). Idempotent. Memory: one more buffer
        of the error memory's size."""
        if self._rows is not None:
            return
        rows = torch.zeros(2, self.error_memory.numel(), device=self.device, dtype=self.dtype)
        if _aligned_offset(rows[0]) != _aligned_offset(rows[1]):  # never with PyTorch's allocators
            raise RuntimeError("the error memory's two rows are aligned differently")
        rows[0].copy_(self.error_memory)
        self._rows = rows
        self._point_error_memory(rows[0])
        self.m_memory = rows[1]
        self.m_group_views, self.m_views = self._matrix_views(rows[1])

    def swap_memory(self) -> None:
        """Make ``m_memory`` the error memory and the old error memory the next step's ``m_memory`` (no
        copy: the batched step builds the new memory in ``m_memory``)."""
        assert self.m_memory is not None
        old = self.error_memory
        self._point_error_memory(self.m_memory)
        self.m_memory = old
        self.m_group_views, self.m_views = self._matrix_views(old)

    def wire_spans(self) -> WireSpans:
        """Where the wire holds each tensor (:class:`WireSpans`), built at the first call (the fp16
        wire's first send) and kept: the wire is laid out once, here."""
        if self._wire_spans is None:
            self._wire_spans = WireSpans(self)
        return self._wire_spans

    def _factor_group_views(self, wire: Tensor, group: GroupPlan) -> tuple[Tensor, Tensor]:
        """``group``'s ``(B, n, r)`` P and ``(B, r, m)`` Q^T in ``wire`` (or a buffer laid out as it)."""
        b, n, m, r = group.batch, group.n, group.m, group.rank
        sent = self.plan.p_numel + self.plan.uncompressed_numel
        p = wire[group.p_offset: group.p_offset + b * n * r].view(b, n, r)
        q = wire[sent + group.q_offset: sent + group.q_offset + b * m * r].view(b, r, m)
        return p, q

    def factor_views(self, wire: Tensor) -> tuple[list[Tensor], list[Tensor]]:
        """Per compressed tensor, in group order, its ``(n, r)`` P and ``(r, m)`` Q^T in ``wire`` (or in a
        copy of it: the factors of an earlier iteration, kept by the alternating scheme)."""
        ps: list[Tensor] = []
        qs: list[Tensor] = []
        for group in self.plan.groups:
            p, q = self._factor_group_views(wire, group)
            ps.extend(p.unbind(0))
            qs.extend(q.unbind(0))
        return ps, qs

    @property
    def compressed_order(self) -> list[int]:
        """Tensor indices of the compressed tensors, in group order (the order of ``error_views``)."""
        return [i for group in self.plan.groups for i in group.members]

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

    def factor_group_views(self, wire: Tensor) -> list[tuple[Tensor, Tensor]]:
        """Per shape group, its ``(B, n, r)`` P and ``(B, r, m)`` Q^T in ``wire`` (or in a copy of it)."""
        return [self._factor_group_views(wire, group) for group in self.plan.groups]

    def output_signals(self) -> Tensor:
        """``(C,)``: per compressed matrix (group order), the sum of the applied approximation's norm
        ``||P Q^T||_F`` over the steps that tracked it (adaptive rank's signal). Zeros at first call."""
        if self.signals is None:
            self.signals = torch.zeros(len(self.error_views), device=self.device, dtype=self.dtype)
        return self.signals

    def draw_q(self, positions: Sequence[int], seed: int, draw: int, with_p: bool = False) -> None:
        """Fill the Q (and, with ``with_p``, the P) of the given compressed positions with seeded normals,
        the same on every rank."""
        self._fill_seeded(self.q_views, self.p_views if with_p else None, positions, seed, draw)

    def stage(self, factors: StagedFactors) -> None:
        """Begin a step: save the factors that :meth:`restore_factors` may have to put back (``factors``:
        which ones are memory, see :class:`StagedFactors`). Called after the step drew the factors it
        lacked (first use): a step that is rolled back keeps those, the draw the next step would make anyway."""
        if factors is not StagedFactors.NOTHING:
            with_p = factors is StagedFactors.P_AND_Q
            p_numel = self.plan.p_numel if with_p else 0
            if self.saved_factors is None or self.saved_factors.numel() != p_numel + self.plan.q_numel:
                self.saved_factors = torch.empty(p_numel + self.plan.q_numel, device=self.device, dtype=self.dtype)
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
        p_numel = self.plan.p_numel if with_p else 0
        pairs = [(self.saved_factors[p_numel:], self.q)]
        if with_p:
            pairs.insert(0, (self.saved_factors[:p_numel], self.phase1[:p_numel]))
        return pairs

    def _fill_seeded(self, q_views: Sequence[Tensor], p_views: Sequence[Tensor] | None, positions: Sequence[int],
                     seed: int, draw: int) -> None:
        """Write draw number ``draw`` of the seeded factors of ``positions`` into per-position views."""
        order = self.compressed_order
        for position in positions:
            key = self.keys[order[position]]
            view = q_views[position].t()
            view.copy_(upload(seeded_normal(view.shape, seed, key, draw), view.device))
            if p_views is not None:
                view = p_views[position]
                view.copy_(upload(seeded_normal(view.shape, seed, key, P_DRAW | draw), view.device))

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
        for position, index in enumerate(order):
            key = self.keys[index]
            tensor = self.plan.tensors[index]
            entry = memory.get(key)
            if entry is not None and tuple(entry.shape) != tensor.shape:
                raise ValueError(
                    f"PowerSGD memory for parameter #{key} has shape {tuple(entry.shape)}, but the gradient "
                    f"has shape {tensor.shape}: the checkpoint belongs to a different model")
            if entry is not None and entry.error is not None and config.use_error_feedback:
                self.error_views[position].copy_(entry.error.reshape(tensor.matrix))
            if entry is not None and entry.signal is not None:
                self.output_signals()[position].copy_(entry.signal)
            q_view = self.q_views[position].t()
            alternating = config.num_iters_per_step is not None
            factors = [(entry.q, q_view, "Q")] if entry is not None else []
            if entry is not None and alternating:
                factors.append((entry.p, self.p_views[position], "P"))
            saved_factors = [(saved, view, name) for saved, view, name in factors if saved is not None]
            if entry is not None and config.warm_start and len(saved_factors) == len(factors):
                for saved, view, name in saved_factors:
                    if tuple(saved.shape) != tuple(view.shape):
                        raise ValueError(
                            f"PowerSGD warm-start {name} for parameter #{key} has shape {tuple(saved.shape)}, "
                            f"expected {tuple(view.shape)}: was the checkpoint taken with another "
                            f"matrix_approximation_rank?")
                    view.copy_(saved)
            else:
                self.factors_to_draw.append(position)

    def export(self, config: EngineConfig) -> dict[int, ParamMemory]:
        """Per-parameter copies of the memory (independent of this segment's buffers)."""
        out: dict[int, ParamMemory] = {}
        drawn = set(range(len(self.q_views))) - set(self.factors_to_draw)
        alternating = config.num_iters_per_step is not None
        for position, index in enumerate(self.compressed_order):
            tensor = self.plan.tensors[index]
            keep = config.warm_start and position in drawn
            out[self.keys[index]] = ParamMemory(
                shape=tensor.shape,
                error=self.error_views[position].clone() if config.use_error_feedback else None,
                q=self.q_views[position].t().clone(memory_format=torch.contiguous_format) if keep else None,
                p=self.p_views[position].clone() if keep and alternating else None,
                signal=None if self.signals is None else self.signals[position].clone(),
            )
        return out

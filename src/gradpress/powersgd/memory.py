"""PowerSGD state: error memory and warm-start Q, per segment for speed, per parameter for checkpoints.

While training, a :class:`Segment` holds the memory of one bucket in flat buffers laid out by its
:class:`~gradpress.powersgd.plan.Plan` (one ``bmm`` per shape group). Checkpoints and layout changes go
through :class:`ParamMemory`, keyed by a stable per-parameter key, so state survives DDP rebuilding its
buckets (which it does after the first iteration of every process: a state keyed by bucket index, as
PyTorch's is, gets applied to the wrong parameters after a resume).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from .config import EngineConfig
from .plan import GroupPlan, Plan, make_plan

__all__ = ["ALIGNMENT_BYTES", "ParamMemory", "Segment", "SegmentStore", "seeded_normal", "work_dtype_for"]

#: Every matrix's error memory starts at a multiple of this many bytes (PyTorch's CPU allocations are
#: aligned the same way). BLAS rounds differently when an operand starts at another alignment (MKL's
#: sgemm, measured: offsets of 1-3 floats change the last bits of M Q), so without it a matrix's numbers
#: would depend on where it sits in its bucket, and DDP's first bucket layout after a restart differs
#: from the rebuilt one an uninterrupted run uses: resuming would not equal never stopping, bit for bit.
ALIGNMENT_BYTES = 64

_MASK64 = (1 << 64) - 1
_P_DRAW = 1 << 40  # draw numbers of P factors, disjoint from those of Q


def _mix(*parts: int) -> int:
    """SplitMix64 over the parts: a seed that differs for every (seed, key, draw) triple."""
    state = 0x9E3779B97F4A7C15
    for part in parts:
        state = (state ^ (part & _MASK64)) & _MASK64
        state = (state + 0x9E3779B97F4A7C15) & _MASK64
        z = state
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
        state = z ^ (z >> 31)
    return state & ((1 << 63) - 1)


def seeded_normal(shape: Sequence[int], seed: int, key: int, draw: int) -> Tensor:
    """Standard normal fp32 values on the CPU, a pure function of ``(seed, key, draw)``.

    Drawn on the CPU so every rank and every device gets the same numbers (design rule 4), and from a
    private generator so the user's global RNG stream is untouched.
    """
    generator = torch.Generator(device="cpu")
    generator.manual_seed(_mix(seed, key, draw))
    return torch.randn(tuple(shape), generator=generator, dtype=torch.float32)


def work_dtype_for(grad_dtype: torch.dtype) -> torch.dtype:
    """Error memory, P and Q are fp32 for fp16/bf16 gradients (design rule 5), else the gradient's dtype."""
    return torch.float32 if grad_dtype in (torch.float16, torch.bfloat16) else grad_dtype


@dataclass
class ParamMemory:
    """What PowerSGD remembers about one compressed parameter, as plain tensors.

    ``error``: the residual not yet applied, shape ``(n, m)`` (``None``: zero / error feedback off).
    ``q``: the warm-start right factor, shape ``(m, r)`` (``None``: not drawn yet).
    ``p``: the left factor, shape ``(n, r)``; kept by the alternating scheme only (``None`` otherwise).
    """

    shape: tuple[int, ...]
    error: Tensor | None = None
    q: Tensor | None = None
    p: Tensor | None = None

    def to_dict(self) -> dict[str, object]:
        """The checkpoint form: plain lists and tensors."""
        return {"shape": list(self.shape), "error": self.error, "q": self.q, "p": self.p}

    @classmethod
    def from_dict(cls, entry: Mapping[str, object]) -> ParamMemory:
        """Inverse of :meth:`to_dict` (checkpoints without ``p`` load with ``p=None``)."""
        return cls(tuple(entry["shape"]), entry["error"], entry["q"], entry.get("p"))  # type: ignore[arg-type]


class Segment:
    """Flat working buffers of one segment (bucket), built from a plan.

    Buffers (all of ``dtype``, on ``device``):
      * ``work``: the compressed matrices, grouped. With error feedback it *is* the error memory, and a
        step leaves it untouched until the step is committed (:meth:`commit`). Without error feedback it
        is scratch: the step computes M = g in it. Each matrix starts at a multiple of
        :data:`ALIGNMENT_BYTES` (zero padding between matrices, never read), so its numbers do not
        depend on its place in the bucket.
      * ``spare``: with error feedback, where a step computes M = g + e and then the candidate memory
        e' = M - PQ^T, laid out as ``work``. Committing a finite step swaps the two (or, where reading
        the step's flag would wait for the device, selects e' into ``work`` on the device). ``None``
        until the first step with error feedback. Memory: one more error memory per segment, the price
        of keeping the previous memory intact until every segment of the step is known to be finite
        (design rule 5, issue 19.3).
      * ``wire``: what is sent, ``[P | uncompressed | Q]`` (see :class:`~gradpress.powersgd.plan.Plan`);
        ``phase1`` (``[P | uncompressed]``) and ``q`` are views of it.
      * ``saved_factors``: the warm-start factors as they were before the step in flight (``[Q]``, or
        ``[P | Q]`` in the alternating scheme, where P is memory too), put back if the step is not
        finite. ``None`` until first needed. Memory: one more Q (and P).

    Q is stored transposed, as ``(r, m)`` per matrix (``(B, r, m)`` per group): the power iteration then
    computes Q^T = P^T M with both operands in their natural layout, and P = M Q reads Q column-major.
    On CPU BLAS this is 2-4x faster than a row-major ``(m, r)`` Q for the skinny products PowerSGD does.
    Checkpoints (:class:`ParamMemory`) keep PyTorch's ``(m, r)`` orientation.
    """

    __slots__ = ("plan", "keys", "dtype", "device", "work", "wire", "phase1", "q", "group_views",
                 "work_views", "p_views", "q_views", "unsent_q", "spare", "spare_views", "spare_group_views",
                 "saved_factors", "staged")

    def __init__(self, plan: Plan, keys: Sequence[int], device: torch.device, dtype: torch.dtype) -> None:
        if len(keys) != len(plan.tensors):
            raise ValueError(f"{len(keys)} parameter keys for a plan of {len(plan.tensors)} tensors")
        self.plan = plan
        self.keys = tuple(keys)
        self.device = device
        self.dtype = dtype
        sent = plan.p_numel + plan.uncompressed_numel
        self.wire = torch.zeros(sent + plan.q_numel, device=device, dtype=dtype)
        self.phase1 = self.wire[:sent]
        self.q = self.wire[sent:]
        # Per shape group: (group, its (B, n, m) view of work, (B, n, r) of P, (B, r, m) of Q^T). Per
        # compressed tensor, in group order: its (n, m) slice of work, (n, r) of P, (r, m) of Q^T.
        self.work, self.group_views, self.work_views = self._matrix_buffer()
        self.p_views: list[Tensor] = [p for _, _, group_p, _ in self.group_views for p in group_p.unbind(0)]
        self.q_views: list[Tensor] = [q for _, _, _, group_q in self.group_views for q in group_q.unbind(0)]
        # Positions (in group order) whose factors must be drawn before the next step.
        self.unsent_q: list[int] = list(range(len(self.q_views)))
        self.spare: Tensor | None = None
        self.spare_views: list[Tensor] = []
        self.spare_group_views: list[tuple[GroupPlan, Tensor, Tensor, Tensor]] = []
        self.saved_factors: Tensor | None = None
        # What the step in flight will commit: (a candidate memory in ``spare``, factors saved (with P)).
        self.staged: tuple[bool, bool | None] | None = None

    def _matrix_buffer(self) -> tuple[Tensor, list[tuple[GroupPlan, Tensor, Tensor, Tensor]], list[Tensor]]:
        """A zeroed buffer for the compressed matrices, each aligned; its group views ``(group, (B, n, m),
        P, Q^T)`` and its per-matrix views."""
        plan = self.plan
        per_line = max(1, ALIGNMENT_BYTES // torch.empty((), dtype=self.dtype).element_size())
        strides = [-(-(group.n * group.m) // per_line) * per_line for group in plan.groups]
        flat = torch.zeros(sum(g.batch * stride for g, stride in zip(plan.groups, strides)) + per_line,
                           device=self.device, dtype=self.dtype)
        # The allocation is aligned on CPU and CUDA; the extra line keeps the layout valid if it is not.
        offset = ((-flat.data_ptr()) % ALIGNMENT_BYTES) // flat.element_size()
        group_views = []
        matrix_views: list[Tensor] = []
        for group, stride in zip(plan.groups, strides):
            b, n, m, r = group.batch, group.n, group.m, group.rank
            matrices = flat[offset: offset + b * stride].view(b, stride)[:, : n * m].view(b, n, m)
            offset += b * stride
            p = self.phase1[group.p_offset: group.p_offset + b * n * r].view(b, n, r)
            q = self.q[group.q_offset: group.q_offset + b * m * r].view(b, r, m)
            group_views.append((group, matrices, p, q))
            matrix_views.extend(matrices.unbind(0))
        return flat, group_views, matrix_views

    @property
    def compressed_order(self) -> list[int]:
        """Tensor indices of the compressed tensors, in group order (the order of ``work_views``)."""
        return [i for group in self.plan.groups for i in group.members]

    def draw_q(self, positions: Sequence[int], seed: int, draw: int, with_p: bool = False) -> None:
        """Fill the Q (and, with ``with_p``, the P) of the given compressed positions with seeded normals,
        the same on every rank."""
        self._fill_seeded(self.q_views, self.p_views if with_p else None, positions, seed, draw)

    def scratch(self, error_feedback: bool) -> tuple[list[tuple[GroupPlan, Tensor, Tensor, Tensor]], list[Tensor]]:
        """Where a step computes M and its residual: ``spare`` with error feedback (so ``work``, the
        memory, stays as it was until :meth:`commit`), else ``work`` itself. As ``group_views`` and
        ``work_views`` are for ``work``."""
        if not error_feedback:
            return self.group_views, self.work_views
        if self.spare is None:
            self.spare, self.spare_group_views, self.spare_views = self._matrix_buffer()
        return self.spare_group_views, self.spare_views

    def stage(self, error_feedback: bool, factors: bool | None) -> None:
        """Begin a step: remember what :meth:`commit` will keep or drop, and save the factors it may
        have to put back. ``factors``: ``None`` (no factor is memory: no warm start), ``False`` (Q),
        ``True`` (P and Q, the alternating scheme). Called after the step drew the factors it lacked
        (first use): a step rolled back keeps those, the draw the next step would make anyway."""
        if factors is not None:
            p_numel = self.plan.p_numel if factors else 0
            if self.saved_factors is None or self.saved_factors.numel() != p_numel + self.plan.q_numel:
                self.saved_factors = torch.empty(p_numel + self.plan.q_numel, device=self.device, dtype=self.dtype)
            for saved, current in self._factor_pairs(factors):
                saved.copy_(current)
        self.staged = (error_feedback, factors)

    def commit(self, finite: Tensor, known: bool | None) -> None:
        """End the staged step: keep its new memory and factors if ``finite`` (a 0-d bool tensor on this
        device, the same on every rank), else leave them bitwise as they were before the step.

        ``known``: ``finite``'s value when the caller has read it (where reading is free), else ``None``:
        then the choice is made on the device with ``torch.where``, with no host sync (one pass over the
        error memory and the factors). Known finite: the buffers are swapped, no pass at all.
        """
        if self.staged is None:
            return
        memory, factors = self.staged
        self.staged = None
        if known is True:
            if memory:
                assert self.spare is not None
                self.work, self.spare = self.spare, self.work
                self.work_views, self.spare_views = self.spare_views, self.work_views
                self.group_views, self.spare_group_views = self.spare_group_views, self.group_views
            return
        if memory and known is None:
            for (_, old, _, _), (_, new, _, _) in zip(self.group_views, self.spare_group_views):
                torch.where(finite, new, old, out=old)
        if factors is not None:
            for saved, current in self._factor_pairs(factors):
                if known is None:
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
            view.copy_(seeded_normal(view.shape, seed, key, draw))
            if p_views is not None:
                view = p_views[position]
                view.copy_(seeded_normal(view.shape, seed, key, _P_DRAW | draw))

    def load(self, memory: Mapping[int, ParamMemory], config: EngineConfig) -> None:
        """Fill the buffers from per-parameter memory (missing keys: zero error, Q drawn at first use)."""
        order = self.compressed_order
        self.unsent_q = []
        for position, index in enumerate(order):
            key = self.keys[index]
            tensor = self.plan.tensors[index]
            entry = memory.get(key)
            if entry is not None and tuple(entry.shape) != tensor.shape:
                raise ValueError(
                    f"PowerSGD memory for parameter #{key} has shape {tuple(entry.shape)}, but the gradient "
                    f"has shape {tensor.shape}: the checkpoint belongs to a different model")
            if entry is not None and entry.error is not None and config.use_error_feedback:
                self.work_views[position].copy_(entry.error.reshape(tensor.matrix))
            q_view = self.q_views[position].t()
            alternating = config.num_iters_per_step is not None
            factors = [(entry.q, q_view, "Q")] if entry is not None else []
            if entry is not None and alternating:
                factors.append((entry.p, self.p_views[position], "P"))
            if entry is not None and config.warm_start and all(saved is not None for saved, _, _ in factors):
                for saved, view, name in factors:
                    if tuple(saved.shape) != tuple(view.shape):
                        raise ValueError(
                            f"PowerSGD warm-start {name} for parameter #{key} has shape {tuple(saved.shape)}, "
                            f"expected {tuple(view.shape)}: was the checkpoint taken with another "
                            f"matrix_approximation_rank?")
                    view.copy_(saved)
            else:
                self.unsent_q.append(position)

    def export(self, config: EngineConfig) -> dict[int, ParamMemory]:
        """Per-parameter copies of the memory (independent of this segment's buffers)."""
        out: dict[int, ParamMemory] = {}
        drawn = set(range(len(self.q_views))) - set(self.unsent_q)
        alternating = config.num_iters_per_step is not None
        for position, index in enumerate(self.compressed_order):
            tensor = self.plan.tensors[index]
            keep = config.warm_start and position in drawn
            out[self.keys[index]] = ParamMemory(
                shape=tensor.shape,
                error=self.work_views[position].clone() if config.use_error_feedback else None,
                q=self.q_views[position].t().clone(memory_format=torch.contiguous_format) if keep else None,
                p=self.p_views[position].clone() if keep and alternating else None,
            )
        return out


class SegmentStore:
    """The segments of one PowerSGD state, by slot (a bucket index, a dtype group), and a per-parameter
    pool holding the memory of parameters that are in no segment right now.

    When the tensors of a slot change (DDP rebuilt its buckets, a parameter got no gradient this step),
    the memory of every affected segment goes back to the pool first and the new segment takes its
    parameters' memory from there: memory follows parameters, never positions.
    """

    __slots__ = ("config", "segments", "pool")

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.segments: dict[object, Segment] = {}
        self.pool: dict[int, ParamMemory] = {}

    def get(self, slot: object, keys: tuple[int, ...], shapes: Sequence[Sequence[int]],
            device: torch.device, dtype: torch.dtype) -> Segment:
        """The segment of ``slot`` for parameters ``keys`` (with gradient ``shapes``), built if needed."""
        segment = self.segments.get(slot)
        if segment is not None and segment.keys == keys and segment.dtype == dtype and segment.device == device:
            return segment
        wanted = set(keys)
        for other in [s for s, seg in self.segments.items() if s == slot or wanted & set(seg.keys)]:
            self.pool.update(self.segments.pop(other).export(self.config))
        plan = make_plan(shapes, self.config.rank, self.config.min_compression_rate)
        segment = Segment(plan, keys, device, dtype)
        segment.load(self.pool, self.config)
        for key in keys:
            self.pool.pop(key, None)
        self.segments[slot] = segment
        return segment

    def export(self) -> dict[int, ParamMemory]:
        """Per-parameter copies of all memory (pool and segments)."""
        memory = dict(self.pool)
        for segment in self.segments.values():
            memory.update(segment.export(self.config))
        return memory

    def scale_errors(self, factor: float) -> None:
        """Multiply all error memory (segments and pool) by ``factor``."""
        for segment in self.segments.values():
            segment.work.mul_(factor)
        for entry in self.pool.values():
            if entry.error is not None:
                entry.error = entry.error * factor

    def replace(self, memory: dict[int, ParamMemory]) -> None:
        """Drop every segment and make ``memory`` the pool (segments are rebuilt from it on use)."""
        self.segments.clear()
        self.pool = dict(memory)

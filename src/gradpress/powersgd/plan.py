"""What PowerSGD compresses, and where each piece lives in the flat buffers.

A plan is pure arithmetic over tensor shapes; the DDP hooks, the standalone aggregator and
``gradpress inspect`` all use it, so the bytes they report are the bytes the engine sends.
"""

from __future__ import annotations

import numbers
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from .linalg import as_matrix_shape

__all__ = ["GroupPlan", "Plan", "TensorPlan", "make_plan", "should_compress"]


def should_compress(n: int, m: int, rank: int, min_compression_rate: float) -> bool:
    """PyTorch's rule: compress an ``n x m`` matrix at ``rank`` iff ``(n + m) * rank * rate < n * m``."""
    return (n + m) * rank * min_compression_rate < n * m


@dataclass(frozen=True)
class TensorPlan:
    """One tensor of a segment.

    ``offset``: start of the tensor in the segment's flat (bucket) layout. ``matrix``: PyTorch's ``(n, m)``
    view, ``(shape[0], prod(shape[1:]))``. ``rank``: ``min(n, m, requested rank)``. ``numel_sent``: floats
    this tensor puts on the wire. ``transposed``: the engine compresses the matrix's transpose
    (:attr:`oriented`, ``(m, n)``), its longer side first (``make_plan(..., orient=True)``).
    """

    index: int
    shape: tuple[int, ...]
    offset: int
    numel: int
    matrix: tuple[int, int]
    rank: int
    compressed: bool
    transposed: bool = False

    @property
    def oriented(self) -> tuple[int, int]:
        """The ``(rows, columns)`` of the matrix the engine compresses: :attr:`matrix`, or its transpose."""
        n, m = self.matrix
        return (m, n) if self.transposed else (n, m)

    @property
    def numel_sent(self) -> int:
        n, m = self.matrix
        return (n + m) * self.rank if self.compressed else self.numel


@dataclass(frozen=True)
class GroupPlan:
    """Compressed matrices of one ``(n, m, rank)`` (their oriented shape: :attr:`TensorPlan.oriented`),
    processed together with ``bmm``.

    ``members``: tensor indices, in segment order. The group's P and Q factors occupy ``B * n * r`` and
    ``B * m * r`` elements of the P and Q parts of the wire from ``p_offset`` and ``q_offset``. (Where its
    error memory lives is the segment's business: :class:`~gradpress.powersgd.memory.Segment` aligns
    each matrix, so it is not a function of the shapes alone.)
    """

    n: int
    m: int
    rank: int
    members: tuple[int, ...]
    p_offset: int
    q_offset: int

    @property
    def batch(self) -> int:
        return len(self.members)


@dataclass(frozen=True)
class Plan:
    """The compression plan of one segment (a DDP bucket, or all parameters of an aggregator).

    The engine sends from one buffer laid out ``[ all P | all uncompressed | all Q ]``, so that every
    phase is one contiguous slice, one collective ("one collective per phase"):
      * classic PowerSGD: phase 1 ``[P | uncompressed]``, phase 2 ``[Q]``;
      * alternating (``num_iters_per_step``): the first iteration sends ``[P | uncompressed]`` or
        ``[uncompressed | Q]``, the others ``[P]`` or ``[Q]``.
    """

    tensors: tuple[TensorPlan, ...]
    groups: tuple[GroupPlan, ...]
    uncompressed: tuple[int, ...]
    p_numel: int
    q_numel: int
    uncompressed_numel: int

    @property
    def numel(self) -> int:
        """Elements of the segment (the uncompressed gradient)."""
        return sum(t.numel for t in self.tensors)

    @property
    def numel_sent(self) -> int:
        """Elements put on the wire per step: ``sum r(n + m)`` over compressed + the rest as is."""
        return self.p_numel + self.q_numel + self.uncompressed_numel

    @property
    def compression_rate(self) -> float:
        sent = self.numel_sent
        return self.numel / sent if sent else 0.0

    def numel_sent_per_step(self, num_iters_per_step: int | None = None, first_iteration: int = 0) -> int:
        """Elements sent by one step. ``None``: classic PowerSGD (:attr:`numel_sent`). ``k``: the
        alternating scheme, whose iteration ``i`` sends P if ``i`` is even, else Q, for
        ``i = first_iteration, ..., first_iteration + k - 1``; plus the uncompressed tensors once.

        >>> plan = make_plan([(100, 10)], rank=1, min_compression_rate=1)
        >>> plan.numel_sent, plan.numel_sent_per_step(1, 0), plan.numel_sent_per_step(1, 1)
        (110, 100, 10)
        """
        if num_iters_per_step is None:
            return self.numel_sent
        evens = (num_iters_per_step + (1 - first_iteration % 2)) // 2
        return self.uncompressed_numel + evens * self.p_numel + (num_iters_per_step - evens) * self.q_numel

    def mean_numel_sent(self, num_iters_per_step: int | None = None) -> float:
        """Elements sent per step, averaged over steps (the alternating scheme's cost depends on parity).

        Classic PowerSGD sends ``P + Q``; ``k`` alternating iterations send ``k (P + Q) / 2`` on average.
        """
        if num_iters_per_step is None:
            return float(self.numel_sent)
        return self.uncompressed_numel + num_iters_per_step * (self.p_numel + self.q_numel) / 2

    @property
    def compressed(self) -> tuple[TensorPlan, ...]:
        return tuple(t for t in self.tensors if t.compressed)


def make_plan(shapes: Sequence[Sequence[int]], rank: int, min_compression_rate: float,
              ranks: Sequence[int | None] | None = None, orient: bool = False) -> Plan:
    """Plan a segment of tensors with the given shapes (in segment order).

    Each tensor is viewed as ``(shape[0], -1)``; its rank is ``min(n, m, rank)``; it is compressed iff
    :func:`should_compress` says so. 0-d and 1-d tensors are never compressed (a vector has no low-rank
    structure to exploit). ``orient``: a compressed matrix with ``n < m`` is compressed as its transpose
    (``TensorPlan.transposed``), so that every group is tall and a model's ``(a, b)`` and ``(b, a)`` shapes
    share one. Compressed matrices with the same oriented ``(n, m, rank)`` form one group, in order of
    first appearance. ``ranks`` (a per-parameter policy): one entry per tensor in place of ``rank``, an
    integer, or ``None`` to send that tensor exactly.

    >>> plan = make_plan([(64, 32), (64,), (64, 32)], rank=2, min_compression_rate=2)
    >>> [g.members for g in plan.groups], plan.uncompressed, plan.numel_sent
    ([(0, 2)], (1,), 448)
    >>> plan = make_plan([(64, 32), (64,), (64, 32)], 2, 2, ranks=[None, 2, 4])
    >>> [(g.members, g.rank) for g in plan.groups], plan.uncompressed
    ([((2,), 4)], (0, 1))
    >>> [(g.n, g.m, g.members) for g in make_plan([(96, 32), (32, 96)], 2, 2, orient=True).groups]
    [(96, 32, (0, 1))]
    """
    given_shapes = list(_iterable(shapes, "shapes", "tensor shapes"))
    per_tensor: list[int | None] = [_checked_rank(rank, "rank")] * len(given_shapes)
    if ranks is not None:
        given_ranks = list(_iterable(ranks, "ranks", "ranks (an int or None per tensor)"))
        if len(given_ranks) != len(given_shapes):
            raise ValueError(f"ranks has {len(given_ranks)} entries for {len(given_shapes)} tensors: give one per "
                             "tensor")
        per_tensor = [None if r is None else _checked_rank(r, f"ranks[{i}]") for i, r in enumerate(given_ranks)]
    if isinstance(min_compression_rate, bool) or not isinstance(min_compression_rate, numbers.Real) \
            or not min_compression_rate >= 0:
        raise ValueError(f"min_compression_rate must be a number >= 0, got {min_compression_rate!r}")
    if not isinstance(orient, bool):
        raise TypeError(f"orient must be a bool, got {orient!r}")
    tensors: list[TensorPlan] = []
    offset = 0
    for index, (given, wanted) in enumerate(zip(given_shapes, per_tensor)):
        shape = _checked_shape(index, given)
        numel = 1
        for size in shape:
            numel *= size
        n, m = as_matrix_shape(shape)
        r = max(1, min(n, m, wanted or 1))
        compressed = wanted is not None and len(shape) >= 2 and numel > 0 \
            and should_compress(n, m, r, min_compression_rate)
        tensors.append(TensorPlan(index, shape, offset, numel, (n, m), r, compressed,
                                  transposed=bool(orient and compressed and n < m)))
        offset += numel

    by_key: dict[tuple[int, int, int], list[int]] = {}
    for t in tensors:
        if t.compressed:
            by_key.setdefault((*t.oriented, t.rank), []).append(t.index)
    groups = []
    p = q = 0
    for (n, m, r), members in by_key.items():
        groups.append(GroupPlan(n, m, r, tuple(members), p, q))
        p += len(members) * n * r
        q += len(members) * m * r
    uncompressed = tuple(t.index for t in tensors if not t.compressed)
    return Plan(tuple(tensors), tuple(groups), uncompressed, p, q,
                sum(tensors[i].numel for i in uncompressed))


def _checked_rank(value: object, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
        raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
    return int(value)


def _iterable(value: object, name: str, what: str) -> Iterable[object]:
    """``value`` if it is an iterable other than a string, else a ``TypeError`` naming ``name``."""
    if isinstance(value, (str, bytes)) or not isinstance(value, Iterable):
        raise TypeError(f"{name} must be a sequence of {what}, got {value!r}")
    return value


def _checked_shape(index: int, shape: object) -> tuple[int, ...]:
    """``shapes[index]`` as a tuple of ints; ``TypeError``/``ValueError`` naming it if it is not a shape."""
    dims: list[int] = []
    for size in _iterable(shape, f"shapes[{index}]", "ints (a torch.Size or a tuple)"):
        if isinstance(size, bool) or not isinstance(size, numbers.Integral):
            raise TypeError(f"shapes[{index}] must be a sequence of ints (a torch.Size or a tuple), got {shape!r}")
        if size < 0:
            raise ValueError(f"shapes[{index}] must have sizes >= 0, got {shape!r}")
        dims.append(int(size))
    return tuple(dims)

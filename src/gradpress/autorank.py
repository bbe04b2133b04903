"""Automatic rank: PowerSGD's rank chosen on the model's own averaged gradients, once, before compression.

During the last ``measure_iters`` iterations of the warm-up (``start_powerSGD_iter``), every worker holds
the exact mean gradient (the warm-up is an allreduce). ``AutoRank`` measures, for every rank k up to
``max_rank``, the share of that mean's energy a rank-k approximation of each matrix would carry: the
**captured energy**

    E(k) = sum over matrices of ||best rank-k approximation of G||^2 / sum over matrices of ||G||^2

(a matrix that rank k would send exactly, because compressing it would not pay ``min_compression_rate``,
counts whole; vectors are left out: they are always sent exactly).

How much of the mean a rank may leave behind depends on the batch: the larger the global batch, the less
noise the mean carries, and the less residual it takes to matter. So by default
(``criterion="noise"``) it also measures the **noise energy of the mean**, from the workers' own
gradients before the warm-up's allreduce (one squared norm per matrix, summed on each worker, no
collective of its own): with W workers, S the workers' mean of ||g_i||^2 and T = ||mean g||^2,

    N = (S - T) / (W - 1)

estimates E||mean g - E mean g||^2 without bias, and the **residual over noise** of rank k is

    R(k) = (1 - E(k)) T / N.

Compression starts at the smallest rank of :meth:`AutoRank.candidates` whose R(k) is at most
``noise_multiple`` (``max_rank`` if none is). ``criterion="energy"`` (the rule before) instead takes the
smallest whose E(k) reaches ``threshold``; a run on one worker, whose noise cannot be read this way, and
one whose workers' gradients are identical (the same data on every worker) decide by the energy too, and
the log says so. Both pool the measured iterations and the workers (energies summed, one all-reduce of
``max_rank + 2`` floats at the first compressed iteration, so every rank takes the same decision).
The candidates start at a floor, ``min_rank`` (by default :data:`DEFAULT_MIN_RANK`, 32, or ``max_rank``
if that is lower): below it the energy alone chose ranks that fell behind on data seen about once. With
``width_floor`` (the default) and no ``min_rank`` the floor is raised to the width rule's rank for the
compressed matrices' width (:func:`width_rule`: 2 sqrt(width) up the ladder, the quality map's rule
without its batch term): at width 768 the noise criterion alone chose 32 where it fell behind and the
rule's 64 held, and on the map's settings the criterion's ranks are at or above the rule's, so the floor
costs them no bytes.
The decision is logged at INFO, kept in the state's checkpoints, and a resume does not decide again.

E(k) comes from the singular values of each mean gradient: exactly for matrices with at most
``max_rank + 8`` rows or columns, else by a randomized range finder (``max_rank + 8`` Gaussian columns,
one power iteration; Halko, Martinsson and Tropp 2011), whose estimate can only fall short of the exact
value, so the rank it picks errs high. Matrices of one shape are measured together (one batched product
per shape). Nothing is read on the host until the decision.

What multiple to use is a measured question, not a law: docs/tuning.md ("A rank chosen on your own
gradients") gives the study behind the default (:data:`DEFAULT_NOISE_MULTIPLE`) and the energy's
threshold (0.997), and where each held and where it did not.

>>> import torch
>>> g = torch.randn(64, 8) @ torch.randn(8, 96)          # a rank-8 matrix
>>> profile = energy_profile([g], max_rank=16, min_compression_rate=1.0, seed=0)
>>> round(float(profile[7] / profile[-1]), 4), round(float(profile[3] / profile[-1]), 2) < 1
(1.0, True)
>>> AutoRank(threshold=0.9, max_rank=16, min_rank=1, criterion="energy").choose(
...     [0.5, 0.7, 0.8, 0.85, 0.88, 0.89, 0.9, 0.95] + [1.0] * 8)
8
>>> # residual over noise R(k) = (1 - E(k)) T / N: here 0.8 / k, since T = 10 N and 1 - E(k) = 0.08 / k
>>> AutoRank(max_rank=16, min_rank=1, noise_multiple=0.25).choose_by_noise(
...     [1 - 0.08 / k for k in range(1, 17)], total=10.0, noise=1.0)
4
>>> AutoRank(max_rank=64).candidates()   # the default floor, 32
(32, 48, 64)
>>> AutoRank(max_rank=128).candidates(width=768)   # raised to the width rule's 64 for width-768 matrices
(64, 96, 128)
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import Tensor

from .powersgd.linalg import as_matrix_shape
from .powersgd.plan import should_compress
from .powersgd.seeding import upload

__all__ = ["CRITERIA", "DEFAULT_MIN_RANK", "DEFAULT_NOISE_MULTIPLE", "WIDTH_RULE_COEFFICIENT", "AutoRank",
           "energy_profile", "matrix_width", "up_the_ladder", "width_rule"]

#: What :class:`AutoRank` decides by: the residual a rank leaves against the mean's noise, or the energy
#: it captures alone.
CRITERIA = ("noise", "energy")

#: The ranks an automatic rank chooses from (up to ``max_rank``, which is always a candidate).
RANK_LADDER = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512)

#: The lowest rank :class:`AutoRank` chooses unless given ``min_rank`` (at most its ``max_rank``). On the
#: quality study's AdamW GPTs on data seen about once (docs/tuning.md), six of the eight runs at a rank
#: below 32 (width 128's 16 and 24, width 256's 24) fell behind allreduce by more than 1.5%, two of them
#: at ranks ``AutoRank(0.995)`` chose from the energy alone (E(24) 0.998), and rank 32 held at width 128's
#: five batches (2-32 workers' worth) and on the mean of three seeds at width 256's smallest batch. Above
#: the floor the energy tells the measured ranks apart at the default threshold. The width rule has the
#: same floor.
DEFAULT_MIN_RANK = 32

#: The residual a rank may leave in the averaged gradient, as a multiple of that average's noise energy
#: (``AutoRank(criterion="noise")``), fitted on the quality study's settings (docs/tuning.md, "A rank
#: chosen on your own gradients"): below it every rank the study trained held, above it each fell behind.
DEFAULT_NOISE_MULTIPLE = 0.011

#: The width rule's coefficient: the rank ``WIDTH_RULE_COEFFICIENT * sqrt(width)``, up the ladder
#: (:func:`width_rule`; the quality map's rule, ``gradpress.tools.quality_map.width_rule_rank``, adds its
#: batch term).
WIDTH_RULE_COEFFICIENT = 2.0


def width_rule(width: int, factor: float = 1.0) -> int:
    """The smallest rank of :data:`RANK_LADDER` at least ``WIDTH_RULE_COEFFICIENT * sqrt(width) * factor``
    and at least :data:`DEFAULT_MIN_RANK` (past the ladder's top, that product rounded up), at most
    ``width``.

    >>> [width_rule(w) for w in (16, 128, 256, 384, 768, 4096)]
    [16, 32, 32, 48, 64, 128]
    """
    if isinstance(width, bool) or not isinstance(width, int) or width < 1:
        raise ValueError(f"width must be an integer >= 1, got {width!r}")
    return min(width, up_the_ladder(max(DEFAULT_MIN_RANK, WIDTH_RULE_COEFFICIENT * math.sqrt(width) * factor)))


def up_the_ladder(target: float) -> int:
    """The smallest rank of :data:`RANK_LADDER` at least ``target`` (past its top, ``target`` rounded up); a
    product that is a ladder rank in exact arithmetic stays that rank.

    >>> up_the_ladder(55.4), up_the_ladder(48.0000000001), up_the_ladder(600)
    (64, 48, 600)
    """
    target = round(target, 9)
    return next((r for r in RANK_LADDER if r >= target), math.ceil(target))


def matrix_width(shapes: Iterable[tuple[int, int]]) -> int:
    """The width of matrices of ``shapes`` (``(n, m)`` views, as PowerSGD compresses them): the median of
    ``min(n, m)`` over them, each weighted by its elements (a transformer of width d gives d, an LSTM its
    hidden size); 0 without one.

    >>> matrix_width([(512, 128), (128, 128), (97, 128)])
    128
    """
    matrices = sorted((min(n, m), n * m) for n, m in shapes if n * m)
    total, seen = sum(numel for _, numel in matrices), 0
    for width, numel in matrices:
        seen += numel
        if 2 * seen >= total:
            return width
    return 0


#: Extra columns of the randomized range finder.
OVERSAMPLING = 8


@dataclass(frozen=True)
class AutoRank:
    """Choose PowerSGD's rank from the averaged gradients at the end of the warm-up: the residual a rank
    leaves against the noise of the average, or the energy it captures (see :mod:`gradpress.autorank`).

    Args:
        threshold: with ``criterion="energy"`` (and where the noise cannot be measured: one worker), the
            captured energy E(k) in (0, 1] the chosen rank must reach. The default, 0.997,
            chooses, on every setting of the quality study's GPTs where the chosen rank was trained, one
            that held, above the floor (docs/tuning.md, "A rank chosen on your own gradients"); 0.996, the
            default before, chose rank 32 at width 256 and 16 workers' worth (E(32) 0.9967), where it fell
            behind, and 0.995, before it, chose 32 there from 4 workers' worth up (E(32) 0.9952 and 0.9954).
            It costs more bytes than the noise criterion where the batch is small.
        max_rank: the highest rank it may choose (>= 1), also the one taken when no lower rank reaches
            ``threshold``.
        measure_iters: how many of the last warm-up iterations are measured (>= 1; fewer if the warm-up
            is shorter).
        min_rank: the lowest rank it may choose (1 <= ``min_rank`` <= ``max_rank``); ``None`` (the default):
            :data:`DEFAULT_MIN_RANK`, or ``max_rank`` if that is lower. ``min_rank=1`` lets the energy alone
            decide (how the study's ``AutoRank`` runs before this floor chose).
        criterion: ``"noise"`` (the default): the smallest candidate whose residual over noise R(k) is at
            most ``noise_multiple``; ``"energy"``: the smallest whose E(k) reaches ``threshold`` (the rule
            of earlier versions, and of rules saved or pickled by them).
        noise_multiple: with ``criterion="noise"``, the largest R(k) (> 0) the chosen rank may leave; the
            default, :data:`DEFAULT_NOISE_MULTIPLE`, is fitted on the study's settings.
        width_floor: without ``min_rank``, raise the default floor to :func:`width_rule` of the measured
            matrices' width (:func:`matrix_width`; at most ``max_rank``): on a width-768 model the noise
            criterion alone chose a rank that fell behind where the rule's held. ``False`` (and wherever
            ``min_rank`` is given): the floor is :attr:`floor` alone (rules saved or pickled before this
            option had none).

    >>> import gradpress
    >>> state = gradpress.PowerSGDState(None, matrix_approximation_rank=64, start_powerSGD_iter=80,
    ...                                 auto_rank=gradpress.AutoRank(threshold=0.997, max_rank=64))
    """

    threshold: float = 0.997
    max_rank: int = 64
    measure_iters: int = 4
    min_rank: int | None = None
    criterion: Literal["noise", "energy"] = "noise"
    noise_multiple: float = DEFAULT_NOISE_MULTIPLE
    width_floor: bool = True

    def __post_init__(self) -> None:
        for name in ("max_rank", "measure_iters"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"AutoRank.{name} must be an integer >= 1, got {value!r}")
        threshold = self.threshold
        if isinstance(threshold, bool) or not isinstance(threshold, (int, float)) or not 0 < threshold <= 1:
            raise ValueError(f"AutoRank.threshold must be a number in (0, 1], got {threshold!r}")
        low = self.min_rank
        if low is not None and (isinstance(low, bool) or not isinstance(low, int) or not 1 <= low <= self.max_rank):
            raise ValueError(f"AutoRank.min_rank must be None or an integer from 1 to max_rank ({self.max_rank}), "
                             f"got {low!r}")
        if self.criterion not in CRITERIA:
            raise ValueError(f"AutoRank.criterion must be one of {', '.join(map(repr, CRITERIA))}, "
                             f"got {self.criterion!r}")
        multiple = self.noise_multiple
        if isinstance(multiple, bool) or not isinstance(multiple, (int, float)) or not 0 < multiple < math.inf:
            raise ValueError(f"AutoRank.noise_multiple must be a finite number > 0, got {multiple!r}")
        if not isinstance(self.width_floor, bool):
            raise ValueError(f"AutoRank.width_floor must be True or False, got {self.width_floor!r}")

    def __setstate__(self, state: dict[str, Any]) -> None:
        # A rule pickled before min_rank existed chose by the energy alone, from rank 1; one pickled before
        # the criterion existed, by the energy.
        for name, value in {**_SAVED_BEFORE, **state}.items():
            object.__setattr__(self, name, value)

    @property
    def floor(self) -> int:
        """The lowest rank it chooses: ``min_rank``, or :data:`DEFAULT_MIN_RANK` capped at ``max_rank``."""
        return min(DEFAULT_MIN_RANK, self.max_rank) if self.min_rank is None else self.min_rank

    def floor_for(self, width: int | None = None) -> int:
        """The lowest rank it chooses for matrices of ``width`` (``None`` or 0: not known): :attr:`floor`,
        and where that is the default one (no ``min_rank``) and ``width_floor`` is on, raised to
        :func:`width_rule` ``(width)`` (at most ``max_rank``)."""
        if not self.width_floor or not width or self.min_rank is not None:
            return self.floor
        return max(self.floor, min(self.max_rank, width_rule(width)))

    def candidates(self, width: int | None = None) -> tuple[int, ...]:
        """The ranks it chooses from: :meth:`floor_for` ``(width)``, the ranks of :data:`RANK_LADDER`
        between it and ``max_rank``, and ``max_rank``."""
        floor = self.floor_for(width)
        return tuple(sorted({r for r in RANK_LADDER if floor < r < self.max_rank} | {floor, self.max_rank}))

    def choose(self, captured: Sequence[float], width: int | None = None) -> int:
        """The smallest candidate rank k (for matrices of ``width``) whose ``captured[k - 1]`` (E(k))
        reaches ``threshold`` (the energy criterion, whatever ``criterion`` says)."""
        for rank in self.candidates(width):
            if captured[rank - 1] >= self.threshold:
                return rank
        return self.max_rank

    def choose_by_noise(self, captured: Sequence[float], total: float, noise: float,
                        width: int | None = None) -> int:
        """The smallest candidate rank k (for matrices of ``width``) whose residual over noise, ``(1 -
        captured[k - 1]) * total / noise`` (R(k); ``total``: the mean's energy T, ``noise``: its noise
        energy N > 0), is at most ``noise_multiple`` (the noise criterion, whatever ``criterion`` says)."""
        ranks = self.candidates(width)
        for rank, ratio in zip(ranks, residual_over_noise(captured, total, noise, ranks)):
            if ratio <= self.noise_multiple:
                return rank
        return self.max_rank

    def to_dict(self) -> dict[str, Any]:
        """The keyword arguments that rebuild it (a checkpoint's form)."""
        return {"threshold": self.threshold, "max_rank": self.max_rank, "measure_iters": self.measure_iters,
                "min_rank": self.min_rank, "criterion": self.criterion, "noise_multiple": self.noise_multiple,
                "width_floor": self.width_floor}

    @classmethod
    def from_saved(cls, saved: dict[str, Any]) -> AutoRank:
        """The rule a checkpoint's :meth:`to_dict` was saved from; one saved before ``min_rank`` existed
        (no such key) chose from rank 1, one saved before ``criterion`` existed by the energy, one saved
        before ``width_floor`` existed without it."""
        return cls(**{**_SAVED_BEFORE, **saved})


#: What a rule saved or pickled before an option existed did: chose from rank 1 (before ``min_rank``) and
#: by the energy alone (before ``criterion``), with no width floor (before ``width_floor``).
_SAVED_BEFORE: dict[str, Any] = {"min_rank": 1, "criterion": "energy", "noise_multiple": DEFAULT_NOISE_MULTIPLE,
                                 "width_floor": False}


def residual_over_noise(captured: Sequence[float], total: float, noise: float,
                        ranks: Sequence[int]) -> list[float]:
    """R(k) = (1 - E(k)) T / N for each of ``ranks`` (``captured[k - 1]``: E(k); ``total``: T; ``noise``:
    N > 0)."""
    return [max(0.0, 1.0 - captured[k - 1]) * total / noise for k in ranks]


def energy_profile(matrices: Sequence[Tensor], max_rank: int, min_compression_rate: float,
                   seed: int) -> Tensor:
    """``(max_rank + 1,)`` float64 on the matrices' device: entry ``k - 1`` is the energy (squared
    Frobenius norm) that rank-``k`` approximations of ``matrices`` carry, a matrix that rank ``k`` would
    not compress counted whole; the last entry is their total energy. Each tensor is viewed as
    ``(shape[0], -1)``; ``seed`` draws the range finder's test matrices (the same on every worker)."""
    device = matrices[0].device if matrices else torch.device("cpu")
    out = torch.zeros(max_rank + 1, dtype=torch.float64, device=device)
    groups: dict[tuple[int, int], list[Tensor]] = defaultdict(list)
    for matrix in matrices:
        n, m = as_matrix_shape(tuple(matrix.shape))
        if n and m:
            groups[(n, m)].append(matrix.reshape(n, m))
    generator = torch.Generator().manual_seed(seed)
    for (n, m), members in sorted(groups.items()):
        stack = torch.stack(members).float()
        total = stack.square().sum(dim=(1, 2), dtype=torch.float64)             # (N,)
        values = _singular_values(stack, max_rank, generator).double().square()  # (N, s), descending
        kept = values.cumsum(dim=1)
        ranks = torch.arange(1, max_rank + 1)
        kept = kept[:, upload(ranks.clamp(max=kept.shape[1]) - 1, device)]       # (N, max_rank)
        compressed = upload(torch.tensor([should_compress(n, m, int(k), min_compression_rate) for k in ranks]),
                            device)
        out[:max_rank] += torch.where(compressed, kept, total[:, None]).sum(dim=0)
        out[max_rank] += total.sum()
    return out


def _singular_values(stack: Tensor, max_rank: int, generator: torch.Generator) -> Tensor:
    """The leading singular values of each matrix of ``stack`` (N, n, m): all of them where ``min(n, m)
    <= max_rank + OVERSAMPLING``, else ``max_rank + OVERSAMPLING`` of them from a randomized range finder
    with one power iteration (each at most the true one)."""
    n, m = stack.shape[1:]
    columns = max_rank + OVERSAMPLING
    if min(n, m) <= columns:
        return torch.linalg.svdvals(stack)
    omega = upload(torch.randn(m, columns, generator=generator), stack.device)
    basis = torch.linalg.qr(stack @ omega).Q                                    # (N, n, s)
    basis = torch.linalg.qr(stack @ torch.linalg.qr(stack.mT @ basis).Q).Q      # one power iteration
    return torch.linalg.svdvals(basis.mT @ stack)                               # (N, s)


class RankDecision:
    """One state's automatic rank in progress: the profile summed over the measured iterations (and, for
    the noise criterion, this worker's own squared norms before averaging), then the decision (the same on
    every rank), and their checkpoint form."""

    __slots__ = ("rule", "profile", "local", "measured", "rank", "captured", "noise_ratio", "shapes")

    def __init__(self, rule: AutoRank) -> None:
        self.rule = rule
        self.profile: Tensor | None = None   # sum over measured iterations of E's numerators, and the total
        self.local: Tensor | None = None     # sum over them of this worker's ||g||^2 before averaging
        self.measured = 0                    # iterations measured
        self.rank: int | None = None         # the decision (None: not taken yet)
        self.captured: list[float] | None = None  # E(1..max_rank) it was taken on
        self.noise_ratio: list[float] | None = None  # R(1..max_rank) it was taken on; None: the energy decided
        self.shapes: list[tuple[int, int]] = []   # the measured matrices' (n, m) views (the same on every rank)

    def measures(self, iteration: int, start: int) -> bool:
        """Whether warm-up ``iteration`` (of ``start``) is measured: one of the last ``measure_iters``."""
        return self.rank is None and start - self.rule.measure_iters <= iteration < start

    def add_local(self, matrices: Sequence[Tensor]) -> None:
        """Add this worker's own ``matrices`` (one bucket's, before they are averaged) to its squared norm
        (on the device, no read); only for the noise criterion."""
        if self.rule.criterion != "noise" or not matrices:
            return
        norms = torch.stack([torch.linalg.vector_norm(m.reshape(-1), dtype=torch.float64) for m in matrices])
        square = norms.square().sum()
        self.local = square if self.local is None else self.local.add_(square.to(self.local.device))

    def add(self, matrices: Sequence[Tensor], min_compression_rate: float, seed: int) -> None:
        """Add the averaged ``matrices`` of one bucket of a measured iteration (on the device, no read)."""
        if not matrices:
            return
        if self.measured == 0:   # the shapes of one iteration: every measured iteration has the same
            self.shapes.extend(as_matrix_shape(tuple(m.shape)) for m in matrices)
        profile = energy_profile(matrices, self.rule.max_rank, min_compression_rate, seed)
        self.profile = profile if self.profile is None else self.profile.add_(profile.to(self.profile.device))

    def end_iteration(self) -> None:
        self.measured += 1

    @property
    def width(self) -> int:
        """The measured matrices' :func:`matrix_width` (0 before any was measured)."""
        return matrix_width(self.shapes)

    def decide(self, comm: Any, fallback: int, device: torch.device) -> tuple[int, list[float] | None]:
        """Average the profile (and the workers' own squared norms) over the workers (one all-reduce on
        ``device``, every rank calls it) and decide: the rank and E(1..max_rank) (``fallback`` and ``None``
        where no rank measured anything)."""
        size = self.rule.max_rank + 1
        noise_criterion = self.rule.criterion == "noise"
        vector = torch.zeros(size + noise_criterion, dtype=torch.float64, device=device)
        if self.profile is not None:
            vector[:size] = self.profile.to(device, torch.float64)
        if noise_criterion and self.local is not None:
            vector[size] = self.local.to(device, torch.float64)
        world = comm.world_size
        vector = vector.div(world) if world > 1 else vector.clone()
        comm.allreduce_sum(vector).wait()
        values = vector.tolist()  # the decision's one host read
        total = values[size - 1]
        if not total > 0:
            self.rank = fallback
            return fallback, None
        self.captured = [v / total for v in values[:size - 1]]
        noise = (values[size] - total) / (world - 1) if noise_criterion and world > 1 else 0.0
        if noise > total * 1e-9:   # identical workers' gradients (or one worker) carry no noise to compare with
            self.noise_ratio = residual_over_noise(self.captured, total, noise, range(1, size))
            self.rank = self.rule.choose_by_noise(self.captured, total, noise, self.width)
        else:
            self.rank = self.rule.choose(self.captured, self.width)
        self.profile = self.local = None
        return self.rank, self.captured

    def state(self) -> dict[str, Any]:
        return {"rule": self.rule.to_dict(), "rank": self.rank, "measured": self.measured, "captured": self.captured,
                "profile": None if self.profile is None else self.profile.detach().cpu().tolist(),
                "local": None if self.local is None else float(self.local),
                "noise_ratio": self.noise_ratio, "shapes": [list(shape) for shape in self.shapes]}

    def load(self, state: dict[str, Any]) -> None:
        self.rank = state.get("rank")
        self.measured = int(state.get("measured", 0))
        self.captured = state.get("captured")
        profile = state.get("profile")
        self.profile = None if profile is None else torch.tensor(profile, dtype=torch.float64)
        local = state.get("local")
        self.local = None if local is None else torch.tensor(local, dtype=torch.float64)
        self.noise_ratio = state.get("noise_ratio")
        self.shapes = [(int(n), int(m)) for n, m in state.get("shapes") or []]

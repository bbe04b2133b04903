"""DiLoCo's outer settings at short periods: what was measured, and a warning, logged once, for a
setting measured to end behind not synchronizing at all.

The averagers' defaults, outer lr 0.7 with Nesterov momentum 0.9, are the DiLoCo paper's, tuned for
periods of hundreds of steps on large models. On the study's GPT (the replica simulator, AdamW at its
tuned 3e-3, 16 sequences per replica per step, the same weights and data order for every method of a seed;
BENCHMARKS.md, "DiLoCo's outer settings at short periods") they ended **behind not synchronizing at all**
in 200-step runs at period 20 on 2, 4 and 8 replicas (on one or more seeds) and at 10 on 4, as did outer
momentum 0.5 with outer lr 1.0 and, on 2 replicas, outer lr 0.3 without momentum
(:data:`MEASURED_LOSSES`); there outer momentum 0 with outer lr 0.7 to 1.0 did best. In an 800-step run
(39 outer steps at period 20) momentum paid: on 2 replicas 0.7 with 0.5 ended best, on 4 and 8 the
defaults, all well ahead of plain averaging. :func:`warn_if_measured_to_lose` logs the loss once per setting, from
:class:`gradpress.OuterOptimizerAverager`'s constructor.

>>> short_period_loss(period=20, outer_lr=0.7, outer_momentum=0.9) is not None, short_period_loss(500, 0.7, 0.9)
(True, None)

:func:`advise_outer` gives the outer settings for a period, a number of replicas and a run length: the
best measured at the nearest measured setting (periods 10 to 100, 2 to 8 replicas, 200 and 800 steps),
and says where that best was plain averaging (outer lr 1, no momentum: local SGD at the same period),
i.e. where DiLoCo's outer optimizer did not beat it:

>>> advice = advise_outer(period=20, replicas=4)
>>> advice.outer_lr, advice.outer_momentum, advice.status
(0.85, 0.0, 'measured')
>>> advise_outer(20, 8).plain_averaging, advise_outer(20, 2, steps=800).arguments, advise_outer(500, 8).status
(True, 'outer_lr=0.7, outer_momentum=0.5', "the paper's (not measured here)")
"""

from __future__ import annotations

import logging
import math
from typing import NamedTuple

__all__ = ["MEASURED_BEST", "MEASURED_LOSSES", "MeasuredBest", "MeasuredLoss", "OuterAdvice", "advise_outer",
           "short_period_loss", "warn_if_measured_to_lose"]

logger = logging.getLogger("gradpress.averaging")


class MeasuredLoss(NamedTuple):
    """One measured run that ended behind not synchronizing: final perplexity against tuned allreduce's
    (of the same seed), of DiLoCo at ``period`` with ``outer_lr`` and ``outer_momentum`` on ``replicas``,
    and of no sync; ``steps``, the run's length, and ``seed``, its weights' and data order's."""

    replicas: int
    period: int
    outer_lr: float
    outer_momentum: float
    vs_allreduce: float
    no_sync_vs_allreduce: float
    steps: int = 200
    seed: int = 0


#: Every measured run that ended behind no synchronization after warm-up (``benchmarks/results/diloco-outer``;
#: a test checks each against its JSON, and that no other run there did).
MEASURED_LOSSES: tuple[MeasuredLoss, ...] = (
    MeasuredLoss(4, 10, 0.7, 0.9, 0.329, 0.277),
    MeasuredLoss(2, 20, 0.3, 0.0, 0.189, 0.132),
    MeasuredLoss(2, 20, 0.7, 0.9, 0.138, 0.132),
    MeasuredLoss(2, 20, 0.7, 0.9, 0.297, 0.212, 200, 1),
    MeasuredLoss(2, 20, 0.7, 0.9, 0.246, 0.104, 200, 2),
    MeasuredLoss(4, 20, 0.7, 0.9, 0.312, 0.277),
    MeasuredLoss(4, 20, 1.0, 0.5, 0.28, 0.277),
    MeasuredLoss(4, 20, 1.0, 0.9, 0.451, 0.277),
    MeasuredLoss(8, 20, 0.7, 0.9, 0.432, 0.376),
)


class MeasuredBest(NamedTuple):
    """The best outer settings measured at ``period`` on ``replicas`` in runs of ``steps`` (final perplexity
    against tuned allreduce's, the mean over ``seeds`` seeds, each against allreduce of its own seed),
    beside plain averaging (outer lr 1, momentum 0), the defaults (0.7, 0.9) and no sync (their means
    over the seeds each was measured on). The best is chosen among the settings measured on the most
    seeds there."""

    replicas: int
    period: int
    outer_lr: float
    outer_momentum: float
    vs_allreduce: float
    plain_vs_allreduce: float
    defaults_vs_allreduce: float
    no_sync_vs_allreduce: float
    steps: int = 200
    seeds: int = 1


#: The best DiLoCo setting of each measured (replicas, period, steps) (``benchmarks/results/diloco-outer``; a
#: test checks each against the JSON: no setting measured on as many seeds there did better on their mean).
MEASURED_BEST: tuple[MeasuredBest, ...] = (
    MeasuredBest(2, 20, 0.85, 0.0, 0.062, 0.064, 0.227, 0.15, 200, 3),
    MeasuredBest(2, 20, 0.7, 0.5, 0.032, 0.08, 0.055, 0.531, 800, 1),
    MeasuredBest(2, 100, 1.0, 0.0, 0.136, 0.136, 0.144, 0.531, 800, 1),
    MeasuredBest(4, 10, 0.5, 0.0, 0.107, 0.149, 0.329, 0.277),
    MeasuredBest(4, 20, 0.85, 0.0, 0.125, 0.142, 0.24, 0.246, 200, 2),
    MeasuredBest(4, 20, 0.7, 0.9, 0.076, 0.152, 0.076, 0.739, 800, 1),
    MeasuredBest(4, 50, 0.5, 0.0, 0.171, 0.178, 0.252, 0.277),
    MeasuredBest(8, 20, 1.0, 0.0, 0.283, 0.283, 0.376, 0.45, 200, 2),
    MeasuredBest(8, 20, 0.7, 0.9, 0.061, 0.124, 0.061, 1.104, 800, 1),
    MeasuredBest(16, 20, 1.4, 0.0, 0.385, 0.403, 0.496, 0.571, 200, 1),
)

#: Up to this period :func:`advise_outer` reads :data:`MEASURED_BEST`; from :data:`PAPER_PERIOD` on it
#: gives the paper's settings, and between the two the nearest measured period's, said to be beyond it.
LONGEST_MEASURED = max(row.period for row in MEASURED_BEST)
PAPER_PERIOD = 500


class OuterAdvice(NamedTuple):
    """Outer settings for a period: ``outer_lr`` and ``outer_momentum`` (Nesterov), ``status`` (``"measured"``,
    ``"nearest measured"``, ``"beyond the measured periods"`` or ``"the paper's (not measured here)"``),
    ``plain_averaging`` (the advice is outer lr 1 without momentum: plain averaging, local SGD at that
    period, did at least as well as any outer optimizer measured there), ``reason`` (one sentence with
    the figures) and ``evidence`` (the measured row read, if any)."""

    outer_lr: float
    outer_momentum: float
    status: str
    plain_averaging: bool
    reason: str
    evidence: MeasuredBest | None

    @property
    def arguments(self) -> str:
        """``"outer_lr=0.7, outer_momentum=0.0"``: the averagers' keyword arguments."""
        return f"outer_lr={self.outer_lr:g}, outer_momentum={self.outer_momentum:g}"


def advise_outer(period: int, replicas: int | None = None, steps: int | None = None) -> OuterAdvice:
    """DiLoCo's outer settings for synchronizing every ``period`` steps over ``replicas`` (``None``: the
    most measured count, 4) in a run of ``steps`` (``None``: the most measured length, 200). Up to
    :data:`LONGEST_MEASURED`: the best measured at the nearest measured (period, replicas, steps)
    (nearest in log-distance, the period first, then the replicas); from :data:`PAPER_PERIOD`: the
    paper's outer lr 0.7 with Nesterov momentum 0.9; between, the longest measured period's best, said
    so. Where the best measured was plain averaging, ``plain_averaging`` is true and the reason says
    DiLoCo's outer optimizer did not beat it at that period (use ``PeriodicModelAverager`` there, or the
    outer settings given: the same steps).

    >>> advise_outer(10).arguments, advise_outer(200).status
    ('outer_lr=0.5, outer_momentum=0', 'beyond the measured periods')
    """
    if isinstance(period, bool) or not isinstance(period, int) or period < 1:
        raise ValueError(f"period must be an integer >= 1, got {period!r}")
    if replicas is not None and (isinstance(replicas, bool) or not isinstance(replicas, int) or replicas < 2):
        raise ValueError(f"replicas must be None or an integer >= 2, got {replicas!r}")
    if steps is not None and (isinstance(steps, bool) or not isinstance(steps, int) or steps < 1):
        raise ValueError(f"steps must be None or an integer >= 1, got {steps!r}")
    if period >= PAPER_PERIOD:
        return OuterAdvice(0.7, 0.9, "the paper's (not measured here)", False,
                           f"at period {period} (hundreds of steps), the DiLoCo paper's outer lr 0.7 with Nesterov "
                           f"momentum 0.9; measured here only up to {LONGEST_MEASURED}, where momentum 0 did better",
                           None)
    wanted = 4 if replicas is None else replicas
    length = 200 if steps is None else steps
    row = min(MEASURED_BEST, key=lambda r: (abs(math.log(r.period / min(period, LONGEST_MEASURED))),
                                             abs(math.log(r.replicas / wanted)), abs(math.log(r.steps / length)),
                                             -r.period))
    exact = row.period == period and row.replicas == wanted and row.steps == length
    status = "measured" if exact else ("beyond the measured periods" if period > LONGEST_MEASURED
                                       else "nearest measured")
    plain = row.outer_lr == 1.0 and row.outer_momentum == 0.0
    where = f"period {row.period} on {row.replicas} replicas"
    seeds = "" if row.seeds == 1 else f", the mean of {row.seeds} seeds"
    reason = (f"read at {where} (the study's GPT, {row.steps} steps{seeds}): outer lr {row.outer_lr:g}, momentum "
              f"{row.outer_momentum:g} ended "
              f"{100 * row.vs_allreduce:+.1f}% from allreduce in perplexity; the defaults 0.7 / 0.9 "
              f"{100 * row.defaults_vs_allreduce:+.1f}%, no sync after warm-up {100 * row.no_sync_vs_allreduce:+.1f}%")
    if plain:
        reason += ("; plain averaging (local SGD at this period) was the best measured there: DiLoCo's outer "
                   "optimizer did not beat it")
    else:
        reason += f", plain averaging {100 * row.plain_vs_allreduce:+.1f}%"
    near = _longer_run(row.period, row.steps, wanted)
    if steps is None and near is not None:  # the run's length was not given: say what a longer run chose
        reason += (f"; in runs of {near.steps} steps ({near.replicas} replicas) the best was outer lr "
                   f"{near.outer_lr:g}, momentum {near.outer_momentum:g} ({100 * near.vs_allreduce:+.1f}%): "
                   "advise_outer(period, replicas, steps) reads the run's length")
    return OuterAdvice(row.outer_lr, row.outer_momentum, status, plain, reason, row)


def _longer_run(period: int, steps: int, replicas: int) -> MeasuredBest | None:
    """The :data:`MEASURED_BEST` row at ``period`` from runs longer than ``steps``, the nearest to
    ``replicas`` (in log-distance); ``None`` where no longer run was measured at that period."""
    longer = [r for r in MEASURED_BEST if r.period == period and r.steps > steps]
    return min(longer, key=lambda r: abs(math.log(r.replicas / replicas)), default=None)


_warned: set[tuple[str, int, float, float]] = set()


def short_period_loss(period: int, outer_lr: float, outer_momentum: float) -> MeasuredLoss | None:
    """The measured run that says DiLoCo at ``period`` with ``outer_lr`` and ``outer_momentum`` loses to not
    syncing: one with these outer settings at that period or a longer one (a shorter period only went
    further behind in every measured pair). ``None`` where no measured run says so: other settings are
    not extrapolated (an outer lr too small lost too, 0.3 on 2 replicas, so neither direction is safe)."""
    for row in sorted(MEASURED_LOSSES, key=lambda r: (r.period, r.replicas)):
        if period <= row.period and math.isclose(outer_lr, row.outer_lr) and \
                math.isclose(outer_momentum, row.outer_momentum):
            return row
    return None


def warn_if_measured_to_lose(owner: str, period: int, outer_lr: float, outer_momentum: float) -> bool:
    """Log a warning, once per ``(owner, period, outer_lr, outer_momentum)``, where that setting was measured
    to end behind not synchronizing (:func:`short_period_loss`). Returns whether this call logged it."""
    row = short_period_loss(period, outer_lr, outer_momentum)
    key = (owner, int(period), float(outer_lr), float(outer_momentum))
    if row is None or key in _warned:
        return False
    _warned.add(key)
    longer = _longer_run(row.period, row.steps, row.replicas)
    after = ""
    if longer is not None and math.isclose(outer_lr, 0.7) and math.isclose(outer_momentum, 0.9):  # the defaults
        after = (f"; in a run of {longer.steps} steps on {longer.replicas} replicas they ended "
                 f"{100 * longer.defaults_vs_allreduce:+.1f}% (plain averaging "
                 f"{100 * longer.plain_vs_allreduce:+.1f}%): outer momentum needs many outer steps")
    logger.warning(
        "%s(period=%d, outer_lr=%g, outer_momentum=%g): these outer settings were measured to end behind not "
        "synchronizing at all at period %d (the study's GPT on %d replicas, a %d-step run: %+.1f%% in perplexity "
        "against allreduce, no sync %+.1f%%); there outer momentum 0 with outer_lr 0.7 to 1.0 did best (the "
        "paper's 0.7 and 0.9 are for periods of hundreds of steps)%s. See docs/tuning.md (DiLoCo's outer "
        "settings).", owner, period, outer_lr, outer_momentum, row.period, row.replicas, row.steps,
        100 * row.vs_allreduce, 100 * row.no_sync_vs_allreduce, after)
    return True

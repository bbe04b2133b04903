"""DiLoCo's outer settings at short periods: what was measured, and a warning, logged once, for a
setting measured to end behind not synchronizing at all.

The averagers' defaults, outer lr 0.7 with Nesterov momentum 0.9, are the DiLoCo paper's, tuned for
periods of hundreds of steps on large models. On the study's GPT (the replica simulator, AdamW at its
tuned 3e-3, 16 sequences per replica per step, 200 steps, the same weights and data order for every run;
BENCHMARKS.md, "DiLoCo's outer settings at short periods") they ended **behind not synchronizing at all**
at period 20 on 2, 4 and 8 replicas and at 10 on 4 (the one count measured there), as did outer
momentum 0.5 with outer lr 1.0 and, on 2 replicas, outer lr 0.3 without momentum
(:data:`MEASURED_LOSSES`); outer momentum 0 with outer lr 0.7 to 1.0 did best.
:func:`warn_if_measured_to_lose` logs that once per setting, from :class:`gradpress.OuterOptimizerAverager`'s
constructor.

>>> short_period_loss(period=20, outer_lr=0.7, outer_momentum=0.9) is not None, short_period_loss(500, 0.7, 0.9)
(True, None)

:func:`advise_outer` gives the outer settings for a period and a number of replicas: the best measured
at the nearest measured setting (periods 10 to 50, 2 to 8 replicas), and says where that best was plain
averaging (outer lr 1, no momentum: local SGD at the same period), i.e. where DiLoCo's outer optimizer
did not beat it:

>>> advice = advise_outer(period=20, replicas=4)
>>> advice.outer_lr, advice.outer_momentum, advice.status
(0.7, 0.0, 'measured')
>>> advise_outer(20, 8).plain_averaging, advise_outer(500, 8).status
(True, "the paper's (not measured here)")
"""

from __future__ import annotations

import logging
import math
from typing import NamedTuple

__all__ = ["MEASURED_BEST", "MEASURED_LOSSES", "MeasuredBest", "MeasuredLoss", "OuterAdvice", "advise_outer",
           "short_period_loss", "warn_if_measured_to_lose"]

logger = logging.getLogger("gradpress.averaging")


class MeasuredLoss(NamedTuple):
    """One measured run that ended behind not synchronizing: final perplexity against tuned allreduce's,
    of DiLoCo at ``period`` with ``outer_lr`` and ``outer_momentum`` on ``replicas``, and of no sync."""

    replicas: int
    period: int
    outer_lr: float
    outer_momentum: float
    vs_allreduce: float
    no_sync_vs_allreduce: float


#: Every measured run that ended behind no synchronization after warm-up (``benchmarks/results/diloco-outer``;
#: a test checks each against its JSON, and that no other run there did).
MEASURED_LOSSES: tuple[MeasuredLoss, ...] = (
    MeasuredLoss(4, 10, 0.7, 0.9, 0.329, 0.277),
    MeasuredLoss(2, 20, 0.3, 0.0, 0.189, 0.132),
    MeasuredLoss(2, 20, 0.7, 0.9, 0.138, 0.132),
    MeasuredLoss(4, 20, 0.7, 0.9, 0.312, 0.277),
    MeasuredLoss(4, 20, 1.0, 0.5, 0.28, 0.277),
    MeasuredLoss(4, 20, 1.0, 0.9, 0.451, 0.277),
    MeasuredLoss(8, 20, 0.7, 0.9, 0.432, 0.376),
)


class MeasuredBest(NamedTuple):
    """The best outer settings measured at ``period`` on ``replicas`` (final perplexity against tuned
    allreduce's), beside plain averaging (outer lr 1, momentum 0), the defaults (0.7, 0.9) and no sync."""

    replicas: int
    period: int
    outer_lr: float
    outer_momentum: float
    vs_allreduce: float
    plain_vs_allreduce: float
    defaults_vs_allreduce: float
    no_sync_vs_allreduce: float


#: The best DiLoCo setting of each measured (replicas, period) (``benchmarks/results/diloco-outer``; a test
#: checks each against the JSON: no run there at that setting did better).
MEASURED_BEST: tuple[MeasuredBest, ...] = (
    MeasuredBest(2, 20, 1.0, 0.0, 0.075, 0.075, 0.138, 0.132),
    MeasuredBest(4, 10, 0.5, 0.0, 0.107, 0.149, 0.329, 0.277),
    MeasuredBest(4, 20, 0.7, 0.0, 0.109, 0.159, 0.312, 0.277),
    MeasuredBest(4, 50, 0.5, 0.0, 0.171, 0.178, 0.252, 0.277),
    MeasuredBest(8, 20, 1.0, 0.0, 0.212, 0.212, 0.432, 0.376),
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


def advise_outer(period: int, replicas: int | None = None) -> OuterAdvice:
    """DiLoCo's outer settings for synchronizing every ``period`` steps over ``replicas`` (``None``: the
    most measured count, 4). Up to :data:`LONGEST_MEASURED`: the best measured at the nearest measured
    (period, replicas) (nearest in log-distance, the period first); from :data:`PAPER_PERIOD`: the paper's
    outer lr 0.7 with Nesterov momentum 0.9; between, the longest measured period's best, said so. Where
    the best measured was plain averaging, ``plain_averaging`` is true and the reason says DiLoCo's outer
    optimizer did not beat it at that period (use ``PeriodicModelAverager`` there, or the outer settings
    given: the same steps).

    >>> advise_outer(10).arguments, advise_outer(100).status
    ('outer_lr=0.5, outer_momentum=0', 'beyond the measured periods')
    """
    if isinstance(period, bool) or not isinstance(period, int) or period < 1:
        raise ValueError(f"period must be an integer >= 1, got {period!r}")
    if replicas is not None and (isinstance(replicas, bool) or not isinstance(replicas, int) or replicas < 2):
        raise ValueError(f"replicas must be None or an integer >= 2, got {replicas!r}")
    if period >= PAPER_PERIOD:
        return OuterAdvice(0.7, 0.9, "the paper's (not measured here)", False,
                           f"at period {period} (hundreds of steps), the DiLoCo paper's outer lr 0.7 with Nesterov "
                           f"momentum 0.9; measured here only up to {LONGEST_MEASURED}, where momentum 0 did better",
                           None)
    wanted = 4 if replicas is None else replicas
    row = min(MEASURED_BEST, key=lambda r: (abs(math.log(r.period / min(period, LONGEST_MEASURED))),
                                             abs(math.log(r.replicas / wanted)), -r.period))
    exact = row.period == period and row.replicas == wanted
    status = "measured" if exact else ("beyond the measured periods" if period > LONGEST_MEASURED
                                       else "nearest measured")
    plain = row.outer_lr == 1.0 and row.outer_momentum == 0.0
    where = f"period {row.period} on {row.replicas} replicas"
    reason = (f"read at {where} (the study's GPT, 200 steps): outer lr {row.outer_lr:g}, momentum "
              f"{row.outer_momentum:g} ended "
              f"{100 * row.vs_allreduce:+.1f}% from allreduce in perplexity; the defaults 0.7 / 0.9 "
              f"{100 * row.defaults_vs_allreduce:+.1f}%, no sync after warm-up {100 * row.no_sync_vs_allreduce:+.1f}%")
    if plain:
        reason += ("; plain averaging (local SGD at this period) was the best measured there: DiLoCo's outer "
                   "optimizer did not beat it")
    else:
        reason += f", plain averaging {100 * row.plain_vs_allreduce:+.1f}%"
    return OuterAdvice(row.outer_lr, row.outer_momentum, status, plain, reason, row)


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
    logger.warning(
        "%s(period=%d, outer_lr=%g, outer_momentum=%g): these outer settings were measured to end behind not "
        "synchronizing at all at period %d (the study's GPT on %d replicas: %+.1f%% in perplexity against "
        "allreduce, no sync %+.1f%%); at such periods outer momentum 0 with outer_lr 0.7 to 1.0 did best (the "
        "paper's 0.7 and 0.9 are for periods of hundreds of steps). See docs/tuning.md (DiLoCo's outer "
        "settings).", owner, period, outer_lr, outer_momentum, row.period, row.replicas,
        100 * row.vs_allreduce, 100 * row.no_sync_vs_allreduce)
    return True

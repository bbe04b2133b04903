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
"""

from __future__ import annotations

import logging
import math
from typing import NamedTuple

__all__ = ["MEASURED_LOSSES", "MeasuredLoss", "short_period_loss", "warn_if_measured_to_lose"]

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

"""Adaptive rank: each parameter's rank follows its gradient between two bounds (Accordion).

Accordion (Agarwal et al., MLSys 2021) observed that compression hurts most in *critical regimes*, the
stretches of training where a layer's gradient norm changes fast (at the start, after a learning-rate
decay), and that a layer can be compressed hard elsewhere. ``AdaptiveRank(low, high, every, threshold)``
applies that to PowerSGD per parameter: every ``every`` compressed iterations it compares the mean norm
of the parameter's applied gradient over the interval with the previous interval's; if it changed by
``threshold`` or more (relative), the parameter is in a critical regime and takes rank ``high``, else
``low``. Parameters start at ``high`` (training starts critical).

How it stays exact and identical everywhere:

* the signal, ``||P Q^T||`` summed over the interval, is taken on the device at each step's commit from
  the averaged approximation (the same on every rank), then averaged over the ranks in one small
  all-reduce at the decision (one value per parameter), so every rank takes the same decisions; the
  decision reads that vector on the host once per interval;
* a switch keeps the error memory (no gradient mass is lost) and resizes the warm-start factors: their
  leading columns are kept, new ones are drawn from the parameter's seed (the same on every rank);
* bytes are counted from the plan of the ranks in force, step by step;
* ``state_dict`` holds the ranks in force, the previous interval's norms and each parameter's running
  signal, so a resume takes the same decisions as a run that never stopped.

>>> policy = AdaptiveRank(low=2, high=8, every=50)
>>> policy.decide(previous=10.0, current=10.5), policy.decide(previous=10.0, current=4.0)
(2, 8)
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["AdaptiveRank"]


@dataclass(frozen=True)
class AdaptiveRank:
    """Per-parameter rank between ``low`` and ``high`` that switches on the change of the parameter's
    gradient norm (see :mod:`gradpress.adaptive`).

    Args:
        low: the rank outside critical regimes (>= 1).
        high: the rank in critical regimes (>= ``low``). A parameter never takes a rank at which it would
            not be worth compressing (``min_compression_rate``): its ``high`` is lowered to fit.
        every: compressed iterations per decision interval (>= 1).
        threshold: relative change of the interval's mean gradient norm that marks a critical regime
            (Accordion's eta, 0.5 in the paper), > 0.
    """

    low: int
    high: int
    every: int = 100
    threshold: float = 0.5

    def __post_init__(self) -> None:
        for name in ("low", "high", "every"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"AdaptiveRank.{name} must be an integer >= 1, got {value!r}")
        if self.high < self.low:
            raise ValueError(f"AdaptiveRank.high must be >= low, got low={self.low}, high={self.high}")
        if isinstance(self.threshold, bool) or not isinstance(self.threshold, (int, float)) or not self.threshold > 0:
            raise ValueError(f"AdaptiveRank.threshold must be a number > 0, got {self.threshold!r}")

    def decide(self, previous: float | None, current: float) -> int | None:
        """The rank for an interval whose mean gradient norm is ``current`` after one of ``previous``
        (``None``: no previous interval, keep the rank in force)."""
        if previous is None:
            return None
        if previous <= 0:
            return self.high if current > 0 else self.low
        return self.high if abs(current - previous) / previous >= self.threshold else self.low

    def to_dict(self) -> dict[str, float]:
        return {"low": self.low, "high": self.high, "every": self.every, "threshold": self.threshold}

""":class:`~gradpress.PowerSGDState`'s automatic rank (:mod:`gradpress.autorank`): which gradients of a
warm-up bucket are measured, the decision at the first compressed iteration, and applying a rank (decided
now or read from a checkpoint) before any compressed step."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from typing import Any

from ..adaptive import AdaptiveRank
from ..autorank import AutoRank, RankDecision
from ..policy import RankRules

__all__ = ["apply_rank", "auto_rank_decision", "decide_rank", "measure_bucket"]

logger = logging.getLogger("gradpress.hooks.powersgd")


def auto_rank_decision(auto_rank: AutoRank | dict[str, Any] | None, adaptive_rank: AdaptiveRank | None,
                       rank_policy: RankRules | None) -> RankDecision | None:
    """The state's decision in progress for ``auto_rank`` (``None``: off); ``TypeError``/``ValueError``
    for what it cannot be combined with."""
    if auto_rank is None:
        return None
    if isinstance(auto_rank, dict):  # its keyword arguments (a JSON options string gives them)
        auto_rank = AutoRank(**auto_rank)
    if not isinstance(auto_rank, AutoRank):
        raise TypeError("auto_rank must be None or a gradpress.AutoRank(threshold, max_rank, measure_iters, "
                        f"min_rank), got {type(auto_rank).__name__}")
    if adaptive_rank is not None:
        raise ValueError("auto_rank and adaptive_rank both choose the rank: give one of them")
    if rank_policy is not None and callable(rank_policy):
        raise ValueError("auto_rank replaces the rank a mapping rank_policy leaves to the default; a function "
                         "rank_policy chooses every rank itself: give a mapping, or no auto_rank")
    return RankDecision(auto_rank)


def measure_bucket(state: Any, bucket: Any) -> Callable[[], None] | None:
    """What a measured warm-up iteration runs once ``bucket``'s exact average is written: add its matrices'
    energy profile (matrices a ``rank_policy`` sends exactly are left out) to the state's decision.
    ``None`` where the iteration is not measured (or there is no automatic rank)."""
    if state._auto is None or not state._auto.measures(state.iter, state.start_powerSGD_iter):
        return None
    params, grads = bucket.parameters(), bucket.gradients()
    ranks = state._params.ranks_for(state._params.keys_for(params), params, grads)
    chosen = [g for i, g in enumerate(grads) if g.dim() >= 2 and (ranks is None or ranks[i] is not None)]
    seed = (state.random_seed * 1_000_003 + state.iter) * 1_009 + bucket.index()
    auto, last = state._auto, bucket.is_last()

    def measure() -> None:
        auto.add(chosen, state.min_compression_rate, seed)
        if last:
            auto.end_iteration()
    return measure


def decide_rank(state: Any, bucket: Any) -> None:
    """At the first compressed iteration's first bucket (every rank): decide and apply the rank, once."""
    if state._auto is None or state._auto.rank is not None:
        return
    device = bucket.buffer().device
    rank, captured = state._auto.decide(state._communicator(), state.matrix_approximation_rank, device)
    apply_rank(state, rank)
    if captured is None:
        logger.warning("PowerSGDState auto_rank: no warm-up iteration was measured (resumed past the warm-up "
                       "from a checkpoint without a decision?); keeping matrix_approximation_rank=%s", rank)
        return
    shown = ", ".join(f"E({k})={captured[k - 1]:.3f}" for k in state._auto.rule.candidates())
    logger.info("PowerSGDState auto_rank: rank %s, the smallest from %s whose captured energy of the averaged "
                "gradients over %s warm-up iterations reaches %s (%s)", rank, state._auto.rule.floor,
                state._auto.measured, state._auto.rule.threshold, shown)


def apply_rank(state: Any, rank: int) -> None:
    """Compress at ``rank`` from now on; before the first compressed step (there is no memory yet)."""
    state._session.config = dataclasses.replace(state._session.config, rank=rank)
    state._session.forget_memory()
    policy = state._params.policy
    if policy is not None:
        policy.default = rank
        state._params.policy_ranks.clear()

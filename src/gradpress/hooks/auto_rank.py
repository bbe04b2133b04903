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
from ..powersgd.session import EngineSession
from ..powersgd.transport import Communicator
from .parameters import ParameterKeys

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
                        f"min_rank, criterion, noise_multiple), got {type(auto_rank).__name__}")
    if adaptive_rank is not None:
        raise ValueError("auto_rank and adaptive_rank both choose the rank: give one of them")
    if rank_policy is not None and callable(rank_policy):
        raise ValueError("auto_rank replaces the rank a mapping rank_policy leaves to the default; a function "
                         "rank_policy chooses every rank itself: give a mapping, or no auto_rank")
    return RankDecision(auto_rank)


def measure_bucket(decision: RankDecision | None, params: ParameterKeys, bucket: Any, iteration: int,
                   start: int, random_seed: int, min_compression_rate: float) -> Callable[[], None] | None:
    """What a measured warm-up iteration (``iteration`` of a state compressing from ``start``) runs once
    ``bucket``'s exact average is written: add its matrices' energy profile (matrices a ``rank_policy``
    sends exactly are left out) to ``decision``. ``None`` where the iteration is not measured (or there is
    no automatic rank). Called before the average is taken: the noise criterion's squared norms of this
    worker's own matrices are added now."""
    if decision is None or not decision.measures(iteration, start):
        return None
    parameters, grads = bucket.parameters(), bucket.gradients()
    ranks = params.ranks_for(params.keys_for(parameters), parameters, grads)
    chosen = [g for i, g in enumerate(grads) if g.dim() >= 2 and (ranks is None or ranks[i] is not None)]
    seed = (random_seed * 1_000_003 + iteration) * 1_009 + bucket.index()
    last = bucket.is_last()
    decision.add_local(chosen)   # this worker's own gradients, before the allreduce overwrites them

    def measure() -> None:
        decision.add(chosen, min_compression_rate, seed)
        if last:
            decision.end_iteration()
    return measure


def decide_rank(decision: RankDecision | None, bucket: Any, comm: Callable[[], Communicator], current_rank: int,
                session: EngineSession, params: ParameterKeys) -> None:
    """At the first compressed iteration's first bucket (every rank): decide and apply the rank, once
    (``comm()``: the state's communicator; ``current_rank``: what to keep if nothing was measured)."""
    if decision is None or decision.rank is not None:
        return
    rank, captured = decision.decide(comm(), current_rank, bucket.buffer().device)
    apply_rank(rank, session, params)
    if captured is None:
        logger.warning("PowerSGDState auto_rank: no warm-up iteration was measured (resumed past the warm-up "
                       "from a checkpoint without a decision?); keeping matrix_approximation_rank=%s", rank)
        return
    rule = decision.rule
    width = decision.width
    shown = ", ".join(f"E({k})={captured[k - 1]:.4f}" for k in rule.candidates(width))
    if decision.noise_ratio is not None:
        ratios = ", ".join(f"R({k})={decision.noise_ratio[k - 1]:.3g}" for k in rule.candidates(width))
        logger.info("PowerSGDState auto_rank: rank %s, the smallest from %s whose residual in the averaged "
                    "gradients over %s warm-up iterations is at most %s x their noise (%s; %s)", rank,
                    rule.floor_for(width), decision.measured, rule.noise_multiple, ratios, shown)
        return
    if rule.criterion == "noise":
        why = ("one worker: no workers' gradients to read the noise from" if comm().world_size < 2
               else "the workers' gradients were identical: no noise to compare with")
        logger.warning("PowerSGDState auto_rank: %s; deciding by the captured energy (threshold %s) instead",
                       why, rule.threshold)
    logger.info("PowerSGDState auto_rank: rank %s, the smallest from %s whose captured energy of the averaged "
                "gradients over %s warm-up iterations reaches %s (%s)", rank, rule.floor_for(width),
                decision.measured, rule.threshold, shown)


def apply_rank(rank: int, session: EngineSession, params: ParameterKeys) -> None:
    """Compress at ``rank`` from now on; before the first compressed step (there is no memory yet): the
    session's configuration, and a mapping policy's default."""
    session.configure(dataclasses.replace(session.config, rank=rank))
    policy = params.policy
    if policy is not None:
        policy.default = rank
        params.policy_ranks.clear()

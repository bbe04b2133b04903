"""The automatic rank (``PowerSGDState(auto_rank=AutoRank(...))``): its energy profile against exact
singular values, its decision on real DDP ranks where the averaged gradient's rank is known, and that a
checkpoint keeps the decision (and a measurement in progress) so that a resume never decides again."""

from __future__ import annotations

import io
import json
import logging
import pickle
from pathlib import Path
from typing import Any

import pytest
import torch

import gradpress
from gradpress.autorank import DEFAULT_MIN_RANK, RANK_LADDER, AutoRank, energy_profile

from distributed import run
from models import GivenGradients


def _exact(matrices: list[torch.Tensor], max_rank: int, rate: float) -> torch.Tensor:
    """The oracle: float64 singular values of every matrix, a matrix rank k would not compress counted whole."""
    out = torch.zeros(max_rank + 1, dtype=torch.float64)
    for g in matrices:
        g = g.reshape(g.shape[0], -1).double()
        n, m = g.shape
        energy = torch.linalg.svdvals(g).square()
        for k in range(1, max_rank + 1):
            out[k - 1] += energy[:k].sum() if (n + m) * k * rate < n * m else energy.sum()
        out[max_rank] += energy.sum()
    return out


def _decaying(n: int, m: int, seed: int, decay: float = 0.8) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    u = torch.linalg.qr(torch.randn(n, min(n, m), generator=g, dtype=torch.float64)).Q
    v = torch.linalg.qr(torch.randn(m, min(n, m), generator=g, dtype=torch.float64)).Q
    s = decay ** torch.arange(min(n, m), dtype=torch.float64)
    return ((u * s) @ v.T).float()


def test_small_matrices_are_measured_exactly_and_uncompressed_ones_count_whole() -> None:
    matrices = [_decaying(20, 30, 0), _decaying(20, 30, 1), _decaying(6, 5, 2), torch.randn(3, 4, 5)]
    got, want = energy_profile(matrices, 16, 2.0, seed=0), _exact(matrices, 16, 2.0)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=0)
    assert got[-1] == pytest.approx(float(sum(m.double().square().sum() for m in matrices)), rel=1e-6)
    assert bool((got[:-1].diff() >= -1e-9 * got[-1]).all())  # more rank never carries less


def test_large_matrices_are_estimated_from_below_and_close() -> None:
    matrices = [_decaying(300, 200, 3, 0.95), _decaying(300, 200, 4, 0.9), _decaying(128, 512, 5, 0.97)]
    got, want = energy_profile(matrices, 24, 1.0, seed=7), _exact(matrices, 24, 1.0)
    assert bool((got[:-1] <= want[:-1] * (1 + 1e-5)).all())     # a range finder never finds more
    torch.testing.assert_close(got[:-1] / got[-1], want[:-1] / want[-1], rtol=1e-2, atol=0)
    torch.testing.assert_close(got[-1], want[-1], rtol=1e-5, atol=0)


def test_the_rule_chooses_the_smallest_candidate_that_reaches_the_threshold() -> None:
    rule = AutoRank(threshold=0.8, max_rank=40, min_rank=1)
    assert rule.candidates() == tuple(r for r in RANK_LADDER if r < 40) + (40,)
    captured = [min(1.0, k / 20) for k in range(1, 41)]      # E(k) = k / 20
    assert rule.choose(captured) == 16                        # E(16) = 0.8; 12 falls short
    assert rule.choose([0.1] * 40) == 40                      # none reaches it: the highest
    for bad in ({"threshold": 0.0}, {"threshold": 1.5}, {"threshold": True}, {"max_rank": 0},
                {"max_rank": 2.0}, {"measure_iters": 0}, {"min_rank": 0}, {"min_rank": 65}, {"min_rank": 8.0},
                {"min_rank": True}, {"min_rank": 24, "max_rank": 16}):
        with pytest.raises(ValueError, match="AutoRank"):
            AutoRank(**bad)


def test_by_default_it_never_chooses_below_the_floor_the_study_measured() -> None:
    """E(24) = 1 would choose 24 from the energy alone; the default floor (the width rule's too) starts at 32,
    or at max_rank where that is lower; an explicit min_rank is its own floor, on or off the ladder."""
    from gradpress.tools.quality_map import RULE_FLOOR

    captured = [min(1.0, k / 24) for k in range(1, 65)]
    assert DEFAULT_MIN_RANK == RULE_FLOOR == 32
    assert AutoRank().candidates() == (32, 48, 64) and AutoRank().choose(captured) == 32
    assert AutoRank(min_rank=1).choose(captured) == 24
    assert AutoRank(max_rank=16).candidates() == (16,)
    assert AutoRank(max_rank=40, min_rank=20).candidates() == (20, 24, 32, 40)
    assert AutoRank(max_rank=40, min_rank=20).choose(captured) == 24


class _OneRank:
    """A communicator of one rank: the decision's all-reduce leaves its vector as it is."""

    world_size = 1

    def allreduce_sum(self, tensor: torch.Tensor) -> Any:
        class _Done:
            def wait(self) -> None:
                return None
        return _Done()


def test_the_default_floor_rises_to_the_width_rule_on_wide_matrices() -> None:
    """Where the residual over noise alone would take 32, matrices of width 768 start at the width rule's
    64 (2 sqrt(768) = 55.4, up the ladder); at width 128 the rule is the floor itself; an explicit
    ``min_rank`` or ``width_floor=False`` keeps 32; ``max_rank`` caps it. The decision reads the width off
    the matrices it measured (one iteration's), keeps it in its checkpoint form, and decides with it."""
    from gradpress.autorank import RankDecision, width_rule
    from gradpress.tools.quality_map import width_rule_rank

    captured = [1 - 0.2 / k for k in range(1, 129)]            # R(k) = 0.2 / k with T = N: R(32) = 0.006
    rule = AutoRank(max_rank=128)
    assert rule.choose_by_noise(captured, 1.0, 1.0) == rule.choose_by_noise(captured, 1.0, 1.0, width=128) == 32
    assert rule.choose_by_noise(captured, 1.0, 1.0, width=768) == 64 == width_rule(768) == width_rule_rank(768)
    assert AutoRank(max_rank=128, width_floor=False).choose_by_noise(captured, 1.0, 1.0, width=768) == 32
    assert AutoRank(max_rank=128, min_rank=32).choose_by_noise(captured, 1.0, 1.0, width=768) == 32
    assert AutoRank(max_rank=48).candidates(width=768) == (48,) and rule.candidates(width=4096) == (128,)
    assert rule.choose([1.0] * 128, width=768) == 64
    with pytest.raises(ValueError, match="width_floor"):
        AutoRank(width_floor=1)  # type: ignore[arg-type]

    decision = RankDecision(AutoRank(max_rank=128, criterion="energy"))
    generator = torch.Generator().manual_seed(0)
    wide = [torch.randn(768, 8, generator=generator) @ torch.randn(8, m, generator=generator) for m in (768, 3072)]
    for _ in range(2):
        decision.add(wide + [torch.randn(96, 64, generator=generator)], 2.0, seed=0)
        decision.end_iteration()
    assert decision.width == 768 and len(decision.shapes) == 3
    resumed = RankDecision(decision.rule)
    resumed.load(decision.state())
    assert resumed.width == 768
    rank, energies = decision.decide(_OneRank(), 8, torch.device("cpu"))
    # rank-8 matrices: E(8) = 1 already, so the energy alone takes the floor: 64 here, 32 without the width
    assert energies is not None and energies[7] > 0.999 and rank == 64
    assert AutoRank(max_rank=128, criterion="energy").choose(energies) == 32


def _measured_settings() -> list[tuple[str, list[float], dict[int, Any]]]:
    """Every setting ``benchmarks/rank_energy.py`` measured: its name, E(1..) at the end of the warm-up, and
    each rank the quality map trained there (same task and tokens per step, AdamW) as the map groups it,
    its seeds together (``holds``: their mean lowest perplexity within the quality target)."""
    from gradpress.tools.quality_map import _settings
    from gradpress.tools.quality_rows import CHARS_PER_SEQUENCE, MEASURED

    out = []
    for path in sorted((Path(__file__).resolve().parents[2] / "benchmarks/results/rank-energy").glob("*.json")):
        run = json.loads(path.read_text())
        rows = [m for m in MEASURED if (m.task, m.optimizer) == (run["task"], "adamw")]
        tokens = run["sequences"] * CHARS_PER_SEQUENCE
        trained = {rank: _settings([m for m in rows if m.rank == rank]).get(tokens) for rank in {m.rank for m in rows}}
        out.append((path.stem, run["captured"], {rank: s for rank, s in trained.items() if s is not None}))
    return out


def test_the_default_threshold_chooses_a_rank_that_held_wherever_the_study_trained_it() -> None:
    """The oracle is the study's own runs: on every measured setting's energies the default rule chooses a
    rank whose training there held (mean over seeds within the quality target), wherever that rank was
    trained; the former defaults chose rank 32 where it fell behind: 0.996 at width 256 and 16 workers'
    worth, 0.995 there and at 4 and 8, and at width 384 at 4."""
    settings = _measured_settings()

    def outcomes(rule: AutoRank) -> dict[str, Any]:
        """Each setting's training at the rank ``rule`` chooses there, where that rank was trained."""
        return {name: trained[r] for name, captured, trained in settings if (r := rule.choose(captured)) in trained}

    judged = outcomes(AutoRank())
    assert len(judged) >= 10 and all(s.holds for s in judged.values()), judged
    assert sorted(name for name, s in outcomes(AutoRank(0.996)).items() if not s.holds) == [
        "gpt-wide-stdlib-s256-lr0.003-seed0"]
    assert sorted(name for name, s in outcomes(AutoRank(0.995)).items() if not s.holds) == [
        "gpt-stdlib-w384-s64-lr0.0015-seed0", "gpt-wide-stdlib-s128-lr0.003-seed0",
        "gpt-wide-stdlib-s256-lr0.003-seed0", "gpt-wide-stdlib-s64-lr0.003-seed0"]


def test_a_checkpoint_or_pickle_saved_before_min_rank_chose_from_rank_1() -> None:
    """A saved rule without ``min_rank`` decided by the energy alone from rank 1 (and one without
    ``criterion`` by the energy, one without ``width_floor`` with no width floor): it loads into a state
    given ``min_rank=1, criterion="energy", width_floor=False`` and is refused, naming auto_rank, by one
    with the default floor, criterion or width floor; unpickled, it stays so."""
    old = gradpress.PowerSGDState(None, 2, start_powerSGD_iter=4,
                                  auto_rank=AutoRank(0.999, 24, 2, min_rank=1, criterion="energy"))
    saved = old.local_state_dict()
    for name in ("min_rank", "criterion", "noise_multiple", "width_floor"):   # the form saved before they existed
        del saved["options"]["auto_rank"][name]
    before = AutoRank(0.999, 24, 2, min_rank=1, criterion="energy", width_floor=False)
    gradpress.PowerSGDState(None, 2, start_powerSGD_iter=4, auto_rank=before).load_state_dict(saved)
    for refusing in (AutoRank(0.999, 24, 2, criterion="energy", width_floor=False),
                     AutoRank(0.999, 24, 2, min_rank=1, width_floor=False),
                     AutoRank(0.999, 24, 2, min_rank=1, criterion="energy")):
        with pytest.raises(ValueError, match="auto_rank"):
            gradpress.PowerSGDState(None, 2, start_powerSGD_iter=4, auto_rank=refusing).load_state_dict(saved)
    copy = gradpress.PowerSGDState.__new__(gradpress.PowerSGDState)
    copy.__setstate__(saved)
    assert copy.auto_rank == before
    rule = AutoRank.__new__(AutoRank)
    rule.__setstate__({"threshold": 0.9, "max_rank": 8, "measure_iters": 2})
    assert rule == AutoRank(0.9, 8, 2, 1, criterion="energy", width_floor=False)
    assert rule.candidates() == rule.candidates(width=768) == (1, 2, 4, 8)
    assert pickle.loads(pickle.dumps(AutoRank(0.9, 8, 2))).min_rank is None   # a new pickle keeps its own
    assert pickle.loads(pickle.dumps(AutoRank(0.9, 8, 2))).criterion == "noise"
    assert pickle.loads(pickle.dumps(AutoRank(0.9, 8, 2))).width_floor


def test_what_it_cannot_be_combined_with_is_refused_at_construction() -> None:
    auto = AutoRank(threshold=0.5)
    with pytest.raises(ValueError, match="auto_rank and adaptive_rank"):
        gradpress.PowerSGDState(None, 4, auto_rank=auto, adaptive_rank=gradpress.AdaptiveRank(2, 8))
    with pytest.raises(ValueError, match="function rank_policy"):
        gradpress.PowerSGDState(None, 4, auto_rank=auto, rank_policy=lambda name, p: 4)
    with pytest.raises(TypeError, match="auto_rank must be"):
        gradpress.PowerSGDState(None, 4, auto_rank=0.5)


def _inputs(rank: int, step: int, true_rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The workers' gradients: a shared part of rank ``true_rank`` plus noise that cancels in the mean
    of two workers (+N on rank 0, -N on rank 1), so the averaged gradient has rank ``true_rank``."""
    shared = torch.Generator().manual_seed(1000 + step)
    noise = torch.Generator().manual_seed(2000 + step)
    out = []
    for _ in range(2):
        low = torch.randn(64, true_rank, generator=shared) @ torch.randn(true_rank, 48, generator=shared)
        n = torch.randn(64, 48, generator=noise) * 3.0
        out.append(low + (n if rank == 0 else -n))
    return out[0], out[1]


def _train(rank: int, world: int, steps: int, true_rank: int, saved: list[bytes] | None, first: int):
    """``steps`` DDP iterations from iteration ``first`` (loading this rank's of ``saved``, the ranks'
    state_dicts, if given): the state's rank and iteration after them, its state_dict, a pickled copy."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = DDP(GivenGradients())
    state = gradpress.PowerSGDState(None, matrix_approximation_rank=2, start_powerSGD_iter=4,
                                    auto_rank=AutoRank(threshold=0.999, max_rank=24, measure_iters=2, min_rank=1,
                                                              criterion="energy"))
    if saved is not None:
        state.load_state_dict(torch.load(io.BytesIO(saved[rank]), weights_only=False))
    model.register_comm_hook(state, gradpress.powerSGD_hook)
    for step in range(first, first + steps):
        model(*_inputs(rank, step, true_rank)).backward()
        model.zero_grad(set_to_none=False)
    buffer = io.BytesIO()
    torch.save(state.state_dict(), buffer)
    copy = pickle.loads(pickle.dumps(state))
    return state.matrix_approximation_rank, state.iter, buffer.getvalue(), copy, state.auto_rank_captured()


@pytest.mark.slow
def test_ddp_ranks_decide_the_averaged_gradients_rank_and_a_resume_never_decides_again(
        caplog: pytest.LogCaptureFixture) -> None:
    decided = run(_train, 2, 6, 8, None, 0)
    assert [rank for rank, *_ in decided] == [8, 8]            # E(8) = 1 (to rounding); E(4) is not
    assert [it for _, it, *_ in decided] == [6, 6]
    copy = decided[0][3]                                       # pickling keeps the rule and the decision
    assert (copy.matrix_approximation_rank, copy.auto_rank) == (8, AutoRank(0.999, 24, 2, 1, criterion="energy"))
    assert [rank for rank, *_ in run(_train, 2, 6, 16, None, 0)] == [16, 16]   # a fresh run on rank-16 means
    # Resumed after the decision, on gradients of rank 16: the saved decision stands.
    after = run(_train, 2, 2, 16, [blob for _, _, blob, *_ in decided], 6)
    assert [(rank, it) for rank, it, *_ in after] == [(8, 8), (8, 8)]
    # Saved between the two measured iterations (2 and 3): the resume decides as if it had never stopped.
    middle = run(_train, 2, 3, 8, None, 0)
    assert [rank for rank, *_ in middle] == [2, 2]             # not decided yet: the constructor's rank
    finished = run(_train, 2, 3, 8, [blob for _, _, blob, *_ in middle], 3)
    assert [rank for rank, *_ in finished] == [8, 8]
    assert middle[0][4] is None
    captured = decided[0][4]
    assert len(captured) == 24 and captured[7] > 0.999 > captured[3] and captured == decided[1][4]
    assert [c[4] for c in finished] == [captured, captured]   # the same measurement, float for float
    assert after[0][4] == captured                            # kept through the later checkpoint
    _a_decision_outlives_the_options_that_only_choose(decided[0][3], middle[0][3], caplog)


def _a_decision_outlives_the_options_that_only_choose(decided: gradpress.PowerSGDState,
                                                      pending: gradpress.PowerSGDState,
                                                      caplog: pytest.LogCaptureFixture) -> None:
    """A checkpoint holding a decision resumes under another threshold or floor (another version's default):
    the decision stands and the log says so. Options that shape the measurement must still agree, and a
    checkpoint whose decision is still to be taken is refused under another threshold, naming auto_rank."""
    def fresh(**rule: object) -> gradpress.PowerSGDState:
        options = {"threshold": 0.99, "max_rank": 24, "measure_iters": 2, "criterion": "energy"} | rule
        return gradpress.PowerSGDState(None, 2, start_powerSGD_iter=4, auto_rank=AutoRank(**options))

    resumed = fresh()                                          # threshold 0.99 and the default floor (24)
    with caplog.at_level(logging.INFO, logger="gradpress.hooks.powersgd"):
        resumed.load_state_dict(decided.local_state_dict(), allow_other_rank=True)
    assert resumed.matrix_approximation_rank == 8 and resumed.auto_rank_captured() == decided.auto_rank_captured()
    said = [r.getMessage() for r in caplog.records if "stands" in r.getMessage()]
    assert len(said) == 1 and "rank 8" in said[0] and "taken with threshold=0.999, min_rank=1;" in said[0] \
        and "this state's threshold=0.99, min_rank=None" in said[0]
    saved = decided.local_state_dict()                         # saved before width_floor existed: it stands
    del saved["options"]["auto_rank"]["width_floor"]
    old = fresh()
    old.load_state_dict(saved, allow_other_rank=True)
    assert old.matrix_approximation_rank == 8
    with pytest.raises(ValueError, match="auto_rank"):          # max_rank shaped the measurement
        fresh(max_rank=16).load_state_dict(decided.local_state_dict(), allow_other_rank=True)
    with pytest.raises(ValueError, match="auto_rank"):          # not decided yet: the run's own rule decides
        fresh(min_rank=1).load_state_dict(pending.local_state_dict(), allow_other_rank=True)
    same = fresh(threshold=0.999, min_rank=1)
    same.load_state_dict(pending.local_state_dict(), allow_other_rank=True)
    assert same.matrix_approximation_rank == 2                # still to decide, with its measurement so far


def _compressed_grads(rank: int, world: int, auto: bool):
    """The averaged gradients of iterations 4 and 5 (compressed) with the automatic rank, or with its
    decision, rank 8, given from the start."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = DDP(GivenGradients())
    options = {"auto_rank": AutoRank(threshold=0.999, max_rank=24, measure_iters=2, min_rank=1,
                                                              criterion="energy")} if auto else {}
    state = gradpress.PowerSGDState(None, matrix_approximation_rank=2 if auto else 8, start_powerSGD_iter=4,
                                    **options)
    model.register_comm_hook(state, gradpress.powerSGD_hook)
    out = []
    for step in range(6):
        model(*_inputs(rank, step, 8)).backward()
        if step >= 4:
            out.append([p.grad.clone() for p in model.parameters()])
        model.zero_grad(set_to_none=False)
    return state.matrix_approximation_rank, out


@pytest.mark.slow
def test_training_after_the_decision_is_bitwise_training_at_that_rank_from_the_start() -> None:
    """Measuring reads only, and the decision replaces the rank before any compressed step: the run is
    the same, bit for bit, as one given the decided rank from the start."""
    chosen, fixed = run(_compressed_grads, 2, True), run(_compressed_grads, 2, False)
    for (rank_a, grads_a), (rank_b, grads_b) in zip(chosen, fixed, strict=True):
        assert rank_a == rank_b == 8
        for step_a, step_b in zip(grads_a, grads_b, strict=True):
            assert all(torch.equal(a, b) for a, b in zip(step_a, step_b, strict=True))

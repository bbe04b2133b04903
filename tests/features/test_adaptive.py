"""Adaptive rank: identical decisions on every rank, bytes of the ranks in force, exact at full rank,
mass conserved across a switch, resume just before a switch equals not stopping."""

from __future__ import annotations

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel as DDP

import gradpress
import models
from distributed import run, run_fresh
from gradpress import AdaptiveRank
from gradpress.comm import LocalCommunicator
from gradpress.powersgd import EngineConfig, SegmentStore, make_plan
from gradpress.powersgd.memory import ParamMemory
from gradpress.powersgd.seeding import seeded_normal
from gradpress.powersgd.step import compress_step

WORLD = 2
START, EVERY = 2, 3


@pytest.mark.parametrize("kwargs, match", [
    ({"low": 0, "high": 2}, "low must be an integer >= 1"),
    ({"low": 4, "high": 2}, "high must be >= low"),
    ({"low": 1, "high": 2, "every": 0}, "every must be an integer >= 1"),
    ({"low": 1, "high": 2, "threshold": 0}, "threshold must be a number > 0"),
])
def test_bad_bounds_are_clear_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        AdaptiveRank(**kwargs)
    with pytest.raises(TypeError, match="adaptive_rank must be None or a gradpress.AdaptiveRank"):
        gradpress.PowerSGDState(None, adaptive_rank=(1, 2))


def test_a_critical_change_of_the_norm_takes_the_high_rank():
    policy = AdaptiveRank(low=1, high=4, threshold=0.5)
    assert policy.decide(None, 3.0) is None
    assert policy.decide(2.0, 2.9) == 1 and policy.decide(2.0, 3.0) == 4 and policy.decide(2.0, 0.9) == 4


def test_resizing_keeps_the_leading_columns_and_draws_the_same_new_ones_everywhere():
    q = torch.randn(7, 3)
    entry = ParamMemory((5, 7), torch.randn(5, 7), q.clone(), None)
    entry.resize(5, seed=1, key=4, draw=9)
    assert torch.equal(entry.q[:, :3], q) and entry.q.shape == (7, 5)
    assert torch.equal(entry.q[:, 3:], seeded_normal((7, 2), 1, 4, 9))
    entry.resize(2, seed=1, key=4, draw=10)
    assert torch.equal(entry.q, q[:, :2])


def test_error_feedback_conserves_mass_across_rank_switches():
    # float64 so that the oracle is exact up to rounding: sum of gradients = sum of outputs + memory.
    config = EngineConfig(rank=4, min_compression_rate=0)
    store = SegmentStore(config)
    shapes = [(12, 10), (6, 9), (5,)]
    ranks_by_step = [[4, 4, None], [4, 4, None], [1, 3, None], [1, 3, None], [6, 1, None], [2, 2, None]]
    sent, put_in = [torch.zeros(s, dtype=torch.float64) for s in shapes], [torch.zeros(s, dtype=torch.float64)
                                                                            for s in shapes]
    previous = ranks_by_step[0]
    for step, ranks in enumerate(ranks_by_step):
        changed = {key: r for key, (r, was) in enumerate(zip(ranks, previous)) if r != was and r is not None}
        store.resize(changed, seed=0, draw=step)
        previous = ranks
        grads = [torch.randn(s, dtype=torch.float64, generator=torch.Generator().manual_seed(step * 10 + i))
                 for i, s in enumerate(shapes)]
        for total, g in zip(put_in, grads):
            total += g
        segment = store.get(0, (0, 1, 2), shapes, torch.device("cpu"), torch.float64, ranks)
        assert [t.rank for t in segment.plan.tensors[:2]] == [min(r, min(s)) for r, s in zip(ranks[:2], shapes[:2])]
        task, _ = compress_step(segment, grads, LocalCommunicator(), config, step, track=True)
        for handle in task:
            handle.wait()
        for total, g in zip(sent, grads):
            total += g
    memory = store.export()
    for key in (0, 1):
        torch.testing.assert_close(put_in[key], sent[key] + memory[key].error.reshape(shapes[key]),
                                   rtol=0, atol=1e-10)
    torch.testing.assert_close(put_in[2], sent[2], rtol=0, atol=1e-12)  # the vector is sent exactly


def _setup(adaptive, rank_policy=None):
    torch.manual_seed(0)
    net = DDP(models.make_model())
    state = gradpress.PowerSGDState(None, matrix_approximation_rank=1, start_powerSGD_iter=START,
                                    adaptive_rank=adaptive, rank_policy=rank_policy)
    state.name_parameters(net)
    net.register_comm_hook(state, gradpress.powerSGD_hook)
    return net, state, torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)


def _train(net, state, opt, rank, steps, first=0):
    """Per step: the ranks in force and the elements it sent. The loss is scaled up at step 9, so the
    gradient norm jumps: a critical regime."""
    history = []
    for step in range(first, first + steps):
        x, y = models.batch(rank, step)
        opt.zero_grad()
        ranks = state.ranks()
        before = state.compression_stats()[2]
        ((4.0 if step >= 9 else 1.0) * models.loss_fn(net, x, y)).backward()
        opt.step()
        history.append((ranks, state.compression_stats()[2] - before))
    return history


ADAPTIVE = AdaptiveRank(low=1, high=4, every=EVERY, threshold=0.5)


def _adaptive_run(rank, world, steps):
    net, state, opt = _setup(ADAPTIVE)
    history = _train(net, state, opt, rank, steps)
    shapes = {name: p.grad.shape for name, p in net.module.named_parameters()}
    return history, shapes, [p.detach().clone() for p in net.parameters()], state.ranks()


@pytest.mark.slow
def test_ranks_with_different_gradients_take_identical_decisions_and_bytes_follow_the_ranks():
    results = run(_adaptive_run, WORLD, 18)
    (history, shapes, params, final), (other_history, _, other_params, other_final) = results
    assert [ranks for ranks, _ in history] == [ranks for ranks, _ in other_history] and final == other_final
    for a, b in zip(params, other_params):
        assert torch.equal(a, b)
    in_force = [ranks for ranks, _ in history[START + 1:]]  # ranks() shows a step's ranks once it ran
    seen = {rank for ranks in in_force for rank in ranks.values()}
    assert 1 in seen and max(seen) > 1, seen  # both bounds were used
    assert any(a != b for a, b in zip(in_force, in_force[1:])), "no switch happened"
    # Elements sent per step = the plan of the ranks in force (exact: count the plan independently).
    names = list(shapes)
    for (ranks, sent), (next_ranks, _) in zip(history[START + 1:], history[START + 2:]):
        plan = make_plan([shapes[n] for n in names], 1, 2.0, [ranks.get(n, 1) for n in names])
        assert sent == plan.numel_sent


def _full_rank_run(rank, world):
    net, state, opt = _setup(AdaptiveRank(low=64, high=64, every=2))
    exact = DDP(models.make_model())
    for step in range(6):
        x, y = models.batch(rank, step)
        for model in (net, exact):
            model.zero_grad()
            models.loss_fn(model, x, y).backward()
    return [(p.grad.clone(), q.grad.clone()) for p, q in zip(net.parameters(), exact.parameters())]


def test_full_rank_reproduces_the_exact_mean():
    for grads in run(_full_rank_run, WORLD):
        for ours, exact in grads:
            torch.testing.assert_close(ours, exact, rtol=1e-4, atol=1e-6)


def _first_part(rank, world, steps, path):
    net, state, opt = _setup(ADAPTIVE)
    _train(net, state, opt, rank, steps)
    torch.save({"model": net.module.state_dict(), "opt": opt.state_dict(), "powersgd": state.state_dict()},
               f"{path}.{rank}")


def _second_part(rank, world, first, steps, path):
    net, state, opt = _setup(ADAPTIVE)
    saved = torch.load(f"{path}.{rank}", weights_only=True)
    net.module.load_state_dict(saved["model"])
    opt.load_state_dict(saved["opt"])
    state.load_state_dict(saved["powersgd"])
    _train(net, state, opt, rank, steps, first)
    return [p.detach().clone() for p in net.parameters()], state.ranks()


@pytest.mark.slow
def test_resume_just_before_a_switch_equals_not_stopping(tmp_path):
    total = 18
    expected = run(_adaptive_run, WORLD, total)
    # Decisions end the compressed iterations 2, 5, 8, ... (steps 4, 7, 10, ...): stop after step 9,
    # one step before the decision at step 10 that sees the jump of step 9.
    stop = 10
    run(_first_part, WORLD, stop, str(tmp_path / "ckpt"))  # saves; the resume starts afresh
    resumed = run_fresh(_second_part, WORLD, stop, total - stop, str(tmp_path / "ckpt"))
    for (_, _, want, ranks), (got, got_ranks) in zip(expected, resumed):
        assert got_ranks == ranks
        for a, b in zip(want, got):
            assert torch.equal(a, b)


def test_another_adaptive_setting_is_refused_at_load():
    state = gradpress.PowerSGDState(None, start_powerSGD_iter=2, adaptive_rank=ADAPTIVE)
    other = gradpress.PowerSGDState(None, start_powerSGD_iter=2, adaptive_rank=AdaptiveRank(1, 8, EVERY))
    with pytest.raises(ValueError, match="adaptive_rank"):
        other.load_state_dict(state.state_dict())

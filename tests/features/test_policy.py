"""Per-parameter rank policy: exact averaging of excluded parameters, ranks and bytes as the plan of each
parameter's own rank says, in the DDP hook and the aggregator; clear errors for bad policies."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import gradpress
import models
from distributed import run
from gradpress import Config, PowerSGD
from gradpress.powersgd import make_plan
from gradpress.policy import RankPolicy

WORLD = 2


def _net():
    torch.manual_seed(0)
    return nn.Sequential(nn.Embedding(50, 24), nn.Linear(24, 40), nn.ReLU(), nn.Linear(40, 50))


def _floats(shapes_and_ranks):
    shapes_and_ranks = list(shapes_and_ranks)
    return models.floats_sent_by_hand([s for s, _ in shapes_and_ranks], [r for _, r in shapes_and_ranks])


def test_make_plan_takes_a_rank_per_tensor():
    shapes = [(64, 32), (64,), (64, 32), (40, 30)]
    ranks = [None, 3, 4, 2]
    plan = make_plan(shapes, 1, 2, ranks)
    assert plan.numel_sent == _floats(zip(shapes, ranks))
    assert [(g.members, g.rank) for g in plan.groups] == [((2,), 4), ((3,), 2)]
    assert plan.uncompressed == (0, 1)
    with pytest.raises(ValueError, match="ranks has 2 entries for 4 tensors"):
        make_plan(shapes, 1, 2, [1, 2])
    with pytest.raises(ValueError, match=r"ranks\[1\] must be an integer >= 1"):
        make_plan(shapes, 1, 2, [1, 0, 1, 1])


def test_patterns_first_match_default_and_functions():
    net = _net()
    policy = RankPolicy({"0.*": None, "1.weight": 8, "*.weight": 3}, default=2, owner="PowerSGD")
    assert policy.resolve(net.named_parameters()) == {"0.weight": None, "1.weight": 8, "1.bias": 2,
                                                      "3.weight": 3, "3.bias": 2}
    by_size = RankPolicy(lambda name, p: None if p.numel() > 1500 else 4, default=2, owner="PowerSGD")
    assert by_size.resolve(net.named_parameters())["3.weight"] is None


@pytest.mark.parametrize("rules, error, match", [
    ({"embed*": None}, ValueError, "pattern 'embed\\*' matches no parameter; the parameters are: 0.weight"),
    ({"0.*": 0}, ValueError, r"rank_policy\['0.\*'\] must be an integer rank >= 1, or None"),
    ({"0.*": 2.5}, ValueError, "rank_policy"),
    ({3: None}, ValueError, "keys must be non-empty name patterns"),
    ({}, ValueError, "empty mapping"),
    ("0.*", TypeError, "mapping .* or a function"),
    (lambda name, p: -1, ValueError, r"rank_policy\('0.weight', ...\) must be an integer rank"),
])
def test_bad_policies_are_clear_errors(rules, error, match):
    with pytest.raises(error, match=match):
        PowerSGD(_net().named_parameters(), Config(rank=2), rank_policy=rules)


def test_the_aggregator_needs_names_for_a_policy():
    with pytest.raises(ValueError, match="named_parameters"):
        PowerSGD(_net().parameters(), Config(rank=2), rank_policy={"0.*": None})


def test_the_aggregator_sends_what_each_parameters_rank_says():
    net = _net()
    policy = {"0.*": None, "3.weight": 16}
    powersgd = PowerSGD(net.named_parameters(), Config(rank=2, num_iters_per_step=None), rank_policy=policy)
    ranks = {"0.weight": None, "1.weight": 2, "1.bias": 2, "3.weight": 16, "3.bias": 2}
    assert powersgd.floats_per_step == _floats([(p.shape, ranks[n]) for n, p in net.named_parameters()])
    plain = PowerSGD(net.named_parameters(), Config(rank=2, num_iters_per_step=None))
    assert plain.floats_per_step != powersgd.floats_per_step


def _aggregate(rank, world_size, policy):
    net = _net()
    powersgd = PowerSGD(net.named_parameters(), Config(rank=1, num_iters_per_step=None,
                                                       start_compressing_after_num_steps=0,
                                                       approximation_error_every_n_iters=1),
                        rank_policy=policy)
    torch.manual_seed(10 + rank)
    tokens = torch.randint(0, 50, (16,))
    net(tokens).square().mean().backward()
    local = {name: p.grad.clone() for name, p in net.named_parameters()}
    powersgd.aggregate_([p.grad for p in net.parameters()])
    return local, {name: p.grad.clone() for name, p in net.named_parameters()}, powersgd.approximation_error()


def test_excluded_parameters_are_averaged_exactly_on_two_workers():
    results = run(_aggregate, WORLD, {"0.*": None, "3.*": None})
    mean = {name: sum(local[name] for local, _, _ in results) / WORLD for name in results[0][0]}
    for _, averaged, errors in results:
        for name in ("0.weight", "3.weight", "3.bias", "1.bias"):
            torch.testing.assert_close(averaged[name], mean[name], rtol=0, atol=1e-7)
        assert set(errors) == {"1.weight"}  # the only compressed parameter
        assert not torch.allclose(averaged["1.weight"], mean["1.weight"])  # rank 1: not exact
    assert torch.equal(results[0][1]["1.weight"], results[1][1]["1.weight"])


def _ddp_policy(rank, world_size, policy, named):
    torch.manual_seed(0)
    model = models.make_model()
    ddp = DDP(model)
    state = gradpress.PowerSGDState(None, matrix_approximation_rank=1, start_powerSGD_iter=2, rank_policy=policy)
    if named:
        state.name_parameters(ddp)
    ddp.register_comm_hook(state, gradpress.powerSGD_hook)
    plain = DDP(models.make_model())
    try:
        for step in range(4):
            x, y = models.batch(rank, step)
            for net in (ddp, plain):
                net.zero_grad()
                models.loss_fn(net, x, y).backward()
    except RuntimeError as error:
        return str(error)
    shapes = {name: p.shape for name, p in model.named_parameters()}
    return ({name: (p.grad.clone(), q.grad.clone()) for (name, p), q in zip(model.named_parameters(),
                                                                              plain.parameters())},
            state.compression_stats(), shapes)


def test_the_ddp_hook_averages_excluded_parameters_exactly_and_counts_each_rank():
    policy = {"head.*": None, "conv2.weight": 4}
    for grads, (_, before, after), shapes in run(_ddp_policy, WORLD, policy, True):
        ranks = {name: None if name.startswith("head.") else 4 if name == "conv2.weight" else 1 for name in shapes}
        plan = make_plan(list(shapes.values()), 1, 2, list(ranks.values()))
        compressed = [name for name, t in zip(shapes, plan.tensors) if t.compressed]
        assert compressed and "head.weight" not in compressed
        for name in ("head.weight", "head.bias"):  # excluded: DDP's plain average
            torch.testing.assert_close(grads[name][0], grads[name][1], rtol=0, atol=1e-7)
        for name in compressed:  # a low rank of a full-rank mean: not DDP's
            assert not torch.allclose(grads[name][0], grads[name][1])
        per_step = _floats([(shape, ranks[name]) for name, shape in shapes.items()])
        assert (before, after) == (2 * sum(s.numel() for s in shapes.values()), 2 * per_step)


def test_the_ddp_hook_asks_for_names_and_refuses_the_batched_hook():
    for message in run(_ddp_policy, WORLD, {"head.*": None}, False):
        assert "rank_policy needs the parameters' names" in message and "name_parameters" in message
    state = gradpress.PowerSGDState(None, start_powerSGD_iter=2, rank_policy={"fc9.*": None})
    with pytest.raises(ValueError, match="rank_policy"):
        gradpress.batched_powerSGD_hook(state, None)
    with pytest.raises(ValueError, match="pattern 'fc9.*' matches no parameter"):
        state.name_parameters(models.make_model())


def _train(net, powersgd, steps, first=0):
    for step in range(first, first + steps):
        torch.manual_seed(100 + step)
        net.zero_grad()
        net(torch.randint(0, 50, (16,))).square().mean().backward()
        powersgd.aggregate_([p.grad for p in net.parameters()])
        with torch.no_grad():
            for p in net.parameters():
                p -= 0.1 * p.grad


def test_resume_with_a_policy_equals_not_stopping_and_another_policy_is_refused():
    policy = {"0.*": None, "3.weight": 3}
    config = Config(rank=2, start_compressing_after_num_steps=1)
    net = _net()
    whole = PowerSGD(net.named_parameters(), config, rank_policy=policy)
    _train(net, whole, 6)
    first = _net()
    stopped = PowerSGD(first.named_parameters(), config, rank_policy=policy)
    _train(first, stopped, 3)
    saved, weights = stopped.state_dict(), {k: v.clone() for k, v in first.state_dict().items()}
    second = _net()
    second.load_state_dict(weights)
    resumed = PowerSGD(second.named_parameters(), config, rank_policy=policy)
    resumed.load_state_dict(saved)
    _train(second, resumed, 3, first=3)
    for a, b in zip(net.parameters(), second.parameters()):
        assert torch.equal(a, b)
    # The same checkpoint under a policy that sends 1.weight exactly would drop its error memory.
    other = PowerSGD(_net().named_parameters(), config, rank_policy={**policy, "1.weight": None})
    other.load_state_dict(saved)
    with pytest.raises(ValueError, match="would be lost"):
        _train(_net(), other, 1)

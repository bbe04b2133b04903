"""Local SGD: model averagers, the post-local SGD hook, the outer optimizer (gloo, ranks with DIFFERENT
parameters, so that averaging is never a numerical no-op)."""

from __future__ import annotations

import os
from collections import OrderedDict

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from distributed import run
from models import train_regression
from gradpress import (Config, HierarchicalModelAverager, OuterOptimizerAverager, PeriodicModelAverager,
                       PostLocalSGDOptimizer, PostLocalSGDState, average_parameters, post_localSGD_hook)


def _gather(t: torch.Tensor) -> list[torch.Tensor]:
    out = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(out, t.contiguous())
    return out


def _local_update(params, rank, step):
    """A different, exactly representable change on every rank and step (multiples of 1/8)."""
    with torch.no_grad():
        for i, p in enumerate(params):
            p.add_(float((rank + 1) * (step + 2) + i) / 8)


def _params(rank, dtype=torch.float32):
    torch.manual_seed(100 + rank)  # different on every rank
    return [nn.Parameter((torch.randint(-8, 8, shape) / 4).to(dtype)) for shape in [(3, 4), (5,)]]


def periodic_schedule(rank, world, period, warmup, steps):
    params = _params(rank)
    alias = params[0]  # something else holding the tensor (an optimizer, an EMA): must see the average
    pointer = params[0].data_ptr()
    averager = PeriodicModelAverager(period=period, warmup_steps=warmup)
    averaged = []
    for step in range(steps):
        _local_update(params, rank, step)
        before = [p.detach().clone() for p in params]
        means = [torch.stack(_gather(b)).sum(0) / world for b in before]
        averager.average_parameters(params)
        if all(torch.equal(p, m) for p, m in zip(params, means)):
            averaged.append(step)
        else:
            assert all(torch.equal(p, b) for p, b in zip(params, before)), f"step {step}: partly changed"
    assert alias is params[0] and alias.data_ptr() == pointer
    return averaged, averager.num_averages, averager.bytes_sent


@pytest.mark.parametrize("period, warmup", [(1, 0), (3, 2), (4, 5)])
def test_periodic_averager_averages_exactly_on_its_schedule(period, warmup):
    steps = 14
    want = [s for s in range(steps) if s >= warmup and (s - warmup) % period == 0]
    for averaged, count, sent in run(periodic_schedule, 2, period, warmup, steps):
        assert averaged == want
        assert count == len(want) and sent == len(want) * 17 * 4


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 3)
        self.bn = nn.BatchNorm1d(3)
        self.frozen = nn.Parameter(torch.zeros(2), requires_grad=False)
        self.fp16 = nn.Parameter(torch.zeros(6, dtype=torch.float16))


def buffers_frozen_and_dtypes(rank, world):
    net = _Net()
    with torch.no_grad():
        for t in [net.fc.weight, net.fc.bias, net.bn.running_mean, net.frozen, net.fp16]:
            t.fill_(rank + 1.5)
        net.fp16.mul_(1000)  # the sum (5500) would overflow nothing; the dtype must stay fp16
    net.bn.num_batches_tracked.fill_(rank + 3)
    average_parameters(net, None)  # a module: float buffers too
    mean = sum(r + 1.5 for r in range(world)) / world
    assert torch.all(net.fc.weight == mean) and torch.all(net.bn.running_mean == mean)
    assert torch.all(net.frozen == rank + 1.5), "frozen parameters are skipped"
    assert int(net.bn.num_batches_tracked) == rank + 3, "integer buffers are left alone"
    assert net.fp16.dtype == torch.float16 and torch.all(net.fp16 == mean * 1000)
    # A parameter list: buffers are not averaged unless asked.
    with torch.no_grad():
        net.bn.running_var.fill_(rank)
    PeriodicModelAverager(1).average_parameters(net.parameters())
    assert torch.all(net.bn.running_var == rank)
    PeriodicModelAverager(1, average_buffers=True).average_parameters(net)
    assert torch.all(net.bn.running_var == sum(range(world)) / world)
    return True


def test_buffers_frozen_parameters_and_mixed_dtypes():
    assert all(run(buffers_frozen_and_dtypes, 2))


def hierarchical(rank, world, warmup, steps, count_from_warmup):
    averager = HierarchicalModelAverager(OrderedDict([(2, 2), (4, 4)]), warmup_steps=warmup,
                                         count_from_warmup=count_from_warmup)
    params = _params(rank)
    events = []
    for step in range(steps):
        _local_update(params, rank, step)
        before = torch.cat([p.detach().reshape(-1) for p in params])
        everyone = torch.stack(_gather(before))
        averager.average_parameters(params)
        after = torch.cat([p.detach().reshape(-1) for p in params])
        pair = everyone[2 * (rank // 2): 2 * (rank // 2) + 2]
        if torch.equal(after, everyone.mean(0)) and not torch.equal(after, pair.mean(0)):
            events.append((step, "all"))
        elif torch.equal(after, pair.mean(0)) and not torch.equal(after, before):
            events.append((step, "pair"))
        else:
            assert torch.equal(after, before)
    return events


@pytest.mark.slow
@pytest.mark.parametrize("count_from_warmup", [False, True])
def test_hierarchical_averager_on_four_ranks_averages_the_right_groups_at_the_right_steps(count_from_warmup):
    warmup, steps = 3, 13
    want = []
    for s in range(warmup, steps):
        counted = s - warmup if count_from_warmup else s  # PyTorch's schedule counts from step 0
        if counted % 4 == 0:
            want.append((s, "all"))
        elif counted % 2 == 0:
            want.append((s, "pair"))
    for events in run(hierarchical, 4, warmup, steps, count_from_warmup):
        assert events == want


def pytorch_three_level(rank, world):
    """PyTorch's own 3-level test (distributed_test.py), on gloo: parameters reset to ``rank`` every step."""
    model = nn.Linear(1, 5, bias=False)
    param = next(model.parameters())
    tensor = torch.ones_like(param.data) * rank
    averager = HierarchicalModelAverager(period_group_size_dict=OrderedDict([(2, 2), (4, 4), (8, world)]),
                                         warmup_steps=10)
    ranks1 = dist.get_process_group_ranks(averager.period_process_group_dict[2])
    group2 = averager.period_process_group_dict[4]
    ranks2 = list(range(world)) if group2 is None else dist.get_process_group_ranks(group2)
    assert ranks1 == [rank // 2 * 2, rank // 2 * 2 + 1] and ranks2 == [0, 1, 2, 3]
    within1 = torch.ones_like(param.data) * sum(ranks1) / 2
    everyone = torch.ones_like(param.data) * sum(range(world)) / world
    for step in range(25):
        with torch.no_grad():
            param.copy_(tensor)
        param.grad = torch.ones_like(param.data)
        averager.average_parameters(model.parameters())
        if step in (16, 24):
            assert torch.equal(param.data, everyone), step
        elif step in (12, 20):
            assert torch.equal(param.data, everyone), step  # the size-4 subgroup is everyone here
        elif step in (10, 14, 18, 22):
            assert torch.equal(param.data, within1), step
        else:
            assert torch.equal(param.data, tensor), step
    return averager.num_averages


def test_hierarchical_averager_passes_pytorchs_three_level_test():
    assert run(pytorch_three_level, 4) == [8] * 4


def hierarchical_errors(rank, world):
    messages = []
    for arg in [{2: 3, 4: 4}, {4: 2, 2: 4}, {2: 2}, {}, {0: 4}]:
        try:
            HierarchicalModelAverager(arg)
        except ValueError as exc:
            messages.append(str(exc))
    HierarchicalModelAverager({2: 4, 4: 4})  # PyTorch accepts a level equal to the world before the last
    return messages


def test_hierarchical_averager_rejects_bad_group_sizes_and_periods():
    messages = run(hierarchical_errors, 4)[0]
    assert len(messages) == 5
    assert "divide" in messages[0] and "3" in messages[0]
    assert "strictly increasing" in messages[1]
    assert "last group size" in messages[2] and "(4)" in messages[2]
    assert "at least one" in messages[3]
    assert "period" in messages[4] and ">= 1" in messages[4]


def post_local_hook(rank, world, post_local_gradient_allreduce, explicit_subgroup):
    torch.manual_seed(0)
    model = DDP(nn.Linear(3, 2, bias=False))
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    subgroup = pairs[rank // 2] if explicit_subgroup else None
    saved = os.environ.get("GRADPRESS_NODE_NAME")
    os.environ["GRADPRESS_NODE_NAME"] = f"node{rank // 2}"  # two simulated machines of two ranks
    try:
        state = PostLocalSGDState(None, subgroup, start_localSGD_iter=2,
                                  post_local_gradient_allreduce=post_local_gradient_allreduce)
        model.register_comm_hook(state, post_localSGD_hook)
        kinds = []
        for step in range(4):
            model.zero_grad()
            x = torch.full((1, 3), float(rank + 1 + step))
            model(x).sum().backward()
            local = x.expand(2, 3)  # d(sum(Wx))/dW
            grads = torch.stack(_gather(local))
            g = model.module.weight.grad
            if torch.equal(g, grads.mean(0)):
                kinds.append("global")
            elif torch.equal(g, grads[2 * (rank // 2): 2 * (rank // 2) + 2].mean(0)):
                kinds.append("subgroup")
            else:
                assert torch.equal(g, local)
                kinds.append("local")
        return kinds, state.iter
    finally:
        if saved is None:
            os.environ.pop("GRADPRESS_NODE_NAME", None)
        else:
            os.environ["GRADPRESS_NODE_NAME"] = saved


@pytest.mark.parametrize("allreduce, explicit, after", [(True, True, "subgroup"), (True, False, "subgroup"),
                                                        (False, False, "local")])
def test_post_local_sgd_hook_switches_at_start_local_sgd_iter(allreduce, explicit, after):
    for kinds, iters in run(post_local_hook, 4, allreduce, explicit):
        assert kinds == ["global", "global", after, after]
        assert iters == 4


def test_post_local_sgd_state_validates():
    with pytest.raises(ValueError, match="start_localSGD_iter"):
        PostLocalSGDState(None, None, start_localSGD_iter=0)
    with pytest.raises(ValueError, match="period"):
        PeriodicModelAverager(period=0)
    with pytest.raises(ValueError, match="warmup_steps"):
        PeriodicModelAverager(period=2, warmup_steps=-1)


def outer_vs_periodic(rank, world, momentum, compression):
    torch.manual_seed(rank)
    a = [nn.Parameter(torch.randn(6, 5, dtype=torch.float64)), nn.Parameter(torch.randn(5, dtype=torch.float64))]
    b = [nn.Parameter(p.detach().clone()) for p in a]
    plain = PeriodicModelAverager(period=3, warmup_steps=1)
    outer = OuterOptimizerAverager(period=3, warmup_steps=1, outer_lr=1.0, outer_momentum=momentum,
                                   compression=compression)
    worst, identical = 0.0, True
    for step in range(12):
        gen = torch.Generator().manual_seed(1000 * rank + step)
        with torch.no_grad():
            for p, q in zip(a, b):
                change = torch.randn(p.shape, generator=gen, dtype=torch.float64)
                p.add_(change)
                q.add_(change)
        plain.average_parameters(a)
        outer.average_parameters(b)
        worst = max(worst, max(float((p - q).abs().max()) for p, q in zip(a, b)))
        if outer.is_averaging_step(step):
            identical &= all(torch.equal(x, y) for q in b for x, y in [(q.detach(), _gather(q.detach())[0])])
    return worst, identical, outer.num_averages


def test_outer_optimizer_with_lr_1_and_no_momentum_is_periodic_averaging():
    for worst, identical, count in run(outer_vs_periodic, 2, 0.0, None):
        assert worst < 1e-12 and identical and count == 4


def test_outer_optimizer_with_momentum_differs_but_keeps_ranks_identical():
    for worst, identical, _ in run(outer_vs_periodic, 2, 0.9, None):
        assert worst > 1e-3 and identical


@pytest.mark.parametrize("compression", ["bf16", Config(rank=2, start_compressing_after_num_steps=0,
                                                        min_compression_rate=0)])
def test_outer_optimizer_compressed_deltas_keep_ranks_identical(compression):
    for worst, identical, _ in run(outer_vs_periodic, 2, 0.0, compression):
        assert identical and worst > 0  # lossy, yet every rank continues from the same point


def train_local_sgd(rank, world, steps, split, averager_kind):
    """Train with PostLocalSGDOptimizer; stop after ``split`` steps, checkpoint, rebuild, resume."""

    def make():
        torch.manual_seed(rank)  # different initial parameters on every rank
        net = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
        if averager_kind == "outer":
            averager = OuterOptimizerAverager(period=3, warmup_steps=2, outer_lr=0.7, outer_momentum=0.9)
        else:
            averager = PeriodicModelAverager(period=3, warmup_steps=2)
        return net, PostLocalSGDOptimizer(torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.5), averager)

    net, opt = make()
    train_regression(net, opt, rank, 0, steps)
    want = [p.detach().clone() for p in net.parameters()]
    net, opt = make()
    train_regression(net, opt, rank, 0, split)
    saved = {"net": net.state_dict(), "opt": opt.state_dict()}
    net, opt = make()
    net.load_state_dict(saved["net"])
    opt.load_state_dict(saved["opt"])
    train_regression(net, opt, rank, split, steps)
    return all(torch.equal(a, b) for a, b in zip(want, net.parameters())), saved["opt"]["step"]


@pytest.mark.parametrize("kind", ["periodic", "outer"])
def test_post_local_sgd_optimizer_resume_equals_uninterrupted(kind):
    for same, step in run(train_local_sgd, 2, 11, 6, kind):
        assert same and step == 6


def test_outer_optimizer_validates_its_arguments():
    for kwargs, name in [({"outer_lr": 0}, "outer_lr"), ({"outer_momentum": 1.0}, "outer_momentum"),
                         ({"compression": "int8"}, "compression"), ({"first_sync": "plain"}, "first_sync")]:
        with pytest.raises(ValueError, match=name):
            OuterOptimizerAverager(period=2, **kwargs)


def test_post_local_sgd_optimizer_state_without_step_warns_and_restarts_the_count_as_pytorch():
    """PyTorch's test_post_localSGD_optimizer_step_reload: the "step" key is the averager's step counter;
    without it, PyTorch's warning and step 0, whatever else the state holds."""
    param = nn.Parameter(torch.zeros(1))
    opt = PostLocalSGDOptimizer(torch.optim.SGD([param], lr=1), PeriodicModelAverager(2, warmup_steps=100))
    for _ in range(5):
        param.grad = torch.ones(1)
        opt.step()
    state = opt.state_dict()
    assert state["step"] == 5
    fresh = PostLocalSGDOptimizer(torch.optim.SGD([param], lr=1), PeriodicModelAverager(2, warmup_steps=100))
    fresh.load_state_dict(state)
    assert fresh.averager.step == 5
    del state["step"]  # gradpress's own "averager" entry still says 5: the missing key wins, as in PyTorch
    with pytest.warns(UserWarning, match="does not contain a step counter for an averager. Setting step "
                                         "counter to 0"):
        fresh.load_state_dict(state)
    assert fresh.averager.step == 0
    with pytest.warns(UserWarning, match="Setting step counter to 0"):
        fresh.load_state_dict(torch.optim.SGD([param], lr=1).state_dict())
    assert fresh.averager.step == 0


def outer_bytes_and_silent_load(rank, world, first_sync):
    """OuterOptimizerAverager sending Δ through PowerSGD: every byte counted (the anchor's broadcast, or the
    plain first average, then the aggregator's), and loading its state issues no collective."""
    params = _params(rank)
    config = Config(rank=1, start_compressing_after_num_steps=0, min_compression_rate=0)
    averager = OuterOptimizerAverager(period=2, outer_lr=0.5, outer_momentum=0.0, compression=config,
                                      first_sync=first_sync)
    averager.anchor_parameters(params)
    full = sum(p.numel() * p.element_size() for p in params)
    for step in range(6):  # syncs at 0, 2, 4
        _local_update(params, rank, step)
        averager.average_parameters(params)
    counted = averager.bytes_sent == full + averager.powersgd.total_bytes_sent
    state = averager.state_dict()
    issued = []
    originals = {name: getattr(dist, name) for name in ("broadcast", "all_reduce", "all_gather", "barrier")}
    for name, fn in originals.items():
        setattr(dist, name, lambda *a, _name=name, _fn=fn, **k: issued.append(_name) or _fn(*a, **k))
    try:
        fresh = OuterOptimizerAverager(period=2, outer_lr=0.5, outer_momentum=0.0, compression=config,
                                       first_sync=first_sync)
        if rank == 0:  # one rank alone: a collective here would hang
            fresh.load_state_dict(state)
    finally:
        for name, fn in originals.items():
            setattr(dist, name, fn)
    return counted, issued, averager.num_averages


@pytest.mark.parametrize("first_sync", ["outer", "average"])
def test_outer_optimizer_with_powersgd_counts_every_byte_and_loads_without_a_collective(first_sync):
    for counted, issued, averages in run(outer_bytes_and_silent_load, 2, first_sync):
        assert counted and issued == [] and averages == 3


def hierarchical_with_a_rank_outside_its_group(rank, world):
    """Three ranks, ``process_group`` holding ranks 0 and 1, the averager constructed on every rank (as
    its docstring asks). ``TORCH_DIST_INIT_BARRIER=1`` makes ``new_group`` end with a barrier over every
    rank (what torch does when it is set): a rank that skips one of the averager's ``new_group`` calls
    leaves the others waiting there."""
    group = dist.new_group([0, 1])
    previous = os.environ.get("TORCH_DIST_INIT_BARRIER")
    os.environ["TORCH_DIST_INIT_BARRIER"] = "1"
    try:
        try:
            averager = HierarchicalModelAverager(OrderedDict([(2, 1), (4, 2)]), process_group=group)
        except ValueError as error:
            averager, outcome = None, str(error)
        # Every rank issued the same new_group calls: the next group is the same group on every rank.
        everyone = dist.new_group([0, 1, 2])
    finally:
        if previous is None:
            os.environ.pop("TORCH_DIST_INIT_BARRIER", None)
        else:
            os.environ["TORCH_DIST_INIT_BARRIER"] = previous
    total = torch.ones(1)
    dist.all_reduce(total, group=everyone)
    assert total.item() == 3
    if averager is not None:  # the members' averager works: step 0 averages over process_group
        params = [nn.Parameter(torch.full((3,), float(rank)))]
        averager.average_parameters(params)
        outcome = params[0].detach().tolist()
    dist.barrier()
    return outcome


def test_hierarchical_averager_with_a_rank_outside_its_process_group_raises_there_and_works_on_members():
    member0, member1, outsider = run(hierarchical_with_a_rank_outside_its_group, 3, timeout=90)
    assert member0 == member1 == [0.5] * 3
    assert isinstance(outsider, str), outsider
    assert "(global rank 2) is not in process_group (global ranks [0, 1])" in outsider, outsider

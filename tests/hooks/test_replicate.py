"""``replicate()`` and gradpress hooks: 2 gloo ranks, float64, oracle: plain ``replicate()`` training.

torch 2.13's FSDP2-based ``replicate()`` (``torch.distributed._composable.replicate_with_fsdp``) makes
each unit a ``ReplicateModule``, an ``FSDPModule`` over a 1-D ``DDPMeshInfo`` mesh: no reduce-scatter,
a native all-reduce over the whole mesh, and ``set_all_reduce_hook`` called *after* that all-reduce
(``foreach_reduce``), so there is no hook point that replaces its all-reduce and
``register_fsdp_comm_hook`` refuses it. The pattern that runs a gradpress hook instead is
``fully_shard`` over the size-1 ``"shard"`` dimension of a ``(world, 1)`` mesh with
``reshard_after_forward=False``: the same unshard and reduce path as ``replicate()`` (FSDP's world-size-1
branches, full parameters on every rank), with the all-reduce across replicas left to the hook.
The older DDP-based ``torch.distributed._composable.replicate`` takes gradpress hooks as DDP comm hooks.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

import gradpress
from distributed import run
from gradpress.powersgd import make_plan

# On one test worker, where the module's runs (the module-scoped fixtures) are made once.
pytestmark = pytest.mark.xdist_group("replicate")

WORLD = 2
STEPS = 5
START = 2  # PowerSGD's exact warm-up iterations: STEPS - START compressed ones
WIDTH = 16  # >= every weight's min(n, m): full rank, the exact mean up to float64 rounding


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 12), nn.ReLU(), nn.Linear(12, 5)).double()


def _units(model):
    return (model[0], model[2], model)


def _batch(rank):
    generator = torch.Generator().manual_seed(rank)
    x = torch.randn(16, 8, dtype=torch.float64, generator=generator)
    return x, torch.randn(16, 5, dtype=torch.float64, generator=generator)


def _train(model, rank):
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = _batch(rank)
    for _ in range(STEPS):
        loss = nn.functional.mse_loss(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return [(p.to_local() if hasattr(p, "to_local") else p).detach().clone() for p in model.parameters()]


def _worst(a, b):
    return max((x - y).abs().max().item() for x, y in zip(a, b))


def _replicated():
    from torch.distributed._composable.replicate_with_fsdp import replicate

    model = _model()
    for unit in _units(model):
        replicate(unit)
    return model


def _hooked(mesh, state, hook):
    """``replicate()``'s equivalent with a gradpress hook: each unit sharded over a one-rank mesh."""
    from torch.distributed.fsdp import fully_shard

    model = _model()
    for unit in _units(model):
        fully_shard(unit, mesh=mesh["shard"], reshard_after_forward=False)
    gradpress.register_fsdp_comm_hook(model, state, hook)
    return model


def replicate_and_hooks(rank, world):
    from torch.distributed._composable import replicate as ddp_replicate
    from torch.distributed.device_mesh import init_device_mesh

    out = {}

    # replicate()'s own hook point sees gradients already averaged by its native all-reduce.
    model, seen = _replicated(), []
    model.set_all_reduce_hook(lambda flat: seen.append(flat.clone()))  # the root unit: model[4]'s
    x, y = _batch(rank)
    nn.functional.mse_loss(model(x), y).backward()
    local = _model()
    nn.functional.mse_loss(local(x), y).backward()
    local = torch.cat([local[4].weight.grad.flatten(), local[4].bias.grad])
    gathered = [torch.empty_like(local) for _ in range(world)]
    dist.all_gather(gathered, local)
    out["hook_input_minus_mean"] = (seen[0] - sum(gathered) / world).abs().max().item()
    out["local_minus_mean"] = (local - sum(gathered) / world).abs().max().item()

    try:
        gradpress.register_fsdp_comm_hook(_replicated(), None, gradpress.allreduce_hook)
        out["refusal"] = None
    except ValueError as exc:
        out["refusal"] = str(exc)

    reference = _train(_replicated(), rank)
    mesh = init_device_mesh("cpu", (world, 1), mesh_dim_names=("replicate", "shard"))
    group = mesh["replicate"].get_group()
    out["allreduce_hook"] = _worst(_train(_hooked(mesh, group, gradpress.allreduce_hook), rank), reference)

    # bytes_per_weight=8: float64 on the wire (the default wire is fp32).
    state = gradpress.PowerSGDState(group, matrix_approximation_rank=WIDTH, min_compression_rate=0,
                                    start_powerSGD_iter=START, bytes_per_weight=8)
    model = _hooked(mesh, state, gradpress.powerSGD_hook)
    out["powerSGD_hook"] = _worst(_train(model, rank), reference)
    plans = [make_plan([p.shape for p in layer.parameters()], WIDTH, 0) for layer in (model[0], model[2], model[4])]
    out["powersgd_counts"] = (state.iter, state.compression_stats()[1:], state.bytes_stats()[2])
    out["plan_counts"] = ((STEPS - START) * sum(p.numel for p in plans),
                          (STEPS - START) * sum(p.numel_sent for p in plans))

    model = ddp_replicate(_model())
    state = gradpress.PowerSGDState(None, matrix_approximation_rank=WIDTH, min_compression_rate=0,
                                    start_powerSGD_iter=START, bytes_per_weight=8)
    model.register_comm_hook(state, gradpress.powerSGD_hook)
    out["ddp_replicate"] = (_worst(_train(model, rank), reference), state.iter)
    return out


@pytest.fixture(scope="module")
def results():
    return run(replicate_and_hooks, WORLD)


def test_replicate_all_reduce_hook_runs_after_its_own_all_reduce(results):
    for r in results:
        assert r["local_minus_mean"] > 1e-3  # the ranks' gradients differ ...
        assert r["hook_input_minus_mean"] < 1e-12  # ... and the hook gets their mean: nothing left to replace


def test_register_fsdp_comm_hook_refuses_replicate(results):
    for r in results:
        assert r["refusal"] is not None and "all-reduces across replicas" in r["refusal"]
        assert "comes from replicate()" in r["refusal"] and "reshard_after_forward=False" in r["refusal"]


@pytest.mark.parametrize("name", ["allreduce_hook", "powerSGD_hook"])
def test_fully_shard_over_a_one_rank_mesh_with_the_hook_trains_as_replicate(results, name):
    for r in results:
        assert r[name] < 1e-9, (name, r[name])


def test_the_hook_ran_and_counted_the_plan(results):
    for r in results:
        iteration, (before, after), wire_bytes = r["powersgd_counts"]
        assert iteration == STEPS
        assert (before, after) == r["plan_counts"] and after > 0
        assert wire_bytes == 8 * after


def test_ddp_based_replicate_takes_gradpress_hooks_as_ddp_comm_hooks(results):
    for r in results:
        worst, iteration = r["ddp_replicate"]
        assert worst < 1e-9 and iteration == STEPS

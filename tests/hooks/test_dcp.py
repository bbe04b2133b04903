"""PowerSGD state through ``torch.distributed.checkpoint`` (DCP): every rank's error memory is kept under its
own key, a resume continues bit for bit, and another world size raises or starts the per-rank state fresh.

Oracle: the run that never stopped. Each worker trains, saves, goes on for a few steps (the reference), then
builds a fresh model, optimizer and state in the same process, loads the checkpoint into them and takes the
same steps: parameters and error memory must be bitwise equal. Float64, small models, gloo on CPU.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import DefaultLoadPlanner
from torch.distributed.checkpoint.state_dict import (get_model_state_dict, get_optimizer_state_dict,
                                                     set_model_state_dict, set_optimizer_state_dict)
from torch.nn.parallel import DistributedDataParallel as DDP

import gradpress
from distributed import run
from gradpress.checkpoint import dcp_stateful

OPTIONS = dict(matrix_approximation_rank=1, start_powerSGD_iter=2)
STEPS, MORE = 5, 3  # steps before the checkpoint (compression from step 2 on), steps after it


def _net(seed):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 12), nn.Tanh(), nn.Linear(12, 3)).double()


def _batch(rank, step):
    gen = torch.Generator().manual_seed(100 * step + rank)
    x = torch.randn(16, 8, generator=gen, dtype=torch.float64)
    return x, x[:, :3].sin()


def _train(model, optimizer, rank, start, stop):
    for step in range(start, stop):
        x, y = _batch(rank, step)
        optimizer.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()


def _params(model):
    return [(p.to_local() if hasattr(p, "to_local") else p).detach().clone() for p in model.parameters()]


def _same_params(a, b):
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


def _same_memory(a, b):
    """Bitwise equality of two ``local_state_dict()["memory"]`` (``{key: {"shape", "error", "q", "p"}}``)."""
    if a.keys() != b.keys():
        return False
    for key in a:
        if a[key].keys() != b[key].keys():
            return False
        for field, value in a[key].items():
            other = b[key][field]
            if isinstance(value, torch.Tensor):
                if not (isinstance(other, torch.Tensor) and torch.equal(value, other)):
                    return False
            elif value != other:
                return False
    return True


def _per_rank_keys(path, prefix="powersgd"):
    keys = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
    return sorted(key for key in keys if key.startswith(f"{prefix}.per_rank."))


# --- DDP + powerSGD_hook, 2 ranks ------------------------------------------------------------------------------

def _ddp_run(seed):
    model = DDP(_net(seed))
    state = gradpress.PowerSGDState(None, **OPTIONS)
    model.register_comm_hook(state, gradpress.powerSGD_hook)
    return model, torch.optim.Adam(model.parameters(), lr=1e-2), state


def ddp_resume(rank, world, path, plain_path):
    model, optimizer, state = _ddp_run(0)
    _train(model, optimizer, rank, 0, STEPS)
    dcp.save({"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, optimizer),
              "powersgd": state}, checkpoint_id=path)
    # The pattern users tried first: the state_dict itself, loaded into a fresh state_dict, then given back.
    dcp.save({"powersgd": state.state_dict()}, checkpoint_id=plain_path)
    saved_memory, saved_iter = state.local_state_dict()["memory"], state.iter
    _train(model, optimizer, rank, STEPS, STEPS + MORE)
    want_params, want_memory = _params(model), state.local_state_dict()["memory"]

    model, optimizer, state = _ddp_run(1)  # another seed: only the checkpoint can make it equal
    fresh_iter = state.iter
    loaded = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, optimizer),
              "powersgd": state}
    dcp.load(loaded, checkpoint_id=path)
    set_model_state_dict(model, loaded["model"])
    set_optimizer_state_dict(model, optimizer, loaded["optim"])
    resumed_iter = state.iter
    _train(model, optimizer, rank, STEPS, STEPS + MORE)

    plain = gradpress.PowerSGDState(None, **OPTIONS)
    template = {"powersgd": plain.state_dict()}
    dcp.load(template, checkpoint_id=plain_path)
    plain.load_state_dict(template["powersgd"])
    return {
        "params": _same_params(want_params, _params(model)),
        "memory": _same_memory(want_memory, state.local_state_dict()["memory"]),
        "compressed": len(want_memory),
        "iters": (fresh_iter, saved_iter, resumed_iter, state.iter),
        "plain": (_same_memory(saved_memory, plain.local_state_dict()["memory"]), plain.iter),
        "keys": _per_rank_keys(path),
        "plain_keys": _per_rank_keys(plain_path),
        "error_sum": sum(float(entry["error"].abs().sum()) for entry in want_memory.values()),
    }


def test_ddp_powersgd_state_resumes_bitwise_through_dcp(tmp_path):
    results = run(ddp_resume, 2, str(tmp_path / "ckpt"), str(tmp_path / "plain"))
    for rank, result in enumerate(results):
        assert result["compressed"] > 0, "no parameter was compressed: the test would prove nothing"
        assert result["params"], rank
        assert result["memory"], rank
        assert result["iters"] == (0, STEPS, STEPS, STEPS + MORE), rank
        assert result["plain"] == (True, STEPS), rank
        assert result["keys"] == result["plain_keys"] == ["powersgd.per_rank.rank_0", "powersgd.per_rank.rank_1"]
    # Each rank's error memory is its own (different batches): had DCP kept one rank's entry for both, the
    # memory comparison above would fail on the other rank, since the two differ.
    assert results[0]["error_sum"] != results[1]["error_sum"]


# --- FSDP2 + register_fsdp_comm_hook, 4 ranks on a (replicate=2, shard=2) mesh -------------------------------

def _fsdp_run(mesh, seed):
    from torch.distributed.fsdp import fully_shard

    model = _net(seed)
    for unit in (model[0], model[2], model):
        fully_shard(unit, mesh=mesh["shard"])
    state = gradpress.PowerSGDState(mesh["replicate"].get_group(), **OPTIONS)
    gradpress.register_fsdp_comm_hook(model, state, gradpress.powerSGD_hook)
    return model, torch.optim.Adam(model.parameters(), lr=1e-2), state


def fsdp_resume(rank, world, path):
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    model, optimizer, state = _fsdp_run(mesh, 0)
    _train(model, optimizer, rank, 0, STEPS)
    # The model's own state_dict (sharded DTensors, loaded in place); the optimizer's through DCP's helper,
    # which creates the state a fresh Adam does not have yet.
    dcp.save({"model": model.state_dict(), "optim": get_optimizer_state_dict(model, optimizer),
              "powersgd": state}, checkpoint_id=path)
    _train(model, optimizer, rank, STEPS, STEPS + MORE)
    want_params, want_memory = _params(model), state.local_state_dict()["memory"]

    model, optimizer, state = _fsdp_run(mesh, 1)
    loaded = {"model": model.state_dict(), "optim": get_optimizer_state_dict(model, optimizer), "powersgd": state}
    dcp.load(loaded, checkpoint_id=path)
    set_optimizer_state_dict(model, optimizer, loaded["optim"])
    _train(model, optimizer, rank, STEPS, STEPS + MORE)
    return {
        "params": _same_params(want_params, _params(model)),
        "memory": _same_memory(want_memory, state.local_state_dict()["memory"]),
        "compressed": len(want_memory),
        "iter": state.iter,
        "keys": _per_rank_keys(path),
        "error_sum": sum(float(entry["error"].abs().sum()) for entry in want_memory.values()),
    }


def test_fsdp2_powersgd_state_resumes_bitwise_through_dcp(tmp_path):
    results = run(fsdp_resume, 4, str(tmp_path / "ckpt"))
    for rank, result in enumerate(results):
        assert result["compressed"] > 0
        assert result["params"], rank
        assert result["memory"], rank
        assert result["iter"] == STEPS + MORE
        assert result["keys"] == [f"powersgd.per_rank.rank_{r}" for r in range(4)]
    # Four ranks, four different error memories (each shard and each replica's batch its own).
    assert len({result["error_sum"] for result in results}) == 4


# --- another world size ----------------------------------------------------------------------------------------

def save_trained(rank, world, path):
    model, optimizer, state = _ddp_run(0)
    _train(model, optimizer, rank, 0, STEPS)
    dcp.save({"model": model.module.state_dict(), "powersgd": state}, checkpoint_id=path)
    return [p.detach().clone() for p in model.parameters()]


def _as_constructed(state):
    sd, new = state.local_state_dict(), gradpress.PowerSGDState(None, **OPTIONS).local_state_dict()
    return sd["iter"] == 0 and sd["memory"] == {} and {k: v for k, v in sd.items() if k != "placement"} == {
        k: v for k, v in new.items() if k != "placement"}


def load_into_other_world(rank, world, path, partial):
    planner = DefaultLoadPlanner(allow_partial_load=True) if partial else None
    state = gradpress.PowerSGDState(None, **OPTIONS)
    try:
        dcp.load({"powersgd": state}, checkpoint_id=path, planner=planner)
        refused = None
    except ValueError as error:
        refused = str(error)
    model = _net(1)
    state = gradpress.PowerSGDState(None, **OPTIONS)
    loaded = {"model": model.state_dict(), "powersgd": dcp_stateful(state, "fresh")}
    dcp.load(loaded, checkpoint_id=path, planner=planner)
    return refused, _as_constructed(state), [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("saved_on, loaded_on", [(4, 2), (2, 4)])
def test_another_world_size_raises_by_default_and_starts_fresh_on_request(tmp_path, saved_on, loaded_on):
    path = str(tmp_path / "ckpt")
    saved = run(save_trained, saved_on, path)[0]
    # A larger world: the new ranks find no entry of their own, which DCP refuses unless told to allow it.
    results = run(load_into_other_world, loaded_on, path, loaded_on > saved_on)
    for rank, (refused, fresh, params) in enumerate(results):
        assert refused is not None and "on_world_size_change" in refused, rank
        assert f"saved by {saved_on} ranks, this run has {loaded_on}" in refused
        assert fresh, rank
        assert _same_params(saved, params), rank  # the replicated model loads all the same


# --- the PowerSGD aggregator, 2 ranks --------------------------------------------------------------------------

def _aggregator_run(seed):
    model = _net(seed)
    powersgd = gradpress.PowerSGD(model.parameters(), gradpress.Config(rank=1, start_compressing_after_num_steps=2))
    return model, torch.optim.Adam(model.parameters(), lr=1e-2), powersgd


def _aggregate(model, optimizer, powersgd, rank, start, stop):
    for step in range(start, stop):
        x, y = _batch(rank, step)
        nn.functional.mse_loss(model(x), y).backward()
        gradpress.optimizer_step(optimizer, powersgd)


def aggregator_resume(rank, world, path):
    model, optimizer, powersgd = _aggregator_run(0)
    _aggregate(model, optimizer, powersgd, rank, 0, STEPS)
    dcp.save({"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, optimizer),
              "powersgd": powersgd}, checkpoint_id=path)
    _aggregate(model, optimizer, powersgd, rank, STEPS, STEPS + MORE)
    want_params, want_memory = _params(model), powersgd.local_state_dict()["memory"]

    model, optimizer, powersgd = _aggregator_run(1)  # init_sync: rank 0's seed-1 weights, until the load
    loaded = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, optimizer),
              "powersgd": powersgd}
    dcp.load(loaded, checkpoint_id=path)
    set_model_state_dict(model, loaded["model"])
    set_optimizer_state_dict(model, optimizer, loaded["optim"])
    _aggregate(model, optimizer, powersgd, rank, STEPS, STEPS + MORE)
    return (_same_params(want_params, _params(model)),
            _same_memory(want_memory, powersgd.local_state_dict()["memory"]), len(want_memory),
            powersgd.step_counter, _per_rank_keys(path))


def test_powersgd_aggregator_resumes_bitwise_through_dcp(tmp_path):
    for rank, (params, memory, compressed, steps, keys) in enumerate(run(aggregator_resume, 2, str(tmp_path))):
        assert compressed > 0
        assert params and memory, rank
        assert steps == STEPS + MORE
        assert keys == ["powersgd.per_rank.rank_0", "powersgd.per_rank.rank_1"]

"""Checkpoint hygiene: atomic save, clear errors for corrupt files, rank/world-size records."""

from __future__ import annotations

import argparse
import os

import pytest
import torch
from torch import nn

import gradpress
from gradpress import checkpoint
from gradpress.aggregator import Config, PowerSGD
from gradpress.averaging import OuterOptimizerAverager
from distributed import run

WORLD = 2


# --- gradpress.checkpoint.save / load -----------------------------------------------------------------------

def _blob():
    return {"step": 7, "weights": torch.arange(2000, dtype=torch.float32).reshape(40, 50)}


def test_save_load_round_trip_leaves_no_temp_files(tmp_path):
    path = tmp_path / "ckpt.pt"
    checkpoint.save(_blob(), path)
    checkpoint.save({**_blob(), "step": 8}, str(path))  # overwrite in place
    loaded = checkpoint.load(path, map_location="cpu")
    assert loaded["step"] == 8 and torch.equal(loaded["weights"], _blob()["weights"])
    assert os.listdir(tmp_path) == ["ckpt.pt"]


def test_failed_save_keeps_the_previous_file(tmp_path):
    path = tmp_path / "ckpt.pt"
    checkpoint.save(_blob(), path)
    before = path.read_bytes()
    with pytest.raises(Exception):
        checkpoint.save({"bad": lambda: None}, path)  # lambdas cannot be pickled: fails mid-write
    assert path.read_bytes() == before
    assert os.listdir(tmp_path) == ["ckpt.pt"]


@pytest.mark.parametrize("damage", ["half", "garbage", "empty", "head"])
def test_corrupt_file_error_names_the_file(tmp_path, damage):
    path = tmp_path / "ckpt.pt"
    checkpoint.save(_blob(), path)
    data = path.read_bytes()
    path.write_bytes({"half": data[: len(data) // 2], "garbage": b"\x80\x04not a checkpoint" * 50,
                      "empty": b"", "head": data[:10]}[damage])
    with pytest.raises(ValueError, match="truncated or corrupt") as info:
        checkpoint.load(path)
    assert str(path) in str(info.value)
    assert len(str(info.value)) < 400  # one readable line, not a pickle traceback


def test_missing_file_names_the_file(tmp_path):
    path = tmp_path / "nope.pt"
    with pytest.raises(FileNotFoundError, match="nope.pt"):
        checkpoint.load(path)


def test_well_formed_but_unsafe_checkpoint_is_not_called_corrupt(tmp_path):
    path = tmp_path / "ckpt.pt"
    checkpoint.save({"obj": argparse.Namespace(x=1)}, path)
    with pytest.raises(Exception) as info:  # weights_only refuses it: torch's own message stands
        checkpoint.load(path)
    assert "truncated or corrupt" not in str(info.value)
    assert checkpoint.load(path, weights_only=False)["obj"].x == 1


# --- rank / world size records (single process: rank 0 of 1) -------------------------------------------------

def _hook_state():
    return gradpress.PowerSGDState(None, matrix_approximation_rank=2, start_powerSGD_iter=3)


def _aggregator():
    torch.manual_seed(0)
    params = [nn.Parameter(torch.randn(8, 6)), nn.Parameter(torch.randn(6))]
    return PowerSGD(params, Config(rank=2, start_compressing_after_num_steps=0))


@pytest.mark.parametrize("make", [_hook_state, _aggregator], ids=["PowerSGDState", "PowerSGD"])
def test_state_dict_records_rank_and_world_size(make):
    assert make().local_state_dict()["placement"] == {"rank": 0, "world_size": 1}


@pytest.mark.parametrize("make", [_hook_state, _aggregator], ids=["PowerSGDState", "PowerSGD"])
def test_load_from_another_rank_or_world_size_is_refused(make):
    sd = make().local_state_dict()
    sd["placement"] = {"rank": 1, "world_size": 2}
    with pytest.raises(ValueError, match=r"world_size=2 but this process has world_size=1") as info:
        make().load_state_dict(sd)
    assert "allow_other_rank=True" in str(info.value)
    sd["placement"] = {"rank": 1, "world_size": 1}
    with pytest.raises(ValueError, match=r"rank=1 but this process has rank=0"):
        make().load_state_dict(sd)
    make().load_state_dict(sd, allow_other_rank=True)  # deliberate


@pytest.mark.parametrize("make", [_hook_state, _aggregator], ids=["PowerSGDState", "PowerSGD"])
def test_old_checkpoints_without_placement_still_load(make):
    sd = make().local_state_dict()
    del sd["placement"]
    make().load_state_dict(sd)


def test_aggregator_shape_mismatch_names_parameter_and_shapes():
    sd = _aggregator().local_state_dict()
    sd["param_shapes"][1] = [7]
    with pytest.raises(ValueError, match=r"parameter #1 has shape \(7,\), this PowerSGD's has \(6,\)"):
        _aggregator().load_state_dict(sd)
    sd["param_shapes"].append([3])
    with pytest.raises(ValueError, match="saved for 3 parameters, this PowerSGD has 2"):
        _aggregator().load_state_dict(sd)


# --- rank / world size records across real ranks -------------------------------------------------------------

def swap_rank_states(rank, world):
    torch.manual_seed(rank)
    params = [nn.Parameter(torch.randn(8, 6))]
    agg = PowerSGD(params, Config(rank=1, start_compressing_after_num_steps=0))
    agg.aggregate_([torch.randn(8, 6)])
    mine = agg.state_dict()
    gathered: list = [None] * world
    torch.distributed.all_gather_object(gathered, mine)
    agg.load_state_dict(gathered[rank])  # own state: fine
    try:
        agg.load_state_dict(gathered[(rank + 1) % world])
    except ValueError as exc:
        return agg.local_state_dict()["placement"], str(exc)
    return agg.local_state_dict()["placement"], None


def test_loading_another_ranks_state_is_refused_across_processes():
    for rank, (placement, message) in enumerate(run(swap_rank_states, WORLD)):
        assert placement == {"rank": rank, "world_size": WORLD}
        assert message is not None and f"rank={(rank + 1) % WORLD} but this process has rank={rank}" in message


def outer_averager_state_of_other_rank(rank, world):
    params = [nn.Parameter(torch.randn(8, 6, dtype=torch.float64))]
    config = Config(rank=1, start_compressing_after_num_steps=0)
    averager = OuterOptimizerAverager(period=1, compression=config)
    averager.anchor_parameters(params)  # where local training starts: every sync is an outer step
    for _ in range(2):
        averager.average_parameters(params)
    sd = averager.state_dict()
    gathered: list = [None] * world
    torch.distributed.all_gather_object(gathered, sd)
    fresh = OuterOptimizerAverager(period=1, compression=config)
    try:
        fresh.load_state_dict(gathered[(rank + 1) % world])
        message = None
    except ValueError as exc:
        message = str(exc)
    fresh.load_state_dict(gathered[(rank + 1) % world], allow_other_rank=True)
    fresh.average_parameters(params)
    return averager.local_state_dict()["powersgd"]["placement"], message


def test_outer_averager_refuses_compressed_state_of_another_rank_at_load():
    for rank, (placement, message) in enumerate(run(outer_averager_state_of_other_rank, WORLD)):
        assert placement == {"rank": rank, "world_size": WORLD}
        assert message is not None and message.startswith("OuterOptimizerAverager checkpoint was saved with "
                                                          f"rank={(rank + 1) % WORLD}")


def _gather_scatter(rank, world_size, what):
    import gradpress
    from torch import nn

    torch.manual_seed(0)
    state = gradpress.PowerSGD([nn.Parameter(torch.zeros(8, 6))], gradpress.Config(
        rank=1, start_compressing_after_num_steps=0), init_sync=False)
    state.aggregate_([torch.randn(8, 6, generator=torch.Generator().manual_seed(rank))])
    gathered = gradpress.gather_state(state)
    if rank != 0:
        assert gathered is None
    fresh = gradpress.PowerSGD([nn.Parameter(torch.zeros(8, 6))], gradpress.Config(
        rank=1, start_compressing_after_num_steps=0), init_sync=False)
    if what == "other world size" and rank == 0:
        gathered = {**gathered, "world_size": 3, "ranks": gathered["ranks"] + [gathered["ranks"][0]]}
    if what == "not gathered" and rank == 0:
        gathered = {"model": {}}
    try:
        gradpress.scatter_state(fresh, gathered if rank == 0 else None)
    except ValueError as error:
        return str(error)
    mine = state.local_state_dict()["memory"][0]["error"]
    return torch.equal(fresh.local_state_dict()["memory"][0]["error"], mine), fresh.step_counter


@pytest.mark.parametrize("what, message", [("other world size", "saved by 3 ranks, this run has 2"),
                                           ("not gathered", "what gather_state returned")])
def test_scatter_state_refuses_on_every_rank_what_it_cannot_split(what, message):
    for result in run(_gather_scatter, 2, what):
        assert isinstance(result, str) and message in result


def test_gather_then_scatter_gives_each_rank_its_own_state():
    assert run(_gather_scatter, 2, "ok") == [(True, 1), (True, 1)]


def _gather_scatter_outer_averager(rank, world_size):
    import gradpress

    config = Config(rank=1, start_compressing_after_num_steps=0)
    params = [nn.Parameter(torch.zeros(8, 6))]
    averager = OuterOptimizerAverager(period=1, compression=config)
    averager.anchor_parameters(params)
    for step in range(3):
        with torch.no_grad():  # local steps: each rank moves its own way between averages
            params[0].add_(torch.randn(8, 6, generator=torch.Generator().manual_seed(10 * step + rank)))
        averager.average_parameters(params)
    gathered = gradpress.gather_state(averager, dst=1)  # any rank may hold the checkpoint
    assert (gathered is None) == (rank != 1)
    fresh = OuterOptimizerAverager(period=1, compression=config)
    gradpress.scatter_state(fresh, gathered, src=1)
    mine, loaded = averager.local_state_dict(), fresh.local_state_dict()
    return (loaded["powersgd"]["placement"], loaded["num_averages"] == mine["num_averages"],
            all(torch.equal(loaded["powersgd"]["memory"][key]["error"], entry["error"])
                for key, entry in mine["powersgd"]["memory"].items()),
            sum(float(entry["error"].abs().sum()) for entry in mine["powersgd"]["memory"].values()))


def test_gather_then_scatter_restores_an_outer_averagers_per_rank_memory():
    results = run(_gather_scatter_outer_averager, WORLD)
    assert [result[:3] for result in results] == [({"rank": rank, "world_size": WORLD}, True, True)
                                                  for rank in range(WORLD)]
    errors = [result[3] for result in results]
    assert min(errors) > 0 and errors[0] != errors[1]  # each rank got its own, non-trivial memory back

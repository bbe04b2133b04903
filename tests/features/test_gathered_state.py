"""gather_state / scatter_state misused the way a rank-0-only script misuses them, and the messages that
say what to do instead: a call made on rank 0 alone, a gathered state handed to ``load_state_dict``, a
gathered state from another world size."""

from __future__ import annotations

import time

import pytest
import torch
from torch import nn

import gradpress
from gradpress import checkpoint
from distributed import run

WORLD = 2
FIX = "every rank must call gather_state at the same iteration"


def _fresh_state():
    return gradpress.PowerSGDState(None, matrix_approximation_rank=1, start_powerSGD_iter=2, min_compression_rate=0.5)


def _hook_state(rank: int):
    """A PowerSGDState that has compressed one step on a small DDP model (non-zero error memory)."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(0)
    model = DDP(nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4)))
    state = _fresh_state()
    model.register_comm_hook(state, gradpress.powerSGD_hook)
    generator = torch.Generator().manual_seed(rank)
    for _ in range(3):
        model(torch.randn(8, 16, generator=generator)).square().sum().backward()
        model.zero_grad()
    return state


def _gather_on_rank_0_only(rank: int, world_size: int, timeout: float) -> dict:
    import torch.distributed as dist
    from torch.distributed import distributed_c10d

    store = distributed_c10d._get_default_store()
    state = gradpress.PowerSGD([nn.Parameter(torch.zeros(8, 6))], gradpress.Config(rank=1), init_sync=False)
    def gather() -> tuple[str | None, float]:
        """The error gather_state raised (None: none) and the seconds it took."""
        started = time.monotonic()
        try:
            gradpress.gather_state(state, arrival_timeout=timeout)
            return None, time.monotonic() - started
        except RuntimeError as error:
            return str(error), time.monotonic() - started

    if rank == 0:  # the natural spot in nanoGPT: inside the block that only rank 0 runs
        message, elapsed = gather()
        store.set("test/rank 0 is done", b"1")
    else:  # elsewhere meanwhile (in a script: the next iteration), then reaching the call late
        store.wait(["test/rank 0 is done"])
        message, elapsed = gather()
    dist.barrier()
    return {"message": message, "seconds": elapsed}


def test_gather_state_called_on_rank_0_only_fails_fast_saying_what_to_do():
    timeout = 2.0
    # Both ranks enter gather_state once (rank 1 late), so the shared workers stay in step for other tests.
    rank0, rank1 = run(_gather_on_rank_0_only, WORLD, timeout, timeout=300)
    # Rank 0 waited its arrival_timeout, not the process group's 30 minutes, and says what to do.
    assert rank0["message"] is not None and FIX in rank0["message"]
    assert "arrival_timeout=2 s" in rank0["message"] and "1 of 2 arrived" in rank0["message"]
    assert "if rank == 0" in rank0["message"]
    assert timeout <= rank0["seconds"] < timeout + 60
    # The rank that reaches the call after rank 0 gave up does not enter the gather alone either.
    assert rank1["message"] is not None and FIX in rank1["message"] and "given up" in rank1["message"]
    assert rank1["seconds"] < 60


def _gather_with_one_rank_late(rank: int, world_size: int, delay: float) -> tuple:
    from gradpress.aggregator import Config, PowerSGD

    state = PowerSGD([nn.Parameter(torch.zeros(8, 6))], Config(rank=1, start_compressing_after_num_steps=0),
                     init_sync=False)
    state.aggregate_([torch.randn(8, 6, generator=torch.Generator().manual_seed(rank))])
    if rank == 1:
        time.sleep(delay)  # within arrival_timeout: a late rank is not an error
    gathered = gradpress.gather_state(state, arrival_timeout=120)
    scattered = gradpress.scatter_state(state, gathered if rank == 0 else None, arrival_timeout=120)
    return gathered is None, scattered


def test_ranks_arriving_at_different_times_within_the_timeout_gather_as_usual():
    assert run(_gather_with_one_rank_late, WORLD, 1.0) == [(False, True), (True, True)]


def test_arrival_timeout_is_checked_at_the_call():
    state = gradpress.PowerSGD([nn.Parameter(torch.zeros(8, 6))], gradpress.Config(rank=1), init_sync=False)
    for bad in (0, -1.0, float("inf"), "60", True):
        with pytest.raises(ValueError, match="arrival_timeout must be None or a finite number of seconds > 0"):
            gradpress.gather_state(state, arrival_timeout=bad)
    with pytest.raises(ValueError, match="on_world_size_change must be 'raise' or 'fresh', got 'reset'"):
        gradpress.scatter_state(state, None, on_world_size_change="reset")


def _gathered_into_load_state_dict(rank: int, world_size: int) -> str | None:
    state = _hook_state(rank)
    gathered = gradpress.gather_state(state)
    if rank != 0:
        return None
    try:
        _fresh_state().load_state_dict(gathered)  # one rank's state_dict expected
    except ValueError as error:
        return str(error)
    return "loaded"


def test_a_gathered_state_given_to_load_state_dict_says_to_use_scatter_state():
    message = run(_gathered_into_load_state_dict, WORLD, timeout=60)[0]
    assert message is not None and "gathered state of 2 ranks" in message, message
    assert "use gradpress.scatter_state" in message


def test_reject_gathered_lets_one_ranks_state_through():
    one_rank = {"version": 1, "options": {}, "memory": {}}
    checkpoint.reject_gathered(one_rank, "X.load_state_dict")  # no error
    gathered = {"format": checkpoint.GATHERED_FORMAT, "version": 1, "world_size": 4, "ranks": [one_rank] * 4}
    with pytest.raises(ValueError, match=r"X.load_state_dict got a gathered state of 4 ranks .*scatter_state"):
        checkpoint.reject_gathered(gathered, "X.load_state_dict")


def _scatter_from_other_world_size(rank: int, world_size: int, mode: str) -> tuple:
    state = _hook_state(rank)
    gathered = gradpress.gather_state(state)
    if rank == 0:  # as if saved by 3 ranks
        gathered = {**gathered, "world_size": 3, "ranks": gathered["ranks"] + [gathered["ranks"][0]]}
    fresh = _fresh_state()
    before = fresh.local_state_dict()
    try:
        loaded = gradpress.scatter_state(fresh, gathered if rank == 0 else None, on_world_size_change=mode)
    except ValueError as error:
        return "error", str(error)
    after = fresh.local_state_dict()
    unchanged = after["iter"] == before["iter"] == 0 and after["memory"] == before["memory"]
    return "ok", loaded, unchanged, state.iter


def test_scatter_state_from_another_world_size_says_how_to_go_on_without_it():
    for result in run(_scatter_from_other_world_size, WORLD, "raise"):
        assert result[0] == "error"
        assert "saved by 3 ranks, this run has 2" in result[1]
        assert "on_world_size_change='fresh'" in result[1] and "costs a few steps" in result[1]
    # The way out it names: every rank keeps its state as constructed and says so.
    assert run(_scatter_from_other_world_size, WORLD, "fresh") == [("ok", False, True, 3)] * WORLD


def _store_keys_around_calls(rank: int, world_size: int, calls: int) -> tuple[int, int]:
    import torch.distributed as dist
    from torch.distributed import distributed_c10d

    store = distributed_c10d._get_default_store()
    state = gradpress.PowerSGD([nn.Parameter(torch.zeros(8, 6))], gradpress.Config(rank=1), init_sync=False)
    dist.barrier()  # no rank still inside an earlier call while the keys are counted
    before = store.num_keys()
    dist.barrier()  # counted on both ranks before either adds a key
    for _ in range(calls):
        gathered = gradpress.gather_state(state)
        assert gradpress.scatter_state(state, gathered if rank == 0 else None)
    dist.barrier()
    return before, store.num_keys()


def test_gather_and_scatter_state_leave_no_keys_behind_in_the_store():
    # A run that checkpoints every N steps calls them thousands of times: the store must not grow with it.
    for before, after in run(_store_keys_around_calls, WORLD, 4, timeout=120):
        assert after <= before, (before, after)

"""gradpress.comm's collectives on 2 and 3 gloo ranks: results, in-place contracts, subgroups (ranks
given within the group), and failures named as CollectiveError."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from distributed import run

from gradpress import comm


def collectives(rank: int, world: int) -> dict[str, object]:
    out: dict[str, object] = {}
    t = torch.tensor([1.0 + rank, -float(rank)])
    out["sum"] = comm.all_reduce(t.clone()).tolist()
    out["max"] = comm.all_reduce(t.clone(), op="max").tolist()
    pending = comm.all_reduce_async(t.clone(), op="min")
    out["min"] = pending.wait().tolist()
    b = torch.full((3,), float(rank))
    assert comm.broadcast(b, src=world - 1) is b
    out["broadcast"] = b.tolist()
    c = torch.full((2,), float(rank))
    out["broadcast_async"] = comm.broadcast_async(c, src=1).wait().tolist()
    gathered = torch.empty(2 * world)
    out["all_gather"] = comm.all_gather_async(gathered, torch.tensor([rank, 10.0 * rank])).wait().tolist()
    share = torch.empty(1)
    pending = comm.reduce_scatter_async(share, torch.arange(world, dtype=torch.float32) + rank)
    out["reduce_scatter"] = pending.wait().tolist()
    out["objects"] = comm.all_gather_objects({"rank": rank})
    comm.barrier()
    # A subgroup of ranks 1 .. world-1: src is a rank within it (its first member, global rank 1).
    group = dist.new_group(list(range(1, world)))
    if rank >= 1:
        s = torch.tensor([float(rank)])
        comm.broadcast(s, src=0, process_group=group)
        out["sub_broadcast"] = s.item()
        out["sub_objects"] = comm.all_gather_objects(rank, group)
    try:
        comm.all_reduce(torch.ones(2), op="mean")
    except ValueError as error:
        out["bad_op"] = str(error)
    return out


@pytest.mark.slow
def test_collectives_give_the_same_results_as_their_definitions():
    world = 3
    results = run(collectives, world)
    for rank, out in enumerate(results):
        assert out["sum"] == [1.0 + 2.0 + 3.0, -(0.0 + 1.0 + 2.0)]
        assert out["max"] == [3.0, 0.0]
        assert out["min"] == [1.0, -2.0]
        assert out["broadcast"] == [2.0] * 3
        assert out["broadcast_async"] == [1.0] * 2
        assert out["all_gather"] == [0.0, 0.0, 1.0, 10.0, 2.0, 20.0]
        assert out["reduce_scatter"] == [sum(rank + r for r in range(world))]  # element `rank` of each rank's input
        assert out["objects"] == [{"rank": r} for r in range(world)]
        if rank >= 1:
            assert out["sub_broadcast"] == 1.0
            assert out["sub_objects"] == [1, 2]
        assert "op must be one of" in out["bad_op"]


class _TimedOut:
    def wait(self) -> None:
        raise RuntimeError("Timed out waiting 5000ms for recv operation to complete")


def failing(rank: int, world: int) -> list[str]:
    """The backend failing at the start (blocking and async) and at the wait: each error is a
    CollectiveError naming the collective and the issuer. The backend is replaced, nothing is sent."""
    def backend(*args: object, async_op: bool = False, **kwargs: object) -> object:
        if async_op and kwargs.get("op") == dist.ReduceOp.MAX:
            return _TimedOut()
        raise RuntimeError("Connection reset by peer")

    messages = []
    calls = [lambda: comm.all_reduce(torch.ones(4), issuer="the test"),
             lambda: comm.all_reduce_async(torch.ones(4), issuer="the test"),
             lambda: comm.all_reduce_async(torch.ones(4), op="max", issuer="the test").wait()]
    original, dist.all_reduce = dist.all_reduce, backend
    try:
        for call in calls:
            try:
                call()
            except Exception as error:  # noqa: BLE001 - the type is what is checked
                messages.append(f"{type(error).__name__}: {error}")
    finally:
        dist.all_reduce = original
    group = dist.new_group([0])
    if rank == 1:  # torch does nothing for a rank outside the group: there is nothing to wait on
        try:
            comm.all_reduce_async(torch.ones(4), group, issuer="the test")
        except Exception as error:  # noqa: BLE001
            messages.append(f"{type(error).__name__}: {error}")
    return messages


def test_a_failure_is_a_collective_error_naming_the_collective_and_issuer():
    messages = run(failing, 2)[1]
    assert len(messages) == 4
    for message, op in zip(messages, ["sum", "sum", "max", "sum"]):
        assert message.startswith(f"CollectiveError: allreduce ({op}) of 4 float32 values over ")
        assert "in the test failed" in message
    assert messages[0].endswith("over 2 ranks in the test failed: RuntimeError: Connection reset by peer")
    assert "did not take part within the process group's timeout" in messages[2]
    assert "not a member of the process group" in messages[3]


def outside_the_group(rank: int, world: int) -> dict[str, object]:
    """Rank 1 is not in ``group``: the averaging helpers leave its tensors alone (PyTorch returns early),
    where a division by the group's world size of -1 once negated them; the collectives raise."""
    from gradpress import PeriodicModelAverager, average_parameters

    group = dist.new_group([0])  # every rank calls new_group
    out: dict[str, object] = {"member": comm.is_member(group), "default_member": comm.is_member(None)}
    params = [torch.nn.Parameter(torch.ones(2, 2) * 2)]
    average_parameters(params, group)
    out["averaged"] = params[0].detach().tolist()
    out["sent"] = comm.average_tensors_([params[0].detach()], group)
    comm.broadcast_parameters(params, group)
    out["broadcast"] = params[0].detach().tolist()
    averager = PeriodicModelAverager(period=1, process_group=group)
    averager.average_parameters(params)
    out["averager"] = (params[0].detach().tolist(), averager.num_averages, averager.step)
    if rank == 1:
        errors = []
        for call in (lambda: comm.all_reduce(torch.ones(1), group), lambda: comm.broadcast(torch.ones(1), 0, group),
                     lambda: comm.all_gather_objects(rank, group), lambda: comm.barrier(group)):
            try:
                call()
                errors.append(None)
            except comm.CollectiveError as error:
                errors.append(str(error))
        out["errors"] = errors
        try:
            comm.ProcessGroupCommunicator(group)
        except ValueError as error:
            out["communicator"] = str(error)
    return out


def test_a_rank_outside_the_group_keeps_its_tensors_and_collectives_say_why():
    member, outsider = run(outside_the_group, 2)
    assert member["member"] and not outsider["member"] and outsider["default_member"]
    for out in (member, outsider):  # a group of one changes nothing either
        assert out["averaged"] == out["broadcast"] == [[2.0, 2.0], [2.0, 2.0]]
        assert out["sent"] == 0
    assert outsider["averager"] == ([[2.0, 2.0], [2.0, 2.0]], 0, 1)  # the step counts, nothing is averaged
    assert all(e is not None and "not a member" in e for e in outsider["errors"]), outsider["errors"]
    assert "process_group" in outsider["communicator"] and "not a member" in outsider["communicator"]

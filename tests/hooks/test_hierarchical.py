"""``hierarchical_wrapper`` on 4 gloo ranks as 2 "nodes" x 2: oracles against plain DDP, the plan, errors.

All distributed checks share ONE run of :func:`hierarchical_checks` (a module-scoped fixture); each test
below asserts on its part of the result. Ranks 0, 1 form node 0 and ranks 2, 3 node 1; the inter-node
groups are {0, 2} (local rank 0) and {1, 3} (local rank 1).
"""

from __future__ import annotations

import hashlib

import pytest
import torch
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.nn.parallel import DistributedDataParallel as DDP

import gradpress
import models
from distributed import run
from gradpress.hooks.hierarchical import ShareBucket, _Layout, assign_shares

# On one test worker, where the module's runs (the module-scoped fixtures) are made once.
pytestmark = pytest.mark.xdist_group("hierarchical")

WORLD, L = 4, 2
# bucket_cap_mb for the oracle runs: after DDP's rebuild, 7 buckets of 1-2 parameters (several with fewer
# parameters than L, the last one included, so local rank 1 skips buckets and its last share is not in
# DDP's last bucket); the first iteration is one bucket of all 10 parameters.
TINY_BUCKETS = 0.0001


# --- the share assignment (no processes) ------------------------------------------------------------------

def test_assign_shares_worked_example():
    # Largest first, each to the lightest share: 9216 -> 0; 320 -> 1; 32 -> 1; 10 -> 1.
    assert assign_shares([10, 320, 32, 9216], 2) == [[3], [0, 1, 2]]
    assert assign_shares([7, 7, 7, 7], 2) == [[0, 2], [1, 3]]  # ties: lower index first, to the lower share
    assert assign_shares([5], 3) == [[0], [], []]
    assert assign_shares([], 2) == [[], []]


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 10_000), max_size=40), st.integers(1, 8))
def test_shares_are_whole_items_balanced_and_deterministic(sizes, num_shares):
    shares = assign_shares(sizes, num_shares)
    assert len(shares) == num_shares
    assert sorted(i for share in shares for i in share) == list(range(len(sizes)))  # a partition
    assert all(share == sorted(share) for share in shares)
    totals = [sum(sizes[i] for i in share) for share in shares]
    assert max(totals) - min(totals) <= max(sizes, default=0)
    assert assign_shares(list(sizes), num_shares) == shares  # a pure function: the same on every node


@pytest.mark.parametrize("sizes, num_shares, name", [([1, 2], 0, "num_shares"), ([1, -2], 2, "sizes"),
                                                     ([1.5], 2, "sizes"), ([1], True, "num_shares")])
def test_assign_shares_rejects_bad_input(sizes, num_shares, name):
    with pytest.raises(ValueError, match=name):
        assign_shares(sizes, num_shares)


def test_layout_packs_shares_share_major_and_unpacks_in_bucket_order():
    params = [torch.empty(3, 2), torch.empty(4), torch.empty(1), torch.empty(2, 2)]
    layout = _Layout.build(params, 2)  # numels 6, 4, 1, 4: shares [0, 2] (7) and [1, 3] (8)
    assert layout.shares == ((0, 2), (1, 3)) and layout.chunk == 8
    buffer = torch.arange(15.0)
    packed = layout.pack(buffer, divisor=2)
    expected = torch.cat([buffer[0:6], buffer[10:11], torch.zeros(1), buffer[6:10], buffer[11:15]]) / 2
    assert torch.equal(packed, expected)
    out = torch.full((15,), -1.0)
    layout.unpack(packed * 2, out)
    assert torch.equal(out, buffer)
    share = ShareBucket(0, True, [params[1], params[3]], packed[8:16])
    assert [g.shape for g in share.gradients()] == [(4,), (2, 2)]
    assert torch.equal(share.gradients()[1].reshape(-1), buffer[11:15] / 2)


def test_wrapper_rejects_a_hook_that_is_not_callable_before_any_collective():
    with pytest.raises(TypeError, match="hook must be a callable"):
        gradpress.hierarchical_wrapper("powerSGD_hook", None)  # type: ignore[arg-type]


# --- the distributed checks, one run -----------------------------------------------------------------------

def _groups(rank):
    """(intra-node group, inter-node group) of ``rank``; every rank creates every group, in this order."""
    nodes = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    inters = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    return nodes[rank // L], inters[rank % L]


def _digest(model) -> str:
    h = hashlib.sha256()
    for p in model.parameters():
        h.update(bytes(p.detach().contiguous().view(-1).view(torch.uint8).tolist()))
    return h.hexdigest()


def _spied(hook, names, record):
    """``hook``, recording what each call sees: (bucket index, is_last, parameter names, shapes)."""
    def spy(state, bucket):
        record.append((bucket.index(), bucket.is_last(), [names[id(p)] for p in bucket.parameters()],
                       [tuple(p.shape) for p in bucket.parameters()]))
        return hook(state, bucket)
    return spy


def _errors(rank, intra, inter):
    """Each bad input's exception type and message, as seen on this rank."""
    out = {}
    bad_three = dist.new_group([0, 1, 2])
    bad_one = dist.new_group([3])
    cases = {
        "3+1": lambda: gradpress.hierarchical_wrapper(gradpress.allreduce_hook, bad_three if rank < 3 else bad_one),
        "not consecutive": lambda: gradpress.hierarchical_wrapper(gradpress.allreduce_hook, inter),
        "not callable": lambda: gradpress.hierarchical_wrapper(None, intra),  # type: ignore[arg-type]
    }
    wrapped = gradpress.hierarchical_wrapper(gradpress.powerSGD_hook, intra)
    cases["world as inter group"] = lambda: wrapped(gradpress.PowerSGDState(None, start_powerSGD_iter=2), None)
    cases["intra as inter group"] = lambda: gradpress.hierarchical_wrapper(gradpress.allreduce_hook, intra)(intra, None)
    cases["foreign state"] = lambda: wrapped(object(), None)
    for name, call in cases.items():
        try:
            call()
        except (TypeError, ValueError) as exc:
            out[name] = (type(exc).__name__, str(exc))
        else:
            out[name] = None
    return out


def _full_rank(rank, intra, inter, names_of):
    """Full-rank PowerSGD inside the wrapper vs plain DDP, tiny buckets: worst gradient difference."""
    ref = DDP(models.make_model())
    net = DDP(models.make_model(), bucket_cap_mb=TINY_BUCKETS)
    names = names_of(net)
    state = gradpress.PowerSGDState(inter, matrix_approximation_rank=128, min_compression_rate=0,
                                    start_powerSGD_iter=2)
    inner, outer = [], []
    net.register_comm_hook(state, _spied(gradpress.hierarchical_wrapper(
        _spied(gradpress.powerSGD_hook, names, inner), intra), names, outer))
    worst = []
    for step in range(6):
        inner.clear()
        outer.clear()
        x, y = models.batch(rank, step)
        for m in (ref, net):
            m.zero_grad()
            models.loss_fn(m, x, y).backward()
        worst.append(max((a.grad - b.grad).abs().max().item() for a, b in zip(ref.parameters(), net.parameters())))
        with torch.no_grad():
            for a in ref.parameters():
                a -= 0.05 * a.grad
            for a, b in zip(ref.parameters(), net.parameters()):
                b.copy_(a)
    return {"worst": worst, "compressed": state.compression_stats()[2] > 0, "inner": list(inner),
            "outer": list(outer)}


def _returns_a_new_tensor(group, bucket):
    """allreduce_hook whose future holds a new tensor, the share bucket's buffer left zeroed."""
    def move_out(fut):
        result = fut.value().clone()
        bucket.buffer().zero_()
        return result
    return gradpress.allreduce_hook(group, bucket).then(move_out)


def _allreduce(rank, intra, inter):
    """allreduce_hook (in place) and a hook returning a new tensor, inside the wrapper, vs plain DDP."""
    ref = DDP(models.make_model())
    nets = [DDP(models.make_model()), DDP(models.make_model(), bucket_cap_mb=TINY_BUCKETS)]
    nets[0].register_comm_hook(inter, gradpress.hierarchical_wrapper(gradpress.allreduce_hook, intra))
    nets[1].register_comm_hook(inter, gradpress.hierarchical_wrapper(_returns_a_new_tensor, intra))
    worst = [0.0, 0.0]
    for step in range(3):
        x, y = models.batch(rank, step)
        for m in (ref, *nets):
            m.zero_grad()
            models.loss_fn(m, x, y).backward()
        for i, net in enumerate(nets):
            worst[i] = max(worst[i], max((a.grad - b.grad).abs().max().item()
                                         for a, b in zip(ref.parameters(), net.parameters())))
    return worst


def _train_rank2(rank, intra, inter, names_of, steps=14):
    net = DDP(models.make_model(), bucket_cap_mb=0.005)  # 2 buckets after the rebuild
    names = names_of(net)
    state = gradpress.PowerSGDState(inter, matrix_approximation_rank=2, start_powerSGD_iter=2)
    outer = []
    net.register_comm_hook(state, _spied(gradpress.hierarchical_wrapper(gradpress.powerSGD_hook, intra),
                                         names, outer))
    opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    x, y = models.batch(rank, 0)  # a fixed batch per rank: the mean loss must fall
    losses = []
    for _ in range(steps):
        outer.clear()
        opt.zero_grad()
        loss = models.loss_fn(net, x, y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return {"losses": losses, "digest": _digest(net), "bytes": state.bytes_stats(), "outer": list(outer),
            "compressed_steps": state.iter - state.start_powerSGD_iter,
            "all_shapes": [tuple(p.shape) for p in net.parameters()]}


def hierarchical_checks(rank, world):
    torch.manual_seed(0)
    intra, inter = _groups(rank)

    def names_of(net):
        return {id(p): n for n, p in net.module.named_parameters()}

    return {"errors": _errors(rank, intra, inter), "full_rank": _full_rank(rank, intra, inter, names_of),
            "allreduce": _allreduce(rank, intra, inter), "rank2": _train_rank2(rank, intra, inter, names_of)}


@pytest.fixture(scope="module")
def results():
    return run(hierarchical_checks, WORLD)


def test_full_rank_powersgd_inside_the_wrapper_equals_plain_ddp(results):
    for r in results:
        assert r["full_rank"]["compressed"] or not any(rec[2] for rec in r["full_rank"]["inner"])
        assert max(r["full_rank"]["worst"]) < 1e-5, r["full_rank"]["worst"]
    assert results[0]["full_rank"]["compressed"]


def test_allreduce_hook_inside_the_wrapper_equals_plain_ddp(results):
    # Also with a wrapped hook whose future holds a new tensor (not the share bucket's buffer).
    assert all(max(r["allreduce"]) < 1e-6 for r in results), [r["allreduce"] for r in results]


def test_shares_are_whole_parameters_identical_on_every_node_with_empty_shares(results):
    outer = results[0]["full_rank"]["outer"]  # the last step's buckets (after DDP's rebuild)
    assert all(r["full_rank"]["outer"] == outer for r in results)
    assert any(len(names) < L for _, _, names, _ in outer) and len(outer[-1][2]) < L
    for local in range(L):
        # The same share on both nodes; it is assign_shares over the bucket, whole parameters.
        seen = results[local]["full_rank"]["inner"]
        assert seen == results[local + L]["full_rank"]["inner"]
        expected = []
        for index, _, names, shapes in outer:
            share = assign_shares([torch.Size(s).numel() for s in shapes], L)[local]
            if share:
                expected.append((index, [names[i] for i in share], [shapes[i] for i in share]))
        assert [(i, n, s) for i, _, n, s in seen] == expected
        # is_last: exactly once, on this rank's last non-empty share (local rank 1 has none in DDP's last bucket)
        assert [last for _, last, _, _ in seen] == [False] * (len(seen) - 1) + [True]
    assert results[1]["full_rank"]["inner"][-1][0] < outer[-1][0]


def test_rank2_trains_identically_on_all_ranks_and_the_loss_falls(results):
    runs = [r["rank2"] for r in results]
    assert len({r["digest"] for r in runs}) == 1, "ranks hold different parameters"
    first = sum(r["losses"][0] for r in runs) / WORLD
    last = sum(sum(r["losses"][-3:]) / 3 for r in runs) / WORLD  # a fixed batch: ~2.28 -> ~1.6
    assert last < 0.85 * first, (first, last, [r["losses"] for r in runs])


def test_inter_node_bytes_are_the_plan_of_each_share_and_sum_to_the_flat_plan(results):
    runs = [r["rank2"] for r in results]
    flat = gradpress.make_plan(runs[0]["all_shapes"], 2, 2).numel_sent * 4  # bytes per rank per step, flat
    per_step = []
    for rank, r in enumerate(runs):
        steps = r["compressed_steps"]
        assert steps == 14 - 2
        share_floats = 0
        for _, _, _, shapes in r["outer"]:
            share = assign_shares([torch.Size(s).numel() for s in shapes], L)[rank % L]
            share_floats += gradpress.make_plan([shapes[i] for i in share], 2, 2).numel_sent
        _, before, after = r["bytes"]
        assert after == steps * 4 * share_floats
        per_step.append(after // steps)
    for node in range(WORLD // L):
        assert sum(per_step[node * L: (node + 1) * L]) == flat
    assert per_step[0] == per_step[2] and per_step[1] == per_step[3]
    assert max(per_step) < flat


def test_bad_input_raises_clear_errors_on_every_rank(results):
    for rank, r in enumerate(results):
        errors = r["errors"]
        kind, message = errors["3+1"]
        assert kind == "ValueError" and "intra_group" in message
        assert "got nodes [0, 1, 2], [3]" in message and "differ in size" in message
        kind, message = errors["not consecutive"]
        assert kind == "ValueError" and "consecutive" in message
        assert errors["not callable"][0] == "TypeError" and "callable" in errors["not callable"][1]
        local = rank % L
        expected = [local, local + L]
        kind, message = errors["world as inter group"]
        assert kind == "ValueError" and "state.process_group" in message and str(expected) in message
        assert "[0, 1, 2, 3]" in message
        kind, message = errors["intra as inter group"]
        assert kind == "ValueError" and "the hook's state" in message and str(expected) in message
        assert errors["foreign state"][0] == "TypeError" and "process_group" in errors["foreign state"][1]

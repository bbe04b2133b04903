"""DiLoCo between FSDP2 islands: 4 gloo ranks, a (island=2, shard=2) mesh, ``fully_shard`` inside each island
and the averagers over ``mesh["island"]``'s group, in float64.

Oracles: an unsharded plain-torch reference of each island (its gradient is the mean over its two ranks'
batches, as FSDP's reduce-scatter makes it) with DiLoCo's outer step written out in plain torch
(``Δ = mean_i(x - θ_i)``, ``torch.optim.SGD`` with Nesterov momentum on the anchor ``x``, ``θ_i ← x``); for
streaming DiLoCo and the other transports the same averager on unsharded replicas. The model's shapes
are odd (rows 7, 3 and 1), so shards are uneven and shard rank 1 holds an empty bias.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from distributed import run
from gradpress import (OuterOptimizerAverager, PeriodicModelAverager, PostLocalSGDOptimizer, QuantizeInt4,
                       QuantizeInt8, StreamingDiLoCoAverager, TopK)
from gradpress.aggregator import Config

WORLD = 4
STEPS = 9
LR = 0.2


def _mesh():
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (2, 2), mesh_dim_names=("island", "shard"))


def _plain_model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3), nn.Tanh(), nn.Linear(3, 1)).double()


def _sharded_model(mesh, hsdp: bool = False) -> nn.Sequential:
    """FSDP2 over ``mesh["shard"]``; ``hsdp``: HSDP inside each island instead, over the island's 2-D
    ``(replicate, shard)`` mesh (placements ``(Replicate(), Shard(0))``)."""
    from torch.distributed.fsdp import fully_shard

    model = _plain_model()
    for unit in (model[0], model[2], model[4], model):
        fully_shard(unit, mesh=mesh["replicate", "shard"] if hsdp else mesh["shard"])
    return model


def _batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(6, 5, generator=g, dtype=torch.float64)
    return x, torch.sin(x.sum(1, keepdim=True)) + 0.1 * rank


def _loss(model, x, y):
    return nn.functional.mse_loss(model(x), y)


def _inner_step(model, optimizer, step, ranks):
    """One inner step of an island: the mean of its ranks' losses (FSDP averages their gradients)."""
    optimizer.zero_grad()
    loss = sum(_loss(model, *_batch(step, r)) for r in ranks) / len(ranks)
    loss.backward()
    optimizer.step()


def _full(model) -> list[torch.Tensor]:
    return [p.full_tensor().detach().clone() for p in model.parameters()]


def _worst(a, b) -> float:
    return max((x - y).abs().max().item() for x, y in zip(a, b))


# --- DiLoCo against plain torch ---------------------------------------------------------------------------

def diloco_against_plain_torch(rank, world, period, hsdp=False):
    if hsdp:  # 2 islands x (2 replicas x 1 shard): HSDP inside each island
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", (2, 2, 1), mesh_dim_names=("island", "replicate", "shard"))
    else:
        mesh = _mesh()
    island, shard = divmod(rank, 2)
    model = _sharded_model(mesh, hsdp)
    averager = OuterOptimizerAverager(period, process_group=mesh["island"].get_group(), outer_lr=0.7,
                                      outer_momentum=0.9)
    optimizer = PostLocalSGDOptimizer(torch.optim.SGD(model.parameters(), lr=LR), averager)
    # The reference: both islands' unsharded models, trained on every rank alike.
    replicas = [_plain_model() for _ in range(2)]
    inner = [torch.optim.SGD(r.parameters(), lr=LR) for r in replicas]
    anchor = [p.detach().clone() for p in replicas[0].parameters()]
    outer = torch.optim.SGD(anchor, lr=0.7, momentum=0.9, nesterov=True)
    worst, sent = 0.0, []
    for step in range(STEPS):
        before = averager.bytes_sent
        _inner_step(model, optimizer, step, [2 * island, 2 * island + 1])
        sent.append(averager.bytes_sent - before)
        for i, (r, o) in enumerate(zip(replicas, inner)):
            _inner_step(r, o, step, [2 * i, 2 * i + 1])
        if step % period == 0:
            with torch.no_grad():
                for a, *thetas in zip(anchor, *(r.parameters() for r in replicas)):
                    a.grad = sum(a - t for t in thetas) / len(thetas)
            outer.step()
            with torch.no_grad():
                for r in replicas:
                    for p, a in zip(r.parameters(), anchor):
                        p.copy_(a)
        worst = max(worst, _worst(_full(model), list(replicas[island].parameters())))
    shard_bytes = sum(p.to_local().numel() * 8 for p in model.parameters())
    return worst, sent, shard_bytes, averager.num_averages


def test_diloco_on_fsdp2_islands_equals_an_unsharded_plain_torch_reference_after_every_step():
    period = 3
    results = run(diloco_against_plain_torch, WORLD, period)
    for rank, (worst, sent, shard_bytes, syncs) in enumerate(results):
        assert worst < 1e-9, (rank, worst)
        assert syncs == len(range(0, STEPS, period))
        # Each sync sends this rank's shard of the model, nothing at the other steps.
        assert sent == [shard_bytes if s % period == 0 else 0 for s in range(STEPS)], (rank, sent, shard_bytes)
    shards = [r[2] for r in results]
    assert shards[0] != shards[1] and shards[0] == shards[2]  # uneven shards, counted per rank


def test_diloco_between_hsdp_islands_equals_the_plain_torch_reference():
    """HSDP inside each island (its replicas all-reduce every step): DiLoCo averages across islands only."""
    period = 2
    for rank, (worst, sent, shard_bytes, _) in enumerate(run(diloco_against_plain_torch, WORLD, period, True)):
        assert worst < 1e-9, (rank, worst)
        assert sent == [shard_bytes if s % period == 0 else 0 for s in range(STEPS)]


def streaming_against_plain_torch(rank, world):
    """Streaming DiLoCo's contract written out: fragment f (layer 0; the rest) sent at steps where
    step % 4 is its offset (0; 2), δ = mean_i(x_f - θ_i) then, τ = 1 step later, x_f ← Nesterov SGD(x_f, δ)
    and θ_f ← x_f + α (θ_f - x_f) with α = 0.5."""
    mesh = _mesh()
    island = rank // 2
    model = _sharded_model(mesh)
    averager = StreamingDiLoCoAverager(4, process_group=mesh["island"].get_group(),
                                       fragments=[model[0], [*model[2].parameters(), *model[4].parameters()]],
                                       fragment_sync_delay=1, fragment_update_alpha=0.5)
    optimizer = PostLocalSGDOptimizer(torch.optim.SGD(model.parameters(), lr=LR), averager)
    replicas = [_plain_model() for _ in range(2)]
    inner = [torch.optim.SGD(r.parameters(), lr=LR) for r in replicas]
    members = [[0, 1], [2, 3, 4, 5]]
    anchors = [[list(replicas[0].parameters())[i].detach().clone() for i in m] for m in members]
    outer = [torch.optim.SGD(a, lr=0.7, momentum=0.9, nesterov=True) for a in anchors]
    pending: list = []
    worst = 0.0
    for step in range(STEPS + 3):
        _inner_step(model, optimizer, step, [2 * island, 2 * island + 1])
        for i, (r, o) in enumerate(zip(replicas, inner)):
            _inner_step(r, o, step, [2 * i, 2 * i + 1])
        params = [list(r.parameters()) for r in replicas]
        for f, offset in enumerate((0, 2)):
            if step % 4 == offset:
                deltas = [sum(a - p[i] for p in params).detach() / 2 for a, i in zip(anchors[f], members[f])]
                pending.append((f, step + 1, deltas))
        for item in [item for item in pending if item[1] == step]:
            f, _, deltas = item
            for a, d in zip(anchors[f], deltas):
                a.grad = d
            outer[f].step()
            with torch.no_grad():
                for p in params:
                    for a, i in zip(anchors[f], members[f]):
                        p[i].copy_(a + 0.5 * (p[i] - a))
            pending.remove(item)
        worst = max(worst, _worst(_full(model), list(replicas[island].parameters())))
    return worst, averager.num_averages


def test_streaming_diloco_on_fsdp2_islands_equals_an_unsharded_plain_torch_reference_after_every_step():
    for rank, (worst, applied) in enumerate(run(streaming_against_plain_torch, WORLD)):
        assert worst < 1e-9 and applied == 6, (rank, worst, applied)


# --- every averager and transport against the same averager on unsharded replicas -------------------------

def _averager(kind, group, fragments=None, alpha=0.5):
    if kind == "periodic":
        return PeriodicModelAverager(2, process_group=group)
    if kind.startswith("diloco"):
        compression = {"diloco": None, "diloco-fp16": "fp16", "diloco-int8": QuantizeInt8(chunk_size=4),
                       "diloco-powersgd": Config(rank=1, start_compressing_after_num_steps=0,
                                                 min_compression_rate=0)}[kind]
        return OuterOptimizerAverager(2, process_group=group, outer_momentum=0.5, compression=compression)
    compression = {"streaming": None, "streaming-int4": QuantizeInt4(chunk_size=4),
                   "streaming-topk": TopK(k=2, chunk_size=4)}[kind]
    return StreamingDiLoCoAverager(4, process_group=group, fragments=fragments, fragment_sync_delay=1,
                                   fragment_update_alpha=alpha, compression=compression)


def same_as_unsharded(rank, world, kind):
    mesh = _mesh()
    island = rank // 2
    group = mesh["island"].get_group()
    model = _sharded_model(mesh)
    fragments = [model[0], [*model[2].parameters(), *model[4].parameters()]] if kind.startswith("streaming") else None
    averager = _averager(kind, group, fragments)
    optimizer = PostLocalSGDOptimizer(torch.optim.SGD(model.parameters(), lr=LR, momentum=0.5), averager)
    replica = _plain_model()
    ref_fragments = [replica[0], [*replica[2].parameters(), *replica[4].parameters()]] \
        if kind.startswith("streaming") else None
    reference = PostLocalSGDOptimizer(torch.optim.SGD(replica.parameters(), lr=LR, momentum=0.5),
                                      _averager(kind, group, ref_fragments))
    worst = 0.0
    for step in range(STEPS):
        _inner_step(model, optimizer, step, [2 * island, 2 * island + 1])
        _inner_step(replica, reference, step, [2 * island, 2 * island + 1])
        worst = max(worst, _worst(_full(model), list(replica.parameters())))
    local = [p.to_local().detach().clone() for p in model.parameters()]
    return worst, local, averager.bytes_sent


@pytest.mark.parametrize("kind", ["periodic", "diloco", "diloco-fp16", "streaming"])
def test_elementwise_transports_on_shards_equal_the_same_averager_unsharded(kind):
    for rank, (worst, _, _) in enumerate(run(same_as_unsharded, WORLD, kind)):
        assert worst < 1e-9, (kind, rank, worst)


@pytest.mark.parametrize("kind", ["diloco-int8", "diloco-powersgd", "streaming-int4", "streaming-topk"])
def test_compressed_transports_on_shards_keep_the_islands_identical(kind):
    """Chunked codes and low-rank factors of a shard differ from the whole tensor's, so the unsharded run is
    no oracle here: the islands must stay identical shard by shard (the outer step is the same on every
    rank of a shard's group) and each rank counts its own bytes."""
    results = run(same_as_unsharded, WORLD, kind)
    for a, b in ((0, 2), (1, 3)):  # the same shard in island 0 and in island 1
        assert results[a][2] == results[b][2] > 0
    assert results[0][2] != results[1][2]  # uneven shards: different bytes per rank


def synced_shards(rank, world, kind):
    mesh = _mesh()
    island = rank // 2
    model = _sharded_model(mesh)
    fragments = [model[0], [*model[2].parameters(), *model[4].parameters()]] if kind.startswith("streaming") else None
    # α = 0: a fragment's parameters become the new anchor, identical in both islands (α > 0 mixes in
    # each island's own last τ steps).
    averager = _averager(kind, mesh["island"].get_group(), fragments, alpha=0.0)
    optimizer = PostLocalSGDOptimizer(torch.optim.SGD(model.parameters(), lr=LR), averager)
    same = []
    for step in range(STEPS):
        _inner_step(model, optimizer, step, [2 * island, 2 * island + 1])
        same.append([p.to_local().detach().clone() for p in model.parameters()])
    return same


@pytest.mark.parametrize("kind", ["diloco-int8", "diloco-powersgd", "streaming-int4"])
def test_after_each_sync_the_same_shard_is_identical_in_both_islands(kind):
    results = run(synced_shards, WORLD, kind)
    sync_steps = [0, 2, 4, 6, 8] if kind.startswith("diloco") else [1, 4, 5, 8]  # applied (τ = 1)
    for a, b in ((0, 2), (1, 3)):
        for step in sync_steps:
            if kind.startswith("streaming"):
                continue  # streaming applies one fragment at a time: checked on that fragment below
            assert all(torch.equal(x, y) for x, y in zip(results[a][step], results[b][step])), (kind, step)
        if kind.startswith("streaming"):
            # Fragment 0 (the first layer) is applied at step 1 and 5, fragment 1 at step 3 and 7.
            for step, members in ((1, [0, 1]), (5, [0, 1]), (3, [2, 3, 4, 5]), (7, [2, 3, 4, 5])):
                assert all(torch.equal(results[a][step][i], results[b][step][i]) for i in members), (kind, step)


# --- a layout that differs between the ranks of the group -------------------------------------------------

def mismatched(rank, world):
    mesh = _mesh()
    model = _sharded_model(mesh)
    # The world as the averaging group pairs shard 0 with shard 1: not the same shards.
    averager = OuterOptimizerAverager(2)
    try:
        PostLocalSGDOptimizer(torch.optim.SGD(model.parameters(), lr=LR), averager)
    except ValueError as exc:
        return str(exc)
    return None


def test_a_group_whose_ranks_hold_different_shards_is_refused_on_every_rank():
    for message in run(mismatched, WORLD):
        assert message is not None and "sharded differently" in message and "mesh['replicate']" in message


# --- torch.distributed.checkpoint: a resumed run continues bitwise ---------------------------------------

RESUME_STEPS = 10


def dcp_resume(rank, world, kind, split, path, via):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    mesh = _mesh()
    island = rank // 2

    def make():
        model = _sharded_model(mesh)
        fragments = [model[0], [*model[2].parameters(), *model[4].parameters()]] \
            if kind.startswith("streaming") else None
        averager = _averager(kind, mesh["island"].get_group(), fragments, alpha=0.5)
        # get_state_dict's inner optimizer state comes back as a per-shard mix of the islands' (DCP
        # deduplicates its DTensors across islands): bitwise with a stateless inner SGD only. The optimizer
        # itself keeps it per rank.
        momentum = 0.0 if via == "get_state_dict" else 0.5
        return model, PostLocalSGDOptimizer(torch.optim.SGD(model.parameters(), lr=LR, momentum=momentum), averager)

    def train(model, optimizer, steps):
        for step in steps:
            _inner_step(model, optimizer, step, [2 * island, 2 * island + 1])

    model, optimizer = make()
    train(model, optimizer, range(RESUME_STEPS))
    want = [p.to_local().detach().clone() for p in model.parameters()]
    want_counts = (optimizer.averager.bytes_sent, optimizer.averager.num_averages)

    model, optimizer = make()
    train(model, optimizer, range(split))
    in_sync = optimizer.averager.in_sync()
    if via == "stateful":
        dcp.save({"model": model.state_dict(), "optim": optimizer}, checkpoint_id=path)
    else:
        model_state, optim_state = get_state_dict(model, optimizer)  # the inner optimizer's state only
        dcp.save({"model": model_state, "optim": optim_state, "averager": optimizer.averager}, checkpoint_id=path)
    keys = set(dcp.FileSystemReader(path).read_metadata().state_dict_metadata)

    model, optimizer = make()  # fresh: the anchor is rank 0's initial parameters, nothing trained
    if via == "stateful":
        dcp.load({"model": model.state_dict(), "optim": optimizer}, checkpoint_id=path)
    else:
        model_state, optim_state = get_state_dict(model, optimizer)  # initializes the inner state
        fresh_step = optimizer.averager.step
        dcp.load({"model": model_state, "optim": optim_state}, checkpoint_id=path)
        set_state_dict(model, optimizer, model_state_dict=model_state, optim_state_dict=optim_state)
        assert fresh_step == 0, "get_state_dict's state initialization took an averaging step"
        dcp.load({"averager": optimizer.averager}, checkpoint_id=path)  # after the model: each island's own
    train(model, optimizer, range(split, RESUME_STEPS))
    got = [p.to_local().detach().clone() for p in model.parameters()]
    same = all(torch.equal(a, b) for a, b in zip(want, got))
    counts = (optimizer.averager.bytes_sent, optimizer.averager.num_averages) == want_counts
    return same, counts, in_sync, sorted(k for k in keys if "per_rank" in k)


@pytest.mark.parametrize("kind, split, via, in_sync", [
    ("diloco-int8", 5, "stateful", True),          # right after a sync
    ("diloco-int8", 6, "stateful", False),         # between syncs: each island's parameters differ
    ("diloco-powersgd", 6, "get_state_dict", False),
    ("streaming-int4", 7, "stateful", False),      # fragment 1's update in flight
    ("streaming-int4", 6, "get_state_dict", False),
])
def test_a_run_resumed_from_a_distributed_checkpoint_continues_bitwise(tmp_path, kind, split, via, in_sync):
    results = run(dcp_resume, WORLD, kind, split, str(tmp_path / "ckpt"), via)
    for rank, (same, counts, synced, per_rank_keys) in enumerate(results):
        assert same and counts, (rank, same, counts)
        assert synced == in_sync
        # Every rank's own entry is kept (not deduplicated).
        prefix = "optim.averager" if via == "stateful" else "averager"
        assert [k for k in per_rank_keys if k.startswith(f"{prefix}.per_rank.")] == \
            [f"{prefix}.per_rank.rank_{r}" for r in range(WORLD)]


@pytest.mark.parametrize("compressor", [QuantizeInt4(chunk_size=4), QuantizeInt8(chunk_size=4),
                                        TopK(k=2, chunk_size=4)], ids=["int4", "int8", "topk"])
def test_an_empty_shard_encodes_to_nothing_and_decodes_to_an_empty_tensor(compressor):
    """FSDP2's uneven shards leave some ranks an empty shard (a 1-row bias on 2 ranks)."""
    payload = compressor.encode(torch.zeros(0, dtype=torch.float64))
    assert payload.numel() == compressor.payload_bytes(0) == 0
    assert compressor.decode(torch.stack([payload, payload]), 0, torch.float64).shape == (2, 0)


def save_on_four(rank, world, path):
    import torch.distributed.checkpoint as dcp

    mesh = _mesh()
    model = _sharded_model(mesh)
    averager = _averager("diloco-int8", mesh["island"].get_group())
    optimizer = PostLocalSGDOptimizer(torch.optim.SGD(model.parameters(), lr=LR), averager)
    for step in range(5):  # syncs at 0, 2, 4: saved right after one, every island equal
        _inner_step(model, optimizer, step, [2 * (rank // 2), 2 * (rank // 2) + 1])
    dcp.save({"model": model.state_dict(), "optim": optimizer}, checkpoint_id=path)
    return [a.full_tensor() for a in averager.state_dict()["anchor"]], \
        [m.full_tensor() for m in averager.state_dict()["momentum"]]


def load_on_two(rank, world, path):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh

    from gradpress.checkpoint import dcp_stateful

    mesh = init_device_mesh("cpu", (2, 1), mesh_dim_names=("island", "shard"))  # 2 islands of 1 rank

    def fresh():
        model = _sharded_model(mesh)
        averager = _averager("diloco-int8", mesh["island"].get_group())
        return model, PostLocalSGDOptimizer(torch.optim.SGD(model.parameters(), lr=LR), averager)

    model, optimizer = fresh()
    try:
        dcp.load({"model": model.state_dict(), "optim": optimizer}, checkpoint_id=path)
        refused = None
    except Exception as exc:  # DCP wraps what a load_state_dict raises
        refused = str(exc)
    model, optimizer = fresh()
    dcp.load({"model": model.state_dict(), "optim": dcp_stateful(optimizer, "fresh")}, checkpoint_id=path)
    averager = optimizer.averager
    state = averager.state_dict()
    return (refused, [a.full_tensor() for a in state["anchor"]], [m.full_tensor() for m in state["momentum"]],
            averager.step, averager.local_state_dict().get("residual"))


def test_a_world_size_change_reshards_the_outer_state_and_refuses_or_refreshes_the_per_rank_state(tmp_path):
    path = str(tmp_path / "ckpt")
    saved_anchor, saved_momentum = run(save_on_four, WORLD, path)[0]
    for refused, anchor, momentum, step, residual in run(load_on_two, 2, path):
        assert refused is not None and "on_world_size_change" in refused
        assert all(torch.equal(a, b) for a, b in zip(anchor, saved_anchor))  # 2 shards -> 1: resharded
        assert all(torch.equal(a, b) for a, b in zip(momentum, saved_momentum))
        assert any(m.abs().sum() > 0 for m in momentum)
        assert step == 5 and residual is None  # the counters load; the residual starts fresh


def plain_average(rank, world):
    from gradpress import average_parameters

    mesh = _mesh()
    model = _sharded_model(mesh)
    with torch.no_grad():
        for p in model.parameters():
            p.to_local().add_(float(rank // 2))  # island 1 is 1 above island 0
    average_parameters(model.parameters(), mesh["island"].get_group())
    reference = _plain_model()
    return _worst(_full(model), [p + 0.5 for p in reference.parameters()])


def test_average_parameters_averages_each_shard_with_its_peer_in_the_other_island():
    assert max(run(plain_average, WORLD)) < 1e-12


def hierarchical_on_dtensors(rank, world):
    from collections import OrderedDict

    from torch.distributed.device_mesh import init_device_mesh

    from gradpress import HierarchicalModelAverager

    mesh = init_device_mesh("cpu", (4, 1), mesh_dim_names=("island", "shard"))  # 4 islands of one rank
    model = _sharded_model(mesh)
    replica = _plain_model()
    schedule = OrderedDict([(2, 2), (4, 4)])
    averager = HierarchicalModelAverager(schedule, process_group=mesh["island"].get_group())
    reference = HierarchicalModelAverager(schedule, process_group=mesh["island"].get_group())
    optimizer = PostLocalSGDOptimizer(torch.optim.SGD(model.parameters(), lr=LR), averager)
    plain = PostLocalSGDOptimizer(torch.optim.SGD(replica.parameters(), lr=LR), reference)
    worst = 0.0
    for step in range(STEPS):
        _inner_step(model, optimizer, step, [rank])
        _inner_step(replica, plain, step, [rank])
        worst = max(worst, _worst(_full(model), list(replica.parameters())))
    return worst, averager.num_averages, averager.bytes_sent == reference.bytes_sent


def test_hierarchical_averaging_of_dtensor_parameters_equals_it_on_plain_ones():
    for worst, averages, same_bytes in run(hierarchical_on_dtensors, WORLD):
        assert worst < 1e-12 and averages > 0 and same_bytes


# --- set-ups that run but cannot be what was meant ---------------------------------------------------------

def _ours(caught) -> list[str]:
    return [str(w.message) for w in caught if "gradpress" in str(w.message) or "Averager" in str(w.message)]


def hsdp_across_islands(rank, world, kind):
    """``fully_shard(mesh=mesh)`` on the (island, shard) mesh is native HSDP across the islands: FSDP
    all-reduces every step over the very ranks the averager averages over."""
    import warnings

    from torch.distributed.fsdp import fully_shard

    mesh = _mesh()
    model = _plain_model()
    for unit in (model[0], model[2], model[4], model):
        fully_shard(unit, mesh=mesh)  # placements (Replicate(), Shard(0)): replicated across islands
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            optimizer = PostLocalSGDOptimizer(torch.optim.SGD(model.parameters(), lr=LR),
                                              _averager(kind, mesh["island"].get_group(), [model[0], model[2:]]))
            for step in range(5):
                _inner_step(model, optimizer, step, [rank])
        except ValueError as error:
            return "raised", str(error)
    return "ran", _ours(caught)


@pytest.mark.parametrize("kind", ["periodic", "diloco", "streaming"])
def test_native_hsdp_across_the_islands_is_refused_for_diloco_and_warned_once_for_averaging(kind):
    for outcome, said in run(hsdp_across_islands, WORLD, kind):
        if kind == "periodic":  # the result is right (replicas equal anyway); the bytes are wasted
            assert outcome == "ran" and len(said) == 1, (outcome, said)
            said = said[0]
        else:  # DiLoCo's outer step would re-apply the islands' common steps: not DiLoCo
            assert outcome == "raised", (outcome, said)
        assert "native HSDP" in said and "mesh dim 'island'" in said and "mesh['shard']" in said, said


def never_wrapped(rank, world, kind):
    """The islands recipe without ``fully_shard``: each rank trains a whole model of its own on its own
    batches; the averager over ``mesh["island"]`` never meets the other rank of its island."""
    import warnings

    mesh = _mesh()
    model = _plain_model()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        optimizer = PostLocalSGDOptimizer(torch.optim.SGD(model.parameters(), lr=LR),
                                          _averager(kind, mesh["island"].get_group(), [model[0], model[2:]]))
        for step in range(5):
            _inner_step(model, optimizer, step, [rank])
    return _ours(caught)


@pytest.mark.parametrize("kind", ["periodic", "diloco", "streaming"])
def test_a_model_never_wrapped_in_fsdp_averaged_over_the_islands_warns_once(kind):
    for said in run(never_wrapped, WORLD, kind):
        assert len(said) == 1, said
        assert "not fully_shard's DTensors" in said[0] and "fully_shard(module, mesh=mesh['shard'])" in said[0], said


def wrapped_runs_quietly(rank, world):
    import warnings

    mesh = _mesh()
    model = _sharded_model(mesh)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        optimizer = PostLocalSGDOptimizer(torch.optim.SGD(model.parameters(), lr=LR),
                                          _averager("diloco", mesh["island"].get_group()))
        for step in range(5):
            _inner_step(model, optimizer, step, [2 * (rank // 2), 2 * (rank // 2) + 1])
    return _ours(caught)


def test_the_islands_recipe_itself_warns_of_nothing():
    assert run(wrapped_runs_quietly, WORLD) == [[]] * WORLD


# --- a consistent model between synchronizations --------------------------------------------------------

def export_between_syncs(rank, world, path):
    """DiLoCo every 3 steps: after step 3 every island holds the anchor; after step 4 each its own. A DCP
    checkpoint of model.state_dict() then keeps each shard once, from one island or the other; the anchor's
    export is the model both islands agreed on, bitwise."""
    import torch.distributed.checkpoint as dcp

    mesh = _mesh()
    island = rank // 2
    model = _sharded_model(mesh)
    averager = OuterOptimizerAverager(3, process_group=mesh["island"].get_group(), outer_momentum=0.5)
    optimizer = PostLocalSGDOptimizer(torch.optim.SGD(model.parameters(), lr=LR), averager)
    for step in range(5):
        _inner_step(model, optimizer, step, [2 * island, 2 * island + 1])
        if step == 3:
            agreed = _full(model)  # right after the sync at step 3: the same in both islands
    mine = _full(model)
    dcp.save({"model": model.state_dict()}, checkpoint_id=f"{path}/model")
    dcp.save({"model": averager.anchor_state_dict(model)}, checkpoint_id=f"{path}/anchor")
    loaded = {}
    for what in ("model", "anchor"):
        fresh = _sharded_model(mesh)
        state = {"model": fresh.state_dict()}
        dcp.load(state, checkpoint_id=f"{path}/{what}")
        fresh.load_state_dict(state["model"])
        loaded[what] = _full(fresh)
    return agreed, mine, loaded


def test_between_syncs_the_anchor_is_the_consistent_model_to_export(tmp_path):
    results = run(export_between_syncs, WORLD, str(tmp_path))
    island_models = [results[0][1], results[2][1]]  # island 0's and island 1's models after step 4
    assert _worst(*island_models) > 0  # the islands differ between syncs
    for agreed, mine, loaded in results:
        assert all(torch.equal(a, b) for a, b in zip(loaded["anchor"], agreed))  # bitwise the synced model
        for model in island_models:  # what model.state_dict() saved is neither island's model
            assert not all(torch.equal(a, b) for a, b in zip(loaded["model"], model))

"""Two-shot reduction of compressed outer gradients (gradpress.averaging.twoshot, the transports' schedule):
on gloo every rank decodes bitwise the same update, bitwise the one-process reference of the same
encode/decode; each rank's link carries exactly 2(W-1)/W of the padded payload; error feedback at both
levels conserves mass over syncs; a checkpoint after either phase resumes bitwise; bad schedules are
refused at construction, naming the argument and the allowed values."""

from __future__ import annotations

import io
import logging

import pytest
import torch
from hypothesis import given, settings, strategies as st
from torch import nn

import gradpress
from distributed import run
from gradpress import (OuterOptimizerAverager, PostLocalSGDOptimizer, QuantizeInt4, QuantizeInt8,
                       StreamingDiLoCoAverager, TopK)
from gradpress.averaging.compress import Compressor, rounding_generator
from gradpress.averaging.transport import Compressed, Link, OwnerResidual, sync_seed, transport_for
from gradpress.averaging.twoshot import (SCHEDULES, decode_regions, encode_regions, reference, regions,
                                         resolve_schedule)

NUMEL = 203  # 26 chunks of 8 (the last one of 3 values): regions of unequal lengths at every W below
COMPRESSORS = {
    "int8": QuantizeInt8(chunk_size=8),
    "int8-stochastic": QuantizeInt8(chunk_size=8, rounding="stochastic", seed=5),
    "int4": QuantizeInt4(chunk_size=8),
    "int4-stochastic": QuantizeInt4(chunk_size=8, rounding="stochastic", seed=7),
}


def _outer_grad(rank: int, sync: int, dtype=torch.float32) -> torch.Tensor:
    gen = torch.Generator().manual_seed(1000 * sync + rank)
    return (torch.randn(NUMEL, generator=gen) * (1 + rank)).to(dtype)


# -- the plain functions ---------------------------------------------------------------------------

@settings(max_examples=60, deadline=None)
@given(numel=st.integers(0, 300), chunk=st.integers(1, 17), world=st.integers(1, 12),
       kind=st.sampled_from(["int8", "int4", "topk"]))
def test_region_rows_are_the_payloads_of_the_regions_and_regions_are_balanced_whole_chunks(numel, chunk, world, kind):
    compressor: Compressor = {"int8": QuantizeInt8(chunk_size=chunk), "int4": QuantizeInt4(chunk_size=chunk),
                              "topk": TopK(k=min(2, chunk), chunk_size=chunk)}[kind]
    plan = regions(compressor, numel, world)
    assert plan.bounds[0][0] == 0 and plan.bounds[-1][1] == numel
    assert all(a[1] == b[0] for a, b in zip(plan.bounds, plan.bounds[1:]))
    starts = [a for a, _ in plan.bounds if a < numel]
    assert all(a % chunk == 0 for a in starts)                       # whole chunks
    chunks = [-(-(b - a) // chunk) for a, b in plan.bounds]
    assert max(chunks) - min(chunks) <= 1                           # balanced
    x = torch.randn(numel, generator=torch.Generator().manual_seed(numel + chunk))
    rows = encode_regions(compressor, x, plan)
    assert rows.shape == (world, plan.row_bytes)
    for r, (a, b) in enumerate(plan.bounds):
        payload = compressor.encode(x[a:b])
        assert torch.equal(rows[r, :payload.numel()], payload)
        assert not rows[r, payload.numel():].any()                  # zero padding
    # What the ranks keep as their residual is what the all-gather schedule keeps: the same chunks.
    whole = compressor.decode(compressor.encode(x).unsqueeze(0), numel, torch.float32)[0]
    assert torch.equal(decode_regions(compressor, rows, plan, torch.float32), whole)


def test_stochastic_region_rows_round_as_one_encode_of_the_whole_vector():
    compressor = QuantizeInt4(chunk_size=8, rounding="stochastic")
    x = torch.randn(NUMEL, generator=torch.Generator().manual_seed(0))
    plan = regions(compressor, NUMEL, 3)
    rows = encode_regions(compressor, x, plan, rounding_generator(11, "cpu"))
    whole = compressor.decode(compressor.encode(x, rounding_generator(11, "cpu")).unsqueeze(0), NUMEL,
                              torch.float32)[0]
    assert torch.equal(decode_regions(compressor, rows, plan, torch.float32), whole)


def test_auto_is_two_shot_for_int8_and_int4_from_three_ranks_and_all_gather_otherwise():
    for compressor in (QuantizeInt8(), QuantizeInt4()):
        assert [resolve_schedule("auto", compressor, w) for w in (1, 2, 3, 64)] == \
            ["all-gather", "all-gather", "two-shot", "two-shot"]
    assert resolve_schedule("auto", TopK(), 64) == "all-gather"
    assert resolve_schedule("two-shot", TopK(), 64) == "two-shot"   # opt-in
    assert resolve_schedule("two-shot", QuantizeInt8(), 1) == "all-gather"  # nothing to exchange alone
    assert transport_for(QuantizeInt8()) == Compressed(QuantizeInt8(), "auto")


# -- on gloo: the reference, agreement and bytes ------------------------------------------------------

def two_shot_sync(rank: int, world: int, name: str, syncs: int, dtype) -> list[dict[str, object]]:
    """``syncs`` two-shot syncs of the transport itself (outer gradient = ``_outer_grad``, anchor zero), with
    the rank's residual and its owner residual fed back as the averagers feed them."""
    compressor = COMPRESSORS[name]
    transport = Compressed(compressor, "two-shot")
    anchor = [torch.zeros(NUMEL, dtype=dtype)]
    residual, owner = None, OwnerResidual()
    out = []
    for sync in range(syncs):
        link = Link(None, rank, world, fragment=2, sync=sync)
        params = [-_outer_grad(rank, sync, dtype)]  # anchor - params = the outer gradient
        sent = transport.send(anchor, params, residual, link)
        phase1 = (sent.bytes_sent, sent.link_bytes)
        transport.progress(sent, anchor, owner.usable(link, "test"), link)
        (update,), finite = transport.mean(sent, anchor)
        residual = sent.residual
        owner.take(sent, finite)
        out.append({"update": update, "residual": residual.clone(), "owner": owner.tensor.clone(),
                    "phase1": phase1, "bytes": sent.bytes_sent, "link": sent.link_bytes, "finite": bool(finite)})
    return out


def _reference_syncs(name: str, world: int, syncs: int, dtype):
    compressor = COMPRESSORS[name]
    stochastic = compressor.rounding == "stochastic"
    residuals = [torch.zeros(NUMEL, dtype=dtype) for _ in range(world)]
    owners: list = [None] * world
    out = []
    for sync in range(syncs):
        inputs = [_outer_grad(r, sync, dtype) + residuals[r] for r in range(world)]
        generators = [rounding_generator(sync_seed(compressor.seed, r, 2, sync), "cpu") if stochastic else None
                      for r in range(world)]
        owner_generators = [rounding_generator(sync_seed(compressor.seed, r, 2, sync, stream=1), "cpu")
                            if stochastic else None for r in range(world)]
        update, residuals, owners = reference(compressor, inputs, owners, generators, owner_generators)
        out.append((update, residuals, owners))
    return out


def _check_against_reference(name: str, world: int, dtype=torch.float32) -> None:
    syncs = 3
    ranks = run(two_shot_sync, world, name, syncs, dtype)
    want = _reference_syncs(name, world, syncs, dtype)
    plan = regions(COMPRESSORS[name], NUMEL, world)
    for sync, (update, residuals, owners) in enumerate(want):
        for rank, got in enumerate(ranks):
            step = got[sync]
            assert step["finite"]
            assert torch.equal(step["update"], update), (sync, rank)          # every rank, bitwise
            assert torch.equal(step["residual"], residuals[rank]), (sync, rank)
            assert torch.equal(step["owner"], owners[rank]), (sync, rank)
            # Bytes: W rows into the all-to-all, one into the all-gather; the link 2(W-1)/W of W rows.
            assert step["phase1"] == (plan.padded_bytes, (world - 1) * plan.row_bytes)
            assert step["bytes"] == plan.padded_bytes + plan.row_bytes
            assert step["link"] == 2 * (world - 1) / world * plan.padded_bytes
    assert not torch.equal(want[0][0], torch.stack([_outer_grad(r, 0) for r in range(world)]).mean(0))  # lossy


@pytest.mark.parametrize("name", list(COMPRESSORS))
@pytest.mark.parametrize("world", [2, 3, 4])
def test_two_shot_is_bitwise_the_one_process_reference_on_every_rank(name, world):
    _check_against_reference(name, world)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["int8", "int4-stochastic"])
def test_two_shot_is_bitwise_the_one_process_reference_on_eight_ranks(name):
    _check_against_reference(name, 8)


def test_two_shot_of_fp64_anchors_works_in_fp64():
    _check_against_reference("int4", 3, torch.float64)


# -- in the averagers: agreement, mass, bytes ------------------------------------------------------

def _params(rank: int, dtype=torch.float64) -> list[nn.Parameter]:
    gen = torch.Generator().manual_seed(100 + rank)
    return [nn.Parameter(torch.randn(shape, generator=gen, dtype=dtype)) for shape in [(9, 13), (40,), (5, 7)]]


def _local_update(params, rank: int, step: int) -> None:
    gen = torch.Generator().manual_seed(7919 * step + rank)
    with torch.no_grad():
        for p in params:
            p.add_(torch.randn(p.shape, generator=gen, dtype=p.dtype) * 0.1)


def _flat(tensors) -> torch.Tensor:
    return torch.cat([t.detach().reshape(-1) for t in tensors])


def _gather(t: torch.Tensor, world: int) -> list[torch.Tensor]:
    out = [torch.empty_like(t) for _ in range(world)]
    torch.distributed.all_gather(out, t.contiguous())
    return out


def averaged_mass(rank: int, world: int, compression, delay: int, schedule: str) -> dict[str, object]:
    """Streaming DiLoCo with outer lr 1, no momentum, α = 0, one fragment: its anchor moves by exactly the
    applied update. Over the syncs, Σ applied + mean residual + owner residual == Σ mean δ (fp64)."""
    params = _params(rank)
    averager = StreamingDiLoCoAverager(3, fragment_sync_delay=delay, outer_lr=1.0, outer_momentum=0.0,
                                       compression=compression, schedule=schedule)
    averager.anchor_parameters(params)  # rank 0's parameters: the first sync is an outer step from there
    anchor = _flat(averager.local_state_dict()["fragments"][0]["anchor"])
    true_sum, applied_sum = torch.zeros_like(anchor), torch.zeros_like(anchor)
    agree, link_ok, sending = True, True, None
    for step in range(22):
        _local_update(params, rank, step)
        before = averager.link_bytes
        if averager.fragment_sent_at(step) is not None:
            sending = (step + delay, anchor - _flat(params))
        averager.average_parameters(params)
        if sending is not None and sending[0] == step:
            new_anchor = _flat(params).clone()
            applied_sum += anchor - new_anchor
            true_sum += sending[1]
            agree &= all(torch.equal(new_anchor, other) for other in _gather(new_anchor, world))
            anchor, sending = new_anchor, None
        if delay == 0 and averager.fragment_sent_at(step) is not None:
            plan = regions(compression, anchor.numel(), world)
            link_ok &= averager.link_bytes - before == 2 * (world - 1) / world * plan.padded_bytes
    state = averager.local_state_dict()["fragments"][0]
    residual = state["residual"]
    plan = regions(compression, anchor.numel(), world)
    owner = torch.zeros_like(anchor)
    start, end = plan.bounds[rank]
    if state.get("owner_residual") is not None:
        owner[start:end] = state["owner_residual"]
    owners = torch.stack(_gather(owner, world)).sum(0)  # each owner's region, in place
    mean_true = torch.stack(_gather(true_sum, world)).mean(0)
    mean_residual = torch.stack(_gather(residual, world)).mean(0)
    gap = float((applied_sum + mean_residual + owners - mean_true).abs().max())
    return {"gap": gap, "agree": agree, "link_ok": link_ok, "owner_max": float(owners.abs().max()),
            "lossy": not torch.allclose(applied_sum, mean_true), "scale": float(mean_true.abs().max())}


@pytest.mark.parametrize("world, compression, delay", [
    (3, QuantizeInt8(chunk_size=16, rounding="stochastic"), 0),
    (4, QuantizeInt4(chunk_size=16), 2),
    (3, TopK(k=3, chunk_size=16), 1),
])
def test_two_shot_error_feedback_at_both_levels_conserves_mass(world, compression, delay):
    for out in run(averaged_mass, world, compression, delay, "two-shot"):
        assert out["gap"] < 1e-12 * max(1.0, out["scale"]), out
        assert out["agree"] and out["link_ok"] and out["lossy"] and out["owner_max"] > 0


def test_all_gather_keeps_no_owner_residual():
    for out in run(averaged_mass, 3, QuantizeInt4(chunk_size=16), 0, "all-gather"):
        assert out["gap"] < 1e-12 * max(1.0, out["scale"]) and out["owner_max"] == 0 and out["agree"]


def top_k_density(rank: int, world: int, schedule: str) -> tuple[int, int, bool]:
    params = [nn.Parameter(torch.randn(256, generator=torch.Generator().manual_seed(rank)))]
    averager = OuterOptimizerAverager(1, outer_lr=1.0, outer_momentum=0.0, compression=TopK(k=2, chunk_size=32),
                                      schedule=schedule)
    averager.anchor_parameters(params)
    before = averager.local_state_dict()["anchor"][0].clone()  # rank 0's parameters
    _local_update(params, rank, 0)
    averager.average_parameters(params)
    moved = params[0].detach() - before
    chunks = (moved.view(-1, 32) != 0).sum(1)
    same = all(torch.equal(params[0].detach(), other) for other in _gather(params[0].detach(), world))
    return int(chunks.max()), int((moved != 0).sum()), same


def test_top_k_two_shot_keeps_the_update_at_density_d():
    for per_chunk, _, same in run(top_k_density, 4, "two-shot"):
        assert per_chunk <= 2 and same
    for per_chunk, _, same in run(top_k_density, 4, "all-gather"):
        assert per_chunk > 2 and same  # the union of the 4 ranks' supports


# -- checkpoints --------------------------------------------------------------------------------------

def _net_and_optimizer(rank: int, compression, schedule: str, delay: int):
    torch.manual_seed(rank)
    net = nn.Sequential(nn.Linear(6, 12), nn.Tanh(), nn.Linear(12, 1))
    averager = StreamingDiLoCoAverager(8, warmup_steps=1, num_fragments=2, fragment_sync_delay=delay,
                                       fragment_update_alpha=0.5, compression=compression, schedule=schedule)
    return net, PostLocalSGDOptimizer(torch.optim.SGD(net.parameters(), lr=0.05), averager)


def _train(net, opt, rank: int, steps: range) -> None:
    for step in steps:
        gen = torch.Generator().manual_seed(31 * step + rank)
        x = torch.randn(8, 6, generator=gen)
        opt.zero_grad()
        (net(x) - x.sum(1, keepdim=True)).pow(2).mean().backward()
        opt.step()


def resume_two_shot(rank: int, world: int, split: int) -> dict[str, object]:
    compression = QuantizeInt4(chunk_size=8, rounding="stochastic", seed=3)
    net, opt = _net_and_optimizer(rank, compression, "auto", 3)
    _train(net, opt, rank, range(30))
    want = [p.detach().clone() for p in net.parameters()]
    counts = (opt.averager.bytes_sent, opt.averager.link_bytes, opt.averager.num_averages)
    net, opt = _net_and_optimizer(rank, compression, "auto", 3)
    _train(net, opt, rank, range(split))
    buffer = io.BytesIO()
    torch.save({"net": net.state_dict(), "opt": opt.state_dict()}, buffer)
    phases = [p.get("phase") for p in opt.averager.local_state_dict()["in_flight"]]
    buffer.seek(0)
    saved = torch.load(buffer, weights_only=False)
    net, opt = _net_and_optimizer(rank, compression, "auto", 3)
    net.load_state_dict(saved["net"])
    opt.load_state_dict(saved["opt"])
    _train(net, opt, rank, range(split, 30))
    return {"same": all(torch.equal(a, b) for a, b in zip(want, net.parameters())),
            "counts": counts == (opt.averager.bytes_sent, opt.averager.link_bytes, opt.averager.num_averages),
            "phases": phases}


@pytest.mark.parametrize("split, phase", [(10, 1), (11, 1), (12, 2)])
def test_resume_after_either_phase_equals_never_stopping(split, phase):
    # Fragment 0 is sent at step 9 (the first after warm-up, at 1, 9, ...: every 8), its all-gather issued at
    # step 9 + 2 and applied at 9 + 3: a checkpoint after step 9 or 10 holds the all-to-all's output, after
    # step 11 the all-gather's.
    for out in run(resume_two_shot, 3, split):
        assert out["same"] and out["counts"], out
        assert out["phases"] == [phase], out


def owner_residual_placement(rank: int, world: int) -> dict[str, bool]:
    params = _params(rank, torch.float32)
    averager = OuterOptimizerAverager(1, outer_lr=1.0, outer_momentum=0.0, compression=QuantizeInt8(chunk_size=8))
    averager.anchor_parameters(params)
    for step in range(3):
        _local_update(params, rank, step)
        averager.average_parameters(params)
    local = averager.local_state_dict()
    mine = OuterOptimizerAverager(1, outer_lr=1.0, outer_momentum=0.0, compression=QuantizeInt8(chunk_size=8))
    mine.anchor_parameters(_params(rank, torch.float32))
    mine.load_state_dict(local)
    other_state = dict(local, placement={"rank": (rank + 1) % world, "world_size": world},
                       owner_at=[(rank + 1) % world, world])
    other = OuterOptimizerAverager(1, outer_lr=1.0, outer_momentum=0.0, compression=QuantizeInt8(chunk_size=8))
    other.anchor_parameters(_params(rank, torch.float32))
    other.load_state_dict(other_state, allow_other_rank=True)
    return {"saved": local.get("owner_residual") is not None,
            "kept on its own rank": torch.equal(mine.local_state_dict()["owner_residual"], local["owner_residual"]),
            "dropped on another": "owner_residual" not in other.local_state_dict(),
            "rank residual loaded": torch.equal(other.local_state_dict()["residual"], local["residual"])}


def test_owner_residuals_are_dropped_when_the_rank_changes(caplog):
    for out in run(owner_residual_placement, 3):
        assert all(out.values()), out


def test_an_owner_residual_of_another_placement_is_dropped_and_logged(caplog):
    owner = OwnerResidual()
    with caplog.at_level(logging.INFO, logger="gradpress.averaging"):
        owner.load({"owner_residual": torch.ones(4), "owner_at": [1, 3]}, {"rank": 1, "world_size": 4},
                   torch.device("cpu"), "test")
    assert owner.tensor is None and "dropped" in caplog.text and "rank 1 of 3" in caplog.text
    owner.load({"owner_residual": torch.ones(4), "owner_at": [1, 3]}, {"rank": 1, "world_size": 3},
               torch.device("cpu"), "test")
    assert torch.equal(owner.tensor, torch.ones(4)) and owner.at == (1, 3)
    assert owner.usable(Link(None, 1, 3), "test") is not None
    assert owner.usable(Link(None, 2, 3), "test") is None and owner.tensor is None  # the rank moved: dropped


def two_shot_non_finite(rank: int, world: int) -> tuple[bool, bool, bool]:
    params = _params(rank, torch.float32)
    averager = StreamingDiLoCoAverager(1, outer_lr=1.0, outer_momentum=0.0, compression=QuantizeInt8(chunk_size=8))
    averager.anchor_parameters(params)
    for step in range(2):
        _local_update(params, rank, step)
        averager.average_parameters(params)
    before = averager.local_state_dict()["fragments"][0]
    anchor = _flat(before["anchor"])
    _local_update(params, rank, 2)
    if rank == 1:
        with torch.no_grad():
            params[0][0, 0] = float("inf")
    averager.average_parameters(params)
    after = averager.local_state_dict()["fragments"][0]
    return (torch.equal(after["owner_residual"], before["owner_residual"]),
            torch.equal(after["residual"], before["residual"]), torch.equal(_flat(params), anchor))


def test_a_non_finite_two_shot_sync_keeps_both_residuals_and_resets_to_the_anchor():
    for kept_owner, kept_rank, reset in run(two_shot_non_finite, 3):
        assert kept_owner and kept_rank and reset


# -- bad input ------------------------------------------------------------------------------------------

class _Sign(Compressor):
    """A compressor that cannot be requantized (two_shot is False)."""

    chunk_size, rounding, seed = 8, "nearest", 0

    def payload_bytes(self, numel: int) -> int:
        return numel

    def encode(self, x, generator=None):
        return (x > 0).to(torch.uint8)

    def decode(self, payloads, numel, dtype):
        return payloads.to(dtype) * 2 - 1

    def __repr__(self) -> str:
        return "_Sign()"


@pytest.mark.parametrize("make", [
    lambda **kw: OuterOptimizerAverager(2, **kw), lambda **kw: StreamingDiLoCoAverager(2, **kw)])
def test_bad_schedules_are_refused_at_construction_naming_the_argument_and_the_allowed_values(make):
    with pytest.raises(ValueError, match=r"schedule must be one of \('auto', 'all-gather', 'two-shot'\), got 'ring'"):
        make(compression=QuantizeInt8(), schedule="ring")
    for compression in (None, "bf16", gradpress.Config(rank=1)):
        with pytest.raises(ValueError, match="schedule='two-shot' .*needs compression=QuantizeInt8"):
            make(compression=compression, schedule="two-shot")
        with pytest.raises(ValueError, match="schedule='all-gather' .*use schedule='auto'"):
            make(compression=compression, schedule="all-gather")
        make(compression=compression, schedule="auto")
    with pytest.raises(ValueError, match=r"schedule='two-shot' needs a compressor .* _Sign\(\) cannot be requantized"):
        make(compression=_Sign(), schedule="two-shot")
    with pytest.raises(ValueError, match="carries its own"):
        make(compression=Compressed(QuantizeInt8()), schedule="two-shot")
    make(compression=_Sign(), schedule="all-gather")
    assert SCHEDULES == ("auto", "all-gather", "two-shot")


def two_shot_host_reads(rank: int, world: int) -> list[str]:
    from host_reads import HostRead, no_host_reads

    failures = []
    for compression in (QuantizeInt8(chunk_size=16, rounding="stochastic"), QuantizeInt4(chunk_size=16),
                        TopK(k=2, chunk_size=16)):
        params = _params(rank, torch.float32)
        averager = StreamingDiLoCoAverager(6, num_fragments=2, fragment_sync_delay=2, fragment_update_alpha=0.5,
                                           compression=compression, schedule="two-shot")
        averager.anchor_parameters(params)
        for step in range(14):
            _local_update(params, rank, step)
            try:
                with no_host_reads():
                    averager.average_parameters(params)
            except HostRead as exc:
                failures.append(f"{compression!r}, step {step}: {exc}")
                raise
    return failures


def test_two_shot_reads_no_device_value_on_the_host():
    for failures in run(two_shot_host_reads, 3):
        assert failures == []

"""Streaming DiLoCo: fragment schedule, overlapped outer steps, compressed outer gradients with
error feedback, non-finite outer gradients, checkpoints (gloo, 2 ranks with DIFFERENT parameters)."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from distributed import run
from models import train_regression
from gradpress import (OuterOptimizerAverager, PostLocalSGDOptimizer, QuantizeInt4, QuantizeInt8,
                       StreamingDiLoCoAverager, TopK)
from gradpress.streaming import fragment_offsets, split_by_size

WORLD = 2
SHAPES = [(7, 5), (3,), (4, 4), (10,), (2, 3), (6,)]  # 76 values, 6 tensors


def _gather(t: torch.Tensor) -> list[torch.Tensor]:
    out = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(out, t.contiguous())
    return out


def _params(rank, dtype=torch.float64):
    gen = torch.Generator().manual_seed(100 + rank)  # different on every rank
    return [nn.Parameter(torch.randn(shape, generator=gen, dtype=dtype)) for shape in SHAPES]


def _local_update(params, rank, step):
    """A different change on every rank and step."""
    gen = torch.Generator().manual_seed(1000 * step + rank)
    with torch.no_grad():
        for p in params:
            p.add_(torch.randn(p.shape, generator=gen, dtype=p.dtype) * 0.1)


def _flat(tensors) -> torch.Tensor:
    return torch.cat([t.detach().reshape(-1) for t in tensors])


# -- F=1, τ=0, no compression is OuterOptimizerAverager ------------------------------------------

def _net(rank):
    torch.manual_seed(rank)  # different initial parameters on every rank
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3), nn.Tanh(), nn.Linear(3, 1))


def same_as_outer_optimizer(rank, world):
    results = []
    for lr, momentum, nesterov in [(0.7, 0.9, True), (0.5, 0.5, False), (1.0, 0.0, True)]:
        nets = [_net(rank), _net(rank)]
        averagers = [OuterOptimizerAverager(3, warmup_steps=2, outer_lr=lr, outer_momentum=momentum, nesterov=nesterov),
                     StreamingDiLoCoAverager(3, warmup_steps=2, num_fragments=1, outer_lr=lr,
                                             outer_momentum=momentum, nesterov=nesterov)]
        opts = [PostLocalSGDOptimizer(torch.optim.SGD(n.parameters(), lr=0.1, momentum=0.5), a)
                for n, a in zip(nets, averagers)]
        identical = True
        for step in range(14):
            for net, opt in zip(nets, opts):
                train_regression(net, opt, rank, step, step + 1)
            identical &= all(torch.equal(a, b) for a, b in zip(nets[0].parameters(), nets[1].parameters()))
        results.append((identical, averagers[0].bytes_sent == averagers[1].bytes_sent,
                        averagers[0].num_averages == averagers[1].num_averages == 4))
    return results


def test_one_fragment_no_delay_no_compression_is_outer_optimizer_averager_bitwise():
    for results in run(same_as_outer_optimizer, WORLD):
        assert results == [(True, True, True)] * 3


# -- the paper's first sync: torchft's published regression values --------------------------------

#: torchft's streaming DiLoCo regression fixtures, copied verbatim into tests/data/torchft/ from
#: github.com/pytorch/torchft (BSD-3-Clause), commit 73dafea422116b2a713542719c8454efe5444c6c, path
#: test_fixtures/torchft.diloco_regression_test.DiLoCoMockedUpdateTest.test_diloco_mocked_updates_{i}.json,
#: written by torchft/diloco_regression_test.py's DiLoCoMockedUpdateTest.test_diloco_mocked_updates, whose
#: case i is (2 fragments, fragment_sync_delay, fragment_update_alpha) below. Each holds, per replica, the
#: parameters before every inner step ("history") and the fragments' global parameters ("original_parameters",
#: our anchors) at some of them ("global_parameter_history").
TORCHFT_DATA = Path(__file__).resolve().parents[1] / "data" / "torchft"
TORCHFT_FIXTURES = [(0, 0.0), (0, 0.5), (0, 1.0), (1, 0.0), (1, 0.5), (1, 1.0)]


def torchft_streaming(rank, world, delay, alpha):
    """torchft's regression setting rebuilt: two fragments, each a 1x1 weight of ones (``layers.i``, one
    module per fragment, torchft's ``model_fragments``), the gradient fixed at 2, inner SGD lr 1, outer SGD lr 2
    without momentum per fragment, sync every 6 steps, 2 replicas; its phase (fragment 0 applied after inner
    steps 3, 9, 15, fragment 1 after 6, 12, each sent ``delay`` steps earlier) is ``fragment_phase="end"``.
    Returns the parameters before each of 16 steps and the anchors there, by torchft's names."""
    model = nn.Module()
    model.layers = nn.ModuleList(nn.Linear(1, 1, bias=False) for _ in range(2))
    with torch.no_grad():
        for layer in model.layers:
            layer.weight.fill_(1.0)
    averager = StreamingDiLoCoAverager(6, fragments=list(model.layers), fragment_sync_delay=delay,
                                       fragment_update_alpha=alpha, outer_lr=2.0, outer_momentum=0.0,
                                       fragment_phase="end")
    opt = PostLocalSGDOptimizer(torch.optim.SGD(model.parameters(), lr=1.0), averager)
    history, anchors = {}, {}
    for step in range(16):  # the state before step 0 (where local training starts) .. after step 14
        history[step] = {name: p.detach().tolist() for name, p in model.named_parameters()}
        anchors[step] = {f"layers.{f}.weight": fragment["anchor"][0].tolist()
                         for f, fragment in enumerate(averager.local_state_dict()["fragments"])}
        if step == 15:
            break
        for p in model.parameters():
            p.grad = torch.full_like(p, 2.0)
        opt.step()
    return history, anchors, averager.num_averages


@pytest.mark.parametrize("case", range(len(TORCHFT_FIXTURES)))
def test_streaming_diloco_reproduces_torchfts_regression_fixtures(case):
    """Every parameter before every step, on both replicas, equals torchft's (exactly: the values are
    small integers and halves), and so do the global parameters where torchft recorded them."""
    delay, alpha = TORCHFT_FIXTURES[case]
    name = f"torchft.diloco_regression_test.DiLoCoMockedUpdateTest.test_diloco_mocked_updates_{case}.json"
    fixture = json.loads((TORCHFT_DATA / name).read_text())
    results = run(torchft_streaming, WORLD, delay, alpha)
    assert len(fixture) == len(results) == WORLD
    for replica, (want, (history, anchors, syncs)) in enumerate(zip(fixture, results)):
        want_history, want_global = want[0]["history"], want[0]["global_parameter_history"]
        assert sorted(map(int, want_history)) == list(range(16))
        for step, params in want_history.items():
            assert history[int(step)] == params, f"replica {replica}, before step {step}"
        assert want_global
        for step, params in want_global.items():
            assert anchors[int(step)] == params, f"replica {replica}, global parameters before step {step}"
        assert syncs == 5  # fragment 0 applied after inner steps 3, 9, 15; fragment 1 after 6, 12


def first_outer_step(rank, world, first_sync):
    """Ranks start apart (rank 0's values are the anchor); OuterOptimizerAverager's first sync (step 0, after
    one local SGD step) against an independent outer SGD on the anchor."""
    torch.manual_seed(rank)
    net = nn.Linear(3, 2)
    start = [p.detach().clone() for p in net.parameters()]
    averager = OuterOptimizerAverager(3, outer_lr=0.7, outer_momentum=0.9, first_sync=first_sync)
    opt = PostLocalSGDOptimizer(torch.optim.SGD(net.parameters(), lr=0.1), averager)
    anchor = [torch.stack(_gather(s))[0] for s in start]  # rank 0's
    opt.zero_grad()
    net(torch.full((1, 3), float(rank + 1))).pow(2).sum().backward()
    before = [p.detach().clone() for p in net.parameters()]
    opt.step()
    local = [b - 0.1 * p.grad for b, p in zip(before, net.parameters())]  # this rank's parameters at the sync
    mean_local = [torch.stack(_gather(t)).mean(0) for t in local]
    if first_sync == "outer":
        x = [a.clone().requires_grad_() for a in anchor]
        outer = torch.optim.SGD(x, lr=0.7, momentum=0.9, nesterov=True)
        for xi, a, m in zip(x, anchor, mean_local):
            xi.grad = a - m
        outer.step()
        want = [xi.detach() for xi in x]
    else:
        want = mean_local
    gaps = [float((p.detach() - w).abs().max()) for p, w in zip(net.parameters(), want)]
    return max(gaps), averager.num_averages


@pytest.mark.parametrize("first_sync", ["outer", "average"])
def test_diloco_first_sync_is_an_outer_step_from_where_local_training_started(first_sync):
    for gap, count in run(first_outer_step, WORLD, first_sync):
        assert gap < 1e-6 and count == 1


def no_anchor(rank, world):
    averager = StreamingDiLoCoAverager(2)
    params = _params(rank)
    try:
        averager.average_parameters(params)
    except ValueError as error:
        return str(error)
    return None


def test_a_sync_without_anchor_says_how_to_give_one():
    for message in run(no_anchor, WORLD):
        assert "no anchor" in message and "PostLocalSGDOptimizer" in message and "first_sync='average'" in message


# -- fragment schedule ---------------------------------------------------------------------------

def schedule(rank, world, explicit, phase, delay):
    params = _params(rank)
    sync_every, warmup = 6, 1
    if explicit:
        kwargs = {"fragments": [params[:2], params[2:3], params[3:]]}
    else:
        kwargs = {"num_fragments": 3}
    averager = StreamingDiLoCoAverager(sync_every, warmup_steps=warmup, fragment_phase=phase,
                                       fragment_sync_delay=delay, **kwargs)
    events = []
    for step in range(22):
        _local_update(params, rank, step)
        sent = averager.bytes_sent
        averager.average_parameters(params)
        synced = {i for i, p in enumerate(params) if all(torch.equal(p.detach(), q) for q in _gather(p.detach()))}
        events.append((step, synced, averager.bytes_sent - sent))
    return events, averager.fragment_layout, averager.fragment_bytes_sent


@pytest.mark.parametrize("explicit, phase, delay", [(False, "start", 0), (True, "start", 0), (False, "start", 2),
                                                    (False, "end", 0), (True, "end", 1)])
def test_each_tensor_synchronizes_once_per_sync_every_at_its_fragments_offset(explicit, phase, delay):
    """Parameters agree across ranks exactly at their fragment's apply step (α = 0), and a fragment's bytes
    are sent ``delay`` steps before: "start" sends on schedule, "end" applies on schedule (torchft's)."""
    sync_every, warmup = 6, 1
    sizes = [8 * torch.Size(s).numel() for s in SHAPES]
    full = sum(sizes)
    want_layout = [0, 0, 1, 2, 2, 2] if explicit else split_by_size(sizes, 3)
    offsets = fragment_offsets(sync_every, 3, phase, delay)  # send offsets
    applied_at = [(o + delay) % sync_every for o in offsets]
    assert applied_at == ([1, 3, 5] if phase == "end" else [(o + delay) % sync_every for o in (0, 2, 4)])
    for events, layout, per_fragment in run(schedule, WORLD, explicit, phase, delay):
        assert layout == want_layout
        members = [{i for i, f in enumerate(layout) if f == g} for g in range(3)]
        last_sync = {}
        for step, synced, sent in events:
            r = step - warmup
            sending = [f for f in range(3) if r >= 0 and r % sync_every == offsets[f]]
            due = [f for f in range(3) if r - delay >= 0 and (r - delay) % sync_every == offsets[f]]
            want = members[due[0]] if due else set()
            assert synced == want, f"step {step}"
            anchor = full if step == warmup - 1 else 0  # the anchor (every fragment) at the last warm-up step
            sending_members = members[sending[0]] if sending else set()
            assert sent == sum(sizes[i] for i in sending_members) + anchor  # uncompressed: the fragment's bytes
            if not explicit and not anchor:
                assert sent <= full / 3 + max(sizes)  # 1/F of a full sync, plus rounding to whole tensors
            for i in want:
                assert step - last_sync.get(i, step - sync_every) == sync_every  # once per sync_every steps
                last_sync[i] = step
        assert sum(per_fragment) == sum(sent for *_, sent in events)


def test_end_phase_sends_delay_steps_before_the_end_of_each_fragments_period():
    assert fragment_offsets(6, 2, "end") == [2, 5]  # applied (and, without delay, sent) after 3 and 6 steps
    assert fragment_offsets(6, 2, "end", delay=1) == [1, 4]  # sent one step earlier, applied at 2 and 5
    assert fragment_offsets(7, 3, "end", delay=1) == [0, 2, 5]  # periods of 2, 2 and 3 steps, ending at 1, 3, 6
    assert fragment_offsets(6, 3, "start", delay=2) == [0, 2, 4]  # "start" sends on schedule, whatever the delay
    with pytest.raises(ValueError, match=r"fragment_sync_delay must be an integer in \[0, 1\] with fragment_phase"):
        fragment_offsets(7, 3, "end", delay=2)


def test_split_by_size_is_contiguous_non_empty_and_balanced():
    gen = torch.Generator().manual_seed(0)
    for _ in range(200):
        count = int(torch.randint(1, 12, (1,), generator=gen))
        sizes = torch.randint(1, 100, (count,), generator=gen).tolist()
        for parts in range(1, count + 1):
            layout = split_by_size(sizes, parts)
            assert layout == sorted(layout) and set(layout) == set(range(parts))
            totals = [sum(s for s, f in zip(sizes, layout) if f == g) for g in range(parts)]
            assert max(totals) <= sum(sizes) / parts + max(sizes)
    with pytest.raises(ValueError, match="num_fragments"):
        split_by_size([1, 2], 3)


# -- compressors ---------------------------------------------------------------------------------

@pytest.mark.parametrize("make", [QuantizeInt8, QuantizeInt4])
@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
def test_quantization_error_is_bounded_per_chunk(make, rounding):
    compressor = make(chunk_size=64, rounding=rounding)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(1000, generator=gen) * torch.logspace(-3, 3, 1000)  # chunks of very different scales
    x[128:192] = 0  # an all-zero chunk
    payload = compressor.encode(x, torch.Generator().manual_seed(2))
    assert payload.dtype == torch.uint8 and payload.numel() == compressor.payload_bytes(1000)
    assert compressor.payload_bytes(1000) == (1000 if make is QuantizeInt8 else 500) + 4 * 16
    decoded = compressor.decode(payload.unsqueeze(0), 1000, torch.float32)[0]
    for start in range(0, 1000, 64):
        chunk, got = x[start: start + 64], decoded[start: start + 64]
        scale = chunk.abs().max() / compressor.levels
        bound = scale / 2 if rounding == "nearest" else scale
        assert (chunk - got).abs().max() <= bound * (1 + 1e-5)
    assert torch.all(decoded[128:192] == 0)


def test_stochastic_rounding_is_unbiased_and_seeded():
    compressor = QuantizeInt4(chunk_size=32, rounding="stochastic")
    x = torch.randn(256, generator=torch.Generator().manual_seed(3))
    draws = torch.stack([compressor.decode(compressor.encode(x, torch.Generator().manual_seed(s)).unsqueeze(0),
                                           256, torch.float64)[0] for s in range(400)])
    scale = x.view(-1, 32).abs().amax(1).repeat_interleave(32) / 7
    assert ((draws.mean(0) - x).abs() / scale).max() < 0.15  # one draw errs by up to a whole scale
    again = compressor.encode(x, torch.Generator().manual_seed(5))
    assert torch.equal(again, compressor.encode(x, torch.Generator().manual_seed(5)))


@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
def test_top_k_sends_exactly_k_values_and_indices_per_chunk(rounding):
    compressor = TopK(k=5, chunk_size=50, rounding=rounding)
    x = torch.randn(480, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    payload = compressor.encode(x, torch.Generator().manual_seed(0))
    chunks = 10  # the last one padded from 30 to 50
    assert payload.numel() == compressor.payload_bytes(480) == -(-chunks * 5 // 4) + 4 * chunks + 2 * chunks * 5
    decoded = compressor.decode(payload.unsqueeze(0), 480, torch.float64)[0]
    for start in range(0, 450, 50):
        chunk, got = x[start: start + 50], decoded[start: start + 50]
        kept = got != 0
        assert int(kept.sum()) == 5
        assert set(kept.nonzero().flatten().tolist()) == set(chunk.abs().topk(5).indices.tolist())
        s = chunk.abs().max()
        assert (got[kept] - chunk[kept]).abs().max() <= (s / 3 if rounding == "nearest" else 2 * s / 3) * (1 + 1e-6)
    assert int((decoded[450:] != 0).sum()) <= 5
    assert TopK(k=1, chunk_size=40000).payload_bytes(40000) == 1 + 4 + 4  # int32 indices past 32768
    assert TopK(density=0.25, chunk_size=8).k_per_chunk == 2


def compressed_mass(rank, world, compression, delay):
    """Outer lr 1, no momentum, α = 0: the anchor moves by exactly the applied outer gradient Δ."""
    params = _params(rank)
    averager = StreamingDiLoCoAverager(4, num_fragments=2, fragment_sync_delay=delay, outer_lr=1.0,
                                       outer_momentum=0.0, compression=compression)
    averager.anchor_parameters(params)  # rank 0's parameters: every sync, the first included, is an outer step
    anchors = {f: _flat(fr["anchor"]) for f, fr in enumerate(averager.local_state_dict()["fragments"])}
    sending, true_sum, applied_sum = {}, {}, {}
    worst_mean_gap, lossy, agree, payload_ok = 0.0, False, True, True
    residuals = {0: 0.0, 1: 0.0}
    for step in range(26):  # updates still in flight at the end are left out of both sums
        _local_update(params, rank, step)
        sent_fragment = averager.fragment_sent_at(step)
        before_bytes = averager.bytes_sent
        if sent_fragment is not None and sent_fragment in anchors:
            members = [p for p, f in zip(params, averager.fragment_layout) if f == sent_fragment]
            sending[sent_fragment] = (step + delay, anchors[sent_fragment] - _flat(members))
        averager.average_parameters(params)
        if sent_fragment is not None and sent_fragment in anchors:
            numel = sending[sent_fragment][1].numel()
            payload_ok &= averager.bytes_sent - before_bytes == compression.payload_bytes(numel)
        layout = averager.fragment_layout
        for f in (0, 1):
            members = [p for p, g in zip(params, layout or []) if g == f]
            if f in sending and sending[f][0] == step:  # the outer update sent τ steps ago lands now
                delta = sending.pop(f)[1]
                new_anchor = _flat(members).clone()
                applied = anchors[f] - new_anchor
                residual = averager.local_state_dict()["fragments"][f]["residual"]
                decay = getattr(compression, "error_decay", 1.0)  # e = δ + β·residual
                own = delta + decay * residuals[f] - residual  # what this rank's payload carried
                worst_mean_gap = max(worst_mean_gap, float((torch.stack(_gather(own)).mean(0) - applied).abs().max()))
                lossy |= not torch.allclose(applied, torch.stack(_gather(delta)).mean(0))
                agree &= all(torch.equal(new_anchor, a) for a in _gather(new_anchor))
                true_sum[f] = true_sum.get(f, 0) + delta
                applied_sum[f] = applied_sum.get(f, 0) + applied
                residuals[f], anchors[f] = residual, new_anchor
    # Per rank: Σ carried + residual == Σ true; across ranks: Σ applied + mean residual == mean Σ true.
    gaps = []
    for f in (0, 1):
        mean_true = torch.stack(_gather(true_sum[f])).mean(0)
        mean_residual = torch.stack(_gather(residuals[f])).mean(0)
        gaps.append(float((applied_sum[f] + mean_residual - mean_true).abs().max()))
    return worst_mean_gap, max(gaps), lossy, agree, payload_ok, float(residuals[0].abs().max())


@pytest.mark.parametrize("compression, delay", [
    (QuantizeInt8(chunk_size=16, rounding="stochastic"), 0),
    (QuantizeInt4(chunk_size=16), 1),
    (TopK(k=3, chunk_size=16, rounding="stochastic"), 2),
])
def test_error_feedback_conserves_mass_and_bytes_are_exact(compression, delay):
    for mean_gap, mass_gap, lossy, agree, payload_ok, residual in run(compressed_mass, WORLD, compression, delay):
        assert mean_gap < 1e-12   # Δ == mean over ranks of what each rank's payload carried
        assert mass_gap < 1e-12   # Σ Δ + mean residual == mean Σ δ (fp64)
        assert lossy and residual > 0 and agree and payload_ok


def test_sparseloco_error_decay_feeds_back_beta_times_the_residual():
    """TopK(error_decay=β): each payload carries δ + β·residual (the first check), so with β < 1 part of
    the mass is dropped on purpose (SparseLoCo's decayed accumulator), and the books no longer balance."""
    for mean_gap, mass_gap, lossy, agree, payload_ok, residual in run(
            compressed_mass, WORLD, TopK(k=3, chunk_size=16, error_decay=0.5), 1):
        assert mean_gap < 1e-12 and agree and payload_ok and lossy
        assert mass_gap > 1e-6
    with pytest.raises(ValueError, match="error_decay must be a number in"):
        TopK(error_decay=0.0)


# -- overlap -------------------------------------------------------------------------------------

class _Recorded:
    def __init__(self, work, key, events):
        self.work, self.key, self.events = work, key, events

    def wait(self):
        self.events.append(("wait", self.key))
        return self.work.wait()


def overlap(rank, world, compression):
    events: list[tuple[str, int]] = []
    names = [n for n in ("all_reduce", "all_gather_single", "all_gather_into_tensor") if hasattr(dist, n)]
    originals = {n: getattr(dist, n) for n in names}

    def recording(original):
        def call(*args, **kwargs):
            work = original(*args, **kwargs)
            if not kwargs.get("async_op"):
                return work
            key = sum(1 for e in events if e[0] == "start")
            events.append(("start", key))
            return _Recorded(work, key, events)
        return call

    net = _net(rank)
    averager = StreamingDiLoCoAverager(6, warmup_steps=1, num_fragments=2, fragment_sync_delay=2,
                                       fragment_update_alpha=0.5, compression=compression)
    inner = torch.optim.SGD(net.parameters(), lr=0.1)
    inner.register_step_post_hook(lambda *_: events.append(("inner", 0)))
    opt = PostLocalSGDOptimizer(inner, averager)
    for name in names:
        setattr(dist, name, recording(originals[name]))
    try:
        train_regression(net, opt, rank, 0, 19)
    finally:
        for name, fn in originals.items():
            setattr(dist, name, fn)
    anchors = [torch.cat([a.reshape(-1) for a in f["anchor"]]) for f in averager.local_state_dict()["fragments"]]
    agree = all(torch.equal(a, b) for a in anchors for b in _gather(a))
    return events, agree


@pytest.mark.parametrize("compression", [None, QuantizeInt8()])
def test_overlapped_collective_is_in_flight_during_inner_steps(compression):
    for events, agree in run(overlap, WORLD, compression):
        starts = [i for i, e in enumerate(events) if e[0] == "start"]
        assert len(starts) == 6  # outer sends at steps 1, 4, 7, 10, 13, 16 (anchors are taken by broadcasts)
        for i in starts:
            key = events[i][1]
            waited = events.index(("wait", key))
            inner_steps = sum(1 for e in events[i:waited] if e[0] == "inner")
            assert inner_steps == 2  # τ optimizer steps ran while the work was not waited on
        assert agree


def alpha_merge(rank, world):
    params = _params(rank)
    averager = StreamingDiLoCoAverager(4, fragment_sync_delay=2, fragment_update_alpha=0.25, outer_lr=1.0,
                                       outer_momentum=0.0)
    averager.anchor_parameters(params)
    gaps = []
    for step in range(12):
        _local_update(params, rank, step)
        if step in (4, 8):
            sent_mean = torch.stack(_gather(_flat(params))).mean(0)
        local = _flat(params).clone()
        averager.average_parameters(params)
        if step in (6, 10):  # the global parameters are the mean at the send step; α weighs the local ones
            gaps.append(float((_flat(params) - (0.25 * local + 0.75 * sent_mean)).abs().max()))
    return gaps


def test_fragment_update_alpha_mixes_local_and_new_global_parameters():
    for gaps in run(alpha_merge, WORLD):
        assert len(gaps) == 2 and max(gaps) < 1e-12


# -- non-finite outer gradients ------------------------------------------------------------------

def non_finite(rank, world, compression):
    params = _params(rank, torch.float32)
    averager = StreamingDiLoCoAverager(4, num_fragments=2, fragment_sync_delay=1, outer_momentum=0.9,
                                       compression=compression)
    averager.anchor_parameters(params)
    bad_step = 12  # fragment 0 is sent at 12 (its fourth outer step), applied at 13
    for step in range(bad_step):
        _local_update(params, rank, step)
        averager.average_parameters(params)
    before = averager.local_state_dict()["fragments"][0]
    _local_update(params, rank, bad_step)
    members = [p for p, f in zip(params, averager.fragment_layout) if f == 0]
    if rank == 1:
        with torch.no_grad():
            members[0].view(-1)[3] = float("nan")
    averager.average_parameters(params)
    _local_update(params, rank, bad_step + 1)
    averager.average_parameters(params)
    after = averager.local_state_dict()["fragments"][0]
    kept = all(torch.equal(a, b) for a, b in zip(before["anchor"], after["anchor"]))
    momentum = [f["outer"]["state"] for f in (before, after)]
    kept &= len(momentum[0]) > 0 and all(
        torch.equal(momentum[0][i]["momentum_buffer"], momentum[1][i]["momentum_buffer"]) for i in momentum[0])
    reset = all(torch.equal(p.detach(), a) for p, a in zip(members, after["anchor"]))
    residual_kept = before["residual"] is None or torch.equal(before["residual"], after["residual"])
    for step in range(bad_step + 2, 22):  # training goes on: fragment 0 moves again at its next sync
        _local_update(params, rank, step)
        averager.average_parameters(params)
    final = averager.local_state_dict()
    finite = all(torch.isfinite(p).all() for p in params) and all(
        f["residual"] is None or bool(torch.isfinite(f["residual"]).all()) for f in final["fragments"])
    moved = not all(torch.equal(a, b) for a, b in zip(after["anchor"], final["fragments"][0]["anchor"]))
    return kept, reset, residual_kept, finite, moved, averager.num_averages


@pytest.mark.parametrize("compression", [None, QuantizeInt8(chunk_size=8), TopK(k=2, chunk_size=8)])
def test_non_finite_outer_gradient_skips_the_fragment_and_resets_it_to_the_anchor(compression):
    for kept, reset, residual_kept, finite, moved, count in run(non_finite, WORLD, compression):
        assert kept and reset and residual_kept and finite and moved
        assert count == 11  # every sync is counted, the skipped one too


# -- no host syncs --------------------------------------------------------------------------------

#: ATen ops that read device values on the host (a stream sync on an accelerator), as in test_host_sync.
SYNCING_OPS = frozenset({"aten._local_scalar_dense", "aten.nonzero", "aten.masked_select", "aten.equal",
                         "aten.is_nonzero", "aten._unique2", "aten.index", "aten.index_put_"})


class _HostReads(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.seen = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if str(func.overloadpacket) in SYNCING_OPS:
            self.seen.append(str(func))
        return func(*args, **(kwargs or {}))


def host_reads(rank, world):
    seen = []
    for compression in [None, "bf16", QuantizeInt8(rounding="stochastic"), QuantizeInt4(), TopK(k=2, chunk_size=8)]:
        params = _params(rank, torch.float32)
        averager = StreamingDiLoCoAverager(4, num_fragments=2, fragment_sync_delay=1, fragment_update_alpha=0.5,
                                           compression=compression)
        averager.anchor_parameters(params)
        for step in range(14):
            _local_update(params, rank, step)
            with _HostReads() as mode:
                averager.average_parameters(params)
            seen += mode.seen
    return seen


def test_no_host_reads_of_device_values():
    for seen in run(host_reads, WORLD):
        assert seen == []


# -- checkpoints ---------------------------------------------------------------------------------

RESUME_CONFIGS = {
    "int8-stochastic": dict(num_fragments=3, fragment_sync_delay=2, fragment_update_alpha=0.5,
                            compression=QuantizeInt8(chunk_size=8, rounding="stochastic")),
    "topk": dict(num_fragments=2, fragment_sync_delay=1, compression=TopK(k=2, chunk_size=8, rounding="stochastic")),
    "plain-delay": dict(num_fragments=2, fragment_sync_delay=3),
    "int4-one-fragment": dict(compression=QuantizeInt4(chunk_size=8), outer_momentum=0.5, nesterov=False),
}


def resume(rank, world, name, split):
    def make():
        torch.manual_seed(rank)
        net = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
        averager = StreamingDiLoCoAverager(6, warmup_steps=2, **RESUME_CONFIGS[name])
        return net, PostLocalSGDOptimizer(torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.5), averager)

    steps = 24
    net, opt = make()
    train_regression(net, opt, rank, 0, steps)
    want = [p.detach().clone() for p in net.parameters()]
    want_counts = (opt.averager.bytes_sent, opt.averager.num_averages)
    net, opt = make()
    train_regression(net, opt, rank, 0, split)
    in_flight = opt.averager.in_flight
    buffer = io.BytesIO()
    torch.save({"net": net.state_dict(), "opt": opt.state_dict()}, buffer)
    local = opt.averager.local_state_dict()  # this rank's state as one plain dict, with its placement
    buffer.seek(0)
    saved = torch.load(buffer, weights_only=False)
    net, opt = make()
    net.load_state_dict(saved["net"])
    opt.load_state_dict(saved["opt"])
    train_regression(net, opt, rank, split, steps)
    same = all(torch.equal(a, b) for a, b in zip(want, net.parameters()))
    counts = (opt.averager.bytes_sent, opt.averager.num_averages) == want_counts
    refused = None
    if opt.averager.compression is not None:
        other = dict(local, placement={"rank": 1 - rank, "world_size": world})
        try:
            make()[1].averager.load_state_dict(other)
            refused = False
        except ValueError as exc:
            refused = "allow_other_rank" in str(exc)
        make()[1].averager.load_state_dict(other, allow_other_rank=True)
    return same, counts, in_flight, refused


@pytest.mark.parametrize("name, split", [("int8-stochastic", 9), ("topk", 12), ("plain-delay", 13),
                                         ("int4-one-fragment", 14)])
def test_resume_mid_flight_equals_never_stopping(name, split):
    for same, counts, in_flight, refused in run(resume, WORLD, name, split):
        assert same and counts
        if RESUME_CONFIGS[name].get("fragment_sync_delay", 0):
            assert in_flight, "the checkpoint should be taken while an outer update is in flight"
        assert refused in (None, True)


# -- arguments -----------------------------------------------------------------------------------

@pytest.mark.parametrize("kwargs, name", [
    ({"sync_every": 0}, "sync_every"),
    ({"warmup_steps": -1}, "warmup_steps"),
    ({"num_fragments": 5}, "num_fragments"),
    ({"num_fragments": 0}, "num_fragments"),
    ({"fragment_sync_delay": 4}, "fragment_sync_delay"),
    ({"fragment_update_alpha": 1.5}, "fragment_update_alpha"),
    ({"outer_lr": 0}, "outer_lr"),
    ({"outer_momentum": 1.0}, "outer_momentum"),
    ({"compression": "int8"}, "compression"),
    ({"fragments": []}, "fragments"),
    ({"fragments": [[]]}, "fragments"),
    ({"fragment_phase": "middle"}, "fragment_phase"),
    ({"num_fragments": 2, "fragment_sync_delay": 2, "fragment_phase": "end"}, "fragment_sync_delay"),  # >= 4 // 2
])
def test_bad_arguments_raise_at_construction_naming_the_argument(kwargs, name):
    kwargs = {"sync_every": 4, **kwargs}
    with pytest.raises(ValueError, match=name):
        StreamingDiLoCoAverager(**kwargs)


def test_bad_compressor_configs_raise_naming_the_field():
    for make, kwargs, name in [(QuantizeInt8, {"chunk_size": 0}, "chunk_size"),
                               (QuantizeInt4, {"rounding": "up"}, "rounding"),
                               (QuantizeInt8, {"seed": -1}, "seed"),
                               (TopK, {"k": 0}, "k"), (TopK, {"k": 9, "chunk_size": 8}, "k"),
                               (TopK, {"density": 1.5}, "density")]:
        with pytest.raises(ValueError, match=name):
            make(**kwargs)
    with pytest.raises(TypeError, match="num_fragments or fragments"):
        StreamingDiLoCoAverager(4, num_fragments=2, fragments=[[nn.Parameter(torch.zeros(1))]])


def anchor_taken_once(rank, world):
    """With a warm-up the anchor is taken once, at its last step (not also when the optimizer is built); a
    later anchor_parameters call changes nothing; a rank outside the group keeps its parameters."""
    out = {}
    for warmup in (1, 3):
        net = _net(rank)
        averager = OuterOptimizerAverager(2, warmup_steps=warmup, outer_lr=0.7, outer_momentum=0.9)
        opt = PostLocalSGDOptimizer(torch.optim.SGD(net.parameters(), lr=0.1), averager)
        sent = [averager.bytes_sent]
        for step in range(warmup + 3):
            train_regression(net, opt, rank, step, step + 1)
            sent.append(averager.bytes_sent)
        anchor = [a.clone() for a in averager.local_state_dict()["anchor"]]
        averager.anchor_parameters(net.parameters())  # after syncs: the run's anchor stays
        kept = all(torch.equal(a, b) for a, b in zip(anchor, averager.local_state_dict()["anchor"]))
        out[warmup] = (sent, kept)
    group = dist.new_group([0])
    params = _params(rank)
    before = [p.detach().clone() for p in params]
    outsider = StreamingDiLoCoAverager(2, process_group=group, first_sync="average")
    for _ in range(3):
        outsider.average_parameters(params)
    out["outside"] = (all(torch.equal(p, b) for p, b in zip(params, before)), outsider.step)
    return out


def test_the_anchor_is_taken_once_and_a_rank_outside_the_group_is_left_alone():
    full = sum(p.numel() * 4 for p in _net(0).parameters())
    for rank, out in enumerate(run(anchor_taken_once, WORLD)):
        for warmup in (1, 3):
            sent, kept = out[warmup]
            assert sent[:warmup] == [0] * warmup and sent[warmup] == full  # one broadcast, at step warmup - 1
            assert sent[warmup + 1] == 2 * full and kept  # the first outer sync at step warmup
        if rank == 1:
            assert out["outside"] == (True, 3)


def test_an_averager_refuses_a_state_that_is_not_its_own():
    averager = OuterOptimizerAverager(2)
    with pytest.raises(ValueError, match="no 'step'"):
        averager.load_state_dict({"anchor": []})
    with pytest.raises(ValueError, match="gathered state of 2 ranks"):
        averager.load_state_dict({"format": "gradpress.gathered_state", "world_size": 2, "ranks": [{}, {}]})

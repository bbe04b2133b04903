"""The tools' byte model (gradpress.tools.bytes) against what the code that sends counts: PowerSGDState's
bytes_stats() on a real two-rank run, the DiLoCo averagers' bytes_sent per sync (exact, cast, compressed,
PowerSGD), and wire labels named after the dtype really sent."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import gradpress
from distributed import run
from gradpress import OuterOptimizerAverager, QuantizeInt4, QuantizeInt8, StreamingDiLoCoAverager, TopK
from gradpress.tools.bytes import (allreduce_bytes, anchor_bytes, anchor_link_bytes, dtype_name, powersgd_bytes,
                                   schedule_at, sync_bytes, sync_link_bytes)

WORLD = 2


def _model(dtype: torch.dtype) -> nn.Module:
    """At rank 3: two matrices compressed, one (3 x 30) below the min rate, two biases sent whole."""
    return nn.Sequential(nn.Linear(50, 100), nn.ReLU(), nn.Linear(100, 30), nn.ReLU(),
                         nn.Linear(30, 3, bias=False)).to(dtype)


def powersgd_run(rank: int, world: int, dtype: torch.dtype, bytes_per_weight: int,
                 num_iters_per_step: int | None) -> tuple[list[tuple[int, int]], list[tuple[int, ...]]]:
    """``bytes_stats()``'s (before, after) after each step of a DDP run, and the gradients' shapes."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(0)
    model = _model(dtype)
    net = DDP(model)
    state = gradpress.PowerSGDState(None, matrix_approximation_rank=3, start_powerSGD_iter=2, min_compression_rate=2,
                                    bytes_per_weight=bytes_per_weight, num_iters_per_step=num_iters_per_step)
    net.register_comm_hook(state, gradpress.powerSGD_hook)
    counts = []
    for _ in range(6):
        net.zero_grad()
        net(torch.randn(4, 50, dtype=dtype)).float().pow(2).mean().backward()
        _, before, after = state.bytes_stats()
        counts.append((before, after))
    return counts, [tuple(p.shape) for p in model.parameters()]


@pytest.mark.parametrize("dtype, bytes_per_weight, wire", [
    (torch.float32, 2, "fp16"), (torch.float32, 4, "fp32"), (torch.bfloat16, 2, "bf16"), (torch.bfloat16, 4, "fp32")])
@pytest.mark.parametrize("num_iters_per_step", [None, 1])
def test_powersgd_bytes_are_what_powersgd_state_counts_on_a_real_run(dtype, bytes_per_weight, wire,
                                                                     num_iters_per_step):
    counts, shapes = run(powersgd_run, WORLD, dtype, bytes_per_weight, num_iters_per_step)[0]
    dtypes = [dtype] * len(shapes)
    compressed = [(b1 - b0, a1 - a0) for (b0, a0), (b1, a1) in zip([(0, 0)] + counts, counts) if a1 > a0]
    assert len(compressed) >= 3  # steps 1.. are compressed (start_powerSGD_iter=2 counts from the first)
    for step, (before, after) in enumerate(compressed):
        model = powersgd_bytes(shapes, dtypes, 3, 2, bytes_per_weight, num_iters_per_step,
                               step * (num_iters_per_step or 0))
        assert (before, after) == (model.bytes_in, model.bytes_sent), step
        assert model.wire == wire and model.gradients == dtype_name(dtype)
    assert allreduce_bytes(shapes, dtypes).bytes_sent == compressed[0][0]


def test_wire_labels_name_the_dtype_sent():
    shapes = [(8, 8), (8,)]
    assert allreduce_bytes(shapes, [torch.float32] * 2, torch.bfloat16).wire == "bf16"
    assert allreduce_bytes(shapes, [torch.float32] * 2, torch.float16).wire == "fp16"
    assert allreduce_bytes(shapes, [torch.bfloat16] * 2).wire == "bf16"
    assert powersgd_bytes(shapes, [torch.bfloat16] * 2, 1, 0, 2).wire == "bf16"
    assert powersgd_bytes(shapes, [torch.float32] * 2, 1, 0, 2).wire == "fp16"
    assert sync_bytes(shapes, [torch.float32] * 2, "bf16") == [2 * 72]


SHAPES = [(7, 5), (3,), (4, 4), (10,), (2, 3), (6,)]  # 76 values


def _params(rank: int) -> list[nn.Parameter]:
    gen = torch.Generator().manual_seed(100 + rank)
    return [nn.Parameter(torch.randn(shape, generator=gen)) for shape in SHAPES]


def averager_bytes(rank: int, world: int, name: str) -> dict[str, object]:
    """Bytes each sync of a DiLoCo averager counted, by compression."""
    compressions = {"none": None, "bf16": "bf16", "int8": QuantizeInt8(chunk_size=16),
                    "int4": QuantizeInt4(chunk_size=16), "topk": TopK(k=2, chunk_size=8),
                    "powersgd": gradpress.Config(rank=1, min_compression_rate=0, start_compressing_after_num_steps=0)}
    compression = compressions[name]
    out: dict[str, object] = {}
    for kind in ("streaming", "outer"):
        params = _params(rank)
        if kind == "streaming":
            averager = StreamingDiLoCoAverager(2, num_fragments=2, outer_lr=0.7, outer_momentum=0.0,
                                               compression=compression)
        else:
            averager = OuterOptimizerAverager(2, outer_lr=0.7, outer_momentum=0.0, compression=compression)
        averager.anchor_parameters(params)
        sent = [averager.bytes_sent]
        for step in range(8):
            with torch.no_grad():
                for p in params:
                    p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(10 * step + rank)) * 0.1)
            averager.average_parameters(params)
            sent.append(averager.bytes_sent)
        out[kind] = [b - a for a, b in zip(sent, sent[1:]) if b != a], sent[0]
    return out


@pytest.mark.parametrize("name", ["none", "bf16", "int8", "int4", "topk", "powersgd"])
def test_sync_bytes_are_what_the_diloco_averagers_count(name):
    compression = {"none": None, "bf16": "bf16", "int8": QuantizeInt8(chunk_size=16),
                   "int4": QuantizeInt4(chunk_size=16), "topk": TopK(k=2, chunk_size=8),
                   "powersgd": gradpress.Config(rank=1, min_compression_rate=0,
                                                start_compressing_after_num_steps=0)}[name]
    dtypes = [torch.float32] * len(SHAPES)
    out = run(averager_bytes, WORLD, name)[0]
    streaming, anchor = out["streaming"]
    assert anchor == anchor_bytes(SHAPES, dtypes)
    per_fragment = [sync_bytes(SHAPES, dtypes, compression, num_fragments=2, sync=s) for s in range(4)]
    # Fragment 0 at steps 0, 2, 4, 6; fragment 1 at 1, 3, 5, 7 (its s-th sync is its own s-th).
    assert streaming == [per_fragment[s // 2][s % 2] for s in range(8)]
    outer, anchor = out["outer"]
    assert anchor == anchor_bytes(SHAPES, dtypes)
    assert outer == [sync_bytes(SHAPES, dtypes, compression, sync=s)[0] for s in range(4)]


def test_sync_bytes_refuses_what_the_averagers_refuse():
    with pytest.raises(ValueError, match="compression must be"):
        sync_bytes(SHAPES, [torch.float32] * len(SHAPES), "int8")


# -- what one rank's link carries ---------------------------------------------------------------------

def averager_link(rank: int, world: int, name: str, schedule: str) -> dict[str, object]:
    """Per sync, the payload and the link bytes each DiLoCo averager counted, and its anchor's."""
    compression = {"none": None, "int8": QuantizeInt8(chunk_size=16), "int4": QuantizeInt4(chunk_size=16),
                   "topk": TopK(k=2, chunk_size=8)}[name]
    out: dict[str, object] = {}
    for kind in ("streaming", "outer"):
        params = _params(rank)
        if kind == "streaming":
            averager = StreamingDiLoCoAverager(2, num_fragments=2, outer_lr=0.7, outer_momentum=0.0,
                                               compression=compression, schedule=schedule)
        else:
            averager = OuterOptimizerAverager(2, outer_lr=0.7, outer_momentum=0.0, compression=compression,
                                              schedule=schedule)
        averager.anchor_parameters(params)
        counts = [(averager.bytes_sent, averager.link_bytes)]
        for step in range(4):
            with torch.no_grad():
                for p in params:
                    p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(10 * step + rank)) * 0.1)
            averager.average_parameters(params)
            counts.append((averager.bytes_sent, averager.link_bytes))
        out[kind] = [(b1 - b0, l1 - l0) for (b0, l0), (b1, l1) in zip(counts, counts[1:]) if b1 != b0], counts[0]
    return out


@pytest.mark.parametrize("world, name, schedule", [(2, "none", "auto"), (2, "int4", "auto"), (3, "int8", "auto"),
                                                   (3, "int4", "all-gather"), (4, "topk", "two-shot")])
def test_link_bytes_are_what_the_diloco_averagers_count(world, name, schedule):
    compression = {"none": None, "int8": QuantizeInt8(chunk_size=16), "int4": QuantizeInt4(chunk_size=16),
                   "topk": TopK(k=2, chunk_size=8)}[name]
    dtypes = [torch.float32] * len(SHAPES)
    out = run(averager_link, world, name, schedule)[0]
    payloads = sync_bytes(SHAPES, dtypes, compression, 2, world=world, schedule=schedule)
    links = sync_link_bytes(SHAPES, dtypes, compression, 2, world=world, schedule=schedule)
    streaming, anchor = out["streaming"]
    assert anchor == (anchor_bytes(SHAPES, dtypes), anchor_link_bytes(SHAPES, dtypes, world))
    assert streaming == [(payloads[s % 2], links[s % 2]) for s in range(4)]
    outer, _ = out["outer"]
    whole = (sync_bytes(SHAPES, dtypes, compression, world=world, schedule=schedule)[0],
             sync_link_bytes(SHAPES, dtypes, compression, world=world, schedule=schedule)[0])
    assert outer == [whole, whole]
    assert schedule_at(compression, world, schedule) == {
        "none": "allreduce", "int4": "all-gather" if world < 3 or schedule == "all-gather" else "two-shot",
        "int8": "two-shot", "topk": "two-shot"}[name]


def test_int4_two_shot_meets_the_link_targets_by_formula_up_to_1024_ranks():
    """n = 2^24 outer-gradient values (a 16M-parameter fragment): int4 two-shot within 2(W-1)/W of its payload
    plus 1% padding at every W up to 1024 (<= 1.02 n bytes at 1024 against ~8 n for an fp32 allreduce), and
    the default schedule's W = 8 at most twice its W = 2."""
    n, fp32 = 1 << 24, [torch.float32]
    int4 = QuantizeInt4()
    payload = int4.payload_bytes(n)
    for world in [2, 3, 4, 5, 8, 16, 32, 64, 128, 256, 512, 1024]:
        link = sync_link_bytes([(n,)], fp32, int4, world=world, schedule="two-shot")[0]
        assert link <= 2 * (world - 1) / world * payload * 1.01, world
    assert sync_link_bytes([(n,)], fp32, int4, world=1024)[0] <= 1.02 * n
    assert sync_link_bytes([(n,)], fp32, None, world=1024)[0] == pytest.approx(8 * n, rel=1e-3)
    for compressor in (QuantizeInt8(), int4):
        at = {w: sync_link_bytes([(n,)], fp32, compressor, world=w)[0] for w in (2, 8)}
        assert at[8] <= 2 * at[2]


def test_powersgd_link_bytes_are_two_w_minus_one_over_w_of_its_payload():
    counts = run(powersgd_link, 3)
    for world, after, link in counts:
        assert world == 3 and after > 0 and link == 2 * 2 / 3 * after


def powersgd_link(rank: int, world: int) -> tuple[int, int, float]:
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(0)
    net = DDP(_model(torch.float32))
    state = gradpress.PowerSGDState(None, matrix_approximation_rank=3, start_powerSGD_iter=2, min_compression_rate=2)
    net.register_comm_hook(state, gradpress.powerSGD_hook)
    for _ in range(4):
        net.zero_grad()
        net(torch.randn(4, 50)).pow(2).mean().backward()
    return state.link_bytes_stats()

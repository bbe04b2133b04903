"""One ``compression=`` family for both DiLoCo averagers (gradpress.averaging.transport): every value
either accepts works in the other, one fragment without delay is OuterOptimizerAverager bit for bit
whatever the transport, compressed state resumes exactly, and bad values name the allowed ones."""

from __future__ import annotations

import io

import pytest
import torch
from torch import nn

import gradpress
from distributed import run
from gradpress import OuterOptimizerAverager, QuantizeInt4, QuantizeInt8, StreamingDiLoCoAverager, TopK
from gradpress.averaging.transport import ALLOWED, Compressed, Exact, OuterTransport, PowerSGD, transport_for

WORLD = 2
SHAPES = [(7, 5), (3,), (4, 4), (10,), (2, 3), (6,)]
CONFIG = gradpress.Config(rank=1, min_compression_rate=0, start_compressing_after_num_steps=0)
COMPRESSIONS = {"none": None, "fp16": "fp16", "exact-bf16": Exact(torch.bfloat16), "int8": QuantizeInt8(chunk_size=16),
                "int4-stochastic": QuantizeInt4(chunk_size=16, rounding="stochastic", seed=3),
                "topk": TopK(k=2, chunk_size=8, error_decay=0.9), "powersgd": CONFIG}


def _params(rank: int) -> list[nn.Parameter]:
    gen = torch.Generator().manual_seed(100 + rank)
    return [nn.Parameter(torch.randn(shape, generator=gen)) for shape in SHAPES]


def _update(params: list[nn.Parameter], rank: int, step: int) -> None:
    gen = torch.Generator().manual_seed(1000 * step + rank)
    with torch.no_grad():
        for p in params:
            p.add_(torch.randn(p.shape, generator=gen) * 0.1)


def _make(kind: str, compression):
    if kind == "streaming":
        return StreamingDiLoCoAverager(2, outer_lr=0.7, outer_momentum=0.9, compression=compression)
    return OuterOptimizerAverager(2, outer_lr=0.7, outer_momentum=0.9, compression=compression)


def _train(kind: str, compression, rank: int, steps: range, params=None, averager=None):
    params = params if params is not None else _params(rank)
    if averager is None:
        averager = _make(kind, compression)
        averager.anchor_parameters(params)
    for step in steps:
        _update(params, rank, step)
        averager.average_parameters(params)
    return params, averager


def both_averagers(rank: int, world: int, name: str) -> dict[str, bool]:
    """Each transport in both averagers: streaming (F=1, τ=0) equals the outer averager bitwise, ranks stay
    identical, and stopping at step 5 and loading the checkpoints into fresh averagers equals not stopping."""
    compression = COMPRESSIONS[name]
    out = {}
    finals = {}
    for kind in ("streaming", "outer"):
        params, averager = _train(kind, compression, rank, range(9))
        finals[kind] = params
        gathered = [torch.empty(76) for _ in range(world)]
        torch.distributed.all_gather(gathered, torch.cat([p.detach().reshape(-1) for p in params]))
        out[f"{kind}: ranks identical"] = torch.equal(gathered[0], gathered[1])
        out[f"{kind}: moved"] = averager.num_averages == 5
        half, first = _train(kind, compression, rank, range(5))
        buffer = io.BytesIO()
        torch.save(first.state_dict(), buffer)
        buffer.seek(0)
        fresh = _make(kind, compression)
        fresh.load_state_dict(torch.load(buffer, weights_only=False))
        resumed, _ = _train(kind, compression, rank, range(5, 9), half, fresh)
        out[f"{kind}: resume equals never stopping"] = all(torch.equal(a, b) for a, b in zip(resumed, params))
    out["streaming equals outer"] = all(torch.equal(a, b) for a, b in zip(finals["streaming"], finals["outer"]))
    return out


@pytest.mark.parametrize("name", list(COMPRESSIONS))
def test_every_transport_works_in_both_averagers_and_resumes_exactly(name):
    for result in run(both_averagers, WORLD, name):
        assert all(result.values()), {k: v for k, v in result.items() if not v}


def test_every_accepted_value_resolves_to_one_transport():
    assert transport_for(None) == Exact() and transport_for("fp16") == Exact(torch.float16)
    assert transport_for("bf16") == Exact(torch.bfloat16)
    assert transport_for(QuantizeInt8()) == Compressed(QuantizeInt8())
    assert transport_for(CONFIG) == PowerSGD(CONFIG)
    custom = Exact(torch.float16)
    assert transport_for(custom) is custom and isinstance(custom, OuterTransport)


@pytest.mark.parametrize("value", ["int8", "fp8", 2, torch.float16])
def test_a_bad_compression_names_every_allowed_value(value):
    for make in (lambda: OuterOptimizerAverager(2, compression=value),
                 lambda: StreamingDiLoCoAverager(2, compression=value)):
        with pytest.raises(ValueError, match="compression must be") as error:
            make()
        assert ALLOWED in str(error.value) and repr(value) in str(error.value)

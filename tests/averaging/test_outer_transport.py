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
from gradpress.averaging.compress import rounding_generator
from gradpress.averaging.transport import (ALLOWED, Compressed, Exact, Link, OuterTransport, PowerSGD, sync_seed,
                                          transport_for)

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


def _outer_gradients(rank: int) -> list[torch.Tensor]:
    """Outer gradients near 1e-5 (below fp16's normal range once divided by W), one near 1e3 beside one
    near 1e-7, on every rank different."""
    gen = torch.Generator().manual_seed(50 + rank)
    sign = torch.randint(0, 2, (400,), generator=gen) * 2 - 1
    return [sign * (0.5 + torch.rand(400, generator=gen)) * 1e-5, (1 + torch.rand(6, generator=gen)) * 1e3,
            (1 + torch.rand(2, 5, generator=gen)) * 1e-7]


def fp16_outer_step(rank: int, world: int) -> list[float]:
    """OuterOptimizerAverager(compression="fp16") with outer SGD at lr 1 from a zero anchor: the
    parameters become minus the averaged outer gradient; relative errors against its exact mean."""
    params = [nn.Parameter(torch.zeros_like(g)) for g in _outer_gradients(rank)]
    averager = OuterOptimizerAverager(1, outer_lr=1.0, outer_momentum=0.0, nesterov=False, compression="fp16")
    averager.anchor_parameters(params)
    with torch.no_grad():
        for p, g in zip(params, _outer_gradients(rank)):
            p.sub_(g)  # outer gradient anchor - θ = g
    averager.average_parameters(params)
    assert averager.num_averages == 1
    errors = []
    for p, g in zip(params, _outer_gradients(rank)):
        exact = g.double()
        torch.distributed.all_reduce(exact)
        exact.div_(world)
        errors.append(float((-p.detach().double() - exact).abs().max() / exact.abs().max()))
    return errors


def test_an_fp16_outer_gradient_keeps_fp16_precision():
    for errors in run(fp16_outer_step, WORLD):
        assert max(errors) < 1e-3, errors  # fp16's 2^-11, not the subnormals' ~1% near 1e-5


@pytest.mark.parametrize("compressor", [QuantizeInt8(chunk_size=16, rounding="stochastic", seed=5),
                                        QuantizeInt4(chunk_size=8, rounding="stochastic", seed=5),
                                        TopK(k=3, chunk_size=8, rounding="stochastic", seed=5)])
def test_stochastic_rounding_draws_on_the_tensors_device(compressor):
    from host_reads import ForbidBlockingUploads, no_host_reads

    anchor = [torch.empty(7, 5, device="meta"), torch.empty(9, device="meta")]
    params = [torch.empty_like(a) for a in anchor]
    transport = Compressed(compressor)
    with no_host_reads(), ForbidBlockingUploads():  # no noise drawn on the host and copied up
        sent = transport.send(anchor, params, None, Link(None, 0, 1))
        transport.mean(sent, anchor)
    assert sent.buffers[0].device.type == "meta"


def test_stochastic_rounding_is_reproducible_from_counters():
    compressor = QuantizeInt8(chunk_size=16, rounding="stochastic", seed=5)
    transport = Compressed(compressor)
    anchor = [torch.randn(7, 5, generator=torch.Generator().manual_seed(1)), torch.zeros(9)]
    params = [torch.randn(a.shape, generator=torch.Generator().manual_seed(2)) for a in anchor]

    def payload(rank: int = 0, fragment: int = 0, sync: int = 0) -> torch.Tensor:
        return transport.send(anchor, params, None, Link(None, rank, 1, fragment, sync)).buffers[0]

    assert torch.equal(payload(sync=3), payload(sync=3))
    assert not torch.equal(payload(), payload(rank=1)) and not torch.equal(payload(), payload(fragment=1))
    assert not torch.equal(payload(), payload(sync=1))
    # On the CPU the draw is the one it always was: a CPU generator seeded with sync_seed.
    outer_grad = torch.cat([(a - p).reshape(-1) for a, p in zip(anchor, params)])
    old = compressor.encode(outer_grad, torch.Generator().manual_seed(sync_seed(5, 0, 0, 3)))
    assert torch.equal(payload(sync=3), old)
    assert rounding_generator(7, "cpu").device.type == "cpu"


def fp16_resume_in_flight(rank: int, world: int) -> dict[str, bool]:
    """StreamingDiLoCoAverager(compression="fp16") with a sync delay: a checkpoint taken with a scaled
    fp16 average in flight (its buffers: the wire and its scales) resumes to the numbers of never stopping."""
    def make():
        return StreamingDiLoCoAverager(2, num_fragments=2, fragment_sync_delay=1, outer_lr=0.7, outer_momentum=0.9,
                                       compression="fp16")

    runs = []
    for steps in (range(9), range(5)):
        averager, start = make(), _params(rank)
        averager.anchor_parameters(start)
        runs.append(_train("streaming", None, rank, steps, start, averager))
    (params, _), (half, first) = runs
    state = first.state_dict()
    in_flight = first.local_state_dict()["in_flight"]
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    fresh = make()
    fresh.load_state_dict(torch.load(buffer, weights_only=False))
    resumed, _ = _train("streaming", None, rank, range(5, 9), half, fresh)
    return {"in flight": len(in_flight) > 0,
            "resume equals never stopping": all(torch.equal(a, b) for a, b in zip(resumed, params))}


def test_an_fp16_average_in_flight_resumes_exactly():
    for result in run(fp16_resume_in_flight, WORLD):
        assert all(result.values()), result

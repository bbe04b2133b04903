"""``warm_up_bytes_per_weight=2``: the exact averages before compression starts travel on the half-precision
wire of the compressed steps (fp16, each tensor scaled by its own power of two), checked against an oracle
computed here from both ranks' gradients."""

import pytest
import torch

import gradpress
from gradpress.hooks.bucket import DenseBucket

from distributed import run

SHAPES = [(6, 5), (7,), (3, 4)]
#: Very different magnitudes per tensor: one scale per bucket would flush the small one to zero.
MAGNITUDES = [1e3, 1.0, 1e-4]


def _gradients(rank: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(10 + rank)
    return [torch.randn(shape, generator=generator, dtype=torch.float64).float() * m
            for shape, m in zip(SHAPES, MAGNITUDES)]


def _fp16_mean(per_rank: list[list[torch.Tensor]]) -> list[torch.Tensor]:
    """The oracle: each tensor divided by W, scaled by 2^(ceil(log2(W * max|x / W|)) - 14) (the max over
    ranks), rounded to fp16, summed (two fp16 terms: one rounding), and scaled back."""
    world = len(per_rank)
    out = []
    for i in range(len(SHAPES)):
        parts = [grads[i].double() / world for grads in per_rank]
        peak = max(float(p.abs().max()) for p in parts)
        scale = 2.0 ** (torch.tensor(world * peak).log2().ceil().item() - 14)
        wires = [(p / scale).half() for p in parts]
        total = sum(w.double() for w in wires).half().double()
        out.append((total * scale).float())
    return out


def _warm_up_step(rank: int, world: int, warm_up_bytes_per_weight: int | None):
    params = [torch.zeros(shape) for shape in SHAPES]
    state = gradpress.PowerSGDState(None, matrix_approximation_rank=1, start_powerSGD_iter=3,
                                    warm_up_bytes_per_weight=warm_up_bytes_per_weight)
    grads = _gradients(rank)
    buffer = torch.cat([g.reshape(-1) for g in grads])
    bucket = DenseBucket(0, True, params, buffer)
    result = gradpress.powerSGD_hook(state, bucket).wait()
    averaged = [piece.view(shape).clone() for piece, shape in zip(result.split([g.numel() for g in grads]), SHAPES)]
    return averaged, state.bytes_stats(), state.compression_stats(), state.iter


def test_the_warm_up_on_the_fp16_wire_is_the_scaled_fp16_mean_and_sends_half_the_bytes():
    half = run(_warm_up_step, 2, 2)
    exact = run(_warm_up_step, 2, None)
    per_rank = [_gradients(rank) for rank in range(2)]
    oracle = _fp16_mean(per_rank)
    mean = [(a + b) / 2 for a, b in zip(*per_rank)]
    for averaged, (rate, before, after), (numel_rate, numel_before, numel_after), iteration in half:
        assert iteration == 1
        for got, want, exact_mean, magnitude in zip(averaged, oracle, mean, MAGNITUDES):
            # fp16 keeps about 11 bits of each tensor's largest values: within its rounding of the oracle...
            torch.testing.assert_close(got, want, rtol=1e-3, atol=1e-3 * magnitude)
            # ... and not the exact fp32 mean, which the default warm-up gives.
            assert not torch.equal(got, exact_mean)
            assert got.abs().max() > 0  # the small tensor kept its own scale: not flushed to zero
        numel = sum(torch.Size(s).numel() for s in SHAPES)
        assert (before, after, rate) == (4 * numel, 2 * numel, 2.0)   # half the bytes of fp32 gradients
        assert (numel_before, numel_after) == (numel, numel)
    assert half[0][0][0].equal(half[1][0][0])  # every rank holds the same mean
    for averaged, bytes_stats, numel_stats, _ in exact:   # the default: the exact mean, PyTorch's counters
        for got, want in zip(averaged, mean):
            torch.testing.assert_close(got, want, rtol=1e-6, atol=0)
        assert bytes_stats == (0, 0, 0) and numel_stats == (0, 0, 0)


def _aggregator_warm_up(rank: int, world: int):
    params = [torch.zeros(shape) for shape in SHAPES]
    powersgd = gradpress.PowerSGD(params, gradpress.Config(rank=1, start_compressing_after_num_steps=2,
                                                           warm_up_bytes_per_weight=2), init_sync=False)
    grads = _gradients(rank)
    powersgd.aggregate_(grads)
    return grads, powersgd.total_bytes_sent, powersgd.total_floats_sent


def test_the_aggregator_warm_up_takes_the_same_wire():
    results = run(_aggregator_warm_up, 2)
    oracle = _fp16_mean([_gradients(rank) for rank in range(2)])
    numel = sum(torch.Size(s).numel() for s in SHAPES)
    for grads, sent_bytes, sent_floats in results:
        for got, want, magnitude in zip(grads, oracle, MAGNITUDES):
            torch.testing.assert_close(got, want, rtol=1e-3, atol=1e-3 * magnitude)
        assert (sent_bytes, sent_floats) == (2 * numel, numel)


@pytest.mark.parametrize("value", [4, 1, True, "2", 2.5])
def test_other_values_are_refused_naming_the_argument(value):
    with pytest.raises(ValueError, match=r"warm_up_bytes_per_weight must be None .* or 2"):
        gradpress.PowerSGDState(None, start_powerSGD_iter=2, warm_up_bytes_per_weight=value)
    with pytest.raises(ValueError, match="warm_up_bytes_per_weight"):
        gradpress.Config(rank=1, warm_up_bytes_per_weight=value)


def test_bf16_gradients_take_the_bf16_wire():
    config = gradpress.powersgd.EngineConfig(warm_up_bytes_per_weight=2)
    assert config.warm_up_wire_dtype(torch.bfloat16) == torch.bfloat16
    assert config.warm_up_wire_dtype(torch.float32) == torch.float16
    assert gradpress.powersgd.EngineConfig().warm_up_wire_dtype(torch.float32) == torch.float32


#: A gradient at 1e-8 beside one at 1e3 in one bucket: one scale per bucket would leave it ~6% off (and
#: flush one at 1e-9 to zero); one per gradient keeps fp16's precision.
TINY_MAGNITUDES = [1e3, 1.0, 1e-8]


def _tiny_warm_up_step(rank: int, world: int, order: list[int]):
    """One warm-up iteration on the fp16 wire, the gradients in one bucket in ``order``."""
    generator = torch.Generator().manual_seed(10 + rank)
    grads = [torch.randn(shape, generator=generator, dtype=torch.float64).float() * m
             for shape, m in zip(SHAPES, TINY_MAGNITUDES)]
    state = gradpress.PowerSGDState(None, matrix_approximation_rank=1, start_powerSGD_iter=3,
                                    warm_up_bytes_per_weight=2)
    params = [torch.zeros(SHAPES[i]) for i in order]
    bucket = DenseBucket(0, True, params, torch.cat([grads[i].reshape(-1) for i in order]))
    result = gradpress.powerSGD_hook(state, bucket).wait()
    pieces = result.split([grads[i].numel() for i in order])
    out = [None] * len(SHAPES)
    for i, piece in zip(order, pieces):
        out[i] = piece.view(SHAPES[i]).clone()
    return out, grads


@pytest.mark.slow
def test_the_ddp_warm_up_scales_each_gradient_bitwise_as_the_per_tensor_oracle_in_any_bucket_order():
    """DDP hands the hook whole buckets: each gradient must still get its own scale, so a 1e-8 gradient
    beside a 1e3 one keeps fp16's precision, and the numbers do not depend on the bucket's layout (DDP's
    first iteration after a restart has another): bitwise equal to the per-tensor oracle in both orders."""
    for order in ([0, 1, 2], [2, 0, 1]):
        results = run(_tiny_warm_up_step, 2, order)
        per_rank = [grads for _, grads in results]
        parts = [[g.double() / 2 for g in grads] for grads in per_rank]
        for i in range(len(SHAPES)):
            peak = max(float(p[i].abs().max()) for p in parts)
            scale = 2.0 ** (torch.tensor(2 * peak).log2().ceil().item() - 14)
            want = ((sum((p[i] / scale).half().double() for p in parts)).half().double() * scale).float()
            for averaged, _ in results:
                assert torch.equal(averaged[i], want), (order, i)
        tiny = torch.stack([g[2] for g in per_rank]).mean(0)
        assert (results[0][0][2] - tiny).abs().max() <= 1e-3 * tiny.abs().max()


class _SameSizeBuckets(torch.nn.Module):
    """Four equal 64 x 64 weights with magnitudes 1e2 .. 1e-7: with a 16 KiB bucket cap each is its own
    bucket, all of one size (so buckets whose wires share a size are in flight together)."""

    def __init__(self) -> None:
        super().__init__()
        self.weights = torch.nn.ParameterList(torch.nn.Parameter(torch.zeros(64, 64)) for _ in range(4))

    def forward(self, inputs: list[torch.Tensor]) -> torch.Tensor:
        return sum((w * x).sum() for w, x in zip(self.weights, inputs))


def _ddp_warm_up(rank: int, world: int, iterations: int):
    """``iterations`` warm-up iterations of a real DDP model on the fp16 warm-up wire, then one compressed:
    the warm-up's averaged gradients and this rank's gradients of each, and the wire buffers kept after
    each iteration."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = DDP(_SameSizeBuckets(), bucket_cap_mb=16 / 1024)
    state = gradpress.PowerSGDState(None, matrix_approximation_rank=1, start_powerSGD_iter=iterations,
                                    warm_up_bytes_per_weight=2)
    model.register_comm_hook(state, gradpress.powerSGD_hook)
    generator = torch.Generator().manual_seed(100 + rank)
    out, wires = [], []
    for _ in range(iterations + 1):   # the last one compresses
        inputs = [torch.randn(64, 64, generator=generator) * 10.0 ** (2 - 3 * i) for i in range(4)]
        model(inputs).backward()   # the gradient of each weight is its input
        out.append(([w.grad.clone() for w in model.module.weights], inputs))
        wires.append(len(state._session._wires))
        model.zero_grad(set_to_none=False)
    return out[:iterations], wires


@pytest.mark.slow
def test_ddp_reuses_its_cpu_wire_buffers_and_every_iteration_is_the_per_tensor_oracle():
    """On the CPU the warm-up keeps one wire buffer per DDP bucket across iterations (fresh pages cost a
    quarter of its time). Buckets of one size are in flight together, DDP lays its buckets out anew
    after its first iteration: every iteration must still be the per-tensor oracle, bit for bit."""
    results = run(_ddp_warm_up, 2, 4)
    for step in range(4):
        per_rank = [results[rank][0][step][1] for rank in range(2)]
        for i in range(4):
            parts = [grads[i].double() / 2 for grads in per_rank]
            peak = max(float(p.abs().max()) for p in parts)
            scale = 2.0 ** (torch.tensor(2 * peak).log2().ceil().item() - 14)
            want = ((sum((p / scale).half().double() for p in parts)).half().double() * scale).float()
            for rank in range(2):
                assert torch.equal(results[rank][0][step][0][i], want), (step, i)
    for _, wires in results:   # one per bucket (DDP's first iteration has one bucket of all four), kept
        assert wires == [1, 4, 4, 0, 0]   # through the warm-up; dropped when compression starts

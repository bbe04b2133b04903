"""A resume across a new DDP model ends bitwise where an uninterrupted run ends, whatever the wire, when
the model spans several DDP buckets.

DDP sends every gradient in one bucket on the first iteration after it is built, then rebuilds its
buckets in the order gradients become ready. So a resumed run's first iteration groups the gradients
differently from the uninterrupted run's same iteration: whatever the hook computes must not depend on
which tensors share a bucket. For the fp16 wire, whose scale is agreed by a max over what is sent, that
means a scale per tensor, not per bucket.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from distributed import run

WORLD = 2
STEPS, STOP = 8, 4


class _Gate(nn.Module):
    """``x * (1 + 1e-6 w)``: a parameter whose gradient is a millionth of its neighbours'."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.zeros(width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * (1 + 1e-6 * self.w)


class _Damp(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return 1e-4 * x


def _model() -> nn.Module:
    """Gradients spanning ten orders of magnitude across the model (the key part of an attention bias has
    such a gradient): the gate's is 1e-6 of the first layer's and 1e-10 of the last layers'. The first
    layers and the last ones end up in different buckets once DDP rebuilds them."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 96), _Gate(96), nn.Tanh(), _Damp(), nn.Linear(96, 96), nn.Tanh(),
                         nn.Linear(96, 8))


def _train(rank: int, world_size: int, bytes_per_weight: int, stop: int | None, each_bucket: bool = False) -> dict:
    from torch.nn.parallel import DistributedDataParallel as DDP

    import gradpress

    def build():
        ddp = DDP(_model(), bucket_cap_mb=0.02)
        state = gradpress.PowerSGDState(None, matrix_approximation_rank=2, start_powerSGD_iter=2,
                                        bytes_per_weight=bytes_per_weight)
        if each_bucket:  # what FSDP and the interleaved ZeRO step set: a segment and a commit per bucket
            state.commit_each_bucket()
        buckets = []

        def hook(state, bucket):
            buckets.append(bucket.index())
            return gradpress.powerSGD_hook(state, bucket)

        ddp.register_comm_hook(state, hook)
        return ddp, torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9), state, buckets

    ddp, optimizer, state, buckets = build()
    layouts = []
    for step in range(STEPS):
        if step == stop:  # stop, then resume in a new DDP model from what a checkpoint would hold
            saved = {"model": ddp.module.state_dict(), "optimizer": optimizer.state_dict(),
                     "hooks": state.state_dict()}
            ddp, optimizer, state, buckets = build()
            ddp.module.load_state_dict(saved["model"])
            optimizer.load_state_dict(saved["optimizer"])
            state.load_state_dict(saved["hooks"])
        generator = torch.Generator().manual_seed(100 * step + rank)  # batches depend on the step only
        x = torch.randn(16, 32, generator=generator)
        buckets.clear()
        ddp(x).square().mean().backward()
        layouts.append(len(buckets))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return {"params": [p.detach().clone() for p in ddp.module.parameters()], "buckets": layouts}


@pytest.mark.parametrize("bytes_per_weight, each_bucket", [(4, False), (2, False), (4, True), (2, True)],
                         ids=["fp32", "fp16", "fp32-each-bucket", "fp16-each-bucket"])
def test_resume_in_a_new_ddp_model_is_bitwise_over_several_buckets(bytes_per_weight, each_bucket):
    # With each bucket its own segment, the resumed run's first iteration groups the matrices otherwise
    # (DDP's one bucket): every factor sits on its own aligned line of the wire, so no product rounds
    # by where its operands sit (gradpress.powersgd.layout).
    whole = run(_train, WORLD, bytes_per_weight, None, each_bucket)
    resumed = run(_train, WORLD, bytes_per_weight, STOP, each_bucket)
    # The premise: several buckets, and one on the first iteration of each DDP model.
    assert whole[0]["buckets"][0] == 1 and min(whole[0]["buckets"][1:]) >= 2
    assert resumed[0]["buckets"][STOP] == 1
    for a, b in zip(whole, resumed):
        assert all(torch.equal(x, y) for x, y in zip(a["params"], b["params"]))


# --- the fp16 wire: a tensor's numbers do not depend on its companions in the buffer -------------------------

#: Distinct shapes (no two matrices batched together, whose order in the batch would matter), each with the
#: magnitude of its gradients: two matrices and two vectors of ~1, and of ~1e-10 (fp16 subnormals next to
#: the large ones under one shared scale, normal numbers under a scale of their own).
SPLIT_SHAPES = [((24, 16), 1.0), ((20, 12), 1e-10), ((16,), 1.0), ((12,), 1e-10), ((6, 4, 3), 1e-3)]
TOGETHER = [[0, 1, 2, 3, 4]]
APART = [[0, 2, 4], [1, 3]]  # the large tensors in one buffer, the small ones in another


def _split_gradients(step: int, rank: int) -> list:
    generator = torch.Generator().manual_seed(10 * step + rank)
    return [scale * torch.randn(shape, generator=generator) for shape, scale in SPLIT_SHAPES]


def _average_in_segments(rank: int, world_size: int, parts: list, bytes_per_weight: int,
                         num_iters: int | None) -> list:
    """Three compressed steps on the tensors of :data:`SPLIT_SHAPES` (each keeping its parameter key, so its
    seeded factors do not depend on the split), one segment per part, on every rank; the outputs."""
    from gradpress.comm import ProcessGroupCommunicator
    from gradpress.powersgd import EngineConfig, Segment, make_plan
    from gradpress.powersgd.step import compress_step

    config = EngineConfig(rank=2, min_compression_rate=0, bytes_per_weight=bytes_per_weight,
                          num_iters_per_step=num_iters, random_seed=5)
    comm = ProcessGroupCommunicator()
    segments = [Segment(make_plan([SPLIT_SHAPES[i][0] for i in part], config.rank, config.min_compression_rate),
                        part, torch.device("cpu"), torch.float32) for part in parts]
    outputs = []
    for step in range(3):
        grads = _split_gradients(step, rank)
        for segment, part in zip(segments, parts):
            task, _ = compress_step(segment, [grads[i] for i in part], comm, config, step)
            for handle in task:
                handle.wait()
        outputs.append(grads)
    return outputs


@pytest.mark.parametrize("bytes_per_weight, num_iters", [(4, None), (2, None), (2, 2)],
                         ids=["fp32-wire", "fp16-wire", "fp16-wire-two-iterations"])
def test_a_tensors_average_does_not_depend_on_what_shares_its_buffer(bytes_per_weight, num_iters):
    together = run(_average_in_segments, WORLD, TOGETHER, bytes_per_weight, num_iters)
    apart = run(_average_in_segments, WORLD, APART, bytes_per_weight, num_iters)
    for rank_together, rank_apart in zip(together, apart):
        for step_together, step_apart in zip(rank_together, rank_apart):
            for i, (a, b) in enumerate(zip(step_together, step_apart)):
                assert torch.equal(a, b), f"tensor {i} ({SPLIT_SHAPES[i][0]}): max difference {(a - b).abs().max()}"
    # The small vector is averaged exactly but for the wire's rounding: fp16's relative precision, as the
    # large one's (a scale shared with the large tensors left it a handful of subnormal bits).
    for index in (2, 3):
        exact = sum(_split_gradients(2, rank)[index].double() for rank in range(WORLD)) / WORLD
        error = (together[0][2][index] - exact).abs().max() / exact.abs().max()
        assert error <= 2 ** -11, f"tensor {index}: relative error {error:.1e}"

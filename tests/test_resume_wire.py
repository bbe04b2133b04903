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


def _train(rank: int, world_size: int, bytes_per_weight: int, stop: int | None) -> dict:
    from torch.nn.parallel import DistributedDataParallel as DDP

    import gradpress

    def build():
        ddp = DDP(_model(), bucket_cap_mb=0.02)
        state = gradpress.PowerSGDState(None, matrix_approximation_rank=2, start_powerSGD_iter=2,
                                        bytes_per_weight=bytes_per_weight)
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


@pytest.mark.parametrize("bytes_per_weight", [
    4,
    pytest.param(2, marks=pytest.mark.xfail(
        strict=True, reason="the fp16 wire's scale is one per phase buffer (per bucket), so the first iteration "
                            "after DDP is built, which sends one bucket, rounds differently")),
])
def test_resume_in_a_new_ddp_model_is_bitwise_over_several_buckets(bytes_per_weight):
    whole = run(_train, WORLD, bytes_per_weight, None)
    resumed = run(_train, WORLD, bytes_per_weight, STOP)
    # The premise: several buckets, and one on the first iteration of each DDP model.
    assert whole[0]["buckets"][0] == 1 and min(whole[0]["buckets"][1:]) >= 2
    assert resumed[0]["buckets"][STOP] == 1
    for a, b in zip(whole, resumed):
        assert all(torch.equal(x, y) for x, y in zip(a["params"], b["params"]))

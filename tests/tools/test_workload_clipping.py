"""Gradient clipping in the demo's training loop (``DemoConfig.clip_grad_norm``), before or after the hook.

Oracle: ``torch.nn.utils.clip_grad_norm_`` on each worker's own gradient (before) or on the mean (after),
computed without DDP, against what DDP hands the optimizer.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

from distributed import run
from gradpress.hooks import allreduce_hook
from gradpress.tools.workloads import training
from gradpress.tools.workloads.config import DemoConfig

MAX_NORM = 4.0


def _model() -> nn.Module:
    torch.manual_seed(0)
    # 2.9 MB of fp32 parameters, the last layers' 1.47 MB over DDP's default first bucket (1 MB): by default
    # two buckets.
    return nn.Sequential(nn.Linear(600, 600), nn.Tanh(), nn.Linear(600, 600), nn.Tanh(), nn.Linear(600, 10))


def _local_batch(rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(10 + rank)
    # Rank 1's inputs are 100x larger: one worker's gradient is clipped, the other's not.
    features = torch.randn(8, 600, generator=generator) * (0.1 + 9.9 * rank)
    return features, torch.randint(0, 10, (8,), generator=generator)


def _grads(model: nn.Module) -> list[torch.Tensor]:
    return [p.grad.detach().clone() for p in model.parameters()]


def _clipping(rank: int, world_size: int, before: bool) -> tuple[float, float]:
    x, y = _local_batch(rank)
    # The oracle, without DDP: this worker's gradient, clipped or not, then the mean over workers.
    reference = _model()
    nn.functional.cross_entropy(reference(x), y).backward()
    local_norm = float(torch.linalg.vector_norm(torch.cat([g.flatten() for g in _grads(reference)])))
    if before:
        torch.nn.utils.clip_grad_norm_(reference.parameters(), MAX_NORM)
    expected = _grads(reference)
    for g in expected:
        dist.all_reduce(g)
        g /= world_size
    mean_norm = float(torch.linalg.vector_norm(torch.cat([g.flatten() for g in expected])))
    if not before:
        norm = torch.linalg.vector_norm(torch.cat([g.flatten() for g in expected]))
        for g in expected:
            g *= torch.clamp(MAX_NORM / (norm + 1e-6), max=1.0)

    model = _model()
    config = DemoConfig(clip_grad_norm=MAX_NORM, clip_before_averaging=before)
    buckets: list[int] = []

    def averaging(state, bucket):  # type: ignore[no-untyped-def]
        buckets.append(bucket.index())
        return allreduce_hook(state, bucket)

    # The training loop's own wiring and clipping step.
    ddp, _ = training._data_parallel(model, (None, averaging), config, torch.device("cpu"))
    for _ in range(2):  # the second step runs on the buckets DDP rebuilt after the first
        ddp.zero_grad(set_to_none=True)
        nn.functional.cross_entropy(ddp(x), y).backward()
        training._clip_averaged_gradient(ddp, config)
        for got, want in zip(_grads(model), expected):
            # Float rounding differs between DDP's flat bucket and separate tensors; a missing or wrong
            # clip would be off by the clip factor.
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * float(want.abs().max()))
    # Clipping before averaging puts the model in one bucket, so the norm is the whole gradient's; by
    # default DDP splits this model (once it rebuilds its buckets after the first step).
    assert (set(buckets) == {0}) if before else (max(buckets) >= 1), buckets
    return local_norm, mean_norm


@pytest.mark.parametrize("before", [True, False])
def test_ddp_gradient_is_the_mean_of_clipped_local_gradients_or_the_clipped_mean(before: bool) -> None:
    (local_0, mean_norm), (local_1, _) = run(_clipping, 2, before)
    # The test means something only if one worker's gradient is over the norm and the other's not, and,
    # clipping after averaging, if their mean is over it too.
    assert min(local_0, local_1) < MAX_NORM < max(local_0, local_1) and (before or mean_norm > MAX_NORM)


def test_the_local_clip_scales_as_torch_does_and_leaves_small_gradients_alone() -> None:
    from gradpress.hooks.bucket import DenseBucket

    seen = []
    hook = training._clip_local_gradient(lambda state, bucket: seen.append(bucket.buffer().clone()), 1.0)
    params = [torch.zeros(3, 4), torch.zeros(5)]
    for scale in (10.0, 0.01):
        gradient = torch.randn(17, generator=torch.Generator().manual_seed(3)) * scale
        hook(None, DenseBucket(0, True, params, gradient.clone()))
        expected = gradient.clone().requires_grad_()
        expected.grad = gradient.clone()
        torch.nn.utils.clip_grad_norm_([expected], 1.0)
        torch.testing.assert_close(seen[-1], expected.grad)
    assert torch.equal(seen[-1], torch.randn(17, generator=torch.Generator().manual_seed(3)) * 0.01)


@pytest.mark.parametrize("kwargs, message", [
    ({"clip_grad_norm": 0.0}, "clip_grad_norm must be a number > 0 or None, got 0.0"),
    ({"clip_grad_norm": -1}, "clip_grad_norm must be a number > 0 or None, got -1"),
    ({"clip_grad_norm": "1"}, "clip_grad_norm must be a number > 0 or None, got '1'"),
    ({"clip_grad_norm": True}, "clip_grad_norm must be a number > 0 or None, got True"),
    ({"clip_before_averaging": True}, "clip_before_averaging=True needs clip_grad_norm"),
])
def test_bad_clipping_settings_are_clear_errors(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        DemoConfig(**kwargs)


def test_checkpoints_written_before_the_clipping_fields_still_resume() -> None:
    config = DemoConfig(task="charlm", steps=10)
    identity = {"method": "allreduce", "world_size": 2, "config": training._resumable(config)}
    older = {**identity, "config": {k: v for k, v in identity["config"].items() if not k.startswith("clip_")}}
    training._check_identity(older, identity, "old.pt")  # no error: it ran without clipping
    clipped = {"method": "allreduce", "world_size": 2,
               "config": training._resumable(DemoConfig(task="charlm", steps=10, clip_grad_norm=1.0))}
    with pytest.raises(ValueError, match=r"clip_grad_norm=None \(now 1.0\)"):
        training._check_identity(older, clipped, "old.pt")

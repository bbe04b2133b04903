"""PostLocalSGDOptimizer as the optimizer a training script hands around: LR schedulers built on it keep
driving the inner optimizer after a resume (``load_state_dict`` and a DCP load), and rank 0's checkpoint
loads on every rank unless it holds per-rank state that would be lost there (2 gloo ranks)."""

from __future__ import annotations

import math
import os

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from distributed import run
from gradpress import (Config, OuterOptimizerAverager, PeriodicModelAverager, PostLocalSGDOptimizer, QuantizeInt4,
                       QuantizeInt8, StreamingDiLoCoAverager)

STEPS = 12
SPLIT = 8  # between two syncs (every 3rd step from step 0)


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 1))


def _batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * step + rank)  # batches depend on the step alone
    x = torch.randn(8, 4, generator=g)
    return x, x.sum(1, keepdim=True).sin()


SCHEDULERS = {
    "lambda": lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, lambda epoch: 0.8 ** epoch),
    "cosine": lambda opt: torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=STEPS, eta_min=1e-4),
}


def _make(scheduler: str):
    model = _model()
    averager = OuterOptimizerAverager(period=3, outer_lr=0.7, outer_momentum=0.5)
    # A generator of parameters, as users pass them; AdamW's moments and LR are what a resume must keep.
    optimizer = PostLocalSGDOptimizer(torch.optim.AdamW(model.parameters(), lr=0.05), averager)
    return model, optimizer, SCHEDULERS[scheduler](optimizer)


def _train(rank, model, optimizer, scheduler, steps) -> list[float]:
    lrs = []
    for step in steps:
        optimizer.zero_grad()
        nn.functional.mse_loss(model(_batch(rank, step)[0]), _batch(rank, step)[1]).backward()
        optimizer.step()
        scheduler.step()
        lrs.append(optimizer.optim.param_groups[0]["lr"])  # what the inner AdamW steps with next
    return lrs


def scheduled_resume(rank, world, scheduler, via, path):
    model, optimizer, sched = _make(scheduler)
    want_lrs = _train(rank, model, optimizer, sched, range(STEPS))
    want = [p.detach().clone() for p in model.parameters()]

    model, optimizer, sched = _make(scheduler)
    lrs = _train(rank, model, optimizer, sched, range(SPLIT))
    if via == "load_state_dict":
        saved = {"model": model.state_dict(), "optim": optimizer.state_dict(), "sched": sched.state_dict()}
        model, optimizer, sched = _make(scheduler)  # fresh objects, a fresh scheduler on the fresh wrapper
        model.load_state_dict(saved["model"])
        optimizer.load_state_dict(saved["optim"])
        sched.load_state_dict(saved["sched"])
    else:
        import torch.distributed.checkpoint as dcp

        from gradpress.checkpoint import dcp_stateful

        dcp.save({"model": model.state_dict(), "optim": optimizer, "sched": sched}, checkpoint_id=path)
        model, optimizer, sched = _make(scheduler)
        state = {"model": model.state_dict(), "optim": dcp_stateful(optimizer, "raise"), "sched": sched}
        dcp.load(state, checkpoint_id=path)
        model.load_state_dict(state["model"])
    shared = optimizer.param_groups is optimizer.optim.param_groups
    lrs += _train(rank, model, optimizer, sched, range(SPLIT, STEPS))
    same = all(torch.equal(a, b) for a, b in zip(want, model.parameters()))
    return shared, same, lrs == want_lrs


@pytest.mark.parametrize("scheduler", list(SCHEDULERS))
@pytest.mark.parametrize("via", ["load_state_dict", "dcp"])
def test_a_scheduler_on_the_wrapper_drives_the_inner_optimizer_after_a_resume_bitwise(tmp_path, scheduler, via):
    for rank, (shared, same, lrs) in enumerate(run(scheduled_resume, 2, scheduler, via, str(tmp_path / "ckpt"))):
        assert shared, (rank, "wrapper.param_groups is not the inner optimizer's after the load")
        assert lrs, (rank, "the inner optimizer's learning rate differs from the uninterrupted run's")
        assert same, (rank, "the resumed run's parameters differ from the uninterrupted run's")


def test_the_wrapper_shares_the_inner_optimizers_groups_and_defaults():
    model = _model()
    inner = torch.optim.AdamW(model.parameters(), lr=0.05)
    optimizer = PostLocalSGDOptimizer(inner, PeriodicModelAverager(2, warmup_steps=100))
    optimizer.load_state_dict(optimizer.state_dict())
    assert optimizer.param_groups is inner.param_groups and optimizer.defaults is inner.defaults
    optimizer.add_param_group({"params": [nn.Parameter(torch.zeros(2))], "lr": 0.5})
    assert optimizer.param_groups is inner.param_groups and len(inner.param_groups) == 2

"""PostLocalSGDOptimizer as the optimizer a training script hands around: LR schedulers built on it keep
driving the inner optimizer after a resume (``load_state_dict`` and a DCP load), and rank 0's checkpoint
loads on every rank unless it holds per-rank state that would be lost there (2 gloo ranks)."""

from __future__ import annotations


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


# --- rank 0's checkpoint, loaded on every rank ------------------------------------------------------------

AVERAGERS = {  # PyTorch's test_post_localSGD_optimizer_step_reload: period 4, warm-up 10, 20 steps
    "periodic": lambda: PeriodicModelAverager(period=4, warmup_steps=10),
    "diloco": lambda: OuterOptimizerAverager(4, warmup_steps=10, outer_momentum=0.5),
    "streaming, an update in flight": lambda: StreamingDiLoCoAverager(4, warmup_steps=10, num_fragments=2,
                                                                      fragment_sync_delay=2, outer_momentum=0.5),
    # Per rank: what rank 1 would take from rank 0's file is rank 0's error feedback.
    "diloco-int8": lambda: OuterOptimizerAverager(4, warmup_steps=10, compression=QuantizeInt8(chunk_size=8)),
    "diloco-powersgd": lambda: OuterOptimizerAverager(4, warmup_steps=10, compression=Config(
        rank=1, start_compressing_after_num_steps=0, min_compression_rate=0)),
    "streaming-int4": lambda: StreamingDiLoCoAverager(4, warmup_steps=10, num_fragments=2,
                                                      compression=QuantizeInt4(chunk_size=8)),
}
PER_RANK = {"diloco-int8": "residual", "diloco-powersgd": "PowerSGD", "streaming-int4": "residual"}


def rank0_checkpoint(rank, world, kind, path):
    def make():
        model = DDP(_model())
        return model, PostLocalSGDOptimizer(torch.optim.SGD(model.parameters(), lr=0.03, momentum=0.5),
                                            AVERAGERS[kind]())

    def train(model, optimizer, steps):
        for step in steps:
            optimizer.zero_grad()
            x, y = _batch(rank, step)
            nn.functional.mse_loss(model(x), y).backward()
            optimizer.step()

    model, optimizer = make()
    train(model, optimizer, range(24))
    want = [p.detach().clone() for p in model.parameters()]
    model, optimizer = make()
    train(model, optimizer, range(20))
    in_flight = bool(getattr(optimizer.averager, "in_flight", []))
    if rank == 0:
        torch.save({"model": model.state_dict(), "optimizer_state_dict": optimizer.state_dict()}, path)
    dist.barrier()
    checkpoint = torch.load(path, weights_only=True)
    model, optimizer = make()
    model.load_state_dict(checkpoint["model"])
    try:
        optimizer.load_state_dict(checkpoint["optimizer_state_dict"])
    except ValueError as error:
        refused = str(error)
    else:
        refused = None
    anyone = torch.tensor([refused is not None], dtype=torch.int64)
    dist.all_reduce(anyone)  # DDP trains on together only if every rank loaded
    if anyone.item():
        return refused, None, in_flight
    step = optimizer.averager.step
    train(model, optimizer, range(20, 24))
    return None, (step, all(torch.equal(a, b) for a, b in zip(want, model.parameters()))), in_flight


@pytest.mark.parametrize("kind", list(AVERAGERS))
def test_rank_0s_checkpoint_loads_everywhere_unless_it_holds_per_rank_state(tmp_path, kind):
    results = run(rank0_checkpoint, 2, kind, str(tmp_path / "rank0.pt"))
    assert results[0][0] is None  # rank 0 loads its own
    refused, resumed, in_flight = results[1]
    assert in_flight == (kind == "streaming, an update in flight")
    if kind in PER_RANK:
        assert refused is not None and "saved with rank=0 but this process has rank=1" in refused, refused
        assert PER_RANK[kind] in refused and "allow_other_rank=True" in refused, refused
    else:  # DDP keeps the ranks identical: rank 0's state is every rank's, and the resume is bitwise
        assert refused is None, refused
        assert results[0][1] == resumed == (20, True)

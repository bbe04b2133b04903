"""What a refused checkpoint says. Another world size: both ways to go on without the per-rank state, each
valid where it applies (``load_state_dict(..., on_world_size_change='fresh')``; ``dcp.load`` has no such
argument: ``dcp_stateful(obj, 'fresh')``), and each works as told. Another averager type or fragment
count: what the checkpoint holds against what this averager is, raised before anything loads (through
DCP, before DCP's own "Missing key"), for ``load_state_dict`` and a DCP load alike."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.distributed as dist
from torch import nn

from distributed import run
from gradpress import (OuterOptimizerAverager, PeriodicModelAverager, PostLocalSGDOptimizer, QuantizeInt8,
                       StreamingDiLoCoAverager)


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))


def _train(model, optimizer, rank, steps=3):
    for step in range(steps):
        optimizer.zero_grad()
        model(torch.full((2, 3), float(rank + step))).square().sum().backward()
        optimizer.step()


def save_diloco_int8(rank, world, path):
    import torch.distributed.checkpoint as dcp

    model = _model()
    optimizer = PostLocalSGDOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                      OuterOptimizerAverager(2, compression=QuantizeInt8(chunk_size=4)))
    _train(model, optimizer, rank)
    torch.save(optimizer.state_dict(), f"{path}.rank{rank}.pt")
    dcp.save({"optim": optimizer}, checkpoint_id=f"{path}.dcp")


def _fresh_diloco_int8():
    model = _model()
    return PostLocalSGDOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                 OuterOptimizerAverager(2, compression=QuantizeInt8(chunk_size=4)))


def test_another_world_size_gives_both_ways_on_and_each_works(tmp_path):
    import torch.distributed.checkpoint as dcp

    from gradpress.checkpoint import dcp_stateful

    assert not dist.is_initialized()  # this process: one rank, no process group
    path = str(tmp_path / "ckpt")
    run(save_diloco_int8, 2, path)
    saved = torch.load(f"{path}.rank0.pt", weights_only=True)
    optimizer = _fresh_diloco_int8()
    with pytest.raises(ValueError) as refused:
        optimizer.load_state_dict(saved)
    message = str(refused.value)
    assert "saved by 2 ranks, this run has 1" in message, message
    assert "load_state_dict(state, on_world_size_change='fresh')" in message, message
    assert "dcp.load({key: gradpress.checkpoint.dcp_stateful(obj, 'fresh')}" in message, message
    optimizer.load_state_dict(saved, on_world_size_change="fresh")  # the first way, as the message says
    assert optimizer.averager.step == 3 and optimizer.averager.anchored
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # DCP: "torch.distributed is disabled ... load in a single process"
        optimizer = _fresh_diloco_int8()
        with pytest.raises(ValueError) as refused:
            dcp.load({"optim": optimizer}, checkpoint_id=f"{path}.dcp")
        message = str(refused.value)
        # Inside dcp.load, the message names the key being loaded in the way that applies there.
        assert "dcp.load({'optim': gradpress.checkpoint.dcp_stateful(obj, 'fresh')}" in message, message
        assert "on_world_size_change" in message, message
        optimizer = _fresh_diloco_int8()
        dcp.load({"optim": dcp_stateful(optimizer, "fresh")}, checkpoint_id=f"{path}.dcp")  # the second way
    assert optimizer.averager.step == 3 and optimizer.averager.anchored


AVERAGERS = {
    "streaming, 2 fragments": lambda: StreamingDiLoCoAverager(4, num_fragments=2),
    "streaming, 3 fragments": lambda: StreamingDiLoCoAverager(4, num_fragments=3),
    "diloco": lambda: OuterOptimizerAverager(2),
    "periodic": lambda: PeriodicModelAverager(2),
}
SAVED_AS = {"streaming, 2 fragments": "a StreamingDiLoCoAverager with 2 fragments",
            "streaming, 3 fragments": "a StreamingDiLoCoAverager with 3 fragments",
            "diloco": "an OuterOptimizerAverager", "periodic": "a PeriodicModelAverager"}


def another_kind(rank, world, path, saved_kind):
    """Save ``saved_kind``'s optimizer (DCP and torch.save), load it into every other kind both ways."""
    import torch.distributed.checkpoint as dcp

    def make(kind):
        model = _model()
        return PostLocalSGDOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), AVERAGERS[kind]())

    model = _model()
    optimizer = PostLocalSGDOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), AVERAGERS[saved_kind]())
    _train(model, optimizer, rank)
    dcp.save({"optim": optimizer}, checkpoint_id=path)
    plain = optimizer.state_dict()
    out = {}
    for kind in AVERAGERS:
        if kind == saved_kind:
            continue
        for via in ("load_state_dict", "dcp"):
            fresh = make(kind)
            try:
                if via == "dcp":
                    dcp.load({"optim": fresh}, checkpoint_id=path)
                else:
                    fresh.load_state_dict(plain)
                out[kind, via] = None
            except BaseException as error:  # noqa: BLE001  (DCP raises a BaseException; the test reads it)
                out[kind, via] = (type(error).__name__, str(error), fresh.averager.step)
    return out


@pytest.mark.parametrize("saved_kind", ["streaming, 2 fragments", "diloco"])
def test_another_averager_or_fragment_count_says_what_differs_before_loading_anything(tmp_path, saved_kind):
    for results in run(another_kind, 2, str(tmp_path / "ckpt"), saved_kind):
        for (kind, via), refused in results.items():
            assert refused is not None, (kind, via, "loaded without a word")
            name, message, step = refused
            assert name == "ValueError", (kind, via, name, message)
            assert f"holds the state of {SAVED_AS[saved_kind]}, this is {SAVED_AS[kind]}" in message, \
                (kind, via, message)
            assert step == 0, (kind, via, "something loaded before the refusal")

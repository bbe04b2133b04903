"""ZeRO step overlapped with DDP communication (gloo, CPU; 2 and 3 ranks so that the shards are uneven).

Oracle: DDP + the same optimizer (plain ``torch.optim``, every parameter, ``step()`` after backward) on
the same data. Every rank sees different data, so the reduction matters and a shard that is not
broadcast, or stepped from unreduced gradients, shows up at once.
"""

from __future__ import annotations

import io
import warnings

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks as torch_hooks
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn.parallel import DistributedDataParallel as DDP

from distributed import run
from gradpress import (PowerSGDState, allreduce_hook, fp16_compress_hook, hook_with_zero_step,
                       hook_with_zero_step_interleaved, powerSGD_hook)

# Buckets of at most ~2 kB: the model below spreads over several buckets, of different sizes.
BUCKET_CAP_MB = 0.002
TEACHER = torch.randn(12, 5, generator=torch.Generator().manual_seed(7)) / 2
OPTIMIZERS = {"sgd": (torch.optim.SGD, {"lr": 0.05, "momentum": 0.9}),
              "adam": (torch.optim.Adam, {"lr": 0.01})}


def _model() -> nn.Module:
    torch.manual_seed(0)  # identical start on every rank
    return nn.Sequential(nn.Linear(12, 40), nn.Tanh(), nn.Linear(40, 30), nn.Tanh(), nn.Linear(30, 20),
                         nn.Tanh(), nn.Linear(20, 5))


def _batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)  # different on every rank and step
    x = torch.randn(16, 12, generator=g)
    return x, torch.tanh(x @ TEACHER)  # a target the model can learn


def _hook_and_state(kind: str):
    if kind == "ours":
        return None, allreduce_hook
    if kind == "torch":
        return None, torch_hooks.allreduce_hook
    if kind == "fp16":
        return None, fp16_compress_hook
    if kind.startswith("powersgd"):
        rank = 40 if kind == "powersgd_full" else 1  # 40 >= every matrix's smaller side: exact
        return PowerSGDState(None, matrix_approximation_rank=rank, start_powerSGD_iter=2,
                             min_compression_rate=0, use_error_feedback=True, warm_start=True), powerSGD_hook
    raise ValueError(kind)


def _overlapped(kind: str, optimizer: str, interleaved: bool, shard: bool):
    ddp = DDP(_model(), bucket_cap_mb=BUCKET_CAP_MB)
    cls, kwargs = OPTIMIZERS[optimizer]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # torch's functional optimizers (TorchScript)
        zero = ZeroRedundancyOptimizer(ddp.parameters(), cls, overlap_with_ddp=True, **kwargs)
    wrap = hook_with_zero_step_interleaved if interleaved else hook_with_zero_step
    state, hook = _hook_and_state(kind)
    zero_hook = wrap(hook, ddp, zero, shard_buckets=shard)
    ddp.register_comm_hook(state, zero_hook)
    return ddp, zero, zero_hook


def _train(ddp: DDP, rank: int, steps: range, optimizer: torch.optim.Optimizer | None = None,
           lr_groups: list[dict] | None = None) -> list[float]:
    """``lr_groups``: param groups whose ``lr`` is halved before step 3 (a scheduler's doing)."""
    losses = []
    for step in steps:
        if step == 3 and lr_groups is not None:
            for group in lr_groups:
                group["lr"] *= 0.5
        x, y = _batch(rank, step)
        loss = nn.functional.mse_loss(ddp(x), y)
        loss.backward()
        if optimizer is not None:
            optimizer.step()
        ddp.zero_grad(set_to_none=False)
        losses.append(loss.item())
    return losses


def _flat(module: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in module.parameters()])


def equivalence(rank: int, world: int, kind: str, optimizer: str, interleaved: bool, shard: bool):
    steps = range(6)
    ddp, zero, zero_hook = _overlapped(kind, optimizer, interleaved, shard)
    _train(ddp, rank, steps, lr_groups=zero.param_groups)

    reference = DDP(_model(), bucket_cap_mb=BUCKET_CAP_MB)
    cls, kwargs = OPTIMIZERS[optimizer]
    optim = cls(reference.parameters(), **kwargs)
    _train(reference, rank, steps, optim, lr_groups=optim.param_groups)

    mine = _flat(ddp.module)
    gathered = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(gathered, mine)
    buckets = len(zero._overlap_info.params_per_bucket)
    local = len(zero.optim.param_groups[0]["params"])
    return ((mine - _flat(reference.module)).abs().max().item(), all(torch.equal(g, mine) for g in gathered),
            (mine - _flat(_model())).abs().max().item(), zero_hook.iterations, buckets, local)


CASES = [("ours", "sgd", False, False), ("ours", "adam", True, False), ("torch", "sgd", True, True),
         ("torch", "adam", False, True), ("powersgd_full", "sgd", False, False),
         ("powersgd_full", "adam", True, True)]


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("kind, optimizer, interleaved, shard", CASES)
def test_overlap_equals_ddp_with_the_same_optimizer(world, kind, optimizer, interleaved, shard):
    results = run(equivalence, world, kind, optimizer, interleaved, shard)
    for diff, identical, moved, iterations, buckets, local in results:
        assert moved > 1e-2            # training did change the parameters
        assert diff <= 1e-6, diff      # ... as DDP + the optimizer, from the first iteration on, lr change included
        assert identical               # every rank holds the same parameters
        assert iterations == 6
        assert buckets >= 3            # several buckets, so ownership is really split
    assert sum(r[5] for r in results) == 8 and all(r[5] > 0 for r in results)  # 8 tensors, sharded


def convergence(rank: int, world: int, interleaved: bool):
    results = {}
    for kind in ("ours", "powersgd_r1"):  # plain allreduce as the yardstick, same data and steps
        ddp, _, _ = _overlapped(kind, "sgd", interleaved, shard=False)
        losses = _train(ddp, rank, range(150))
        mine = _flat(ddp.module)
        gathered = [torch.empty_like(mine) for _ in range(world)]
        dist.all_gather(gathered, mine)
        results[kind] = (sum(losses[:10]) / 10, sum(losses[-10:]) / 10, all(torch.equal(g, mine) for g in gathered))
    return results


@pytest.mark.slow
@pytest.mark.parametrize("interleaved", [False, True])
def test_powersgd_rank_1_converges_and_ranks_agree(interleaved):
    for result in run(convergence, 3, interleaved):
        (_, exact_last, _), (first, last, identical) = result["ours"], result["powersgd_r1"]
        assert last < 0.2 * first, (first, last)            # it learns ...
        assert last < 1.5 * exact_last, (last, exact_last)  # ... nearly as well as uncompressed
        assert identical


def checkpoint_round_trip(rank: int, world: int, interleaved: bool):
    """Train 7 steps straight vs 4 steps, checkpoint, rebuild everything, 3 more steps."""
    straight, _, _ = _overlapped("ours", "adam", interleaved, shard=True)
    _train(straight, rank, range(7))

    first, zero, _ = _overlapped("ours", "adam", interleaved, shard=True)
    _train(first, rank, range(4))
    zero.consolidate_state_dict(to=0)
    blob = io.BytesIO()
    torch.save({"model": first.module.state_dict(), "optim": zero.state_dict() if rank == 0 else None}, blob)
    payload = [blob.getvalue() if rank == 0 else None]
    dist.broadcast_object_list(payload, src=0)  # "the file", read by every rank
    saved = torch.load(io.BytesIO(payload[0]), weights_only=False)
    before = {k: v.clone() for k, v in saved["optim"]["state"][0].items()}

    resumed, _, zero_hook = _overlapped("ours", "adam", interleaved, shard=True)
    resumed.module.load_state_dict(saved["model"])
    zero_hook.load_optimizer_state_dict(saved["optim"])  # before the first backward: applied at init
    _train(resumed, rank, range(4, 7))
    untouched = all(torch.equal(before[k], saved["optim"]["state"][0][k]) for k in before)
    return (_flat(resumed.module) - _flat(straight.module)).abs().max().item(), untouched


@pytest.mark.parametrize("interleaved", [False, True])
def test_consolidated_checkpoint_resume_equals_never_stopping(interleaved):
    for diff, untouched in run(checkpoint_round_trip, 2, interleaved):
        assert diff == 0.0
        assert untouched  # the caller's state dict is not modified (ZeRO's load_state_dict does)


def hook_returning_a_new_tensor(rank: int, world: int):
    """A hook whose future holds a fresh tensor (the bucket is left unreduced): its result must be used."""

    def out_of_place(_, bucket):
        reduced = bucket.buffer().clone() / world
        return dist.all_reduce(reduced, async_op=True).get_future().then(lambda f: f.value()[0])

    ddp = DDP(_model(), bucket_cap_mb=BUCKET_CAP_MB)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        zero = ZeroRedundancyOptimizer(ddp.parameters(), torch.optim.SGD, overlap_with_ddp=True, lr=0.05)
    ddp.register_comm_hook(None, hook_with_zero_step(out_of_place, ddp, zero))
    _train(ddp, rank, range(3))
    reference = DDP(_model(), bucket_cap_mb=BUCKET_CAP_MB)
    _train(reference, rank, range(3), torch.optim.SGD(reference.parameters(), lr=0.05))
    return (_flat(ddp.module) - _flat(reference.module)).abs().max().item()


def test_a_hook_that_returns_a_new_tensor():
    assert all(diff <= 1e-6 for diff in run(hook_returning_a_new_tensor, 2))


def errors(rank: int, world: int):
    messages = {}

    def catch(key, fn):
        try:
            fn()
        except (TypeError, ValueError) as exc:
            messages[key] = f"{type(exc).__name__}: {exc}"

    def zero_for(params, overlap=True, **kwargs):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            return ZeroRedundancyOptimizer(params, torch.optim.SGD, overlap_with_ddp=overlap, lr=0.1, **kwargs)

    ddp = DDP(_model())
    catch("not_ddp", lambda: hook_with_zero_step(allreduce_hook, ddp.module, zero_for(ddp.parameters())))
    catch("not_zero", lambda: hook_with_zero_step(allreduce_hook, ddp, torch.optim.SGD(ddp.parameters(), lr=1)))
    catch("no_overlap", lambda: hook_with_zero_step(allreduce_hook, ddp, zero_for(ddp.parameters(), overlap=False)))
    catch("hook", lambda: hook_with_zero_step("allreduce", ddp, zero_for(ddp.parameters())))
    catch("shard", lambda: hook_with_zero_step(allreduce_hook, ddp, zero_for(ddp.parameters()), shard_buckets=1))
    groups = [{"params": list(ddp.module[0].parameters())},
              {"params": [p for m in list(ddp.module)[1:] for p in m.parameters()], "lr": 0.01}]
    catch("groups", lambda: hook_with_zero_step(allreduce_hook, ddp, zero_for(groups)))
    catch("subset", lambda: hook_with_zero_step(allreduce_hook, ddp, zero_for(ddp.module[0].parameters())))
    unused = DDP(_model(), find_unused_parameters=True)
    catch("unused", lambda: hook_with_zero_step(allreduce_hook, unused, zero_for(unused.parameters())))
    catch("functional", lambda: ZeroRedundancyOptimizer(ddp.parameters(), torch.optim.LBFGS, overlap_with_ddp=True))
    zero = zero_for(ddp.parameters())
    hook_with_zero_step(allreduce_hook, ddp, zero)
    catch("twice", lambda: hook_with_zero_step_interleaved(allreduce_hook, ddp, zero))
    return messages


def test_clear_errors():
    messages = run(errors, 2)[0]
    expected = {
        "not_ddp": "TypeError: hook_with_zero_step: ddp must be a torch.nn.parallel.DistributedDataParallel",
        "not_zero": "TypeError: hook_with_zero_step: zero must be a torch.distributed.optim.ZeroRedundancyOptimizer",
        "no_overlap": "ValueError: hook_with_zero_step: construct the optimizer with ZeroRedundancyOptimizer(..., "
                      "overlap_with_ddp=True)",
        "hook": "TypeError: hook_with_zero_step: hook must be a callable",
        "shard": "TypeError: hook_with_zero_step: shard_buckets must be True or False, got 1",
        "groups": "ValueError: hook_with_zero_step: the ZeroRedundancyOptimizer has 2 parameter groups",
        "subset": "ValueError: hook_with_zero_step: the ZeroRedundancyOptimizer must be built over exactly",
        "unused": "ValueError: hook_with_zero_step: DistributedDataParallel(find_unused_parameters=True) is not",
        # torch's own check, at construction (before any hook exists): LBFGS has no functional equivalent
        "functional": "ValueError: Using `ddp_with_overlap=True` requires using a functional optimizer",
        "twice": "ValueError: hook_with_zero_step_interleaved: this ZeroRedundancyOptimizer is already driven",
    }
    assert set(messages) == set(expected), messages
    for key, start in expected.items():
        assert messages[key].startswith(start), messages[key]
    assert "LBFGS" in messages["functional"]


def test_internals_check_names_the_missing_field(monkeypatch):
    from gradpress.hooks import _zero_internals

    class Fake:
        _overlap_with_ddp = True

    with pytest.raises(RuntimeError, match=r"ZeroRedundancyOptimizer has no attribute '_overlap_info'.*torch 2\.13"):
        _zero_internals.check_internals(Fake())  # type: ignore[arg-type]

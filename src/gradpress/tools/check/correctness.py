"""Does gradpress compute the right thing on this backend and device? Each check is PASS/FAIL with a reason.

Every check trains a small MLP under DDP with a hook and compares what DDP hands back with an oracle:
the mean of the ranks' local gradients, computed by a plain allreduce (:func:`gradpress.comm.all_reduce`).
The hooks under test are injectable (``hooks=``), so a broken hook can be shown to fail the check.

Collectives: every function here is called on every rank of the default group, in the same order.

>>> items = run_correctness(torch.device("cpu"))   # doctest: +SKIP
>>> [(item.name, item.ok) for item in items]       # doctest: +SKIP
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from ... import comm
from ...hooks import (PowerSGDState, allreduce_hook, bf16_compress_hook, bf16_compress_wrapper, fp16_compress_hook,
                     fp16_compress_wrapper, powerSGD_hook)
from ...hooks.hierarchical import hierarchical_wrapper
from .link import node_groups

__all__ = ["DEFAULT_HOOKS", "Item", "TOLERANCES", "run_correctness"]

#: The hooks the checks exercise, by role; pass a dict with some replaced to test a hook of your own.
DEFAULT_HOOKS: dict[str, Callable[..., Any]] = {
    "powersgd": powerSGD_hook, "allreduce": allreduce_hook, "fp16": fp16_compress_hook,
    "bf16": bf16_compress_hook, "fp16_wrapper": fp16_compress_wrapper, "bf16_wrapper": bf16_compress_wrapper,
}

#: Largest allowed ``max |got - mean| / max |mean|`` per wire precision (fp32 on a GPU allows TF32-free
#: reordering of the sums only).
TOLERANCES = {"fp32": 1e-4, "fp16": 2e-3, "bf16": 1.6e-2}

_STEPS = 4
_START = 2  # compressed steps start here (the minimum PowerSGD allows with error feedback)


@dataclass(frozen=True)
class Item:
    """One check's outcome: ``ok`` and a one-line ``reason`` (what was compared, and the worst error)."""

    name: str
    ok: bool
    reason: str


def _model(device: torch.device) -> nn.Module:
    generator = torch.Generator().manual_seed(0)  # the same weights on every rank, drawn on the CPU
    model = nn.Sequential(nn.Linear(24, 48), nn.Tanh(), nn.Linear(48, 40), nn.Tanh(), nn.Linear(40, 8))
    with torch.no_grad():
        for param in model.parameters():
            param.copy_(torch.randn(param.shape, generator=generator) * 0.3)
    return model.to(device)


def _batch(rank: int, step: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1000 * step + rank)
    return (torch.randn(16, 24, generator=generator).to(device),
            torch.randn(16, 8, generator=generator).to(device))


def _loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, y = batch
    return nn.functional.mse_loss(model(x), y)


@contextlib.contextmanager
def _sync_guard(device: torch.device, where: str) -> Iterator[None]:
    """On CUDA, fail on any host sync inside the block (``set_sync_debug_mode("error")``), naming ``where``."""
    if device.type != "cuda":
        yield
        return
    previous = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    except RuntimeError as exc:
        raise RuntimeError(f"host sync in {where}: {str(exc).splitlines()[0]}") from exc
    finally:
        torch.cuda.set_sync_debug_mode(previous)


def _guarded(hook: Callable[..., Any], device: torch.device, name: str) -> Callable[..., Any]:
    def guarded(state, bucket):  # no annotations: DDP inspects them
        with _sync_guard(device, f"{name} (called on a bucket of {bucket.buffer().numel()} elements)"):
            return hook(state, bucket)
    return guarded


def _grad(param: torch.Tensor) -> torch.Tensor:
    """``param.grad``, which the backward pass just filled (every parameter of the checked models gets one)."""
    assert param.grad is not None
    return param.grad


def _mean_grads(model: nn.Module, batch: Any, world: int) -> list[torch.Tensor]:
    """The oracle: each local gradient allreduced and divided by the world size."""
    model.zero_grad()
    _loss(model, batch).backward()
    grads = [_grad(p).detach().clone() for p in model.parameters()]
    for grad in grads:
        comm.all_reduce(grad, issuer="gradpress check (oracle)")
        grad.div_(world)
    model.zero_grad()
    return grads


def _relative_error(got: list[torch.Tensor], want: list[torch.Tensor]) -> float:
    scale = max(float(w.abs().max()) for w in want) or 1.0
    return max(float((g.double() - w.double()).abs().max()) for g, w in zip(got, want)) / scale


def _compare_to_mean(device: torch.device, hook: Callable[..., Any], make_state: Callable[[], Any], name: str,
                     tolerance: float, steps: int = _STEPS) -> Item:
    """DDP with ``hook`` for ``steps`` steps (no parameter update, so every step has a fresh oracle)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    reference = _model(device)
    model = DDP(_model(device), device_ids=[device.index] if device.type == "cuda" else None,
                bucket_cap_mb=0.004)  # several buckets: the ordering across buckets is exercised too
    model.register_comm_hook(make_state(), _guarded(hook, device, name))
    worst = 0.0
    for step in range(steps):
        batch = _batch(rank, step, device)
        want = _mean_grads(reference, batch, world)
        model.zero_grad()
        _loss(model, batch).backward()
        worst = max(worst, _relative_error([_grad(p) for p in model.parameters()], want))
    ok = worst <= tolerance
    return Item(name, ok, f"max |hook - mean| / max |mean| = {worst:.2e} over {steps} steps "
                          f"({'<=' if ok else '>'} {tolerance:.1e})")


def _full_rank_state(group: Any = None) -> PowerSGDState:
    return PowerSGDState(group, matrix_approximation_rank=64, min_compression_rate=0, start_powerSGD_iter=_START)


def _ranks_identical(device: torch.device, hook: Callable[..., Any], steps: int = 6) -> Item:
    """Compressed (rank 2) SGD training: every rank's parameters equal rank 0's, bitwise."""
    rank = dist.get_rank()
    model = DDP(_model(device), device_ids=[device.index] if device.type == "cuda" else None, bucket_cap_mb=0.004)
    state = PowerSGDState(None, matrix_approximation_rank=2, start_powerSGD_iter=_START)
    model.register_comm_hook(state, _guarded(hook, device, "powerSGD_hook (rank 2)"))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for step in range(steps):
        optimizer.zero_grad()
        _loss(model, _batch(rank, step, device)).backward()
        optimizer.step()
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    root = comm.broadcast(flat.clone(), src=0, issuer="gradpress check (rank 0's parameters)")
    differ = torch.tensor([float((flat - root).abs().max())], device=device)
    comm.all_reduce(differ, op="max", issuer="gradpress check (largest difference)")
    worst = float(differ)
    ok = worst == 0.0
    return Item("compressed training keeps ranks identical", ok,
                f"after {steps} SGD steps at rank 2 the largest difference from rank 0's parameters is {worst:.2e}"
                f"{'' if ok else ' (must be 0)'}")


def _state_tensors(state: PowerSGDState) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}

    def walk(prefix: str, value: Any) -> None:
        if isinstance(value, torch.Tensor):
            out[prefix] = value.detach().cpu().clone()
        elif isinstance(value, Mapping):
            for key, item in value.items():
                walk(f"{prefix}.{key}", item)
        elif isinstance(value, (list, tuple)):
            for index, item in enumerate(value):
                walk(f"{prefix}.{index}", item)

    walk("state", state.local_state_dict())
    return out


def _nonfinite_skipped(device: torch.device, hook: Callable[..., Any]) -> Item:
    """An inf in the last rank's input at one step: every rank gets non-finite gradients, state unchanged."""
    rank, world = dist.get_rank(), dist.get_world_size()
    model = DDP(_model(device), device_ids=[device.index] if device.type == "cuda" else None, bucket_cap_mb=0.004)
    state = PowerSGDState(None, matrix_approximation_rank=2, start_powerSGD_iter=_START)
    model.register_comm_hook(state, _guarded(hook, device, "powerSGD_hook (non-finite step)"))
    for step in range(_START + 2):
        model.zero_grad()
        _loss(model, _batch(rank, step, device)).backward()
    before = _state_tensors(state)
    x, y = _batch(rank, 99, device)
    if rank == world - 1:
        x[0, 0] = float("inf")
    model.zero_grad()
    _loss(model, (x, y)).backward()
    finite = all(bool(torch.isfinite(_grad(p)).all()) for p in model.parameters())
    after = _state_tensors(state)
    changed = sorted(key for key in before if key in after and not torch.equal(before[key], after[key])
                     and not key.endswith("iter"))
    flags = torch.tensor([float(finite), float(bool(changed))], device=device)
    comm.all_reduce(flags, op="max", issuer="gradpress check (non-finite outcome)")
    any_finite, any_changed = bool(flags[0]), bool(flags[1])
    ok = not any_finite and not any_changed and set(before) == set(after)
    if ok:
        reason = (f"an inf on rank {world - 1} gave non-finite gradients on every rank and left the state "
                  "bitwise as it was")
    elif any_finite:
        reason = f"an inf on rank {world - 1} left finite gradients on some rank (a GradScaler there would step)"
    else:
        reason = f"the skipped step changed the state ({', '.join(changed[:3]) or 'on another rank'})"
    return Item("non-finite step skipped on every rank", ok, reason)


def run_correctness(device: torch.device, hooks: Mapping[str, Callable[..., Any]] | None = None,
                    local_world_size: int | None = None) -> list[Item]:
    """Run every check on ``device`` over the default process group; the same list on every rank.

    ``hooks``: replacements for entries of :data:`DEFAULT_HOOKS` (unknown keys are a ``ValueError``).
    ``local_world_size``: ranks per node; when it divides the world size into several nodes, the
    hierarchical wrapper is checked too. A check that raises is a FAIL with the error's first line.
    """
    unknown = sorted(set(hooks or {}) - set(DEFAULT_HOOKS))
    if unknown:
        raise ValueError(f"hooks: unknown role(s) {unknown}; valid roles: {', '.join(DEFAULT_HOOKS)}")
    chosen = {**DEFAULT_HOOKS, **(hooks or {})}
    world = dist.get_world_size()
    if local_world_size is not None and (local_world_size < 1 or world % local_world_size):
        raise ValueError(f"local_world_size={local_world_size} must be a positive divisor of the world size {world}")
    fp32, fp16, bf16 = TOLERANCES["fp32"], TOLERANCES["fp16"], TOLERANCES["bf16"]
    checks: list[tuple[str, Callable[[], Item]]] = [
        ("full-rank PowerSGD equals allreduce", lambda: _compare_to_mean(
            device, chosen["powersgd"], _full_rank_state, "full-rank PowerSGD equals allreduce", fp32)),
        ("allreduce_hook equals the mean", lambda: _compare_to_mean(
            device, chosen["allreduce"], lambda: None, "allreduce_hook equals the mean", fp32)),
        ("fp16_compress_hook", lambda: _compare_to_mean(device, chosen["fp16"], lambda: None,
                                                        "fp16_compress_hook", fp16)),
        ("bf16_compress_hook", lambda: _compare_to_mean(device, chosen["bf16"], lambda: None,
                                                        "bf16_compress_hook", bf16)),
        ("fp16_compress_wrapper(full-rank PowerSGD)", lambda: _compare_to_mean(
            device, chosen["fp16_wrapper"](chosen["powersgd"]), _full_rank_state,
            "fp16_compress_wrapper(full-rank PowerSGD)", fp16)),
        ("bf16_compress_wrapper(full-rank PowerSGD)", lambda: _compare_to_mean(
            device, chosen["bf16_wrapper"](chosen["powersgd"]), _full_rank_state,
            "bf16_compress_wrapper(full-rank PowerSGD)", bf16)),
        ("compressed training keeps ranks identical", lambda: _ranks_identical(device, chosen["powersgd"])),
        ("non-finite step skipped on every rank", lambda: _nonfinite_skipped(device, chosen["powersgd"])),
    ]
    if local_world_size is not None and 1 < local_world_size < world:
        intra, inter = node_groups(local_world_size)
        name = f"hierarchical_wrapper(full-rank PowerSGD), {world // local_world_size} nodes x {local_world_size}"
        checks.append((name, lambda: _compare_to_mean(
            device, hierarchical_wrapper(chosen["powersgd"], intra), lambda: _full_rank_state(inter), name, fp32)))
    items = []
    for name, check in checks:
        try:
            items.append(check())
        except Exception as exc:  # a check that crashes is a FAIL, with the error's first line as the reason
            first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
            items.append(Item(name, False, f"raised {type(exc).__name__}: {first}"))
    return items

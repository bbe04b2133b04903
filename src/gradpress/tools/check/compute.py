"""The model side of the advice: its step time, and each hook's compute time (the model named by ``--model``
comes from :func:`gradpress.tools.check.loader.load_model`).

Hook compute is timed with no network: every rank runs the real engine (the :class:`gradpress.PowerSGD`
aggregator, which shares the hooks' engine) on random gradients of the model's shapes over a process
group holding only itself, so its collectives are local copies and what remains is compression compute.
The cast hooks' compute is the cast there and back, named by the wire's dtype
(:func:`gradpress.tools.bytes.dtype_name`: ``fp16``, ``bf16``). Timings are medians over a few calls.

>>> from gradpress.tools.check.loader import load_model
>>> model, batch, loss = load_model("charlm", torch.device("cpu"))   # doctest: +SKIP
>>> hook_compute_ms([tuple(p.shape) for p in model.parameters()], torch.device("cpu"))   # doctest: +SKIP
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..bytes import dtype_name
from .advice import Recommended, powersgd_configs
from .loader import Loss

__all__ = ["hook_compute_ms", "step_ms"]


def _median_ms(call: Callable[[], Any], device: torch.device, iters: int) -> float:
    times = []
    for _ in range(iters + 2):  # two warm-up calls (plans, allocations)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        call()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(1000 * (time.perf_counter() - start))
    return statistics.median(times[2:])


def _round_trip(flat: torch.Tensor, wire: torch.dtype) -> torch.Tensor:
    """What a cast hook computes: ``flat`` cast to the wire's dtype and back to fp32."""
    return flat.to(wire).float()


def step_ms(model: nn.Module, batch: Any, loss: Loss, device: torch.device, iters: int = 3) -> float:
    """Median forward + backward time of one batch, in milliseconds."""
    def step() -> None:
        model.zero_grad(set_to_none=True)
        loss(model, batch).backward()
    return _median_ms(step, device, iters)


def _own_group() -> Any:
    """A process group of this rank alone (every rank creates every one-rank group, in rank order)."""
    if not dist.is_initialized():
        return None
    mine = None
    for rank in range(dist.get_world_size()):
        group = dist.new_group([rank])
        if rank == dist.get_rank():
            mine = group
    return mine


def hook_compute_ms(shapes: Sequence[Sequence[int]], device: torch.device, powersgd_ranks: Sequence[int] = (4,),
                    iters: int = 3, recommended: Recommended | None = None) -> dict[str, float]:
    """Per method name (as :func:`~gradpress.tools.check.advice.candidate_methods` names them, with the
    same ``recommended`` PowerSGD configuration; ``bf16`` too), the hook's own compute in milliseconds on
    ``device`` for fp32 gradients of ``shapes``. A collective (group creation)."""
    from ...aggregator import Config, PowerSGD

    group = _own_group()
    generator = torch.Generator().manual_seed(0)
    params = [torch.randn(tuple(s), generator=generator).to(device).requires_grad_() for s in shapes]
    grads = [torch.randn(p.shape, generator=generator).to(device) for p in params]
    flat = torch.cat([g.reshape(-1) for g in grads])
    out = {"allreduce": _median_ms(lambda: flat.div(2), device, iters)}
    for wire in (torch.float16, torch.bfloat16):  # the cast hooks: there and back
        out[dtype_name(wire)] = _median_ms(partial(_round_trip, flat, wire), device, iters)
    for name, rank, bytes_per_weight, _ in powersgd_configs(shapes, powersgd_ranks, recommended):
        aggregator = PowerSGD(params, Config(rank=rank, bytes_per_weight=bytes_per_weight,
                                             start_compressing_after_num_steps=0), process_group=group)
        work = [g.clone() for g in grads]

        def aggregate(aggregator: PowerSGD = aggregator, work: list[torch.Tensor] = work) -> None:
            for target, grad in zip(work, grads):
                target.copy_(grad)
            aggregator.aggregate_(work)
        out[name] = _median_ms(aggregate, device, iters)
    return out

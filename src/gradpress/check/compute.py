"""The model side of the advice: the model named by ``--model``, its step time, and each hook's compute time.

Hook compute is timed with no network: every rank runs the real engine (the :class:`gradpress.PowerSGD`
aggregator, which shares the hooks' engine) on random gradients of the model's shapes over a process
group holding only itself, so its collectives are local copies and what remains is compression compute.
The cast hooks' compute is the cast there and back. Timings are medians over a few calls.

>>> model, batch, loss = load_model("charlm", torch.device("cpu"))   # doctest: +SKIP
>>> hook_compute_ms([tuple(p.shape) for p in model.parameters()], torch.device("cpu"))   # doctest: +SKIP
"""

from __future__ import annotations

import importlib
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..zoo import MODELS, build_model, import_from_current_folder
from .advice import RECOMMENDED_POWERSGD

__all__ = ["hook_compute_ms", "load_model", "step_ms"]

Loss = Callable[[nn.Module, Any], torch.Tensor]


def _valid() -> str:
    from ..workloads.tasks import TASKS
    return f"{', '.join(MODELS)}, the demo's tasks {', '.join(TASKS)}, or module.path:function for your own model"


def _output_loss(model: nn.Module, batch: Any) -> torch.Tensor:
    out = model(*batch) if isinstance(batch, (tuple, list)) else model(batch)
    if hasattr(out, "loss") and isinstance(out.loss, torch.Tensor):
        out = out.loss
    if isinstance(out, (tuple, list)):
        out = out[0]
    return out.float().mean()


def _to(batch: Any, device: torch.device) -> Any:
    if isinstance(batch, torch.Tensor):
        return batch.to(device)
    if isinstance(batch, (tuple, list)):
        return type(batch)(_to(item, device) for item in batch)
    return batch


def load_model(spec: str, device: torch.device) -> tuple[nn.Module, Any, Loss]:
    """``(model on device, example batch or None, loss(model, batch))`` for ``--model spec``.

    ``spec``: a demo task (its model and a batch of its data when the data loads), a zoo model (no batch),
    or ``module.path:function`` returning a module or ``(module, example_batch)`` (the loss is the mean of
    the output, or of ``output.loss``). ``ValueError`` naming ``--model`` and the valid values otherwise.
    """
    from ..workloads.tasks import TASKS

    if not isinstance(spec, str) or not spec:
        raise ValueError(f"--model {spec!r}: give {_valid()}")
    if spec in TASKS and spec not in MODELS:
        task = TASKS[spec]
        model = task.model(0).to(device)
        try:
            data = task.load(0)
        except (RuntimeError, OSError, ImportError):
            return model, None, lambda m, b: task.loss(m, *b)
        batch = (data.x_train[:task.batch_size].to(device), data.y_train[:task.batch_size].to(device))
        return model, batch, lambda m, b: task.loss(m, *b)
    if spec in MODELS:
        return build_model(spec, device), None, _output_loss
    if ":" not in spec:
        raise ValueError(f"--model {spec!r} is not a model name; give {_valid()}")
    import_from_current_folder()
    module_name, _, attr = spec.partition(":")
    try:
        factory: Any = importlib.import_module(module_name)
        for part in attr.split("."):
            factory = getattr(factory, part)
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"--model {spec!r}: cannot load {attr!r} from module {module_name!r} ({exc})") from None
    if not callable(factory):
        raise ValueError(f"--model {spec!r}: {attr!r} is not callable; give a function returning a module "
                         "or (module, example_batch)")
    try:
        result = factory()
    except TypeError as exc:
        raise ValueError(f"--model {spec!r}: calling {attr}() with no arguments failed ({exc})") from None
    model, batch = (result if isinstance(result, tuple) and len(result) == 2 else (result, None))
    if not isinstance(model, nn.Module):
        raise ValueError(f"--model {spec!r} returned {type(result).__name__}; expected an nn.Module or "
                         "(nn.Module, example_batch)")
    return model.to(device), _to(batch, device), _output_loss


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
                    iters: int = 3) -> dict[str, float]:
    """Per method name (as :func:`~gradpress.check.advice.candidate_methods` names them), the hook's own
    compute in milliseconds on ``device`` for fp32 gradients of ``shapes``. A collective (group creation)."""
    from ..aggregator import Config, PowerSGD

    group = _own_group()
    generator = torch.Generator().manual_seed(0)
    params = [torch.randn(tuple(s), generator=generator).to(device).requires_grad_() for s in shapes]
    grads = [torch.randn(p.shape, generator=generator).to(device) for p in params]
    flat = torch.cat([g.reshape(-1) for g in grads])
    out = {"allreduce": _median_ms(lambda: flat.div(2), device, iters),
           "fp16": _median_ms(lambda: flat.half().float(), device, iters)}
    configs = [(r, 4) for r in powersgd_ranks] + [RECOMMENDED_POWERSGD]
    for rank, bytes_per_weight in dict.fromkeys(configs):
        aggregator = PowerSGD(params, Config(rank=rank, bytes_per_weight=bytes_per_weight,
                                             start_compressing_after_num_steps=0), process_group=group)
        work = [g.clone() for g in grads]

        def aggregate(aggregator: PowerSGD = aggregator, work: list[torch.Tensor] = work) -> None:
            for target, grad in zip(work, grads):
                target.copy_(grad)
            aggregator.aggregate_(work)
        wire = "fp16" if bytes_per_weight == 2 else "fp32"
        out[f"powersgd-r{rank}-{wire}"] = _median_ms(aggregate, device, iters)
    return out

"""The model that ``--model`` names, for ``gradpress check`` and ``gradpress inspect`` alike.

One loader, so both commands accept the same values and refuse the bad ones with the same words:

* a demo task (``charlm``, ``gpt``, ...): the task's model (seed 0) and, when asked for and its data
  loads, a batch of its training data, with the task's loss;
* a :mod:`gradpress.tools.zoo` model (``resnet18-cifar``, ``gpt2``, ...): no batch;
* ``module.path:function`` (the current folder importable): ``function()`` called with no arguments,
  returning an ``nn.Module`` or ``(module, example_batch)``; the loss is the mean of the output, or of
  ``output.loss``.

On the ``meta`` device nothing is allocated: the model is built under ``with torch.device("meta")`` and
no data is loaded (what ``inspect`` needs: shapes and dtypes only).

>>> model, batch, loss = load_model("gpt", torch.device("meta"), data=False)
>>> model.wte.weight.shape, batch
(torch.Size([97, 128]), None)
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from ..zoo import MODELS, build_model, import_callable, import_from_current_folder

__all__ = ["Loss", "load_model", "valid_models"]

Loss = Callable[[nn.Module, Any], torch.Tensor]

_RETURNS = "an nn.Module or (nn.Module, example_batch)"


def valid_models() -> str:
    """The values ``--model`` accepts, in words (for help texts and errors)."""
    from ..workloads.tasks import TASKS
    return (f"{', '.join(MODELS)}, the demo's tasks {', '.join(TASKS)}, or module.path:function for your own "
            f"model (returning {_RETURNS})")


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


def _building_on(device: torch.device) -> contextlib.AbstractContextManager[Any]:
    """Where models are built: on the meta device directly; elsewhere on the default device, then moved
    (so a model's initial values do not depend on the device it is checked on)."""
    return torch.device("meta") if device.type == "meta" else contextlib.nullcontext()


def _function(spec: str) -> Callable[[], Any]:
    """The function ``module.path:function`` names, checked to be callable with no arguments."""
    import_from_current_folder()
    return import_callable(spec, f"--model {spec!r}", "function",
                           f"not a function; give a function returning {_RETURNS}")


def load_model(spec: str, device: torch.device, *, data: bool = True) -> tuple[nn.Module, Any, Loss]:
    """``(model on device, example batch or None, loss(model, batch))`` for ``--model spec``.

    ``data=False`` (or the meta device) loads no data and returns no batch. A task's data that cannot load
    (its package missing) gives no batch either. ``ValueError`` naming ``--model``, the value and the valid
    values (or what is wrong with the function) otherwise.
    """
    from ..workloads.tasks import TASKS

    if not isinstance(spec, str) or not spec:
        raise ValueError(f"--model {spec!r}: give {valid_models()}")
    data = data and device.type != "meta"
    if spec in TASKS and spec not in MODELS:
        task = TASKS[spec]

        def task_loss(m: nn.Module, b: Any) -> torch.Tensor:
            return task.loss(m, *b)

        with _building_on(device):
            model = task.model(0).to(device)
        if not data:
            return model, None, task_loss
        try:
            loaded = task.load(0)
        except (RuntimeError, OSError, ImportError):
            return model, None, task_loss
        batch: Any = (loaded.x_train[:task.batch_size].to(device), loaded.y_train[:task.batch_size].to(device))
        return model, batch, task_loss
    if spec in MODELS:
        return build_model(spec, device), None, _output_loss
    if ":" not in spec:
        raise ValueError(f"--model {spec!r} is not a model name; give {valid_models()}")
    function = _function(spec)
    with _building_on(device):
        result = function()
    model, batch = (result if isinstance(result, tuple) and len(result) == 2 else (result, None))
    if not isinstance(model, nn.Module):
        raise ValueError(f"--model {spec!r}: {spec.partition(':')[2]}() returned an object of type "
                         f"{type(result).__name__}; expected {_RETURNS}")
    return model.to(device), (_to(batch, device) if data else None), _output_loss

"""Which tensors a model averager averages: trainable parameters, and floating-point buffers on request."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any, Union

import torch.distributed as dist
from torch import Tensor, nn

from ..comm import average_tensors_

__all__ = ["Params", "average_parameters", "tensors_to_average"]

Params = Union[nn.Module, Iterable[Tensor], Iterable[Mapping[str, Any]], Iterable[tuple[str, Tensor]]]


def tensors_to_average(params: Params, average_buffers: bool = False) -> list[Tensor]:
    """The tensors :func:`average_parameters` averages: trainable parameters (of a module, of parameter
    groups, of ``named_parameters()``, or a plain list), and with ``average_buffers`` (or a module) its
    floating-point buffers. Each tensor once."""
    out: list[Tensor] = []
    if isinstance(params, nn.Module):
        out = [p for p in params.parameters() if p.requires_grad]
        if average_buffers:
            out += [b for b in params.buffers() if b.is_floating_point()]
    else:
        for item in params:
            if isinstance(item, Mapping):
                out += [p for p in item["params"] if p.requires_grad]
            elif isinstance(item, tuple):
                if item[1].requires_grad:
                    out.append(item[1])
            elif isinstance(item, Tensor):
                if item.requires_grad or not isinstance(item, nn.Parameter):
                    out.append(item)
            else:
                raise TypeError(f"params must hold tensors, parameter groups or (name, tensor) pairs, got "
                                f"{type(item).__name__}")
    seen: set[int] = set()
    return [t for t in out if not (id(t) in seen or seen.add(id(t)))]  # type: ignore[func-returns-value]


def average_parameters(params: Params, process_group: dist.ProcessGroup | None = None) -> None:
    """Average ``params`` over ``process_group`` (``None``: the default group), in place.

    FSDP2's DTensor parameters are averaged shard by shard over ``process_group`` (the ranks holding the
    same shard in each island; their layout is checked first, one ``all_gather_object``).

    >>> average_parameters(model.parameters(), None)     # doctest: +SKIP
    >>> average_parameters(model, None)                   # a module: its float buffers too
    """
    from .shards import check_same_layout, local_views

    views, specs = local_views(tensors_to_average(params, average_buffers=isinstance(params, nn.Module)))
    if any(spec is not None for spec in specs):
        check_same_layout(views, specs, process_group, "average_parameters")
    average_tensors_(views, process_group)

"""Which tensors a model averager averages: trainable parameters, and floating-point buffers on request."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any, Union

import torch.distributed as dist
from torch import Tensor, nn

from ..comm import average_tensors_

__all__ = ["Params", "average_parameters", "named_tensors_to_average", "tensors_to_average"]

Params = Union[nn.Module, Tensor, Iterable[Tensor], Iterable[Mapping[str, Any]], Iterable[tuple[str, Tensor]]]


def named_tensors_to_average(params: Params, average_buffers: bool = False) -> tuple[list[Tensor], list[str | None]]:
    """The tensors :func:`average_parameters` averages and their names where ``params`` gives them.

    ``params`` is read once (a generator such as ``model.parameters()`` is consumed here): a module (its
    trainable parameters, and with ``average_buffers`` its floating-point buffers, by name), one tensor,
    or an iterable of tensors, of ``(name, tensor)`` pairs (``named_parameters()``) or of parameter groups
    as ``torch.optim`` takes them (dicts whose ``"params"`` is a tensor or an iterable of tensors or of
    pairs, named by ``"param_names"`` when an optimizer built from ``named_parameters()`` holds them).
    Frozen parameters (``requires_grad=False``) are left out; each tensor is kept once, under its first
    name (``None`` where nothing names it)."""
    out: list[tuple[Tensor, str | None]] = []
    if isinstance(params, nn.Module):
        out = [(p, n) for n, p in params.named_parameters() if p.requires_grad]
        if average_buffers:
            out += [(b, n) for n, b in params.named_buffers() if b.is_floating_point()]
    else:
        for item in [params] if isinstance(params, Tensor) else params:
            if isinstance(item, Mapping):
                group = item["params"]
                members = [group] if isinstance(group, Tensor) else list(group)
                names = item.get("param_names")
                if not isinstance(names, (list, tuple)) or len(names) != len(members):
                    names = [None] * len(members)
                for member, name in zip(members, names):
                    if isinstance(member, tuple):
                        name, member = member
                    if member.requires_grad:
                        out.append((member, name))
            elif isinstance(item, tuple):
                if item[1].requires_grad:
                    out.append((item[1], str(item[0])))
            elif isinstance(item, Tensor):
                if item.requires_grad or not isinstance(item, nn.Parameter):
                    out.append((item, None))
            else:
                raise TypeError(f"params must hold tensors, parameter groups or (name, tensor) pairs, got "
                                f"{type(item).__name__}")
    seen: set[int] = set()
    kept = [(t, n) for t, n in out if not (id(t) in seen or seen.add(id(t)))]  # type: ignore[func-returns-value]
    return [t for t, _ in kept], [n for _, n in kept]


def tensors_to_average(params: Params, average_buffers: bool = False) -> list[Tensor]:
    """The tensors :func:`average_parameters` averages (see :func:`named_tensors_to_average`): trainable
    parameters (of a module, of parameter groups, of ``named_parameters()``, or a plain list), and with
    ``average_buffers`` (or a module) its floating-point buffers. Each tensor once; ``params`` is read
    once."""
    return named_tensors_to_average(params, average_buffers)[0]


def average_parameters(params: Params, process_group: dist.ProcessGroup | None = None) -> None:
    """Average ``params`` over ``process_group`` (``None``: the default group), in place.

    FSDP2's DTensor parameters are averaged shard by shard over ``process_group`` (the ranks holding the
    same shard in each island; their layout is checked first, one all-gather of a few integers per
    tensor).

    >>> average_parameters(model.parameters(), None)     # doctest: +SKIP
    >>> average_parameters(model, None)                   # a module: its float buffers too
    """
    from .islands import check_islands
    from .shards import check_same_layout, local_views

    views, specs = local_views(tensors_to_average(params, average_buffers=isinstance(params, nn.Module)))
    check_islands(views, specs, process_group, "average_parameters", outer_step=False, one_group=True)
    if any(spec is not None for spec in specs):
        check_same_layout(views, specs, process_group, "average_parameters")
    average_tensors_(views, process_group)

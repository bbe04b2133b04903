"""Parameters and other tensor lists over a group: one collective per (device, dtype), in place.
(Averaging them is :mod:`gradpress.comm.average`'s.)"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch
import torch.distributed as dist
from torch import Tensor, nn

from .collectives import broadcast, is_distributed, is_member

__all__ = ["broadcast_parameters", "flat_groups"]


def flat_groups(tensors: list[Tensor], wire_dtype: torch.dtype | None = None) -> Iterator[tuple[list[Tensor], Tensor]]:
    """For each (device, dtype) group of ``tensors``: ``(members, flat)`` where ``flat`` is their
    concatenation (in ``wire_dtype`` if given); after the caller resumes, ``flat`` is copied back."""
    groups: dict[tuple[torch.device, torch.dtype], list[Tensor]] = {}
    for t in tensors:
        groups.setdefault((t.device, t.dtype), []).append(t)
    with torch.no_grad():
        for (_, dtype), members in groups.items():
            flat = torch.cat([t.detach().reshape(-1) for t in members]).to(wire_dtype or dtype)
            yield members, flat
            offset = 0
            for t in members:
                t.detach().copy_(flat[offset: offset + t.numel()].view_as(t))
                offset += t.numel()


def broadcast_parameters(params: nn.Module | Iterable[Tensor], process_group: dist.ProcessGroup | None = None,
                         src: int = 0) -> None:
    """Overwrite ``params`` on every worker, in place, with their values on ``src`` (a rank *within*
    ``process_group``; ``None``: the default group), as ``DistributedDataParallel`` does at construction.

    A collective: every worker of the group calls it with tensors of the same shapes and dtypes. One
    broadcast per (device, dtype). For a module, all its parameters (frozen ones too) and buffers. Nothing
    happens when ``torch.distributed`` is not initialised, the group has one worker, or this rank is not a
    member of the group.

    >>> broadcast_parameters(model)          # after init_process_group, on every rank  # doctest: +SKIP
    """
    if not is_distributed() or not is_member(process_group) or dist.get_world_size(process_group) == 1:
        return
    if isinstance(params, nn.Module):
        tensors = list(params.parameters()) + list(params.buffers())
    else:
        tensors = list(params)
    for _, flat in flat_groups(tensors):
        broadcast(flat, src, process_group, "broadcast_parameters")

"""Averaging FSDP2 parameters: each rank averages its own shard with the same shard of the other islands.

A parameter of ``fully_shard`` (FSDP2, or HSDP over a 2-D mesh) is a ``DTensor``; its local tensor is this
rank's shard, a view into FSDP's storage, so writing into it changes the parameter. The averagers
convert every ``DTensor`` they are given to that view (:func:`local_views`) and run unchanged on the
views over their ``process_group``, the group of the ranks that hold the same shard in each island
(``mesh["replicate"].get_group()`` with ``fully_shard(..., mesh=mesh["shard"])``). What they keep per
tensor (DiLoCo's anchor, the outer momentum) is local too, and is saved as a ``DTensor`` with the
parameter's mesh and placements (:func:`as_sharded`), so ``torch.distributed.checkpoint`` stores one
copy of each shard and reshards it on load. Each island must shard the model the same way: the first
averaging of a layout checks it over the group (:func:`check_same_layout`: integers all-gathered, no numpy).
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple, overload

import torch
import torch.distributed as dist
from torch import Tensor

from ..comm import all_gather_ints

__all__ = ["Spec", "as_sharded", "check_same_layout", "from_saved", "local_views", "on_device_of"]


class Spec(NamedTuple):
    """What makes a local shard a ``DTensor`` again: the parameter's mesh, placements, global shape and
    stride."""

    mesh: Any
    placements: tuple[Any, ...]
    shape: torch.Size
    stride: tuple[int, ...]

    def where(self) -> tuple[int, tuple[int, ...]]:
        """Where this rank's shard lies in the global tensor, identical on the ranks that hold the same
        shard in every island: ``(1, offset)``, its first element's index; ``(2, coordinate)``, this rank's
        mesh coordinate, on a torch without the offset's helper (stricter: Replicate placements too)."""
        try:
            from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
        except ImportError:
            coordinate = self.mesh.get_coordinate()
            return 2, () if coordinate is None else tuple(int(c) for c in coordinate)
        _, offset = compute_local_shape_and_global_offset(self.shape, self.mesh, self.placements)
        return 1, tuple(int(o) for o in offset)

    def describe(self) -> str:
        """The shard in words: the global shape and where this rank's shard starts in it."""
        return describe_shard(tuple(self.shape), *self.where())


def describe_shard(shape: tuple[int, ...], kind: int, where: tuple[int, ...]) -> str:
    """:meth:`Spec.describe` from the parts :func:`layout_key` sends."""
    return f"global shape {tuple(shape)} at {'offset' if kind == 1 else 'mesh coordinate'} {tuple(where)}"


@functools.lru_cache(maxsize=1)
def _dtensor_type() -> type | None:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # torch built without distributed
        return None
    return DTensor


def is_sharded(tensor: Any) -> bool:
    """Whether ``tensor`` is a ``DTensor`` (a parameter of ``fully_shard``)."""
    kind = _dtensor_type()
    return kind is not None and isinstance(tensor, kind)


def local_views(tensors: list[Tensor]) -> tuple[list[Tensor], list[Spec | None]]:
    """``tensors`` with every ``DTensor`` replaced by its local shard (a view: writes reach the
    parameter), and each one's :class:`Spec` (``None`` for a plain tensor)."""
    views: list[Tensor] = []
    specs: list[Spec | None] = []
    with torch.no_grad():
        for t in tensors:
            if is_sharded(t):
                views.append(t.to_local())  # type: ignore[attr-defined]
                specs.append(Spec(t.device_mesh, tuple(t.placements), t.shape, tuple(t.stride())))  # type: ignore[attr-defined]
            else:
                views.append(t)
                specs.append(None)
    return views, specs


def as_sharded(local: Tensor, spec: Spec | None) -> Tensor:
    """``local`` as a ``DTensor`` laid out like its parameter (``spec``), or itself for a plain tensor.
    Builds no collective."""
    if spec is None:
        return local
    from torch.distributed.tensor import DTensor
    return DTensor.from_local(local, spec.mesh, spec.placements, run_check=False, shape=spec.shape,
                              stride=spec.stride)


def from_saved(saved: Tensor, like: Tensor) -> Tensor:
    """A saved tensor (a ``DTensor`` after a DCP load, or a plain one) as a local tensor with ``like``'s
    shape, dtype and device (a copy). ``ValueError`` if the shapes differ."""
    local = saved.to_local() if is_sharded(saved) else saved  # type: ignore[attr-defined]
    if local.shape != like.shape:
        raise ValueError(f"a saved tensor has local shape {tuple(local.shape)}, this rank's parameter shard "
                         f"{tuple(like.shape)}: the model is sharded differently than when it was saved")
    return local.detach().to(device=like.device, dtype=like.dtype, copy=True)


@overload
def on_device_of(saved: Tensor, anchor: list[Tensor] | None) -> Tensor: ...
@overload
def on_device_of(saved: None, anchor: list[Tensor] | None) -> None: ...
def on_device_of(saved: Tensor | None, anchor: list[Tensor] | None) -> Tensor | None:
    """A copy of a saved per-rank tensor (kept on the CPU by the checkpoint) on ``anchor``'s device
    (``None`` stays ``None``)."""
    return None if saved is None else saved.to(device=None if not anchor else anchor[0].device, copy=True)


def layout_key(views: list[Tensor], specs: list[Spec | None]) -> tuple[tuple[int, ...], ...]:
    """What :func:`check_same_layout` compares, as integers (sent without pickling): per tensor its local
    shape and, where sharded, its global shape and where its shard lies (:meth:`Spec.where`)."""
    key = []
    for view, spec in zip(views, specs):
        entry = [len(view.shape), *view.shape]
        if spec is None:
            entry.append(0)
        else:
            kind, where = spec.where()
            entry += [kind, len(spec.shape), *spec.shape, len(where), *where]
        key.append(tuple(int(v) for v in entry))
    return tuple(key)


def _entries(flat: list[int]) -> tuple[tuple[int, ...], ...]:
    """:func:`layout_key` back from its flattened form (``[count, *entries]``)."""
    out, i = [], 1
    for _ in range(flat[0] if flat else 0):
        start = i
        i += 1 + flat[i]      # the local shape
        kind = flat[i]
        i += 1
        if kind:
            i += 1 + flat[i]  # the global shape
            i += 1 + flat[i]  # the offset or coordinate
        out.append(tuple(flat[start:i]))
    return tuple(out)


def _describe_entry(entry: tuple[int, ...]) -> tuple[tuple[int, ...], str]:
    """A :func:`layout_key` entry in words: its local shape, and its shard (or "not sharded")."""
    n = entry[0]
    local = entry[1:1 + n]
    rest = entry[1 + n:]
    if not rest[0]:
        return local, "not sharded"
    g = rest[1]
    shape = rest[2:2 + g]
    where = rest[3 + g:3 + g + rest[2 + g]]
    return local, describe_shard(shape, rest[0], where)


def check_same_layout(views: list[Tensor], specs: list[Spec | None], process_group: dist.ProcessGroup | None,
                      owner: str) -> None:
    """Refuse (``ValueError`` on every rank) a shard layout that differs between the ranks of
    ``process_group``: each rank must hold the same shard of each parameter as its peers in the other
    islands. A collective over ``process_group``: two all-gathers of a few integers per tensor (no
    numpy, which ``all_gather_object`` would need), on the tensors' device."""
    mine = layout_key(views, specs)
    flat = [len(mine), *(v for entry in mine for v in entry)]
    device = views[0].device if views else None
    gathered = [_entries(theirs) for theirs in
                all_gather_ints(flat, process_group, issuer=f"{owner}: the shard layout check", device=device)]
    for peer, theirs in enumerate(gathered):
        if theirs == mine:
            continue
        if len(theirs) != len(mine):
            raise ValueError(f"{owner}: rank {peer} of process_group averages {len(theirs)} tensors, this rank "
                             f"{len(mine)}: every island must hold the same parameters")
        i = next(i for i, (a, b) in enumerate(zip(mine, theirs)) if a != b)
        (their_shape, their_shard), (my_shape, my_shard) = _describe_entry(theirs[i]), _describe_entry(mine[i])
        raise ValueError(
            f"{owner}: tensor {i} is sharded differently on rank {peer} of process_group (local shape "
            f"{their_shape}, {their_shard}) than on this rank (local shape {my_shape}, {my_shard}): every island "
            "must shard the model the same way (same mesh shape, placements and fully_shard units), so that each "
            "rank averages the same shard as its peers; process_group must join the ranks at the same mesh "
            "coordinate (e.g. mesh['replicate'].get_group())")

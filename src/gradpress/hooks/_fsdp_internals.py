"""The one place that reads FSDP2's and autograd's private internals (for :mod:`gradpress.hooks.fsdp`).

``register_fsdp_comm_hook`` needs, per ``fully_shard`` unit, its parameter group and mesh
(``FSDPModule._get_fsdp_state()._fsdp_param_groups``, ``DDPMeshInfo``, ``mesh_info``), each parameter's
local and padded shard sizes (``FSDPParam.sharded_size``, ``padded_sharded_param_size``,
``sharded_param``), the group's ``gradient_divide_factor``, and autograd's current graph task id and
final callbacks (``torch._C._current_graph_task_id``, ``Variable._execution_engine.queue_callback``) to
recognize a backward pass. Written against torch 2.13 (``torch/distributed/fsdp/_fully_shard/``); a
release that renames one of them breaks here and nowhere else.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

if TYPE_CHECKING:
    from torch.distributed.fsdp import FSDPModule

__all__ = ["check_replicate_group", "current_backward", "divide_factor", "layout", "on_backward_end",
           "trainable_units", "units"]


def current_backward() -> int:
    """The id of the autograd graph task running now: one per backward pass."""
    return torch._C._current_graph_task_id()


def on_backward_end(callback: Callable[[], None]) -> None:
    """Run ``callback`` when the current backward pass ends (an autograd final callback)."""
    torch.autograd.Variable._execution_engine.queue_callback(callback)


def trainable_units(param_groups: list[Any]) -> int:
    """How many of the units' parameter groups hold a trainable parameter (each reduces once per backward)."""
    return sum(any(p.sharded_param.requires_grad for p in g.fsdp_params) for g in param_groups)


def divide_factor(param_group: Any) -> float | None:
    """The unit's custom gradient divide factor (``set_gradient_divide_factor``; ``None``: FSDP's own)."""
    return param_group.gradient_divide_factor


def units(module: nn.Module) -> list[tuple[str, FSDPModule, Any]]:
    """``(name, unit, FSDPParamGroup)`` for each ``fully_shard`` unit with parameters, in module order."""
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.fsdp._fully_shard._fsdp_common import DDPMeshInfo, FSDPMeshInfo

    if not isinstance(module, nn.Module):
        raise TypeError(f"module must be a torch.nn.Module containing fully_shard units, got {type(module).__name__}")
    units: list[tuple[str, FSDPModule, Any]] = []
    for name, unit in module.named_modules():
        if not isinstance(unit, FSDPModule):
            continue
        label = repr(name) if name else "the root module"
        param_groups = unit._get_fsdp_state()._fsdp_param_groups
        if len(param_groups) > 1:
            raise ValueError(f"module: fully_shard unit {label} has {len(param_groups)} parameter groups "
                             "(per-parameter meshes); register_fsdp_comm_hook supports one mesh per unit")
        if not param_groups:
            continue  # a unit without parameters of its own reduces nothing
        mesh_info = param_groups[0].mesh_info
        if not isinstance(mesh_info, FSDPMeshInfo):
            # replicate() (torch.distributed._composable.replicate_with_fsdp): no shard dimension, and FSDP's
            # all-reduce hook runs after its own all-reduce, so there is nothing for a hook to replace.
            raise ValueError(
                f"module: unit {label} comes from replicate(), which all-reduces across replicas itself "
                f"(over its mesh {tuple(mesh_info.mesh.shape)}, before any all-reduce hook). For a gradpress hook "
                "as that all-reduce, build a (world, 1) mesh with mesh_dim_names=('replicate', 'shard'), apply "
                "fully_shard(unit, mesh=mesh['shard'], reshard_after_forward=False) instead of replicate(unit) "
                "and pass mesh['replicate'].get_group()")
        if isinstance(mesh_info, DDPMeshInfo) or mesh_info.mesh.ndim != 1:
            raise ValueError(
                f"module: fully_shard unit {label} is sharded over a {mesh_info.mesh.ndim}-D mesh "
                f"{tuple(mesh_info.mesh.shape)}; native HSDP already all-reduces across replicas. "
                "Shard every unit over a 1-D mesh, e.g. fully_shard(unit, mesh=mesh['shard'])")
        units.append((name, unit, param_groups[0]))
    if not units:
        raise ValueError(f"module: {type(module).__name__} has no fully_shard unit with parameters; apply "
                         "torch.distributed.fsdp.fully_shard(submodule, mesh=mesh['shard']) first")
    return units


def layout(param_group: Any, flat: Tensor) -> tuple[list[Tensor], list[int], list[torch.Size]]:
    """Parameters, offsets in ``flat`` and local shard shapes of the gradients FSDP reduced.

    FSDP puts each parameter that has a gradient (``requires_grad`` ones, in the unit's order) at the next
    multiple of its padded shard size (``padded_sharded_param_size``); the local shard
    (``sharded_size``) comes first, the padding rows after it.
    """
    parameters, offsets, shapes = [], [], []
    offset = 0
    for fsdp_param in param_group.fsdp_params:
        if not fsdp_param.sharded_param.requires_grad:
            continue
        parameters.append(fsdp_param.sharded_param)
        offsets.append(offset)
        shapes.append(torch.Size(fsdp_param.sharded_size))
        offset += fsdp_param.padded_sharded_param_size.numel()
    if offset != flat.numel():
        raise RuntimeError(
            f"register_fsdp_comm_hook: fully_shard reduced {flat.numel()} elements for a unit whose trainable "
            f"parameters take {offset}: a trainable parameter got no gradient. Every trainable parameter must "
            "get one (set_reduce_scatter_unused_params(True) on the root module reduces zeros for unused ones)")
    return parameters, offsets, shapes


def check_replicate_group(group: dist.ProcessGroup | None, param_group: Any, name: str) -> None:
    """The group must hold one rank per shard group: this one, and no other rank of its shard mesh."""
    group_ranks = set(dist.get_process_group_ranks(group if group is not None else dist.group.WORLD))
    shard_ranks = set(param_group.mesh_info.mesh.mesh.flatten().tolist())
    if group_ranks & shard_ranks != {dist.get_rank()}:
        label = repr(name) if name else "the root module"
        raise ValueError(
            f"state: the hook's process group has ranks {sorted(group_ranks)}, which should include this rank "
            f"({dist.get_rank()}) and no other rank of the shard mesh {sorted(shard_ranks)} of fully_shard unit "
            f"{label}: they hold other shards. Pass the replicate group, e.g. mesh['replicate'].get_group() "
            "(None means the default group)")

"""Set-ups that run without an error but cannot be what was meant, caught once, when an averager first
averages or takes its anchor (no collective, no per-step cost):

* **native HSDP across the islands** (``fully_shard(mesh=mesh)`` on the whole ``(island, shard)`` mesh):
  FSDP all-reduces the gradients over the ranks the averager averages over, every step, so those replicas
  never drift apart. Averaging them changes nothing (a warning: the result is right, the bytes wasted);
  DiLoCo's outer step would apply their common steps once more, with momentum: a different optimizer, not
  DiLoCo, so its averagers raise;
* **a model never wrapped in FSDP, averaged over the islands only**: plain tensors and a ``process_group``
  that is one dimension of a ``DeviceMesh`` leaving out other ranks (the islands recipe without
  ``fully_shard``): nothing synchronizes a rank with the rest of its island, whose ranks drift apart. A
  warning, not an error: DDP over the island's ranks (which the averager cannot see) would keep them
  together, and pipeline stages differ on purpose.
"""

from __future__ import annotations

import warnings

import torch.distributed as dist
from torch import Tensor

from .shards import Spec

__all__ = ["check_islands"]

FIX = ("shard each island on its own: fully_shard(module, mesh=mesh['shard']) for each unit and the root (or HSDP "
       "inside each island, over mesh['replicate', 'shard'] of an (island, replicate, shard) mesh), and average over "
       "mesh['island'].get_group()")


def _ranks(process_group: dist.ProcessGroup | None) -> list[int]:
    return list(range(dist.get_world_size())) if process_group is None else \
        dist.get_process_group_ranks(process_group)


def _hsdp_across(specs: list[Spec | None], averaged: set[int]) -> tuple[Spec, str, list[int]] | None:
    """The first parameter layout that replicates over a mesh dimension holding other ranks of
    ``averaged``: ``(spec, dimension name, its ranks)``."""
    me = dist.get_rank()
    seen: set[tuple[int, tuple[object, ...]]] = set()
    for spec in specs:
        if spec is None or (id(spec.mesh), spec.placements) in seen:
            continue
        seen.add((id(spec.mesh), spec.placements))
        for dim, placement in enumerate(spec.placements):
            if not placement.is_replicate():
                continue
            replicas = dist.get_process_group_ranks(spec.mesh.get_group(dim))
            if (set(replicas) & averaged) - {me}:
                names = spec.mesh.mesh_dim_names
                return spec, names[dim] if names else str(dim), sorted(replicas)
    return None


def check_islands(views: list[Tensor], specs: list[Spec | None], process_group: dist.ProcessGroup | None,
                  owner: str, outer_step: bool, one_group: bool) -> None:
    """Refuse or warn about the set-ups of the module docstring for these tensors (``views``, their
    ``specs``) averaged over ``process_group``. ``outer_step``: the averager takes DiLoCo's outer step
    (HSDP across its group is then an error); ``one_group``: ``process_group`` is the only group it
    averages over (not :class:`HierarchicalModelAverager`'s subgroups, which leave ranks out by design)."""
    if not views or not dist.is_available() or not dist.is_initialized():
        return
    averaged = set(_ranks(process_group))
    found = _hsdp_across(specs, averaged)
    if found is not None:
        spec, dim, replicas = found
        consequence = ("DiLoCo's outer step would apply once more, with its momentum, the steps they take together "
                       "(a different optimizer, not DiLoCo) and send the model at every synchronization for nothing"
                       if outer_step else "averaging them changes nothing and sends the model at every "
                       "synchronization for nothing")
        message = (f"{owner}: the parameters are native HSDP across the ranks of process_group: placements "
                   f"{tuple(spec.placements)} replicate them over mesh dim {dim!r} (ranks {replicas}), over which FSDP "
                   f"all-reduces their gradients every step, and process_group averages over ranks {sorted(averaged)}. "
                   f"Those replicas never drift apart, so {consequence}. To train islands apart, {FIX}")
        if outer_step:
            raise ValueError(message)
        warnings.warn(message, stacklevel=4)
        return
    if not one_group or process_group is None or any(s is not None for s in specs):
        return
    world, size = dist.get_world_size(), dist.get_world_size(process_group)
    desc = str(getattr(process_group, "group_desc", "") or "")
    if size < world and desc.startswith("mesh_"):
        warnings.warn(
            f"{owner}: the averaged tensors are plain tensors, not fully_shard's DTensors, and process_group (mesh "
            f"dim {desc[len('mesh_'):]!r}, ranks {sorted(averaged)}) leaves out the other {world - size} of the "
            f"{world} ranks: nothing here synchronizes this rank with the other ranks of its island, so each trains "
            f"a model of its own and they drift apart. Wrap the model in each island first: {FIX} "
            "(docs/zero-fsdp-hierarchical.md, DiLoCo between FSDP2 islands). If something else keeps the ranks of an "
            "island identical (DDP over the island's ranks) or they hold different parts of the model on purpose "
            "(pipeline stages), this does not apply: silence it with warnings.filterwarnings", stacklevel=4)

"""The one place that reads ``ZeroRedundancyOptimizer``'s private fields (for :mod:`gradpress.hooks.zero`).

``hook_with_zero_step`` works with the ``ZeroRedundancyOptimizer(..., overlap_with_ddp=True)`` users
already create, so that its ``consolidate_state_dict()`` / ``state_dict()`` / ``load_state_dict()`` keep
working. That needs ZeRO's delayed-initialization machinery, which is private. Everything used is listed
in :data:`ZERO_FIELDS`, :data:`OVERLAP_INFO_FIELDS` and :data:`ASSIGNMENT_FIELDS`, and
:func:`check_internals` verifies them when a hook is created, so that a torch release that renames one fails
at once with a message naming it (tested with torch 2.13), not later in the middle of a backward pass.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

if TYPE_CHECKING:  # only annotated here; importing it costs a second (hooks/zero.py imports it at use)
    from torch.distributed.optim import ZeroRedundancyOptimizer

__all__ = ["ASSIGNMENT_FIELDS", "OVERLAP_INFO_FIELDS", "ZERO_FIELDS", "check_internals", "initialize",
           "install_state_dict", "is_driven", "is_initialized", "local_parameters", "local_step", "mark_driven",
           "overlaps_with_ddp"]

#: The marker a hook leaves on the optimizer it drives (one hook per optimizer).
_DRIVEN = "_gradpress_zero_hook"

#: ``ZeroRedundancyOptimizer`` attributes we use (private ones start with ``_``).
ZERO_FIELDS = ("_overlap_with_ddp", "_overlap_info", "_init_zero_for_overlap", "_local_step", "rank",
               "world_size", "process_group", "param_groups")
#: ``ZeroRedundancyOptimizer._overlap_info`` (``_OverlapInfo``) attributes we use.
OVERLAP_INFO_FIELDS = ("status", "shard_buckets", "total_size", "params_per_bucket", "assigned_ranks_per_bucket")
#: ``_DDPBucketAssignment`` attributes we use (checked after initialization, when they exist).
ASSIGNMENT_FIELDS = ("parameters", "tensor")


def _incompatible(what: str) -> RuntimeError:
    return RuntimeError(
        f"gradpress.hook_with_zero_step: torch {torch.__version__}'s ZeroRedundancyOptimizer has no {what}, "
        "which the overlap relies on (written against torch 2.13). Use the ZeroRedundancyOptimizer without "
        "overlap_with_ddp (call zero.step() after backward), or a torch version gradpress supports.")


def _status_enum() -> Any:
    from torch.distributed.optim import zero_redundancy_optimizer as module

    status = getattr(module, "_OverlapStatus", None)
    if status is None or not hasattr(status, "UNINITIALIZED") or not hasattr(status, "INITIALIZED"):
        raise _incompatible("_OverlapStatus.UNINITIALIZED / INITIALIZED")
    return status


def check_internals(zero: ZeroRedundancyOptimizer) -> None:
    """Raise ``RuntimeError`` naming the field if ``zero`` lacks one we use (a torch version change).

    Without ``overlap_with_ddp=True`` only that flag is checked (the caller rejects such an optimizer).
    """
    if not hasattr(zero, "_overlap_with_ddp"):
        raise _incompatible("attribute '_overlap_with_ddp'")
    if not zero._overlap_with_ddp:
        return  # the caller says how to construct it; nothing else is used without overlap
    for field in ZERO_FIELDS:
        if not hasattr(zero, field):
            raise _incompatible(f"attribute {field!r}")
    for field in OVERLAP_INFO_FIELDS:
        if not hasattr(zero._overlap_info, field):
            raise _incompatible(f"_overlap_info.{field}")
    _status_enum()


def overlaps_with_ddp(zero: ZeroRedundancyOptimizer) -> bool:
    """Whether ``zero`` was built with ``overlap_with_ddp=True`` (check :func:`check_internals` first)."""
    return bool(zero._overlap_with_ddp)


def is_driven(zero: ZeroRedundancyOptimizer) -> bool:
    """Whether a hook already drives ``zero`` (:func:`mark_driven`)."""
    return bool(getattr(zero, _DRIVEN, False))


def mark_driven(zero: ZeroRedundancyOptimizer) -> None:
    """Note on ``zero`` that a hook drives it, so that a second hook over it is refused."""
    setattr(zero, _DRIVEN, True)


def is_initialized(zero: ZeroRedundancyOptimizer) -> bool:
    """Whether ZeRO's delayed (overlap) initialization has run, by us or by another hook."""
    return zero._overlap_info.status != _status_enum().UNINITIALIZED


def initialize(zero: ZeroRedundancyOptimizer, params_per_bucket: Sequence[Sequence[Tensor]],
               shard_buckets: bool) -> tuple[list[dict[int, Any]], list[set[int]]]:
    """Run ZeRO's delayed initialization for this bucket layout; return its assignments.

    ``params_per_bucket[i]``: the parameters of DDP bucket ``i``. Afterwards ZeRO owns a partition of
    the parameters (whole buckets round-robin, or with ``shard_buckets`` bucket slices balanced by size),
    has built this rank's local functional optimizer over its part, and has made every parameter a view
    into one flat tensor per (bucket, owner) (``param.data`` is rebound, as PyTorch's ZeRO always does).
    Returns ``(assignments_per_rank, ranks_per_bucket)``: ``assignments_per_rank[r][i].tensor`` is the
    flat tensor of rank ``r``'s part of bucket ``i`` (what ``r`` broadcasts), ``ranks_per_bucket[i]`` the
    group ranks owning part of bucket ``i``.
    """
    info = zero._overlap_info
    info.shard_buckets = bool(shard_buckets)
    total_size = sum(p.numel() for ps in params_per_bucket for p in ps) if shard_buckets else None
    # torch's stub says int; its source declares Optional[int] (None: buckets not sharded).
    info.total_size = total_size  # type: ignore[assignment]
    info.params_per_bucket[:] = [list(ps) for ps in params_per_bucket]
    zero._init_zero_for_overlap()
    if getattr(info, "status", None) != _status_enum().INITIALIZED:
        raise _incompatible("INITIALIZED status after _init_zero_for_overlap()")
    try:
        assignments = zero._bucket_assignments_per_rank
    except AttributeError:
        raise _incompatible("attribute '_bucket_assignments_per_rank'") from None
    for per_rank in assignments:
        for assignment in per_rank.values():
            for field in ASSIGNMENT_FIELDS:
                if not hasattr(assignment, field):
                    raise _incompatible(f"bucket assignment field {field!r}")
    return assignments, [set(ranks) for ranks in info.assigned_ranks_per_bucket]


def local_parameters(zero: ZeroRedundancyOptimizer) -> list[Tensor]:
    """The parameters this rank's local (functional) optimizer updates, in its gradient-list order."""
    groups = getattr(zero.optim, "param_groups", None)
    if not groups or len(groups) != 1:
        raise _incompatible("single local parameter group after initialization")
    return list(groups[0]["params"])


def local_step(zero: ZeroRedundancyOptimizer, gradients: list[Tensor | None]) -> None:
    """One step of the local optimizer; ``None`` gradients leave their parameter (and its state) alone.

    The functional optimizers read their hyperparameters from ``optim.defaults``, while ZeRO only copies
    ``zero.param_groups`` into ``optim.param_groups``: in PyTorch an LR scheduler (or any change of
    ``zero.param_groups[0]["lr"]``) is silently ignored with ``overlap_with_ddp=True``. Copy them first.
    """
    defaults = getattr(zero.optim, "defaults", None)
    if isinstance(defaults, dict):
        for key, value in zero.param_groups[0].items():
            if key == "betas" and "beta1" in defaults:
                defaults["beta1"], defaults["beta2"] = value
            elif key != "params" and key in defaults:
                defaults[key] = value
    zero._local_step(gradients)


def install_state_dict(zero: ZeroRedundancyOptimizer) -> None:
    """Give the local functional optimizer the ``state_dict()`` that ``zero.consolidate_state_dict()`` calls.

    PyTorch's functional optimizers have none, so ``consolidate_state_dict()`` raises ``AttributeError``
    with ``overlap_with_ddp=True``. The format is ``torch.optim``'s: ``state`` by local parameter index
    (SGD ``momentum_buffer``; Adam ``step``, ``exp_avg``, ``exp_avg_sq``), one param group with local
    indices, which ``zero.state_dict()`` maps to global indices (so the checkpoint also loads into a
    ``ZeroRedundancyOptimizer`` without overlap, or a plain ``torch.optim`` optimizer, of the same class).
    """
    optim = zero.optim
    if callable(getattr(optim, "state_dict", None)):
        return
    params = local_parameters(zero)

    def state_dict() -> dict[str, Any]:
        index = {id(p): i for i, p in enumerate(params)}
        group = {k: v for k, v in zero.param_groups[0].items() if k != "params"}
        return {"state": {index[id(p)]: dict(s) for p, s in optim.state.items() if id(p) in index},
                "param_groups": [{**group, "params": list(range(len(params)))}]}

    optim.state_dict = state_dict

"""Per-rank state in checkpoints: where a rank's state was saved (:func:`placement`), the refusals of state
from another rank, world size or set of options, and the layout that ``torch.distributed.checkpoint`` keeps
per rank (:func:`per_rank_state`, :func:`read_per_rank`, :class:`dcp_stateful`). Re-exported by
:mod:`gradpress.checkpoint`."""

from __future__ import annotations

import io
import logging
import sys
from collections.abc import Callable, Mapping
from types import FrameType
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["PER_RANK_FORMAT", "check_placement", "check_saved_options", "check_world_size_policy", "dcp_load_key",
           "dcp_saved_keys", "dcp_stateful", "per_rank_state", "placement", "read_per_rank", "to_cpu"]

logger = logging.getLogger("gradpress.checkpoint")


def to_cpu(obj: Any) -> Any:
    """``obj`` with every tensor detached and moved to the CPU (mappings, lists and tuples walked)."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu()
    if isinstance(obj, Mapping):
        return {key: to_cpu(value) for key, value in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(to_cpu(value) for value in obj)
    return obj


def clone_tensors(obj: Any) -> Any:
    """``obj`` with every tensor detached and cloned where it is (mappings, lists and tuples walked): a
    state that stays as it is while training goes on changing the live tensors (a fault-tolerant group
    serves a joiner the state after the quorum)."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().clone()
    if isinstance(obj, Mapping):
        return {key: clone_tensors(value) for key, value in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(clone_tensors(value) for value in obj)
    return obj


def placement(process_group: Any = None) -> dict[str, int]:
    """``{"rank": r, "world_size": w}`` of this process in ``process_group`` (``0``/``1`` when
    ``torch.distributed`` is not initialized): stored in every per-rank state_dict."""
    if dist.is_available() and dist.is_initialized():
        return {"rank": dist.get_rank(process_group), "world_size": dist.get_world_size(process_group)}
    return {"rank": 0, "world_size": 1}


def check_placement(saved: Any, current: dict[str, int], owner: str, allow_other_rank: bool) -> None:
    """Refuse per-rank state saved on another rank or world size (``saved`` is ``None`` for old
    checkpoints, which carry no placement and are accepted)."""
    if saved is None or allow_other_rank:
        return
    for name in ("world_size", "rank"):
        if name in saved and int(saved[name]) != current[name]:
            raise ValueError(
                f"{owner} checkpoint was saved with {name}={int(saved[name])} but this process has "
                f"{name}={current[name]} (saved on rank {saved.get('rank')!r} of {saved.get('world_size')!r}, "
                f"loading on rank {current['rank']} of {current['world_size']}); its error memory is per "
                f"rank: load each rank's own file, or pass allow_other_rank=True to load it anyway")


def check_saved_options(saved: Mapping[str, Any], current: Mapping[str, Any], owner: str, remedy: str) -> None:
    """Refuse a checkpoint whose options that shape the saved state (``saved``) differ from this
    object's (``current``, by name): ``ValueError`` naming the first that differs, its two values and
    ``remedy``."""
    for name, value in current.items():
        if saved.get(name) != value:
            raise ValueError(f"checkpoint was saved with {name}={saved.get(name)!r} but this {owner} has "
                             f"{name}={value!r}; {remedy}")


#: ``format`` of a state_dict whose per-rank part is keyed by the global rank (:func:`per_rank_state`).
PER_RANK_FORMAT = "gradpress.per_rank"

_WORLD_SIZE_POLICIES = ("raise", "fresh")


def check_world_size_policy(on_world_size_change: Any) -> str:
    """``on_world_size_change`` checked: ``"raise"`` or ``"fresh"`` (``ValueError`` naming both)."""
    if on_world_size_change not in _WORLD_SIZE_POLICIES:
        raise ValueError(f"on_world_size_change must be one of {_WORLD_SIZE_POLICIES}, got {on_world_size_change!r}")
    return str(on_world_size_change)


def per_rank_state(local: Any, shared: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """A state_dict that ``torch.distributed.checkpoint`` keeps per rank: ``local`` (this rank's own
    values: error memory, residuals, counters of its bytes) serialized under the key
    ``per_rank.rank_<global rank>``, which no other rank saves, so DCP neither deduplicates it nor
    needs a template of its tensors' shapes (a fresh object's ``state_dict()`` holds its own entry,
    which DCP's in-place load replaces with the saved one); ``world_size`` (the default group's,
    identical on every rank, kept once) says how many ranks saved theirs. ``shared``: values identical
    on every rank (counters) or sharded (DTensors), merged in as they are. The same dict goes through
    ``torch.save`` and :func:`gather_state`; :func:`read_per_rank` reads it back."""
    here = placement()  # in the default group
    rank, world = here["rank"], here["world_size"]
    payload = io.BytesIO()
    torch.save(to_cpu(local), payload)
    return {**(shared or {}), "format": PER_RANK_FORMAT, "world_size": world,
            "per_rank": {f"rank_{rank}": payload.getvalue()}}


def read_per_rank(state: Mapping[str, Any], owner: str, *, on_world_size_change: str = "raise",
                  allow_other_rank: bool = False,
                  portable: Callable[[Any], str | None] | None = None) -> tuple[Any, bool]:
    """``(this rank's values, True)`` from :func:`per_rank_state`'s dict, or ``(None, False)`` where
    they start fresh. A dict of another format (checkpoints from before this layout) comes back as it
    is, ``(state, True)``.

    Saved by another world size (``world_size`` differs; after a DCP load into a larger world with
    ``allow_partial_load`` a new rank keeps its own template entry, and ``world_size`` is the saved one),
    or holding no entry at all: ``on_world_size_change="raise"``
    raises a ``ValueError`` naming both sizes and the remedy; ``"fresh"`` returns ``(None, False)`` (the
    per-rank values start as constructed; what is sharded or identical on every rank still loads).
    A dict of this world size holding only other ranks' entries (rank 0's file loaded on rank 1) raises a
    ``ValueError`` naming both ranks, whatever ``on_world_size_change``; ``allow_other_rank``: a dict
    holding one other rank's entry gives that entry (on purpose). ``portable(entry)`` says whether such
    an entry can serve this rank anyway: ``None`` where nothing in it belongs to the rank that saved it
    (counters, an inner optimizer's state that PyTorch's own wrapper hands every rank: rank 0's
    ``torch.save`` loaded everywhere), else what would be lost or misapplied (error memory, residuals),
    which the refusal names."""
    check_world_size_policy(on_world_size_change)
    if state.get("format") != PER_RANK_FORMAT:
        return state, True
    here = placement()  # in the default group
    rank, world = here["rank"], here["world_size"]
    entries = state.get("per_rank") or {}
    blob = entries.get(f"rank_{rank}")
    if not blob and allow_other_rank:
        saved = [b for b in entries.values() if b]
        blob = saved[0] if len(saved) == 1 else None
    saved_world = int(state.get("world_size", 0))
    if blob and (saved_world == world or allow_other_rank):
        return torch.load(io.BytesIO(bytes(blob)), weights_only=True), True
    others = sorted(key for key, value in entries.items() if value and key != f"rank_{rank}")
    if not blob and saved_world == world and others:  # one rank's file loaded on another: not a new world
        what = "its error memory is per rank"
        if portable is not None and len(others) == 1:
            entry = torch.load(io.BytesIO(bytes(entries[others[0]])), weights_only=True)
            why = portable(entry)
            if why is None:
                logger.info("%s: rank %d loads the per-rank entry of %s, which holds nothing that belongs to "
                            "that rank alone", owner, rank, others[0])
                return entry, True
            what = f"it holds per-rank state that would be lost or misapplied here: {why}"
        raise ValueError(
            f"{owner} checkpoint was saved with rank={others[0].removeprefix('rank_')} but this process has "
            f"rank={rank} (it holds the per-rank state of {', '.join(others)} of {saved_world} ranks, none of "
            f"rank_{rank}); {what}: load each rank's own, or pass allow_other_rank=True to load it anyway")
    if on_world_size_change == "fresh":
        logger.warning("%s: the checkpoint was saved by %s ranks, this run has %d (rank %d): "
                       "on_world_size_change='fresh', this rank's per-rank state starts fresh", owner,
                       saved_world, world, rank)
        return None, False
    key = dcp_load_key()
    dcp_way = (f"dcp.load({{{'key' if key is None else repr(key)}: gradpress.checkpoint.dcp_stateful(obj, 'fresh')}}, "
               "checkpoint_id=...) (dcp.load itself has no on_world_size_change)")
    plain_way = "obj.load_state_dict(state, on_world_size_change='fresh')"
    ways = (f"through torch.distributed.checkpoint, as here, {dcp_way}; through load_state_dict, {plain_way}"
            if key is not None else f"through load_state_dict, {plain_way}; through torch.distributed.checkpoint, "
            f"{dcp_way}")
    raise ValueError(
        f"{owner} checkpoint was saved by {saved_world} ranks, this run has {world} (rank {rank} finds "
        f"{'no entry of its own' if not blob else 'the entry of a rank of another run'}): per-rank state "
        f"(error memory, residuals) cannot be split or merged across world sizes. To resume without it: {ways}. "
        f"Each rank's per-rank state then starts fresh, which costs a few steps of quality; sharded and shared "
        f"state still loads. To load into a larger world through torch.distributed.checkpoint, also pass "
        f"planner=DefaultLoadPlanner(allow_partial_load=True)")


def _dcp_load_frame(limit: int = 16) -> Any:
    """The frame of ``torch.distributed.checkpoint.load`` among the callers (``None``: not inside one).
    How a ``Stateful`` learns that DCP is loading it, and under which key: DCP tells it nothing."""
    frame: FrameType | None = sys._getframe(1)
    for _ in range(limit):
        if frame is None:
            return None
        code = frame.f_code
        if code.co_name == "load" and code.co_filename.replace("\\", "/").endswith(
                "torch/distributed/checkpoint/state_dict_loader.py"):
            return frame
        frame = frame.f_back
    return None


def dcp_load_key() -> str | None:
    """The key of the ``Stateful`` that ``torch.distributed.checkpoint.load`` is loading now (``None``:
    not inside a DCP load), so that a refusal can say how to load that key instead."""
    frame = _dcp_load_frame()
    key = None if frame is None else frame.f_locals.get("key")
    return key if isinstance(key, str) else None


def dcp_saved_keys() -> tuple[str, set[str]] | None:
    """``(key, the checkpoint's keys)`` when the caller's caller is ``torch.distributed.checkpoint.load``
    asking a ``Stateful`` for its template, directly or through :class:`dcp_stateful`; ``None``
    otherwise, or if the checkpoint's metadata cannot be read here (DCP then reports it). Lets a
    ``state_dict()`` compare what DCP is about to load into it with what the checkpoint holds, before
    DCP's own "Missing key" (which does not say what differs)."""
    frame: FrameType | None = sys._getframe(2)
    if frame is not None and frame.f_code is dcp_stateful.state_dict.__code__:
        frame = frame.f_back
    if frame is None or _dcp_load_frame() is not frame:
        return None
    key, reader = frame.f_locals.get("key"), frame.f_locals.get("storage_reader")
    if not isinstance(key, str) or reader is None:
        return None
    try:
        return key, set(reader.read_metadata().state_dict_metadata)
    except Exception:  # noqa: BLE001  (a reader that cannot tell yet: DCP's own errors stand)
        return None


class dcp_stateful:  # noqa: N801  (used like a function)
    """``obj`` (a ``PowerSGDState``, a ``PowerSGD`` aggregator, an averager, a ``PostLocalSGDOptimizer``)
    as a ``torch.distributed.checkpoint`` Stateful whose load applies ``on_world_size_change``: with
    ``"fresh"``, a checkpoint saved by another world size loads its sharded and shared parts, and the
    per-rank parts (error memory, residuals) start fresh, as :func:`scatter_state`'s option does. The
    objects themselves are Stateful already; they raise on another world size.

    >>> dcp.load({"powersgd": gradpress.checkpoint.dcp_stateful(state, "fresh")}, checkpoint_id=path,  # doctest: +SKIP
    ...          planner=DefaultLoadPlanner(allow_partial_load=True))   # a larger world: no entry of its own
    """

    def __init__(self, obj: Any, on_world_size_change: str = "fresh") -> None:
        self.obj = obj
        self.on_world_size_change = check_world_size_policy(on_world_size_change)

    def state_dict(self) -> dict[str, Any]:
        return self.obj.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.obj.load_state_dict(state_dict, on_world_size_change=self.on_world_size_change)

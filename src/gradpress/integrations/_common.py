"""What the framework adapters share: argument checks and the per-rank checkpoint entry.

A *rank entry* is what one process must save to resume exactly: ``{"comm_state": ..., "averager": ...}``
(each key present only when there is something to save), holding plain CPU tensors and numbers, so it
loads with ``torch.load(weights_only=True)`` on any device. It belongs to the rank that made it.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from typing import Any, Callable, Literal, overload

import torch.distributed as dist

from ..checkpoint import placement, to_cpu
from ..hooks.bucket import check_hook as _check_hook

#: Version of the layout written by the adapters (inside each framework's checkpoint).
FORMAT_VERSION = 1


@overload
def check_hook(hook: Any, name: str = ..., *, allow_none: Literal[False] = ...) -> Callable[..., Any]: ...
@overload
def check_hook(hook: Any, name: str = ..., *, allow_none: bool) -> Callable[..., Any] | None: ...


def check_hook(hook: Any, name: str = "hook", *, allow_none: bool = False) -> Callable[..., Any] | None:
    """``hook`` itself if it is callable (or ``None`` when allowed); ``TypeError`` naming ``name`` otherwise."""
    if hook is None and allow_none:
        return None
    return _check_hook(hook, name=name)


def is_stateful(obj: Any) -> bool:
    """Whether ``obj`` has ``state_dict()`` and ``load_state_dict()`` (what the adapters checkpoint)."""
    return callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None))


def check_averager(averager: Any, name: str = "model_averager") -> None:
    """A gradpress :class:`~gradpress.averaging.ModelAverager` or a zero-argument factory of one."""
    from ..averaging import ModelAverager

    if averager is None or isinstance(averager, ModelAverager):
        return
    if isinstance(averager, type) or not callable(averager):
        raise TypeError(f"{name} must be a gradpress model averager (PeriodicModelAverager, "
                        "HierarchicalModelAverager, OuterOptimizerAverager) or a function with no arguments "
                        f"that returns one, got {type(averager).__name__}: {averager!r}")


def build_averager(averager: Any, name: str = "model_averager") -> Any:
    """The averager itself, or what its factory returns (checked)."""
    from ..averaging import ModelAverager

    if averager is None or isinstance(averager, ModelAverager):
        return averager
    built = averager()
    if not isinstance(built, ModelAverager):
        raise TypeError(f"{name}() must return a gradpress model averager, got {type(built).__name__}")
    return built


def rank_and_world() -> tuple[int, int]:
    """``(rank, world size)`` of the default group; ``(0, 1)`` when ``torch.distributed`` is not running."""
    where = placement()
    return where["rank"], where["world_size"]


def _warn(message: str, *args: Any) -> None:
    warnings.warn(message % args, UserWarning, stacklevel=3)


def _is_process_group(obj: Any) -> bool:
    return isinstance(obj, dist.ProcessGroup)


def rank_entry(comm_state: Any, averager: Any) -> dict[str, Any]:
    """This rank's state to checkpoint: the hook state's and the averager's ``state_dict()``, on CPU.

    A hook state without ``state_dict`` (PyTorch's ``PowerSGDState``, a plain object) is not saved, with
    a warning; ``None`` and process groups (the state of ``allreduce_hook``/``fp16_compress_hook``) hold
    nothing to save.
    """
    entry: dict[str, Any] = {}
    if is_stateful(comm_state):
        entry["comm_state"] = to_cpu(comm_state.state_dict())
    elif comm_state is not None and not _is_process_group(comm_state):
        _warn("the DDP communication state %s has no state_dict(): it is not checkpointed, and a resumed "
                       "run starts it afresh", type(comm_state).__name__)
    if averager is not None:
        entry["averager"] = to_cpu(averager.state_dict())
    return entry


def restore_rank_entry(entry: Mapping[str, Any], comm_state: Any, averager: Any, source: str) -> None:
    """Load ``entry`` (from :func:`rank_entry`) into ``comm_state`` and ``averager``.

    An entry part with nowhere to go, or an object with no saved part, is a warning (a run may resume with
    a different method on purpose); the load itself raises what the object raises (e.g. ``ValueError`` for
    a PowerSGD checkpoint made with another rank).
    """
    saved_comm = entry.get("comm_state")
    if saved_comm is not None:
        if is_stateful(comm_state):
            comm_state.load_state_dict(saved_comm)
        else:
            _warn("%s holds DDP communication-hook state, but this run's hook state (%s) cannot load it; "
                           "it is ignored", source, type(comm_state).__name__)
    elif is_stateful(comm_state):
        _warn("%s holds no gradpress hook state: the %s starts afresh", source, type(comm_state).__name__)
    saved_averager = entry.get("averager")
    if saved_averager is not None:
        if averager is not None:
            averager.load_state_dict(saved_averager)
        else:
            _warn("%s holds model-averager state, but this run has no model averager; it is ignored",
                           source)
    elif averager is not None:
        _warn("%s holds no model-averager state: the %s starts at step 0", source,
                       type(averager).__name__)


def check_saved_world(saved: Mapping[str, Any], world: int, source: str) -> None:
    """``ValueError`` unless ``saved`` (a gradpress checkpoint header) was written by ``world`` ranks."""
    version = saved.get("version")
    if version != FORMAT_VERSION:
        raise ValueError(f"{source}: unsupported gradpress checkpoint format {version!r} (expected {FORMAT_VERSION})")
    saved_world = int(saved["world_size"])
    if saved_world != world:
        raise ValueError(
            f"{source} holds the gradpress hook state of {saved_world} ranks, but this run has {world}: "
            "error memory belongs to one rank and cannot be split or merged. Resume with the same number of "
            "processes, or remove the gradpress entry from the checkpoint to start the hook state afresh.")

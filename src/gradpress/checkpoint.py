"""Atomic checkpoint files.

``save(obj, path)`` writes to a temporary file in the same directory, flushes and fsyncs it, then
``os.replace``-s it over ``path``: a crash mid-write never leaves a half-written file under ``path``.
``load(path)`` raises a ``ValueError`` naming the file when it is truncated or corrupt, instead of a
pickle/zip traceback.

>>> import tempfile, os
>>> d = tempfile.mkdtemp()
>>> save({"step": 3}, os.path.join(d, "ckpt.pt"))
>>> load(os.path.join(d, "ckpt.pt"))["step"]
3
"""
from __future__ import annotations

import os
import pickle
import tempfile
import zipfile
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist

from .comm import gather_objects, scatter_objects

__all__ = ["save", "load", "placement", "check_placement", "gather_state", "scatter_state", "state_nbytes",
           "to_cpu"]


def save(obj: Any, path: str | os.PathLike[str]) -> None:
    """Save ``obj`` with ``torch.save`` atomically (temp file in the same directory, fsync, ``os.replace``)."""
    path = os.fspath(path)
    directory = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(path)}.", suffix=".tmp", dir=directory)
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    try:  # make the rename itself durable; not possible on every platform
        dfd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(dfd)
    except OSError:
        pass
    finally:
        os.close(dfd)


def load(path: str | os.PathLike[str], map_location: Any = None, *, weights_only: bool = True) -> Any:
    """Load a checkpoint written by :func:`save` (or ``torch.save``).

    Raises ``FileNotFoundError`` if ``path`` does not exist and ``ValueError`` naming the file if it is
    truncated or corrupt.
    """
    path = os.fspath(path)
    if not os.path.exists(path):
        raise FileNotFoundError(f"checkpoint file {path!r} does not exist")
    size = os.path.getsize(path)
    try:
        return torch.load(path, map_location=map_location, weights_only=weights_only)
    except pickle.UnpicklingError as e:
        if "Weights only load failed" in str(e) and zipfile.is_zipfile(path):
            raise  # a well-formed checkpoint holding objects weights_only refuses: not corruption
        raise _corrupt(path, size, e) from e
    except (EOFError, zipfile.BadZipFile, UnicodeDecodeError) as e:
        raise _corrupt(path, size, e) from e
    except (PermissionError, IsADirectoryError, FileNotFoundError):
        raise
    except OSError as e:  # torch's zip reader reports a cut-off archive as EINVAL
        raise _corrupt(path, size, e) from e
    except RuntimeError as e:
        msg = str(e)
        if any(s in msg for s in ("zip archive", "central directory", "PytorchStreamReader",
                                  "invalid header", "file too short")):
            raise _corrupt(path, size, e) from e
        raise


def _corrupt(path: str, size: int, e: BaseException) -> ValueError:
    detail = str(e).split(". ")[0].strip() or "unexpected end of file"
    return ValueError(f"checkpoint file {path!r} ({size} bytes) is truncated or corrupt "
                      f"({type(e).__name__}: {detail})")


def to_cpu(obj: Any) -> Any:
    """``obj`` with every tensor detached and moved to the CPU (mappings, lists and tuples walked)."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu()
    if isinstance(obj, Mapping):
        return {key: to_cpu(value) for key, value in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(to_cpu(value) for value in obj)
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


#: ``format`` of what :func:`gather_state` returns on its destination rank.
GATHERED_FORMAT = "gradpress.gathered_state"


def gather_state(state: Any, dst: int = 0, process_group: Any = None) -> dict[str, Any] | None:
    """Every rank's ``state.state_dict()`` on rank ``dst``, for scripts that save one checkpoint on rank 0.

    ``state`` is anything with ``state_dict()``/``load_state_dict()`` whose state is per rank: a
    ``PowerSGDState``, a ``PowerSGD`` aggregator, an averager. **A collective**: every rank calls it at
    the same step (decide on rank 0 and broadcast the decision first if only rank 0 knows it). On
    ``dst`` it returns ``{"format", "world_size", "ranks": [rank 0's state_dict, ...]}`` (tensors on the
    CPU), to put in the checkpoint; elsewhere ``None``. Size: the world size times one rank's state (a
    PowerSGD state is about the fp32 size of the compressed gradients, see :func:`state_nbytes`).

    >>> if step % eval_interval == 0:                                              # doctest: +SKIP
    ...     hooks = gradpress.checkpoint.gather_state(state)        # on every rank
    ...     if rank == 0:
    ...         torch.save({"model": model.module.state_dict(), "powersgd": hooks}, "ckpt.pt")
    """
    entry = to_cpu(state.state_dict())
    gathered = gather_objects(entry, dst, process_group)
    if gathered is None:
        return None
    return {"format": GATHERED_FORMAT, "version": 1, "world_size": dist.get_world_size(process_group),
            "ranks": gathered}


def scatter_state(state: Any, gathered: dict[str, Any] | None, src: int = 0, process_group: Any = None) -> None:
    """Load each rank's own entry of :func:`gather_state`'s result into ``state``: rank ``src`` passes
    the dict it read from its checkpoint, the other ranks ``None``. **A collective**: every rank calls it.

    If ``gathered`` is not such a dict, or was saved with another world size, every rank raises the
    same ``ValueError`` (the other ranks do not wait for a timeout). Each entry then goes through
    ``state.load_state_dict``, which checks the options, shapes, rank and world size as usual.
    """
    world = dist.get_world_size(process_group)
    objs = None
    if dist.get_rank(process_group) == src:
        problem = _gathered_problem(gathered, world)
        objs = [problem] * world if problem else list(gathered["ranks"])  # type: ignore[index]
    entry = scatter_objects(objs, src, process_group)
    if isinstance(entry, str):
        raise ValueError(entry)
    state.load_state_dict(entry)


def state_nbytes(state_dict: Any) -> int:
    """Bytes of the tensors in a (nested) state dict: what one rank's hook state adds to a checkpoint.
    For ``PowerSGDState`` it is the error memory (fp32 ``n x m`` per compressed matrix, i.e. about the
    size of those gradients in fp32) plus the warm-start factors (``m x r``, and ``n x r`` with
    ``num_iters_per_step``)."""
    if isinstance(state_dict, torch.Tensor):
        return state_dict.numel() * state_dict.element_size()
    if isinstance(state_dict, dict):
        return sum(state_nbytes(value) for value in state_dict.values())
    if isinstance(state_dict, (list, tuple)):
        return sum(state_nbytes(value) for value in state_dict)
    return 0


def _gathered_problem(gathered: Any, world: int) -> str | None:
    if not isinstance(gathered, dict) or gathered.get("format") != GATHERED_FORMAT:
        return (f"scatter_state expects on its source rank what gather_state returned (a dict with "
                f"format={GATHERED_FORMAT!r}), got {type(gathered).__name__}")
    if gathered.get("world_size") != world or len(gathered.get("ranks", ())) != world:
        return (f"the gathered hook state was saved by {gathered.get('world_size')!r} ranks, this run has {world}: "
                "per-rank state (error memory) cannot be split or merged across world sizes")
    return None

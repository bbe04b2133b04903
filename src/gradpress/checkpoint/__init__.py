"""Atomic checkpoint files, rank-0 checkpoints of per-rank state (:func:`gather_state`), and the per-rank
layout every stateful object's ``state_dict()`` uses (:mod:`gradpress.checkpoint.per_rank`, re-exported).

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

import io
import logging
import math
import os
import pickle
import tempfile
import zipfile
from collections.abc import Mapping
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from ..comm import gather_objects, scatter_objects
from .per_rank import (PER_RANK_FORMAT, check_placement, check_saved_options, check_world_size_policy, dcp_load_key,
                       dcp_saved_keys, dcp_stateful, per_rank_state, placement, read_per_rank, to_cpu,
                       clone_tensors)

__all__ = ["save", "load", "placement", "check_placement", "check_saved_options", "reject_gathered", "gather_state",
           "scatter_state", "state_nbytes", "to_cpu", "clone_tensors", "ARRIVAL_TIMEOUT", "PER_RANK_FORMAT",
           "per_rank_state", "read_per_rank", "check_world_size_policy", "dcp_load_key", "dcp_saved_keys",
           "dcp_stateful"]

logger = logging.getLogger(__name__)


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


#: ``format`` of what :func:`gather_state` returns on its destination rank.
GATHERED_FORMAT = "gradpress.gathered_state"

#: Seconds :func:`gather_state` and :func:`scatter_state` wait for every rank of the group to call them
#: before raising (instead of waiting in the collective for the process group's timeout, 30 minutes by
#: default). Long enough for ranks that reach the call at different times (rank 0 evaluating alone first),
#: short enough that a call made on rank 0 only fails within a minute.
ARRIVAL_TIMEOUT = 60.0

# A count above this many arrivals means a rank gave up waiting and closed the call (see _await_every_rank).
_CLOSED = 1 << 40


def reject_gathered(state_dict: Any, where: str) -> None:
    """Raise a ``ValueError`` if ``state_dict`` is what :func:`gather_state` returned (every rank's state,
    not one rank's): ``load_state_dict`` methods call it first, so that such a dict is not reported as a
    missing key. ``where`` names the caller, e.g. ``"PowerSGDState.load_state_dict"``."""
    if isinstance(state_dict, Mapping) and state_dict.get("format") == GATHERED_FORMAT:
        ranks = state_dict.get("world_size", len(state_dict.get("ranks", ())))
        raise ValueError(
            f"{where} got a gathered state of {ranks} ranks (what gradpress.gather_state returns), not one "
            f"rank's state_dict: use gradpress.scatter_state(state, gathered if rank == 0 else None) on every "
            "rank, which hands each rank its own entry")


def gather_state(state: Any, dst: int = 0, process_group: Any = None, *,
                 arrival_timeout: float | None = ARRIVAL_TIMEOUT) -> dict[str, Any] | None:
    """Every rank's ``state.state_dict()`` on rank ``dst``, for scripts that save one checkpoint on rank 0.

    ``state`` is anything with ``state_dict()``/``load_state_dict()`` whose state is per rank: a
    ``PowerSGDState``, a ``PowerSGD`` aggregator, an averager. **A collective**: every rank calls it at
    the same iteration (decide on rank 0 and broadcast the decision first if only rank 0 knows it). On
    ``dst`` it returns ``{"format", "world_size", "ranks": [rank 0's state_dict, ...]}`` (tensors on the
    CPU), to put in the checkpoint; elsewhere ``None``. Size: the world size times one rank's state (a
    PowerSGD state is about the fp32 size of the compressed gradients, see :func:`state_nbytes`).

    ``arrival_timeout``: seconds to wait for every rank to call it (``None``: no such check, only the
    process group's timeout). A rank that waits longer raises a ``RuntimeError`` saying that every rank
    must call ``gather_state`` at the same iteration: the mistake of calling it inside ``if rank == 0:``
    otherwise hangs until the process group's timeout. The check is a few messages through the process
    group's store, whatever the backend; the last rank to leave it deletes the call's keys, so the store
    holds no more keys after a call than before it, however many calls a run makes (where the store can
    delete keys, as TCPStore and FileStore can; a call that not every rank reaches keeps its few keys).

    >>> if step % eval_interval == 0:                                              # doctest: +SKIP
    ...     hooks = gradpress.checkpoint.gather_state(state)        # on every rank
    ...     if rank == 0:
    ...         torch.save({"model": model.module.state_dict(), "powersgd": hooks}, "ckpt.pt")
    """
    _check_arrival_timeout(arrival_timeout)
    _await_every_rank("gather_state", process_group, arrival_timeout)
    entry = to_cpu(state.state_dict())
    gathered = gather_objects(entry, dst, process_group)
    if gathered is None:
        return None
    return {"format": GATHERED_FORMAT, "version": 1, "world_size": dist.get_world_size(process_group),
            "ranks": gathered}


def scatter_state(state: Any, gathered: dict[str, Any] | None, src: int = 0, process_group: Any = None, *,
                  on_world_size_change: str = "raise", arrival_timeout: float | None = ARRIVAL_TIMEOUT) -> bool:
    """Load each rank's own entry of :func:`gather_state`'s result into ``state``: rank ``src`` passes
    the dict it read from its checkpoint, the other ranks ``None``. **A collective**: every rank calls it
    (``arrival_timeout`` as in :func:`gather_state`, leaving no keys in the store either). Returns ``True``
    where the entry was loaded.

    If ``gathered`` is not such a dict, every rank raises the same ``ValueError`` (the other ranks do not
    wait for a timeout). If it was saved with another world size, per-rank state cannot be split or
    merged: ``on_world_size_change="raise"`` (the default) raises that ``ValueError`` on every rank;
    ``"fresh"`` leaves ``state`` as constructed on every rank and returns ``False`` (the run goes on
    without the saved error memory, which costs a few steps of quality; a fresh ``PowerSGDState`` also
    sends plain allreduce again for its ``start_powerSGD_iter`` iterations). Each entry goes through
    ``state.load_state_dict``, which checks the options, shapes, rank and world size as usual.
    """
    if on_world_size_change not in ("raise", "fresh"):
        raise ValueError(f"on_world_size_change must be 'raise' or 'fresh', got {on_world_size_change!r}")
    _check_arrival_timeout(arrival_timeout)
    _await_every_rank("scatter_state", process_group, arrival_timeout)
    world = dist.get_world_size(process_group)
    objs = None
    if dist.get_rank(process_group) == src:
        problem, other_world = _gathered_problem(gathered, world)
        if problem is None:
            objs = list(gathered["ranks"])  # type: ignore[index]
        elif other_world and on_world_size_change == "fresh":
            logger.warning("the gathered state was saved by %s ranks, this run has %d: "
                           "on_world_size_change='fresh', every rank goes on without it",
                           gathered.get("world_size"), world)  # type: ignore[union-attr]
            objs = [_FRESH] * world
        else:
            objs = [problem] * world
    entry = scatter_objects(objs, src, process_group)
    if entry == _FRESH:
        return False
    if isinstance(entry, str):
        raise ValueError(entry)
    state.load_state_dict(entry)
    return True


# What scatter_state hands every rank that is to keep its state as constructed (a string: every rank's
# entry goes through pickling, so an object's identity would not survive).
_FRESH = "gradpress.scatter_state: start fresh"


def _check_arrival_timeout(arrival_timeout: Any) -> None:
    if arrival_timeout is None:
        return
    if isinstance(arrival_timeout, bool) or not isinstance(arrival_timeout, (int, float)) or not (
            arrival_timeout > 0 and math.isfinite(arrival_timeout)):
        raise ValueError(f"arrival_timeout must be None or a finite number of seconds > 0, got {arrival_timeout!r}")


# How many times this process entered each checked call, per (call, group): the n-th call of every rank
# meets the others' n-th call under the same store keys.
_ARRIVALS: dict[tuple[str, tuple[int, ...]], int] = {}


def _group_store(process_group: Any) -> Any:
    """The store the process group was set up with (shared by every rank), or ``None`` if torch does not
    expose it."""
    try:
        from torch.distributed import distributed_c10d

        return distributed_c10d._get_default_store()
    except Exception:  # pragma: no cover - a torch without it: the check is skipped
        return None


def _await_every_rank(name: str, process_group: Any, timeout: float | None) -> None:
    """Return once every rank of ``process_group`` has entered its call to ``name`` (as many times as this
    rank); raise a ``RuntimeError`` saying so if they have not within ``timeout`` seconds.

    Through the store: each rank adds 1 to the call's counter, the rank that brings it to the world size
    sets ``go``, the others wait for ``go``. A rank that times out adds ``_CLOSED``: a rank arriving after
    that sees the door closed and raises at once, instead of entering a collective its peers have left.
    Every decision follows from the order of those atomic additions, so the ranks agree on it.

    Every rank then adds 1 to the call's ``left`` counter, after its last read of the call's keys, whether
    it returns or raises: the rank that brings it to the world size knows no rank will read them again
    and deletes them (a call's keys are never reused: each call has its own ``count``).
    """
    if timeout is None:
        return
    world = dist.get_world_size(process_group)
    store = _group_store(process_group) if world > 1 else None
    if store is None:
        return
    from ..launch import restart_store_prefix

    ranks = tuple(dist.get_process_group_ranks(process_group)) if process_group is not None else ()
    count = _ARRIVALS[(name, ranks)] = _ARRIVALS.get((name, ranks), 0) + 1
    attempt = restart_store_prefix() or ""
    base = f"gradpress/arrivals/{attempt}/{name}/{','.join(map(str, ranks)) or 'world'}/{count}"
    try:
        _meet(store, base, name, dist.get_rank(process_group), world, timeout)
    except BaseException:
        try:  # the error this rank raises matters more than a store that fails to clean up
            _leave(store, base, world)
        except Exception:
            pass
        raise
    _leave(store, base, world)


def _leave(store: Any, base: str, world: int) -> None:
    """Count this rank out of the call under ``base``; the last rank out deletes the call's keys."""
    if store.add(f"{base}/left", 1) != world:
        return
    for key in ("arrived", "go", "left"):
        try:
            store.delete_key(f"{base}/{key}")
        except (NotImplementedError, RuntimeError):  # a store that cannot delete keys keeps them, as before
            return


def _meet(store: Any, base: str, name: str, rank: int, world: int, timeout: float) -> None:
    """The arrival check of :func:`_await_every_rank` under the store keys ``base``."""
    arrived = store.add(f"{base}/arrived", 1)
    if arrived >= _CLOSED:
        raise RuntimeError(_arrival_message(name, rank, world, timeout, None, late=True))
    if arrived == world:
        store.set(f"{base}/go", b"1")
        return
    try:
        store.wait([f"{base}/go"], timedelta(seconds=timeout))
        return
    except RuntimeError:  # torch.distributed.DistStoreError: the peers did not all arrive in time
        pass
    now = store.add(f"{base}/arrived", _CLOSED)
    if now // _CLOSED == 1:  # this rank closed the call: it went ahead only if everyone was in
        if now % _CLOSED == world:
            return
        raise RuntimeError(_arrival_message(name, rank, world, timeout, now % _CLOSED))
    # Another rank closed it first and decided: the last arrival, if it came before, sets go at once.
    try:
        store.wait([f"{base}/go"], timedelta(seconds=5))
        return
    except RuntimeError:
        raise RuntimeError(_arrival_message(name, rank, world, timeout, None)) from None


def _arrival_message(name: str, rank: int, world: int, timeout: float, arrived: int | None,
                     late: bool = False) -> str:
    if late:
        what = (f"rank {rank} called {name} after another rank had waited arrival_timeout={timeout:g} s for it "
                "and given up")
    else:
        seen = "" if arrived is None else f" ({arrived} of {world} arrived)"
        what = f"rank {rank} waited arrival_timeout={timeout:g} s for the other ranks to call {name}{seen}"
    return (f"{what}: every rank must call {name} at the same iteration. It is a collective: call it "
            "outside `if rank == 0:` (if only rank 0 decides to save, broadcast that decision first and "
            f"call {name} on every rank). If a rank is only late (rank 0 evaluating alone before the call), "
            "call it before that work or pass a larger arrival_timeout")


def state_nbytes(state_dict: Any) -> int:
    """Bytes of the tensors in a (nested) state dict: what one rank's hook state adds to a checkpoint.
    For ``PowerSGDState`` it is the error memory (fp32 ``n x m`` per compressed matrix, i.e. about the
    size of those gradients in fp32) plus the warm-start factors (``m x r``, and ``n x r`` with
    ``num_iters_per_step``)."""
    if isinstance(state_dict, torch.Tensor):
        return state_dict.numel() * state_dict.element_size()
    if isinstance(state_dict, (bytes, bytearray)) and state_dict:  # a per-rank entry (per_rank_state)
        return state_nbytes(torch.load(io.BytesIO(bytes(state_dict)), weights_only=True))
    if isinstance(state_dict, Mapping):
        return sum(state_nbytes(value) for value in state_dict.values())
    if isinstance(state_dict, (list, tuple)):
        return sum(state_nbytes(value) for value in state_dict)
    return 0


def _gathered_problem(gathered: Any, world: int) -> tuple[str | None, bool]:
    """Why ``gathered`` cannot be scattered over ``world`` ranks (``None`` if it can), and whether the reason
    is only its world size."""
    if not isinstance(gathered, dict) or gathered.get("format") != GATHERED_FORMAT:
        return (f"scatter_state expects on its source rank what gather_state returned (a dict with "
                f"format={GATHERED_FORMAT!r}), got {type(gathered).__name__}"), False
    if gathered.get("world_size") != world or len(gathered.get("ranks", ())) != world:
        return (f"the gathered hook state was saved by {gathered.get('world_size')!r} ranks, this run has {world}: "
                "per-rank state (error memory) cannot be split or merged across world sizes. To resume without "
                "it, call gradpress.scatter_state(state, gathered, on_world_size_change='fresh') on every rank: "
                "each rank's error memory then starts from zero, which costs a few steps of quality; load the "
                "model and optimizer as usual"), True
    return None, False

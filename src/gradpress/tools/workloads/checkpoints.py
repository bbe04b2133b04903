"""Per-rank training checkpoints for :func:`gradpress.tools.workloads.train` (``examples/train.py``,
``--checkpoint-dir``): atomic files, resume from the newest step that *every* rank completed.

Layout: ``DIR/<method>/step-<00000040>.rank-<R>.pt``, one file per rank and step, written with
:func:`gradpress.checkpoint.save` (temporary file, fsync, rename), so a file that exists is whole. A
worker killed mid-save leaves the previous step as the newest complete one: resuming takes the newest
step for which all ranks hold a file (agreed with one ``all_gather_object``, so each node may keep its
ranks' files on its own disk). After every rank has saved a step, each rank deletes its older files.

>>> # inside each worker, after dist.init_process_group(...)                     # doctest: +SKIP
>>> step = newest_common_step(directory, rank, world_size)     # None: start from scratch
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from typing import Any

from ... import checkpoint
from ...comm import all_gather_objects

__all__ = ["checkpoint_path", "load", "load_everywhere", "newest_common_step", "prune", "run_directory", "save",
           "steps_saved"]

_FILE = re.compile(r"^step-(\d+)\.rank-(\d+)\.pt$")


def run_directory(root: str | os.PathLike[str], method_spec: str) -> str:
    """The folder of one method's checkpoints under ``root`` (``powersgd:2`` -> ``root/powersgd-2``)."""
    return os.path.join(os.fspath(root), re.sub(r"[^A-Za-z0-9_.-]", "-", method_spec))


def checkpoint_path(directory: str, step: int, rank: int) -> str:
    """``directory/step-00000040.rank-1.pt``."""
    return os.path.join(directory, f"step-{step:08d}.rank-{rank}.pt")


def steps_saved(directory: str, rank: int) -> list[int]:
    """The steps for which ``rank`` has a (complete: written atomically) file in ``directory``, ascending."""
    if not os.path.isdir(directory):
        return []
    steps = []
    for name in os.listdir(directory):
        found = _FILE.match(name)
        if found and int(found.group(2)) == rank:
            steps.append(int(found.group(1)))
    return sorted(steps)


def newest_common_step(directory: str, rank: int, world_size: int) -> int | None:
    """The newest step every rank has saved (``None``: none). A collective over the default group when
    ``world_size > 1``: every rank calls it."""
    mine = steps_saved(directory, rank)
    everyone: list[Any] = [mine]
    if world_size > 1:
        everyone = all_gather_objects(mine, issuer="newest_common_step")
    common = set(everyone[0]).intersection(*everyone[1:])
    return max(common) if common else None


def prune(directory: str, rank: int, keep_from: int) -> None:
    """Delete ``rank``'s files for steps before ``keep_from`` (call once every rank has saved ``keep_from``)."""
    for step in steps_saved(directory, rank):
        if step < keep_from:
            try:
                os.unlink(checkpoint_path(directory, step, rank))
            except FileNotFoundError:
                pass


def save(directory: str, step: int, rank: int, state: dict[str, Any]) -> None:
    """Write ``rank``'s ``state`` for ``step`` atomically (creating ``directory`` if needed)."""
    os.makedirs(directory, exist_ok=True)
    checkpoint.save(state, checkpoint_path(directory, step, rank))


def load(directory: str, step: int, rank: int) -> dict[str, Any]:
    """Read ``rank``'s file for ``step`` (``ValueError`` naming the file when it is corrupt)."""
    return checkpoint.load(checkpoint_path(directory, step, rank), map_location="cpu")


def load_everywhere(directory: str, step: int, rank: int, world_size: int,
                    check: Callable[[dict[str, Any], str], None] | None = None) -> dict[str, Any]:
    """:func:`load` ``rank``'s file for ``step`` and run ``check(state, path)`` on it; a collective:
    if any rank's file is corrupt or fails the check, *every* rank raises ``ValueError`` with that
    rank's message (rather than the others blocking in their next collective until the timeout)."""
    path = checkpoint_path(directory, step, rank)
    state: dict[str, Any] = {}
    error = None
    try:
        state = load(directory, step, rank)
        if check is not None:
            check(state, path)
    except (ValueError, FileNotFoundError) as exc:
        error = str(exc)
    errors: list[Any] = [error]
    if world_size > 1:
        errors = all_gather_objects(error, issuer="load_everywhere")
    failed = [(r, e) for r, e in enumerate(errors) if e is not None]
    if failed:
        raise ValueError("; ".join(f"rank {r}: {e}" for r, e in failed))
    return state

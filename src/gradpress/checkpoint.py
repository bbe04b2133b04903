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
from typing import Any

import torch

__all__ = ["save", "load", "placement", "check_placement"]


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


def placement(process_group: Any = None) -> dict[str, int]:
    """``{"rank": r, "world_size": w}`` of this process in ``process_group`` (``0``/``1`` when
    ``torch.distributed`` is not initialized): stored in every per-rank state_dict."""
    import torch.distributed as dist

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

"""How a failed collective is described: :class:`CollectiveError` names the collective, its size, the
world size and the gradpress component that issued it; and the check of a process-group argument."""

from __future__ import annotations

import torch.distributed as dist
from torch import Tensor

__all__ = ["CollectiveError", "check_process_group", "collective_error", "describe_collective"]


class CollectiveError(RuntimeError):
    """A collective failed (a peer died, hung past the process group's timeout, or the link broke); the
    message says which collective, issued by which gradpress component, and the backend's own error.
    A ``RuntimeError``, as the backend's errors are; the original is its ``__cause__``."""


def collective_error(what: str, error: BaseException) -> CollectiveError:
    """``error`` from a collective, described: ``"<what> failed: <error>"`` (``what`` names the
    collective, its size and the component that issued it), with a hint when a peer timed out."""
    text = str(error).strip()
    hint = ""
    if "timed out" in text.lower() or "timeout" in text.lower():
        hint = (" (a peer did not take part within the process group's timeout: it died, is stuck, or is "
                "far behind)")
    return CollectiveError(f"{what} failed{hint}: {type(error).__name__}: {text}")


def describe_collective(op: str, buffer: Tensor, world_size: int, issuer: str) -> str:
    """``"allreduce (sum) of 1,234 float32 values over 2 ranks in powerSGD_hook"``."""
    dtype = str(buffer.dtype).replace("torch.", "")
    return f"{op} of {buffer.numel():,} {dtype} values over {world_size} ranks in {issuer}"


def check_process_group(value: object, where: str, hint: str = "") -> None:
    """Raise a ``TypeError`` naming ``where`` unless ``value`` is ``None`` or a ``ProcessGroup``.

    A hook's state argument and a state's first argument are easy to fill with something else (a rank
    given as the first positional argument of ``PowerSGDState``, a ``PowerSGDState`` handed to a plain
    hook); without this check such a value only fails deep inside the first collective. ``hint`` is
    appended to the message (what the caller probably meant).
    """
    if value is None or (dist.is_available() and isinstance(value, dist.ProcessGroup)):
        return
    raise TypeError(f"{where} must be None (the default group) or a torch.distributed.ProcessGroup, got "
                    f"{type(value).__name__} {value!r}" + (f"; {hint}" if hint else ""))

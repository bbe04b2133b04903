"""How a failed collective is described: :class:`CollectiveError` names the collective, its size, the
world size and the gradpress component that issued it; and the check of a process-group argument."""

from __future__ import annotations

import torch.distributed as dist
from torch import Tensor

__all__ = ["CollectiveError", "TORCHFT_HINT", "check_communicator", "check_process_group", "collective_error",
           "describe_collective", "is_torchft_object"]

#: What to use instead when a torchft object is given where a process group is expected.
TORCHFT_HINT = ("a torchft Manager (and its process group, which reports rank 0 on every replica group) is "
                "given to gradpress through gradpress.integrations.torchft: group = FaultTolerantGroup(manager), "
                "then PowerSGDState(None, ..., communicator=group.communicator()), PowerSGD(params, config, "
                "communicator=group.communicator()) or StreamingDiLoCoAverager(..., sync_group=group)")


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
    if is_torchft_object(value):
        raise TypeError(f"{where} must be None (the default group) or a torch.distributed.ProcessGroup, got "
                        f"torchft's {type(value).__name__}: {TORCHFT_HINT}")
    if value is None or (dist.is_available() and isinstance(value, dist.ProcessGroup)):
        return
    raise TypeError(f"{where} must be None (the default group) or a torch.distributed.ProcessGroup, got "
                    f"{type(value).__name__} {value!r}" + (f"; {hint}" if hint else ""))


def is_torchft_object(value: object) -> bool:
    """Whether ``value`` is a torchft ``Manager`` or one of torchft's process groups (read from its class,
    without importing torchft): neither is a process group gradpress can average over as it is."""
    for cls in type(value).__mro__:
        if cls.__module__.split(".")[0] == "torchft" and (cls.__name__ == "Manager" or "ProcessGroup" in cls.__name__):
            return True
    return False


def check_communicator(communicator: object, process_group: object, owner: str) -> None:
    """``communicator`` (``None`` or an object with the engine's communicator methods: ``world_size``,
    ``allreduce_sum``, ``allreduce_max``) checked, and not given with a ``process_group``: ``TypeError``
    naming ``owner``'s argument and what it takes."""
    if communicator is None:
        return
    if is_torchft_object(communicator):
        raise TypeError(f"{owner}'s communicator must be a gradpress communicator, got torchft's "
                        f"{type(communicator).__name__}: {TORCHFT_HINT}")
    missing = [name for name in ("world_size", "allreduce_sum", "allreduce_max") if not hasattr(communicator, name)]
    if missing:
        raise TypeError(f"{owner}'s communicator must have world_size, allreduce_sum and allreduce_max (the "
                        f"Communicator protocol of gradpress.powersgd.transport), got {type(communicator).__name__} "
                        f"without {', '.join(missing)}")
    if process_group is not None:
        raise TypeError(f"{owner}: give process_group or communicator, not both (the communicator decides "
                        f"who takes part; got process_group={process_group!r})")

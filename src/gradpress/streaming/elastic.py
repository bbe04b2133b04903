"""Streaming DiLoCo under a :class:`~gradpress.averaging.syncgroup.SyncGroup` (membership decided per sync,
e.g. torchft's quorums): what the averager checks and computes differently there.

The schedule is torchft's ``DiLoCo``'s: one fragment per *round* of ``L = sync_every // F`` inner steps,
fragment ``m % F`` where ``m`` is the number of syncs committed so far, sent ``τ`` steps before the
round's end and applied at its end (``fragment_phase="end"``). A sync that does not commit is retried: the
same fragment again in the next round. The averager's step counter is put back at each round's start to
:func:`round_start` of the committed count, so that a joiner healed from a peer (which copies that
counter) and the incumbents agree on every later step.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

from torch import Tensor

from ..aggregator import Config
from ..averaging.compress import Compressor
from ..averaging.syncgroup import SyncGroup, is_sync_group
from ..averaging.transport import OuterTransport
from ..comm import CollectiveError

__all__ = ["check_sync_group", "guarded", "means_if_committed", "round_start"]

T = TypeVar("T")


def check_sync_group(sync_group: Any, *, process_group: Any, sync_every: int, num_fragments: int,
                     warmup_steps: int, fragment_phase: str, first_sync: str, compression: Any) -> None:
    """``ValueError``/``TypeError`` naming the argument unless the averager can run under ``sync_group``."""
    if sync_group is None:
        return
    if not is_sync_group(sync_group):
        raise TypeError(f"sync_group must be None or a gradpress SyncGroup (e.g. gradpress.integrations.torchft."
                        f"FaultTolerantGroup(manager)), got {type(sync_group).__name__}")
    if process_group is not None:
        raise TypeError("give process_group or sync_group, not both: the sync group decides who takes part in "
                        f"each sync (got process_group={process_group!r})")
    if fragment_phase != "end":
        raise ValueError(f"fragment_phase must be 'end' under a sync_group (torchft's schedule: a fragment is "
                         f"sent and applied within its round, so a sync that fails is retried), got "
                         f"{fragment_phase!r}")
    if sync_every % num_fragments:
        raise ValueError(f"sync_every must be a multiple of num_fragments under a sync_group (every round has "
                         f"the same length, so a joiner and the incumbents agree on it), got sync_every="
                         f"{sync_every}, num_fragments={num_fragments}")
    if warmup_steps != 0:
        raise ValueError(f"warmup_steps must be 0 under a sync_group (the replicas train alone from the start; "
                         f"torchft heals a joiner), got {warmup_steps}")
    if first_sync != "outer":
        raise ValueError(f"first_sync must be 'outer' under a sync_group, got {first_sync!r}")
    if isinstance(compression, Config):
        raise ValueError("compression=Config(...) (PowerSGD outer gradients) is not supported under a "
                         "sync_group: its warm-start factors are global state that a healed joiner would not "
                         "get; use QuantizeInt8(), QuantizeInt4() or TopK(...)")
    if not isinstance(compression, Compressor):
        # The all-reduced outer gradients (None, 'fp16', 'bf16') go through torch.distributed's functions,
        # which ask the default group for this rank's place in torchft's group: not tested, so refused.
        raise ValueError(f"compression must be QuantizeInt8(), QuantizeInt4() or TopK(...) under a sync_group (their "
                         f"payloads travel through the group's exchange, ranked by the group), got {compression!r}; "
                         "for uncompressed DiLoCo on torchft use torchft's own DiLoCo")


def round_start(committed: int, sync_every: int, num_fragments: int) -> int:
    """The step at which the round after ``committed`` committed syncs starts: the start of fragment
    ``committed % F``'s period in cycle ``committed // F``."""
    return (committed // num_fragments) * sync_every + (committed % num_fragments) * (sync_every // num_fragments)


def guarded(group: SyncGroup | None, collective: Callable[[], T]) -> T | None:
    """``collective()`` (issuing a sync's collectives); without a group, just that. Under a group: ``None``
    where the sync already failed (nothing is issued on a broken group) or where this raises a
    :class:`~gradpress.comm.CollectiveError`, which is reported to the group."""
    if group is None:
        return collective()
    if group.failed():
        return None
    try:
        return collective()
    except CollectiveError as error:
        group.report(error)
        return None


def means_if_committed(group: SyncGroup, pending: Any, transport: OuterTransport,
                       anchor: list[Tensor]) -> tuple[list[Tensor], Tensor] | None:
    """At a sync's apply step under ``group``: wait for its collectives (a failure is reported), then ask
    the group once whether the sync counts. Its means and finite flag where it does, else ``None``."""
    held = None if pending.failed else guarded(group, lambda: transport.mean(pending.sent, anchor))
    committed = bool(group.commit())  # asked on every sync, failed or not: every member votes once
    return held if committed and held is not None else None

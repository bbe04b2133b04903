"""Who takes part in each outer sync when that is decided per sync: the :class:`SyncGroup` protocol a
DiLoCo averager is given as ``sync_group=`` instead of a fixed ``process_group``.

A fault-tolerant group (:class:`gradpress.integrations.torchft.FaultTolerantGroup` over a torchft
``Manager``; the replica simulator's scheduled membership,
:mod:`gradpress.tools.workloads.membership`) forms a quorum at each sync, may heal a joining replica from
a peer there, carries the sync's collectives among the quorum's members, and decides afterwards whether
the sync counts. The averager asks it, in this order, the same on every member:

1. :meth:`SyncGroup.begin` at the sync's send step, before anything is sent (a joiner's registered
   state is loaded here: the averager reads its schedule again afterwards);
2. :attr:`SyncGroup.rank`, :attr:`SyncGroup.world`, :attr:`SyncGroup.process_group` and
   :meth:`SyncGroup.exchange` for the sync's :class:`~gradpress.averaging.transport.Link`;
3. :meth:`SyncGroup.failed` before each collective (none is issued once one failed) and
   :meth:`SyncGroup.report` with a collective's error;
4. :meth:`SyncGroup.commit` once, at the step the update is applied: ``False`` leaves every tensor of the
   averager (anchor, outer momentum, residual, owner residual) bitwise as it was and puts the fragment's
   parameters back to its anchor, and the sync is retried;
5. :meth:`SyncGroup.committed`, the number of syncs committed so far, which the schedule keys on: the
   fragment a sync sends and the counter that seeds its stochastic rounding.
"""

from __future__ import annotations

from typing import Any, Protocol

from ..comm import PayloadExchange

__all__ = ["SyncGroup", "is_sync_group"]


class SyncGroup(Protocol):
    """See the module docstring."""

    @property
    def rank(self) -> int:
        """This replica's rank among the current sync's members."""

    @property
    def world(self) -> int:
        """How many replicas take part in the current sync."""

    @property
    def process_group(self) -> Any:
        """The group an exact average all-reduces over (``torch.distributed``'s functions take it)."""

    def begin(self) -> None:
        """Start a sync: form its membership (and heal this replica if it joins)."""

    def exchange(self, issuer: str) -> PayloadExchange:
        """The all-gather and all-to-all of compressed payloads among the current members."""

    def failed(self) -> bool:
        """Whether a collective of the current sync failed (nothing more is issued then)."""

    def report(self, error: BaseException) -> None:
        """A collective of the current sync failed with ``error``: the sync will not count."""

    def commit(self) -> bool:
        """Whether the current sync counts (asked once per sync, at its apply step)."""

    def committed(self) -> int:
        """Syncs committed so far (what the schedule keys on)."""


_MEMBERS = ("rank", "world", "process_group", "begin", "exchange", "failed", "report", "commit", "committed")


def is_sync_group(value: object) -> bool:
    """Whether ``value`` has every member of :class:`SyncGroup` (looked up without reading a property:
    a group's ``rank`` may only be known once a quorum has formed)."""
    return all(hasattr(type(value), name) or name in getattr(value, "__dict__", {}) for name in _MEMBERS)

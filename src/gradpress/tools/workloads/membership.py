"""The replica simulator's membership: who is in each outer sync, replayed in one process.

A torchft run records its quorums (:attr:`gradpress.integrations.torchft.FaultTolerantGroup.quorums`
and ``commits``: per replica, each sync attempt's committed count before it, the replica's rank, the
quorum's size and whether it committed). :func:`schedule_from_records` turns those records into a
schedule of :class:`Attempt`; :class:`Membership` replays it for replicas running as threads of one
process, each given :meth:`Membership.group`, a :class:`~gradpress.averaging.syncgroup.SyncGroup`:

* a sync's members exchange payloads in memory (all-gather and all-to-all are data movement only, so
  every sum, encoding and rounding is gradpress's own, as on gloo: the replay gives bitwise the same
  parameters);
* an attempt that did not commit issues nothing and does not commit (the averager keeps every tensor as
  it was and retries, as under torchft);
* a replica that joins copies the global state registered with :meth:`MembershipGroup.register` from the
  lowest-ranked member that was in before (its local state starts from zero); a replica with no attempt
  left leaves at its next :meth:`~MembershipGroup.begin` (:class:`Departed`).

Example (each replica a thread running the same loop as under torchft)::

    membership = Membership(schedule_from_records(records))
    group = membership.group("replica_1")
    averager = StreamingDiLoCoAverager(..., sync_group=group); group.register("model", model)
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from ...checkpoint import clone_tensors, state_nbytes

__all__ = ["Attempt", "Departed", "Membership", "MembershipGroup", "schedule_from_records"]


@dataclass(frozen=True)
class Attempt:
    """One sync attempt: the syncs committed before it, its members in rank order, whether it committed,
    and the quorum's size and the members' ranks as recorded (``None``: ``len(members)`` and their
    positions; a member lost during an attempt that did not commit is counted there, not replayed)."""

    committed: int
    members: tuple[str, ...]
    commit: bool
    world: int | None = None
    ranks: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        if self.commit and self.world not in (None, len(self.members)):
            raise ValueError(f"Attempt: a committed attempt has every member of its quorum, got world={self.world} "
                             f"for members {self.members}")


class Departed(Exception):
    """Raised by :meth:`MembershipGroup.begin` for a replica whose schedule has no attempt left."""


def schedule_from_records(records: Mapping[str, Sequence[tuple[int, int, int, bool | None]]]) -> list[Attempt]:
    """The attempts, in order, from each replica's ``(committed before, rank, world, committed)`` records
    (``None``: the replica was lost during that attempt; it is left out of it). Attempts at the same
    committed count are told apart by their outcome: the failed ones (in order) before the one that
    committed. ``ValueError`` where the members' records disagree (ranks, sizes or outcomes)."""
    found: dict[tuple[int, int, int], dict[str, Any]] = {}
    for name, rows in records.items():
        failures: dict[int, int] = {}
        for committed, rank, world, commit in rows:
            if commit is None:
                continue
            index = 0 if commit else 1 + failures.get(committed, 0)
            if not commit:
                failures[committed] = index
            key = (committed, 1 if commit else 0, index)
            entry = found.setdefault(key, {"world": world, "ranks": {}, "commit": commit})
            if entry["world"] != world or entry["commit"] != commit or rank in entry["ranks"]:
                raise ValueError(f"schedule_from_records: {name}'s record {(committed, rank, world, commit)} "
                                 f"disagrees with the other members of that attempt ({entry})")
            entry["ranks"][rank] = name
    schedule = []
    for (committed, _, _), entry in sorted(found.items()):
        ranks = tuple(sorted(entry["ranks"]))
        members = tuple(entry["ranks"][r] for r in ranks)
        schedule.append(Attempt(committed, members, bool(entry["commit"]), entry["world"], ranks))
    return schedule


class _Done:
    __slots__ = ("result",)

    def __init__(self, result: Tensor) -> None:
        self.result = result

    def wait(self) -> Tensor:
        return self.result


class _Exchange:
    """All-gather and all-to-all among one attempt's members, in memory (issued in the same order by all)."""

    def __init__(self, membership: Membership, next_key: Callable[[], tuple[int, int]], rank: int,
                 world: int) -> None:
        self.membership, self.next_key, self.rank, self.world = membership, next_key, rank, world

    def _deposit(self, tensor: Tensor) -> list[Tensor]:
        key = self.next_key()  # the attempt and the collective's place in it: the same on every member
        with self.membership.lock:
            slot = self.membership.slots.setdefault(key, ([None] * self.world, threading.Barrier(self.world)))
        slot[0][self.rank] = tensor.detach().clone()
        slot[1].wait(timeout=self.membership.timeout_s)
        return slot[0]  # type: ignore[return-value]

    def all_gather(self, out: Tensor, tensor: Tensor, what: Any) -> _Done:
        pieces = self._deposit(tensor)
        out.view(self.world, -1).copy_(torch.stack([p.reshape(-1) for p in pieces]))
        return _Done(out)

    def all_to_all(self, out: Tensor, tensor: Tensor, what: Any) -> _Done:
        pieces = self._deposit(tensor)
        rows = out.view(self.world, -1)
        for r, piece in enumerate(pieces):
            rows[r].copy_(piece.view(self.world, -1)[self.rank])
        return _Done(out)


class Membership:
    """A schedule of :class:`Attempt` replayed for replica threads (see the module docstring).
    ``init_sync`` (torchft ``Manager``'s option, default ``True``): at the first attempt every member but
    rank 0 copies rank 0's registered state, as torchft heals them at its first quorum."""

    def __init__(self, schedule: Sequence[Attempt], timeout_s: float = 120.0, init_sync: bool = True) -> None:
        self.schedule = list(schedule)
        self.init_sync = init_sync
        self.timeout_s = timeout_s
        self.lock = threading.Lock()
        self.slots: dict[tuple[int, int], tuple[list[Any], threading.Barrier]] = {}
        self.states: dict[int, tuple[threading.Event, dict[str, Any]]] = {}

    def group(self, name: str) -> MembershipGroup:
        """The :class:`MembershipGroup` of replica ``name``."""
        return MembershipGroup(self, name)

    def _state(self, attempt: int) -> tuple[threading.Event, dict[str, Any]]:
        with self.lock:
            return self.states.setdefault(attempt, (threading.Event(), {}))


class MembershipGroup:
    """One replica's :class:`~gradpress.averaging.syncgroup.SyncGroup` in a :class:`Membership`, with the
    records :class:`~gradpress.integrations.torchft.FaultTolerantGroup` keeps (``quorums``,
    ``last_commit``, ``healed_bytes``, ``quorum_seconds``)."""

    def __init__(self, membership: Membership, name: str) -> None:
        self.membership, self.name = membership, name
        self.attempts = [i for i, a in enumerate(membership.schedule) if name in a.members]
        self.current: int | None = None
        self.issued = 0
        self.taken = 0
        self._committed = 0
        self.last_commit: bool | None = None
        self.quorums: list[tuple[int, int, int]] = []
        self.quorum_seconds: list[float] = []
        self.healed_bytes: list[int] = []
        self._saves: dict[str, Callable[[], Any]] = {}
        self._loads: dict[str, Callable[[Any], None]] = {}

    def register(self, key: str, obj: Any) -> None:
        """As :meth:`gradpress.integrations.torchft.FaultTolerantGroup.register`: what a joiner copies."""
        if hasattr(obj, "global_state_dict"):
            self._saves[key], self._loads[key] = obj.global_state_dict, obj.load_global_state_dict
        elif isinstance(obj, (nn.Module, torch.optim.Optimizer)):
            self._saves[key] = lambda: clone_tensors(obj.state_dict())
            self._loads[key] = obj.load_state_dict
        else:
            raise TypeError(f"register's obj must be a StreamingDiLoCoAverager, nn.Module or torch.optim.Optimizer, "
                            f"got {type(obj).__name__}")

    @property
    def attempt(self) -> Attempt:
        if self.current is None:
            raise RuntimeError(f"MembershipGroup {self.name}: no sync begun")
        return self.membership.schedule[self.current]

    @property
    def rank(self) -> int:
        attempt = self.attempt
        position = attempt.members.index(self.name)
        return position if attempt.ranks is None else attempt.ranks[position]

    @property
    def world(self) -> int:
        attempt = self.attempt
        return len(attempt.members) if attempt.world is None else attempt.world

    @property
    def process_group(self) -> Any:
        return None

    def begin(self) -> None:
        if self.taken == len(self.attempts):
            raise Departed(self.name)
        index = self.attempts[self.taken]
        self.current, self.last_commit, self.issued = index, None, 0
        attempt = self.membership.schedule[index]
        before = {n for a in self.membership.schedule[:index] for n in a.members}
        event, state = self.membership._state(index)
        sources = [n for n in attempt.members if n in before]
        if not before and self.membership.init_sync:  # torchft's init_sync: the first quorum heals from rank 0
            before, sources = {attempt.members[0]}, [attempt.members[0]]
        if self.taken == 0 and sources and self.name not in before:  # a joiner: heal from a peer
            if not event.wait(timeout=self.membership.timeout_s):
                raise TimeoutError(f"MembershipGroup {self.name}: no member served the registered state of attempt "
                                   f"{index} within {self.membership.timeout_s} s (timeout_s of the Membership)")
            for key, load in self._loads.items():
                self.healed_bytes.append(state_nbytes(state[key]))
                load(state[key])
        elif sources and self.name == sources[0] and any(n not in before for n in attempt.members):
            state.update({key: save() for key, save in self._saves.items()})
            event.set()
        self.taken += 1
        self._committed = attempt.committed
        self.quorums.append((self._committed, self.rank, self.world))

    def exchange(self, issuer: str) -> _Exchange:
        return _Exchange(self.membership, self._next_key, self.rank, self.world)

    def _next_key(self) -> tuple[int, int]:
        assert self.current is not None
        self.issued += 1
        return self.current, self.issued - 1

    def failed(self) -> bool:
        return not self.attempt.commit

    def report(self, error: BaseException) -> None:
        raise RuntimeError(f"MembershipGroup {self.name}: a collective failed in the replay") from error

    def commit(self) -> bool:
        self.last_commit = self.attempt.commit
        if self.last_commit:
            self._committed = self.attempt.committed + 1
        return self.last_commit

    def committed(self) -> int:
        return self._committed

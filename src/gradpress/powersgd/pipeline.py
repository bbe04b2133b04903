"""Run multi-phase communication tasks so that every rank issues its collectives in the same order.

A *task* is a generator: it computes, starts a collective, and yields the collective's handle; when it
is resumed, that collective has completed. PowerSGD is such a task with two phases (P, then Q).

Backends match collectives by the order in which they are issued ("same order on every rank"). PyTorch's hook issues
the Q allreduce from a future callback, on whatever thread finished the P allreduce, which can race with
the next bucket's collective issued by the autograd thread. Here every collective is issued by the
thread that calls :meth:`OrderedPipeline.submit` / :meth:`drain`, in an order that depends only on the
sequence of calls, never on timing. Two such orders:

* ``advance_on_submit=True``: each submit first moves every in-flight task forward by one phase, oldest
  first (waiting for its collective), then starts the new task; the P allreduce of bucket ``b`` overlaps
  with the backward pass that produces bucket ``b + 1``;
* ``advance_on_submit=False`` (what ``PowerSGDState`` uses): a submit only starts the new task; the later
  phases of all tasks run in :meth:`OrderedPipeline.drain`, at the last bucket. Every P allreduce
  overlaps with the rest of the backward pass and the submitting thread never waits on the link.

No future callback ever blocks.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Generator
from typing import Any

from .transport import Handle

__all__ = ["OrderedPipeline", "Task"]

Task = Generator[Handle, None, None]


class _InFlight:
    __slots__ = ("task", "handle", "on_done", "on_error")

    def __init__(self, task: Task, handle: Handle, on_done: Callable[[], Any],
                 on_error: Callable[[BaseException], Any]) -> None:
        self.task = task
        self.handle = handle
        self.on_done = on_done
        self.on_error = on_error


class OrderedPipeline:
    """A FIFO of in-flight tasks, advanced deterministically (see the module docstring).

    ``advance_on_submit=False``: :meth:`submit` only starts the new task and never waits, so the
    thread that submits (DDP's autograd thread) is never blocked by the link; the later phases of
    every task run in :meth:`drain`. The collectives are then issued as all first phases in submit
    order, then all second phases, and so on: still a function of the sequence of calls alone.
    """

    __slots__ = ("_in_flight", "advance_on_submit")

    def __init__(self, advance_on_submit: bool = True) -> None:
        self._in_flight: deque[_InFlight] = deque()
        self.advance_on_submit = advance_on_submit

    def __len__(self) -> int:
        return len(self._in_flight)

    def submit(self, task: Task, on_done: Callable[[], Any],
               on_error: Callable[[BaseException], Any]) -> None:
        """Advance every in-flight task by one phase (unless ``advance_on_submit`` is off), then start
        ``task`` up to its first collective.

        ``on_done()`` runs when the task finishes; ``on_error(exc)`` when it raises (the exception is
        also re-raised here, since a rank that stops issuing collectives would hang the others).
        """
        if self.advance_on_submit:
            self._advance_all()
        self._start(_InFlight(task, None, on_done, on_error))  # type: ignore[arg-type]

    def drain(self) -> None:
        """Run every in-flight task to completion (oldest first, one phase at a time)."""
        while self._in_flight:
            self._advance_all()

    def _advance_all(self) -> None:
        for _ in range(len(self._in_flight)):
            entry = self._in_flight.popleft()
            entry.handle.wait()
            self._start(entry)

    def _start(self, entry: _InFlight) -> None:
        """Resume ``entry`` until it issues its next collective (re-queued) or finishes."""
        try:
            entry.handle = next(entry.task)
        except StopIteration:
            entry.on_done()
            return
        except BaseException as exc:
            self._in_flight.clear()
            entry.on_error(exc)
            raise
        self._in_flight.append(entry)

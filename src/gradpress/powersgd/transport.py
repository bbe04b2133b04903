"""What the engine consumes: the :class:`Communicator` protocol (sum or max of a flat buffer,
asynchronously) and the :class:`Handle` of an in-flight collective.

A communicator may also decide whether a step counts at all (:class:`StepDecision`: a fault-tolerant
group, whose replicas vote on each step); the engine then asks it once per optimizer step, before it
writes anything a later step reads.

The engine (``step``, ``session``, ``pipeline``) sees only these protocols, so it never imports
``torch.distributed``: :mod:`gradpress.comm` provides the implementations (over a process group, or one
worker), which satisfy them structurally.
"""

from __future__ import annotations

from typing import Protocol

from torch import Tensor

__all__ = ["Communicator", "Handle", "StepDecision", "decision_of"]


class Handle(Protocol):
    """An in-flight collective. ``wait()`` blocks until the buffer holds the result and returns it."""

    def wait(self) -> Tensor: ...


class Communicator(Protocol):
    """Sums flat buffers across the workers of a group."""

    @property
    def world_size(self) -> int: ...

    def allreduce_sum(self, buffer: Tensor) -> Handle:
        """Start summing ``buffer`` (1-d, contiguous) over all workers, in place."""
        ...

    def allreduce_max(self, buffer: Tensor) -> Handle:
        """Start taking the elementwise maximum of ``buffer`` over all workers, in place."""
        ...


class StepDecision(Protocol):
    """A communicator that decides whether a step counts (a fault-tolerant group such as
    :mod:`gradpress.integrations.torchft`'s: a peer lost mid-step, too few replicas). Asked once per
    optimizer step, after every collective of the step has completed and before its commit; ``False``
    takes the commit's non-finite path: the error memory and the warm-start factors of every segment stay
    bitwise as they were, as if the step had never been taken (``docs/design.md``, non-finite steps)."""

    def decide_step(self) -> bool: ...


def decision_of(comm: object) -> StepDecision | None:
    """``comm`` if it decides whether steps count (:class:`StepDecision`), else ``None``."""
    return comm if callable(getattr(comm, "decide_step", None)) else None  # type: ignore[return-value]

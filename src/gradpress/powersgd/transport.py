"""What the engine consumes: the :class:`Communicator` protocol (sum or max of a flat buffer,
asynchronously) and the :class:`Handle` of an in-flight collective.

The engine (``step``, ``session``, ``pipeline``) sees only these protocols, so it never imports
``torch.distributed``: :mod:`gradpress.comm` provides the implementations (over a process group, or one
worker), which satisfy them structurally.
"""

from __future__ import annotations

from typing import Protocol

from torch import Tensor

__all__ = ["Communicator", "Handle"]


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

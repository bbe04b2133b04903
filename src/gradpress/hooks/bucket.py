"""Adapters between DDP's ``GradBucket`` and plain tensors, and the check every function that takes a hook makes."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

__all__ = ["CastBucket", "DenseBucket", "bucket_gradient_views", "check_hook", "future_tensor"]


def check_hook(hook: Any, where: str | None = None, name: str = "hook") -> Any:
    """``hook`` itself if it is callable; else ``TypeError`` saying which argument (``name``) of which
    function (``where``) must be a hook, and what was given.

    >>> check_hook(len) is len
    True
    """
    if not callable(hook):
        prefix = f"{where}: " if where else ""
        raise TypeError(f"{prefix}{name} must be a callable hook(state, bucket) -> Future, such as "
                        f"gradpress.powerSGD_hook, got {type(hook).__name__}: {hook!r}")
    return hook


def bucket_gradient_views(buffer: Tensor, gradients: list[Tensor]) -> list[Tensor]:
    """Views into ``buffer`` with the shapes of ``gradients``, at the same offsets they have in it.

    DDP lays a bucket out densely (each gradient right after the previous one); that is the layout used
    when the gradients are not views of the buffer's storage.
    """
    views = []
    offset: int | torch.SymInt = 0
    same_storage = all(g.untyped_storage().data_ptr() == buffer.untyped_storage().data_ptr()
                       for g in gradients) if gradients else False
    for grad in gradients:
        start = grad.storage_offset() - buffer.storage_offset() if same_storage else offset
        views.append(buffer[start: start + grad.numel()].view(grad.shape))
        offset = start + grad.numel()
    return views


class CastBucket:
    """A ``GradBucket`` stand-in whose buffer is a cast copy of the original bucket's buffer.

    Supports what hooks use: ``buffer()``, ``gradients()``, ``parameters()``, ``index()``, ``is_last()``,
    ``set_buffer()``.
    """

    __slots__ = ("_bucket", "_buffer", "_gradients")

    def __init__(self, bucket: Any, buffer: Tensor) -> None:
        self._bucket = bucket
        self._buffer = buffer
        self._gradients = bucket_gradient_views(buffer, bucket.gradients())

    def buffer(self) -> Tensor:
        return self._buffer

    def gradients(self) -> list[Tensor]:
        return self._gradients

    def parameters(self) -> list[Tensor]:
        return self._bucket.parameters()

    def index(self) -> int:
        return self._bucket.index()

    def is_last(self) -> bool:
        return self._bucket.is_last()

    def set_buffer(self, buffer: Tensor) -> None:
        self._buffer = buffer
        self._gradients = bucket_gradient_views(buffer, self._bucket.gradients())


class DenseBucket:
    """A ``GradBucket`` stand-in over a dense buffer: the gradients back to back, shaped ``shapes``
    (default: the parameters' shapes).

    Supports what hooks use: ``buffer()``, ``gradients()`` (views into the buffer), ``parameters()``,
    ``index()``, ``is_last()``, ``set_buffer()`` (the gradients become views into the new buffer, as with
    ``GradBucket.set_buffer``).
    """

    __slots__ = ("_index", "_is_last", "_parameters", "_shapes", "_buffer", "_gradients")

    def __init__(self, index: int, is_last: bool, parameters: list[Tensor], buffer: Tensor,
                 shapes: Sequence[torch.Size] | None = None) -> None:
        self._index = index
        self._is_last = is_last
        self._parameters = parameters
        self._shapes = [p.shape for p in parameters] if shapes is None else list(shapes)
        self.set_buffer(buffer)

    def buffer(self) -> Tensor:
        return self._buffer

    def gradients(self) -> list[Tensor]:
        return self._gradients

    def parameters(self) -> list[Tensor]:
        return self._parameters

    def index(self) -> int:
        return self._index

    def is_last(self) -> bool:
        return self._is_last

    def set_buffer(self, buffer: Tensor) -> None:
        self._buffer = buffer
        pieces = buffer.split([shape.numel() for shape in self._shapes])
        self._gradients = [piece.view(shape) for piece, shape in zip(pieces, self._shapes)]


def future_tensor(value: Any) -> Tensor:
    """The tensor a hook's future holds (collective futures hold a one-element list)."""
    return value[0] if isinstance(value, (list, tuple)) else value

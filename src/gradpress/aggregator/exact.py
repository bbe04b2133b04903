"""The :class:`Aggregator` interface, exact averaging (:class:`AllReduce`), and what every aggregator
checks and groups: dense floating-point gradients, by (device, dtype), through contiguous stand-ins."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from ..comm import check_process_group, make_communicator
from ..powersgd.pipeline import OrderedPipeline
from ..powersgd.step import StepCommit, average_step

__all__ = ["AllReduce", "Aggregator", "Contiguous", "by_device_dtype", "dense_gradients"]


class Aggregator(ABC):
    """Turns every worker's gradients into (an approximation of) their average over the workers.

    All workers must call :meth:`aggregate` / :meth:`aggregate_` together, with the same tensors (same
    shapes, same ones ``None``), as with any collective.

    ``finite``: after an aggregation, a 0-d bool tensor on the gradients' device, the same on every
    worker: whether everything averaged was finite (``False`` when any worker had an inf/NaN gradient;
    the averages are then non-finite too). ``None`` before the first aggregation or when there was
    nothing to aggregate. Reading it is a host sync on a GPU; :func:`optimizer_step` reads it once per
    step to skip non-finite steps.
    """

    finite: Tensor | None = None

    @abstractmethod
    def aggregate_(self, gradients: Sequence[Tensor | None]) -> None:
        """Replace each gradient, in place, by the average; ``None`` entries are skipped."""

    def aggregate(self, gradients: Sequence[Tensor | None]) -> list[Tensor | None]:
        """The averages as new tensors; the inputs are left unchanged (the reference's signature)."""
        dense_gradients(gradients, type(self).__name__)  # refuse what is not a gradient before copying it
        out = [None if g is None else g.detach().clone() for g in gradients]
        self.aggregate_(out)
        return out


def dense_gradients(gradients: Sequence[Tensor | None], what: str) -> list[tuple[int, Tensor]]:
    """``(index, gradient)`` of every gradient that is not ``None``; ``TypeError``/``ValueError`` naming
    ``what`` and the index for anything that is not a dense real floating-point tensor."""
    out = []
    for index, grad in enumerate(gradients):
        if grad is None:
            continue
        if not isinstance(grad, Tensor):
            raise TypeError(f"{what}: gradient #{index} must be a torch.Tensor or None, got {type(grad).__name__}")
        if not grad.is_floating_point():
            raise TypeError(f"{what}: gradient #{index} has dtype {grad.dtype}; only real floating-point "
                            "gradients (float16, bfloat16, float32, float64) can be aggregated")
        if grad.is_sparse:
            raise ValueError(f"{what}: gradient #{index} is sparse; only dense gradients can be aggregated")
        out.append((index, grad))
    return out


def by_device_dtype(items: Sequence[tuple[int, Tensor]]) -> dict[tuple[torch.device, torch.dtype],
                                                                   list[tuple[int, Tensor]]]:
    """``items`` grouped by (device, dtype), in order: each group is one collective (or one segment)."""
    groups: dict[tuple[torch.device, torch.dtype], list[tuple[int, Tensor]]] = {}
    for index, grad in items:
        groups.setdefault((grad.device, grad.dtype), []).append((index, grad))
    return groups


class Contiguous:
    """Contiguous stand-ins for non-contiguous gradients (e.g. channels-last), copied back on exit."""

    def __init__(self, tensors: Sequence[Tensor]) -> None:
        self.originals = list(tensors)
        self.tensors = [t if t.is_contiguous() else t.contiguous() for t in tensors]

    def __enter__(self) -> list[Tensor]:
        return self.tensors

    def __exit__(self, *exc: Any) -> None:
        for original, tensor in zip(self.originals, self.tensors):
            if tensor is not original:
                original.copy_(tensor)


class AllReduce(Aggregator):
    """Exact averaging: one allreduce per device and dtype, no compression.

    >>> AllReduce().aggregate([torch.ones(2)])     # one worker: the average is the input
    [tensor([1., 1.])]
    """

    def __init__(self, process_group: dist.ProcessGroup | None = None,
                 comm_device: torch.device | str | None = None) -> None:
        check_process_group(process_group, "AllReduce's process_group")
        self.process_group = process_group
        self.comm_device = comm_device

    def aggregate_(self, gradients: Sequence[Tensor | None]) -> None:
        comm = make_communicator(self.process_group, self.comm_device, issuer="gradpress.AllReduce.aggregate_")
        pipeline = OrderedPipeline()
        commit = StepCommit()
        for group in by_device_dtype(dense_gradients(gradients, "AllReduce")).values():
            with Contiguous([g for _, g in group]) as tensors:
                pipeline.submit(average_step(tensors, comm, commit), lambda: None, lambda exc: None)
                pipeline.drain()
        self.finite = commit.apply()

"""The buckets of one DDP iteration, held until the last one so that PowerSGD compresses them in one
engine step (:meth:`gradpress.PowerSGDState.compress_with_step`).

A transformer's layers share their shapes but DDP puts about one layer in each 25 MB bucket, so shape
groups formed per bucket hold one matrix each. Held until the last bucket, the gradients of every bucket
form one segment per (device, dtype), its parameters in key order: each product, orthogonalization and
collective is then issued once per shape group or phase for the whole model, and the segment's layout,
hence every number, does not depend on DDP's bucket layout (its first iteration's or the rebuilt one).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

from ..powersgd.memory import Segment, work_dtype_for
from ..powersgd.session import EngineSession
from ..powersgd.step import StartedStep
from ..powersgd.transport import Communicator
from .parameters import ParameterKeys

__all__ = ["OVERLAPS", "StartedBuckets", "StepGroup", "WaitingBuckets", "bucket_segment", "overlap_pays"]

#: ``PowerSGDState(overlap=...)``: ``"none"``, every bucket held until the last and one step for all of them
#: (:class:`WaitingBuckets`); ``"p-phase"``, each bucket's P product and all-reduce issued as it arrives and the
#: rest of every bucket's step at the last (:class:`StartedBuckets`); ``"auto"``, the one measured faster on
#: the buckets' device (docs/design.md, "Overlap with the backward pass").
OVERLAPS = ("auto", "none", "p-phase")


def overlap_pays(device: torch.device) -> bool:
    """What ``overlap="auto"`` chooses for buckets on ``device``: ``True`` for ``"p-phase"``. Holding the
    buckets was faster on the CPU over shaped 1 Gbit/s links (ResNet-18's shapes: 1.84x the
    no-communication step against 2.24x; ResNet-18 itself: 1.13x against 1.20x; BENCHMARKS.md), and costs
    fewer kernels on an accelerator (the overlapped step is per bucket there): held everywhere."""
    return False


def bucket_segment(params: ParameterKeys, session: EngineSession, index: int, parameters: Sequence[Tensor],
                   tensors: list[Tensor]) -> Segment:
    """The segment of one bucket of ``parameters`` on its own (slot ``index``, the parameters' stable keys
    and ranks): where each bucket's step commits alone (FSDP, the interleaved ZeRO step)."""
    keys = params.keys_for(parameters)
    ranks = params.ranks_for(keys, parameters, tensors)
    return session.store.get(index, keys, [t.shape for t in tensors], tensors[0].device,
                             work_dtype_for(tensors[0].dtype), ranks)


@dataclass
class StepGroup:
    """The tensors of one (device, dtype) of an iteration, in key order, and their buckets' completions."""

    device: torch.device
    dtype: torch.dtype
    keys: list[int] = field(default_factory=list)
    tensors: list[Tensor] = field(default_factory=list)
    ranks: list[int | None] = field(default_factory=list)
    completions: list[tuple[Callable[[], None], Callable[[BaseException], None]]] = field(default_factory=list)

    def done(self) -> None:
        """Run every bucket's completion (the outputs are written)."""
        for done, _ in self.completions:
            done()

    def failed(self, error: BaseException) -> None:
        """Fail every bucket."""
        for _, failed in self.completions:
            failed(error)


class WaitingBuckets:
    """The buckets handed over so far in the iteration in flight (:meth:`add`), grouped at the last one
    (:meth:`take`)."""

    __slots__ = ("_entries",)

    def __init__(self) -> None:
        self._entries: list[tuple[Sequence[Tensor], list[Tensor], Callable[[], None],
                                  Callable[[BaseException], None]]] = []

    def __bool__(self) -> bool:
        return bool(self._entries)

    def add(self, params: Sequence[Tensor], tensors: list[Tensor], on_done: Callable[[], None],
            on_fail: Callable[[BaseException], None]) -> None:
        """Hold a bucket: its parameters, gradients, and what to run once its outputs are written (or
        if the step fails)."""
        self._entries.append((params, tensors, on_done, on_fail))

    def clear(self) -> None:
        self._entries = []

    def run(self, params: ParameterKeys, session: EngineSession, comm: Communicator, compressed_step: int, *,
            measure: bool, track: bool, global_residual: bool) -> None:
        """At the last bucket: start one engine step per (device, dtype) over every held bucket (each
        segment's parameters in key order, at their ranks), whose completions run once the outputs are
        written (the caller's ``session.finish()``); ``measure``, ``track``, ``global_residual``: see
        :meth:`~gradpress.powersgd.session.EngineSession.run`."""
        policy = params.policy is not None or params.adaptive is not None
        for group in self.take(params, params.ranks_for):
            segment = session.store.get(("step", group.device, group.dtype), tuple(group.keys),
                                        [t.shape for t in group.tensors], group.device, work_dtype_for(group.dtype),
                                        group.ranks if policy else None)
            session.run(segment, group.tensors, comm, compressed_step, measure=measure, track=track,
                        global_residual=global_residual, on_done=group.done, on_fail=group.failed)

    def take(self, keys: ParameterKeys, ranks: Callable[..., list[int | None] | None]) -> list[StepGroup]:
        """Every held bucket, grouped by (device, dtype) in key order (``keys`` assigns the keys, in the
        buckets' arrival order as before; ``ranks(keys, params, grads)`` gives their ranks), and forget
        them. A bucket without gradients completes at once."""
        entries, self._entries = self._entries, []
        groups: dict[tuple[torch.device, torch.dtype], StepGroup] = {}
        for params, tensors, on_done, on_fail in entries:
            bucket_keys = keys.keys_for(params)
            if not tensors:
                on_done()
                continue
            bucket_ranks = ranks(bucket_keys, params, tensors)
            group = groups.setdefault((tensors[0].device, tensors[0].dtype),
                                      StepGroup(tensors[0].device, tensors[0].dtype))
            group.keys.extend(bucket_keys)
            group.tensors.extend(tensors)
            group.ranks.extend(bucket_ranks if bucket_ranks is not None else [None] * len(bucket_keys))
            group.completions.append((on_done, on_fail))
        for group in groups.values():
            order = sorted(range(len(group.keys)), key=group.keys.__getitem__)
            group.keys = [group.keys[i] for i in order]
            group.tensors = [group.tensors[i] for i in order]
            group.ranks = [group.ranks[i] for i in order]
        return list(groups.values())


class StartedBuckets:
    """The buckets of the iteration in flight whose P phase was issued as each arrived (:meth:`start`),
    finished together at the last one (:meth:`finish`): each bucket is its own segment, in its slot, so its
    P product and all-reduce overlap with the rest of the backward pass; the orthogonalization, the Q
    products, one Q all-reduce per (device, dtype) and the commit run for all of them at the last bucket."""

    __slots__ = ("_started",)

    def __init__(self) -> None:
        self._started: list[StartedStep] = []

    def __bool__(self) -> bool:
        return bool(self._started)

    def clear(self) -> None:
        self._started = []

    def start(self, params: ParameterKeys, session: EngineSession, comm: Communicator, compressed_step: int,
              index: int, parameters: Sequence[Tensor], tensors: list[Tensor], *, measure: bool, track: bool,
              global_residual: bool, on_done: Callable[[], None], on_fail: Callable[[BaseException], None]) -> None:
        """Issue bucket ``index``'s P phase now (``on_done`` runs once its outputs are written, at the
        optimizer step's commit)."""
        if not tensors:
            on_done()
            return
        segment = bucket_segment(params, session, index, parameters, tensors)
        self._started.append(session.start(segment, tensors, comm, compressed_step, measure=measure, track=track,
                                           global_residual=global_residual, on_done=on_done, on_fail=on_fail))

    def finish(self, session: EngineSession, comm: Communicator, on_fail: Callable[[BaseException], None]) -> None:
        """At the last bucket: the rest of every started step, one batch per (device, dtype, wire), in the
        order their first buckets arrived (the same on every rank)."""
        started, self._started = self._started, []
        by_kind: dict[tuple[object, ...], list[StartedStep]] = {}
        for part in started:
            kind = (part.segment.device, part.segment.dtype, part.codec.dtype)
            by_kind.setdefault(kind, []).append(part)
        for parts in by_kind.values():
            session.finish_started(parts, comm, on_fail)

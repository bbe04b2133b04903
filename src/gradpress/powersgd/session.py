"""One PowerSGD run's engine state, shared by both front-ends.

:class:`gradpress.PowerSGDState` (DDP hooks) and :class:`gradpress.PowerSGD` (the aggregator) each hold
one :class:`EngineSession` and differ only in how they are called and what they call things. The
session owns what a compressed run changes from step to step:

* the :class:`~gradpress.powersgd.memory.SegmentStore` (error memory and warm-start factors per
  parameter), plus the per-bucket memory of the batched hook;
* the ordered pipeline the steps' collectives run in and the :class:`~gradpress.powersgd.step.StepCommit`
  that writes one optimizer step's outputs and memory together ("non-finite steps" in docs/design.md);
* learning-rate rescaling of the error memory, byte and element counters;
* the memory part of both front-ends' checkpoints, and a memory report.

It issues no collective itself and knows nothing of DDP: the steps it runs are given a communicator.

>>> from gradpress.powersgd import EngineConfig, EngineSession
>>> session = EngineSession(EngineConfig(rank=2))
>>> session.memory_report().total
0
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch import Tensor

from .pipeline import OrderedPipeline, Task
from .config import EngineConfig
from .memory import ParamMemory, Segment, SegmentStore, work_dtype_for
from .plan import make_plan
from .step import StepCommit

__all__ = ["EngineSession", "MemoryReport"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class MemoryReport:
    """Bytes the engine holds, by purpose (what ``torch.cuda.memory_allocated`` would see of it).

    ``error_memory``: the residuals carried to the next step; ``p``: the first collective's buffer (P and
    the tensors sent exactly); ``q``: the Q factors (the warm start); ``saved_factors``: the warm-start factors of the step in flight, put back if that step
    is not finite; ``workspace``: the one scratch buffer the segments share; ``total``: their sum.
    ``sent``, ``p_numel``, ``q_numel``: elements a compressed step sends, and of those the P and Q
    factors, under the current plans.
    """

    error_memory: int = 0
    p: int = 0
    q: int = 0
    saved_factors: int = 0
    workspace: int = 0
    sent: int = 0
    p_numel: int = 0
    q_numel: int = 0

    @property
    def total(self) -> int:
        return self.error_memory + self.p + self.q + self.saved_factors + self.workspace

    def as_dict(self) -> dict[str, int]:
        return {**asdict(self), "total": self.total}


def _nbytes(tensor: Tensor | None) -> int:
    return 0 if tensor is None else tensor.numel() * tensor.element_size()


class EngineSession:
    """Store, pipeline, commit, learning-rate rescaling, counters and checkpoint core of one run.

    Args:
        config: how each step compresses.
        advance_on_submit: the pipeline's policy (see :class:`gradpress.powersgd.pipeline.OrderedPipeline`): the
            DDP hooks start only the first phase of each bucket's step and run the rest when the last
            bucket arrives (``False``); the aggregator, which has all tensors at once, advances on
            every submit (``True``).

    A step's work is handed over with :meth:`submit`; :meth:`finish` ends the optimizer step (drain the
    pipeline, commit every segment together, then run the completions). With ``commit_each_task`` set
    (:meth:`commit_each_task_alone`), each task commits as it ends instead, for wrappers that need each
    bucket's result at once (FSDP, the interleaved ZeRO step).
    """

    __slots__ = ("config", "store", "pipeline", "commit", "commit_each_task", "last_lr", "numel_in",
                 "numel_sent", "bytes_in", "bytes_sent", "_padded", "_saved_padded", "_pending")

    def __init__(self, config: EngineConfig, *, advance_on_submit: bool = True) -> None:
        self.config = config
        self.store = SegmentStore(config)
        self.pipeline = OrderedPipeline(advance_on_submit=advance_on_submit)
        self.commit = StepCommit()
        self.commit_each_task = False
        #: The learning rate the error memory is expressed for (``None``: not tracked yet).
        self.last_lr: float | None = None
        #: Elements handed in, elements sent, and the same in bytes (at the wire's precision).
        self.numel_in = 0
        self.numel_sent = 0
        self.bytes_in = 0
        self.bytes_sent = 0
        # The batched hook's memory: bucket index -> (bucket numel, segment, padded square matrix).
        self._padded: dict[int, tuple[int, Segment, Tensor]] = {}
        self._saved_padded: dict[int, dict[str, Any]] = {}  # loaded, not yet seen again
        # Completions waiting for the commit, each with what to run instead if the step fails.
        self._pending: list[tuple[Callable[[], None], Callable[[BaseException], None]]] = []

    # --- running steps ------------------------------------------------------------------------------
    def forget_memory(self) -> None:
        """Drop every error memory and warm-start factor (the state moved to another model); the
        counters and the learning rate stay. Nothing may be in flight."""
        self.store = SegmentStore(self.config)
        self._padded.clear()
        self._saved_padded.clear()

    def commit_each_task_alone(self) -> None:
        """From now on each submitted task commits when it ends (its result is needed at once)."""
        self.commit_each_task = True

    def step_commit(self) -> StepCommit | None:
        """The commit a task joins: the optimizer step's, or ``None`` (the task commits alone)."""
        return None if self.commit_each_task else self.commit

    def submit(self, task: Task, complete: Callable[[], None], fail: Callable[[BaseException], None]) -> None:
        """Start ``task`` in the ordered pipeline. ``complete`` runs once its outputs are written: after
        :meth:`finish`'s commit, or when the task ends under ``commit_each_task``. ``fail(error)`` runs
        if it raises (and fails every completion still waiting)."""
        def failed(error: BaseException) -> None:
            pending, self._pending = self._pending, []
            fail(error)
            for _, fail_waiting in pending:
                fail_waiting(error)

        done = complete if self.commit_each_task else (lambda: self._pending.append((complete, fail)))
        try:
            self.pipeline.submit(task, done, failed)
        except BaseException:
            self.discard()
            raise

    def finish(self) -> Tensor | None:
        """End the optimizer step: run every task to its end, commit them together, run the waiting
        completions. Returns the step's all-finite flag (``None``: nothing was committed)."""
        try:
            self.pipeline.drain()
            finite = self.commit.apply()
        except BaseException:
            self.discard()
            raise
        pending, self._pending = self._pending, []
        for complete, _ in pending:
            complete()
        return finite

    def drain(self) -> None:
        """Run every task in flight to its end (their commits, if joint, wait for :meth:`finish`)."""
        self.pipeline.drain()

    def in_flight(self) -> bool:
        """Whether a task is still running (a checkpoint now would miss its writes)."""
        return len(self.pipeline) > 0

    def discard(self) -> None:
        """Forget a step that failed midway: the memory stays as it was before it, and no task of it is
        resumed by the next step."""
        self.commit.discard()
        self._pending = []
        if len(self.pipeline):
            self.pipeline = OrderedPipeline(advance_on_submit=self.pipeline.advance_on_submit)

    # --- learning rate, counters ------------------------------------------------------------------
    def rescale_to_lr(self, lr: float) -> None:
        """Keep the error memory in update units: if the learning rate changed from the one the memory
        is expressed for, multiply the memory by ``old / new`` (constant LR: bitwise no-op)."""
        lr = float(lr)
        if not lr > 0:
            raise ValueError(f"lr_scheduler.get_last_lr()[0] is {lr!r}; LR-aware error feedback needs a "
                             "positive learning rate")
        if self.last_lr is not None and lr != self.last_lr:
            factor = self.last_lr / lr
            self.store.scale_errors(factor)
            for _, segment, _ in self._padded.values():
                segment.error_memory.mul_(factor)
        self.last_lr = lr

    def wire_dtype(self, grad_dtype: torch.dtype) -> torch.dtype:
        """The dtype a compressed step sends for gradients of ``grad_dtype``."""
        return self.config.wire_dtype(grad_dtype, work_dtype_for(grad_dtype))

    def count(self, numel: int, sent: int, grad_dtype: torch.dtype, wire_dtype: torch.dtype) -> None:
        """Add one task's figures: ``numel`` gradient elements in, ``sent`` elements of ``wire_dtype`` out."""
        self.numel_in += numel
        self.numel_sent += sent
        self.bytes_in += numel * grad_dtype.itemsize
        self.bytes_sent += sent * wire_dtype.itemsize

    # --- the batched hook's per-bucket memory -------------------------------------------------------
    def padded_segment(self, index: int, buffer: Tensor) -> tuple[Segment, Tensor]:
        """The segment and the padded ``s x s`` matrix of bucket ``index`` (``s = ceil(sqrt(numel))``);
        a bucket whose size or device changed starts with fresh memory (with a warning)."""
        numel = buffer.numel()
        entry = self._padded.get(index)
        if entry is not None and entry[0] == numel and entry[1].device == buffer.device:
            return entry[1], entry[2]
        side = max(1, int(numel ** 0.5))
        while side * side < numel:
            side += 1
        dtype = work_dtype_for(buffer.dtype)
        plan = make_plan([(side, side)], self.config.rank, min_compression_rate=0)
        # Negative keys: the batched hook's memory is per bucket, not per parameter.
        segment = Segment(plan, [-1 - index], buffer.device, dtype, self.store.workspace)
        saved = self._saved_padded.pop(index, None)
        if saved is not None:
            if saved["numel"] == numel:
                memory = {-1 - index: ParamMemory.from_dict({**saved, "shape": (side, side)})}
                segment.load(memory, self.config)
            else:
                logger.warning("batched_powerSGD_hook: bucket %s has %s elements, the checkpoint %s; its memory "
                               "is reset", index, numel, saved["numel"])
        elif entry is not None:
            logger.warning("batched_powerSGD_hook: bucket %s changed size (%s -> %s elements); its memory is "
                           "reset", index, entry[0], numel)
        square = torch.zeros(side, side, device=buffer.device, dtype=dtype)
        self._padded[index] = (numel, segment, square)
        return segment, square

    # --- reading the memory -----------------------------------------------------------------------
    def approximation_norms(self) -> dict[int, tuple[float, float]]:
        """``{key: (||M||, ||M - P Q^T||)}`` of the last measured step (batched buckets under ``-1 - index``)."""
        return self._with_padded(self.store.approximation_norms(), lambda segment: segment.norms)

    def global_residual_norms(self) -> dict[int, tuple[float, float]]:
        """``{key: (||mean M Omega||, ||(mean M - P Q^T) Omega||)}`` of the last measured step, sketched over
        the workers' mean (see :meth:`~gradpress.powersgd.memory.Segment.global_residual_norms`; batched
        buckets under ``-1 - index``)."""
        return self._with_padded(self.store.global_residual_norms(), lambda segment: segment.global_norms)

    def _with_padded(self, norms: dict[int, tuple[float, float]],
                     of: Callable[[Segment], Tensor | None]) -> dict[int, tuple[float, float]]:
        """``norms`` plus the batched hook's per-bucket norms (``of(segment)``), read on the host."""
        for index, (_, segment, _) in self._padded.items():
            measured = of(segment)
            if measured is not None:
                whole, residual = measured[0].tolist()
                if whole == whole:
                    norms[-1 - index] = (whole, residual)
        return norms

    def segments(self) -> list[Segment]:
        """Every segment of memory: the store's (per parameter) and the batched hook's (per bucket)."""
        return [*self.store.segments.values(), *(segment for _, segment, _ in self._padded.values())]

    def memory_report(self) -> MemoryReport:
        """What the engine holds now, in bytes, and what its plans send (see :class:`MemoryReport`)."""
        segments = self.segments()
        plans = [segment.plan for segment in segments]
        workspace = self.store.workspace.nbytes if segments else 0
        return MemoryReport(
            error_memory=sum(_nbytes(s.error_memory) for s in segments),
            p=sum(_nbytes(s.phase1) for s in segments), q=sum(_nbytes(s.q) for s in segments),
            saved_factors=sum(_nbytes(s.saved_factors) for s in segments), workspace=workspace,
            sent=sum(p.numel_sent for p in plans), p_numel=sum(p.p_numel for p in plans),
            q_numel=sum(p.q_numel for p in plans))

    # --- checkpoint core -----------------------------------------------------------------------------
    def memory_state(self) -> dict[int, dict[str, Any]]:
        """Per-parameter error memory and factors as plain tensors (the ``"memory"`` entry of both
        front-ends' checkpoints)."""
        return {key: memory.to_dict() for key, memory in self.store.export().items()}

    def padded_state(self) -> dict[int, dict[str, Any]]:
        """The batched hook's per-bucket memory (``"padded"``); buckets loaded but not seen again since
        keep their loaded memory."""
        return {**self._saved_padded,
                **{index: {"numel": numel, **segment.export(self.config)[-1 - index].to_dict()}
                   for index, (numel, segment, _) in self._padded.items()}}

    def load_memory_state(self, memory: dict[Any, dict[str, Any]],
                          padded: dict[Any, dict[str, Any]] | None = None) -> None:
        """Replace the memory by a checkpoint's (:meth:`memory_state`, :meth:`padded_state`); a step
        in flight is forgotten."""
        self.discard()
        self.store.replace({int(key): ParamMemory.from_dict(entry) for key, entry in memory.items()})
        self._padded.clear()
        self._saved_padded = {int(key): entry for key, entry in (padded or {}).items()}

"""One PowerSGD run's engine state, shared by both front-ends.

:class:`gradpress.PowerSGDState` (DDP hooks) and :class:`gradpress.PowerSGD` (the aggregator) each hold
one :class:`EngineSession` and differ only in how they are called and what they call things. Each
bucket (or dtype group) is one call: :meth:`EngineSession.run` (a compressed step) or
:meth:`EngineSession.average` (an exact average, the warm-up), which start the step in the ordered
pipeline, join it to the optimizer step's commit and count what it sends. The session owns what a
compressed run changes from step to step:

* the :class:`~gradpress.powersgd.store.SegmentStore` (error memory and warm-start factors per parameter);
* the ordered pipeline the steps' collectives run in and the :class:`~gradpress.powersgd.commit.StepCommit`
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

from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch import Tensor

from .backend import backend_for
from .commit import StepCommit
from .config import EngineConfig
from .memory import ParamMemory, Segment, work_dtype_for
from .pipeline import OrderedPipeline, Task
from .seeding import upload
from .step import StartedStep, average_step, compress_step, finish_power_steps, step_options, step_wire_dtype
from .store import SegmentStore
from .transport import Communicator, StepDecision
from .wire import wire_codec

__all__ = ["EngineSession", "MemoryReport"]

@dataclass(frozen=True)
class MemoryReport:
    """Bytes the engine holds, by purpose (what ``torch.cuda.memory_allocated`` would see of it).

    ``error_memory``: the residuals carried to the next step; ``m_buffer``: where a step builds M = g + e
    once (laid out as the error memory; the two trade roles at each commit); ``p``: the first collective's
    buffer (P and the tensors sent exactly); ``q``: the Q factors (the warm start); ``saved_factors``: the
    warm-start factors of the step in flight, put back if that step is not finite; ``workspace``: the one
    scratch buffer the segments share; ``total``: their sum. ``sent``, ``p_numel``, ``q_numel``: elements a
    compressed step sends, and of those the P and Q factors, under the current plans.
    """

    error_memory: int = 0
    m_buffer: int = 0
    p: int = 0
    q: int = 0
    saved_factors: int = 0
    workspace: int = 0
    sent: int = 0
    p_numel: int = 0
    q_numel: int = 0

    @property
    def total(self) -> int:
        return self.error_memory + self.m_buffer + self.p + self.q + self.saved_factors + self.workspace

    def as_dict(self) -> dict[str, int]:
        return {**asdict(self), "total": self.total}


def _tiles(flat: Tensor, tensors: Sequence[Tensor]) -> bool:
    """Whether ``tensors`` are contiguous views of the contiguous ``flat``, back to back, covering it."""
    if not flat.is_contiguous() or sum(t.numel() for t in tensors) != flat.numel():
        return False
    address, size = flat.data_ptr(), flat.element_size()
    for tensor in tensors:
        if tensor.numel() and (not tensor.is_contiguous() or tensor.data_ptr() != address
                               or tensor.dtype != flat.dtype):
            return False
        address += tensor.numel() * size
    return True


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

    Each bucket's work is one call, :meth:`run` (compressed) or :meth:`average` (exact); :meth:`finish`
    ends the optimizer step (drain the pipeline, commit every segment together, then run the completions).
    With :attr:`commit_each_bucket` set, each bucket's step commits as it ends instead, for wrappers that
    need each bucket's result at once (FSDP, the interleaved ZeRO step).
    """

    __slots__ = ("config", "store", "pipeline", "commit", "commit_each_bucket", "last_lr", "numel_in",
                 "numel_sent", "bytes_in", "bytes_sent", "_pending", "_span_lengths", "_wires", "last_step_bytes",
                 "_step_bytes")

    def __init__(self, config: EngineConfig, *, advance_on_submit: bool = True) -> None:
        self.config = config
        self.store = SegmentStore(config)
        self.pipeline = OrderedPipeline(advance_on_submit=advance_on_submit)
        self.commit = StepCommit()
        #: Whether each bucket's step writes its output and memory as soon as it ends (``True``), or all
        #: steps of an optimizer step together at :meth:`finish` (``False``, the default).
        self.commit_each_bucket = False
        #: The learning rate the error memory is expressed for (``None``: not tracked yet).
        self.last_lr: float | None = None
        #: Elements handed in, elements sent, and the same in bytes (at the wire's precision).
        self.numel_in = 0
        self.numel_sent = 0
        self.bytes_in = 0
        self.bytes_sent = 0
        # Completions waiting for the commit, each with what to run instead if the step fails.
        self._pending: list[tuple[Callable[[], None], Callable[[BaseException], None]]] = []
        #: ``(bytes in, bytes sent)`` of the last optimizer step that compressed (:meth:`run`'s tasks; the
        #: warm-up's exact averages are not counted), ``(0, 0)`` before the first.
        self.last_step_bytes: tuple[int, int] = (0, 0)
        self._step_bytes: tuple[int, int] | None = None  # the step in flight's, while it compresses
        # The half-precision warm-up's span lengths per layout, uploaded once (see average).
        self._span_lengths: dict[tuple[torch.device, tuple[int, ...]], Tensor] = {}
        # Its wire buffers on the CPU, one per DDP bucket, until end_warm_up(): a fresh buffer there is fresh
        # pages from the kernel (a quarter of the half-precision warm-up's cost on GPT-2 small).
        self._wires: dict[int, Tensor] = {}

    # --- running steps ------------------------------------------------------------------------------
    def run(self, segment: Segment, tensors: Sequence[Tensor], comm: Communicator, compressed_step: int, *,
            numel: int | None = None, dtype: torch.dtype | None = None, measure: bool = False,
            track: bool = False, global_residual: bool = False, on_done: Callable[[], None] = lambda: None,
            on_fail: Callable[[BaseException], None] = lambda error: None) -> int:
        """Compress ``tensors`` (``segment``'s, in plan order) in compressed step number ``compressed_step``
        (see :func:`~gradpress.powersgd.step.compress_step`; ``measure``, ``track``, ``global_residual``
        too), averaging over
        ``comm``: start the step in the ordered pipeline, join it to the optimizer step's commit (or let it
        commit alone under :attr:`commit_each_bucket`) and count it. Returns the bytes it sends.

        ``on_done()`` runs once the outputs are written (after :meth:`finish`'s commit, or when the step
        ends under :attr:`commit_each_bucket`); ``on_fail(error)`` if it raises. ``numel``, ``dtype``:
        the gradient elements the tensors stand for and their dtype, counted as what came in (default:
        the plan's elements, the tensors' dtype; the batched hook's padded square stands for its bucket).
        """
        commit = None if self.commit_each_bucket else self.commit
        task, sent = compress_step(segment, tensors, comm, self.config, compressed_step, commit,
                                   measure=measure, track=track, global_residual=global_residual)
        self._submit(task, on_done, on_fail)
        return self._count_step(segment, tensors, sent, numel, dtype)

    def _count_step(self, segment: Segment, tensors: Sequence[Tensor], sent: int, numel: int | None,
                    dtype: torch.dtype | None) -> int:
        """Count a compressed step of ``segment`` that sends ``sent`` elements; returns its bytes."""
        wire = step_wire_dtype(segment, tensors, self.config)
        grad_dtype = tensors[0].dtype if dtype is None else dtype
        numel_in = segment.plan.numel if numel is None else numel
        bytes_in, bytes_sent = self._step_bytes or (0, 0)
        self._step_bytes = (bytes_in + numel_in * grad_dtype.itemsize, bytes_sent + sent * wire.itemsize)
        return self.count(numel_in, sent, grad_dtype, wire)

    def start(self, segment: Segment, tensors: Sequence[Tensor], comm: Communicator, compressed_step: int, *,
              dtype: torch.dtype | None = None, measure: bool = False, track: bool = False,
              global_residual: bool = False, on_done: Callable[[], None] = lambda: None,
              on_fail: Callable[[BaseException], None] = lambda error: None) -> StartedStep:
        """:meth:`run`'s classic step split in two: start its P phase now (M, P = M Q and P's all-reduce,
        issued at once) and return it; :meth:`finish_started` runs the rest of several such steps together.
        ``on_done``/``on_fail`` and the counting are :meth:`run`'s (the bytes are the whole step's)."""
        if self.config.num_iters_per_step is not None:
            raise ValueError("EngineSession.start splits classic PowerSGD's step (num_iters_per_step=None), got "
                             f"num_iters_per_step={self.config.num_iters_per_step!r}")
        add_memory, damping, probe = step_options(self.config, compressed_step, measure, track, global_residual)
        started = StartedStep(segment, tensors, self.config, compressed_step, add_memory=add_memory,
                              damping=damping, probe=probe)
        self._submit(started.send_p(comm), on_done, on_fail)
        self._count_step(segment, tensors, segment.plan.numel_sent, None, dtype)
        return started

    def finish_started(self, started: Sequence[StartedStep], comm: Communicator,
                       on_fail: Callable[[BaseException], None] = lambda error: None) -> None:
        """The rest of ``started`` steps (:meth:`start`), together, once every P phase has completed: one call
        orthogonalizes every P, one all-reduce carries every Q, and each commits with the optimizer step
        (:meth:`finish`)."""
        self.pipeline.drain()
        self._submit(finish_power_steps(started, comm, self.config, self.commit), lambda: None, on_fail)

    def average(self, tensors: Sequence[Tensor], comm: Communicator, *, flat: Tensor | None = None,
                counted: bool = True, bucket: int | None = None, on_done: Callable[[], None] = lambda: None,
                on_fail: Callable[[BaseException], None] = lambda error: None) -> int:
        """Average ``tensors`` (one device and dtype) exactly over ``comm``, in place, in one collective:
        the iterations before compression starts. The wire is the working precision, or the half-precision
        wire of the compressed steps with ``config.warm_up_bytes_per_weight=2``, each tensor scaled by its
        own power of two (see :func:`~gradpress.powersgd.step.average_step`). ``flat``: a contiguous
        buffer the tensors are views of, back to back (a DDP bucket's), sent as it is; ignored if they are
        not. Started, committed and completed as :meth:`run`; ``counted``: add the elements and bytes to
        the counters. ``bucket``: the DDP bucket's index, under which a CPU wire buffer is kept for the
        next iterations (until :meth:`end_warm_up`). Returns the bytes it sends."""
        if not tensors:
            return 0
        dtype = tensors[0].dtype
        wire = self.config.warm_up_wire_dtype(dtype)
        commit = None if self.commit_each_bucket else self.commit
        if flat is not None and not _tiles(flat, tensors):
            flat = None
        lengths = out = None
        backend = backend_for(tensors[0].device)
        if wire_codec(wire, dtype).needs_spans and backend.span_tables:
            sizes = tuple(t.numel() for t in tensors if t.numel())
            key = (tensors[0].device, sizes)
            lengths = self._span_lengths.get(key)
            if lengths is None:
                lengths = self._span_lengths[key] = upload(torch.tensor(sizes, dtype=torch.int64), key[0])
        if wire != dtype and flat is not None and backend.keeps_wire_buffers and bucket is not None:
            out = self._wires.get(bucket)
            if out is None or out.numel() != flat.numel() or out.dtype != wire:  # DDP's first layout differs
                out = self._wires[bucket] = torch.empty(flat.numel(), dtype=wire)
        self._submit(average_step(tensors, comm, commit, wire, flat=flat, lengths=lengths, out=out), on_done, on_fail)
        numel = sum(t.numel() for t in tensors)
        return self.count(numel, numel, dtype, wire) if counted else numel * wire.itemsize

    def _submit(self, task: Task, complete: Callable[[], None], fail: Callable[[BaseException], None]) -> None:
        """Start ``task`` in the ordered pipeline. ``complete`` runs once its outputs are written: after
        :meth:`finish`'s commit, or when the task ends under :attr:`commit_each_bucket`. ``fail(error)``
        runs if it raises (and fails every completion still waiting)."""
        def failed(error: BaseException) -> None:
            pending, self._pending = self._pending, []
            fail(error)
            for _, fail_waiting in pending:
                fail_waiting(error)

        done = complete if self.commit_each_bucket else (lambda: self._pending.append((complete, fail)))
        try:
            self.pipeline.submit(task, done, failed)
        except BaseException:
            self.discard()
            raise

    def finish(self, decision: StepDecision | None = None) -> Tensor | None:
        """End the optimizer step: run every task to its end, commit them together, run the waiting
        completions. Returns the step's all-finite flag (``None``: nothing was committed).

        ``decision`` (the communicator, where it decides whether steps count: a fault-tolerant group) is
        asked once, after every collective has completed and before the commit; a step it refuses is
        committed as a non-finite one (memory and factors bitwise as before, the flag ``False``)."""
        if self._step_bytes is not None:
            self.last_step_bytes, self._step_bytes = self._step_bytes, None
        try:
            self.pipeline.drain()
            if decision is not None and len(self.commit):
                self.commit.add(torch.tensor(bool(decision.decide_step())))
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

    def end_warm_up(self) -> None:
        """Compression starts: drop the half-precision warm-up's wire buffers."""
        self._wires.clear()

    def forget_memory(self) -> None:
        """Drop every error memory and warm-start factor (the state moved to another model); the
        counters and the learning rate stay. Nothing may be in flight."""
        self.store = SegmentStore(self.config)

    @property
    def oriented(self) -> bool | None:
        """Whether this run's memory compresses wide matrices as their transpose (``None``: no segment yet,
        so nothing decided: ``config.orient`` says what will be)."""
        return self.store.oriented

    def configure(self, config: EngineConfig) -> None:
        """Compress with ``config`` from now on (an automatic rank's decision, a checkpoint's orientation):
        the memory is dropped, as :meth:`forget_memory`, since its meaning depends on the configuration;
        load or build it afterwards. Nothing may be in flight."""
        if self.in_flight():
            raise RuntimeError("EngineSession.configure() was called while a step is in flight")
        self.config = config
        self.forget_memory()

    # --- learning rate, counters ------------------------------------------------------------------
    def rescale_to_lr(self, lr: float) -> float | None:
        """Keep the error memory in update units: if the learning rate changed from the one the memory
        is expressed for, multiply the memory by ``old / new`` (constant LR: bitwise no-op). Returns the
        factor applied (``None``: none), for memory the caller keeps outside the store."""
        lr = float(lr)
        if not lr > 0:
            raise ValueError(f"lr_scheduler.get_last_lr()[0] is {lr!r}; LR-aware error feedback needs a "
                             "positive learning rate")
        factor = None
        if self.last_lr is not None and lr != self.last_lr:
            factor = self.last_lr / lr
            self.store.scale_errors(factor)
        self.last_lr = lr
        return factor

    def wire_dtype(self, grad_dtype: torch.dtype) -> torch.dtype:
        """The dtype a compressed step sends for gradients of ``grad_dtype``."""
        return self.config.wire_dtype(grad_dtype, work_dtype_for(grad_dtype))

    def count(self, numel: int, sent: int, grad_dtype: torch.dtype, wire_dtype: torch.dtype) -> int:
        """Add one task's figures: ``numel`` gradient elements in, ``sent`` elements of ``wire_dtype`` out.
        Returns the bytes sent."""
        self.numel_in += numel
        self.numel_sent += sent
        self.bytes_in += numel * grad_dtype.itemsize
        self.bytes_sent += sent * wire_dtype.itemsize
        return sent * wire_dtype.itemsize

    # --- reading the memory -----------------------------------------------------------------------
    def approximation_norms(self) -> dict[int, tuple[float, float]]:
        """``{key: (||M||, ||M - P Q^T||)}`` of the last measured step (see
        :meth:`~gradpress.powersgd.store.SegmentStore.approximation_norms`)."""
        return self.store.approximation_norms()

    def global_residual_norms(self) -> dict[int, tuple[float, float]]:
        """``{key: (||mean M Omega||, ||(mean M - P Q^T) Omega||)}`` of the last measured step, sketched over
        the workers' mean (see :meth:`~gradpress.powersgd.memory.Segment.global_residual_norms`)."""
        return self.store.global_residual_norms()

    def segments(self) -> list[Segment]:
        """The store's segments (the per-parameter memory in use)."""
        return list(self.store.segments.values())

    def memory_report(self, extra: Sequence[Segment] = ()) -> MemoryReport:
        """What the engine holds now, in bytes, and what its plans send (see :class:`MemoryReport`);
        ``extra``: segments the caller keeps outside the store (sharing its workspace), counted too."""
        segments = [*self.segments(), *extra]
        plans = [segment.plan for segment in segments]
        workspace = self.store.workspace.nbytes if segments else 0
        return MemoryReport(
            error_memory=sum(_nbytes(s.error_memory) for s in segments),
            m_buffer=sum(_nbytes(s.m_memory) for s in segments),
            p=sum(_nbytes(s.phase1) for s in segments), q=sum(_nbytes(s.q) for s in segments),
            saved_factors=sum(_nbytes(s.saved_factors) for s in segments), workspace=workspace,
            sent=sum(p.numel_sent for p in plans), p_numel=sum(p.p_numel for p in plans),
            q_numel=sum(p.q_numel for p in plans))

    # --- checkpoint core -----------------------------------------------------------------------------
    def memory_state(self) -> dict[int, dict[str, Any]]:
        """Per-parameter error memory and factors as plain tensors (the ``"memory"`` entry of both
        front-ends' checkpoints)."""
        return {key: memory.to_dict() for key, memory in self.store.export().items()}

    def load_memory_state(self, memory: dict[Any, dict[str, Any]]) -> None:
        """Replace the memory by a checkpoint's (:meth:`memory_state`); a step in flight is forgotten."""
        self.discard()
        self.store.replace({int(key): ParamMemory.from_dict(entry) for key, entry in memory.items()})

"""PowerSGD as DDP communication hooks, drop-in for ``torch.distributed.algorithms.ddp_comm_hooks``.

>>> import gradpress                                                            # doctest: +SKIP
>>> state = gradpress.PowerSGDState(process_group=None, matrix_approximation_rank=2,
...                                 start_powerSGD_iter=10)                      # doctest: +SKIP
>>> ddp_model.register_comm_hook(state, gradpress.powerSGD_hook)                 # doctest: +SKIP

Differences from PyTorch that users can rely on (each has a test):
  * collectives are issued in the same order on every rank (:mod:`gradpress.powersgd.pipeline`), with no
    blocking wait inside a future callback, so gloo cannot hang or mismatch;
  * no ``torch.cuda.synchronize``: CPU tensors work on machines that also have CUDA;
  * ``batched_powerSGD_hook`` works (PyTorch's resizes the bucket buffer and fails);
  * state is kept per parameter, so a checkpoint resumes correctly although DDP rebuilds its buckets
    after the first iteration; ``local_state_dict()`` holds plain tensors;
  * error memory, P and Q are fp32 for fp16/bf16 gradients, and non-finite values never enter them: an
    iteration whose averaged result is not finite (an inf/NaN gradient on any rank) leaves the memory of
    every rank bitwise as it was and hands DDP non-finite gradients, so a ``GradScaler`` skips it on
    every rank (see :class:`PowerSGDState`).
"""

import logging
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from ..adaptive import AdaptiveRank
from ..comm import check_communicator, check_process_group, make_communicator
from ..policy import RankRules
from ..powersgd.config import EngineConfig
from ..powersgd.session import EngineSession, MemoryReport
from ..powersgd.transport import Communicator, decision_of
from ..autorank import AutoRank
from .auto_rank import auto_rank_decision
from .iteration import StartedBuckets, WaitingBuckets
from .parameters import ParameterKeys
from .state_buckets import StateBuckets
from .state_checkpoint import StateCheckpoint
from .state_options import (check_lr_scheduler, check_schedule, check_warm_up, checked_device, checked_overlap,
                            merged_error_feedback)
from .state_report import BucketMemory, StateReport

__all__ = ["PowerSGDState", "powerSGD_hook", "powersgd_hook"]

logger = logging.getLogger(__name__)


def _from_config(field: str) -> property:
    """A read-only property showing the engine configuration's ``field``."""
    return property(lambda state: getattr(state.session.config, field), doc=f"``{field}`` of :attr:`config`.")


def _counter(field: str) -> property:
    """A property reading and setting the engine session's counter ``field``."""
    return property(lambda state: getattr(state.session, field),
                    lambda state, value: setattr(state.session, field, int(value)),
                    doc=f"The engine session's ``{field}`` counter.")


class PowerSGDState(StateBuckets, StateReport, StateCheckpoint):
    r"""State of :func:`powerSGD_hook` / :func:`batched_powerSGD_hook`: configuration, memory, counters.

    Same arguments, names and defaults as PyTorch's ``PowerSGDState``, plus ``comm_device`` and
    ``num_iters_per_step``.

    Args:
        process_group: the group to average over (``None``: the default group).
        matrix_approximation_rank: rank r of the approximation (each matrix uses ``min(n, m, r)``).
        start_powerSGD_iter: plain allreduce for this many iterations first (> 1 with error feedback or
            warm start, since DDP rebuilds its buckets after the first iteration).
        min_compression_rate: compress an ``n x m`` gradient only if ``n*m > (n+m)*r*rate``.
        use_error_feedback: add each step's residual to the next gradient (PowerSGD paper, Alg. 2).
        warm_start: start each power iteration from the previous step's Q.
        orthogonalization_epsilon: added to column norms in rank-1 orthogonalization. Not needed for
            safety here: orthogonalization never produces NaN, even for all-zero gradients.
        random_seed: seeds the initial Q, identically on every rank.
        compression_stats_logging_frequency: log :meth:`compression_stats` every this many iterations.
        batch_tensors_with_same_shape: accepted for compatibility; gradpress always batches same-shape
            matrices with ``bmm`` (results are the same either way).
        comm_device: device the factors travel on, e.g. ``"cpu"`` for CUDA gradients over gloo.
        num_iters_per_step: ``None`` (default): classic PowerSGD, PyTorch's semantics. An integer k >= 1:
            multi-iteration PowerSGD, k one-sided iterations per step with one rank-r factor sent
            each (k=1 sends half of classic; k=2 about the same as classic, with error no larger).
            Needs ``warm_start=True``. See :func:`gradpress.powersgd.step.alternating_step`.
        error_feedback: alias of ``use_error_feedback``; when given it wins over the default
            ``use_error_feedback=True`` (``use_error_feedback=False, error_feedback=True`` is an error).
        bytes_per_weight: precision of P, Q and the uncompressed tensors *on the wire*: 4 = fp32
            (default), 2 = half (bf16 for bf16 gradients, else fp16 scaled so the sum cannot overflow,
            at the cost of a max-allreduce of one float per tensor per phase), 8 = fp64. Error memory and
            orthogonalization keep fp32 (or the gradient's wider dtype). ``bytes_stats()`` counts it.
            ``None``: that working precision on the wire too (fp32; fp64 for fp64 gradients), as
            ``Config(bytes_per_weight=None)``.
        warm_up_bytes_per_weight: the wire of the exact averages of the iterations before
            ``start_powerSGD_iter``. ``None`` (default): the gradients at their own precision, as PyTorch,
            not counted in :meth:`bytes_stats` or :meth:`compression_stats`. 2: the half-precision wire
            of ``bytes_per_weight=2`` (bf16 for bf16 gradients, else fp16 with each gradient scaled by its
            own power of two, agreed on by a max-allreduce of one float per gradient, so the sum cannot
            overflow): half the bytes of fp32 gradients, at fp16's precision (about 3 decimal digits).
            Those iterations are then counted (as many elements after as before, in the wire's bytes).
        lr_scheduler: a ``torch.optim.lr_scheduler.LRScheduler`` or anything with ``get_last_lr()``.
            The error memory is kept in update units: when the learning rate (of the first parameter
            group) goes from ``lr_old`` to ``lr_new``, the memory is multiplied by ``lr_old / lr_new``
            before it is added back, so ``sum_t lr_t * applied_t + lr_last * error`` equals
            ``sum_t lr_t * gradient_t``. Constant LR: bitwise no-op.
        feedback_every_n_iters: the residual of every compressed step is accumulated, but the error
            memory is added back into the gradient only on every n-th compressed step (1: standard).
        warm_up_beta_factor: beta in (0, 1]: during the first ``start_powerSGD_iter`` compressed steps
            the stored residual is ``beta * residual`` (error memory damped while the warm-start factors
            are still untrained); then full feedback. ``None``: off.
        approximation_error_every_n_iters: measure each compressed matrix's relative approximation
            error ``||M - P Q^T|| / ||M||`` on every n-th compressed iteration (the first included), on
            the device, from tensors the step holds anyway (two norms per matrix, no collective); read it
            with :meth:`approximation_error` (names after :meth:`name_parameters`). ``None`` (default): never.
        global_residual_every_n_iters: the same for the global residual of the workers' mean
            (:meth:`global_residual`), which costs one more all-reduce (of a sketch, ``n x 16`` per matrix)
            on each measured iteration. ``None`` (default): never.
        rank_policy: which parameters are compressed and at what rank, by name:
            ``{"embed*": None, "*.attn.*": 16}`` (shell patterns, the first match decides, ``None`` sends
            the parameter exactly, unmatched ones take ``matrix_approximation_rank``) or a function
            ``(name, parameter) -> rank or None`` (see :mod:`gradpress.policy`). Needs the names:
            call :meth:`name_parameters` with the model before the first compressed iteration.
            Not for ``batched_powerSGD_hook``, which compresses whole buckets.
        adaptive_rank: an :class:`~gradpress.adaptive.AdaptiveRank` ``(low, high, every, threshold)``:
            each compressed parameter's rank switches between ``low`` and ``high`` every ``every``
            compressed iterations, on the change of its gradient norm (Accordion); decisions are the
            same on every rank (one small all-reduce per interval), switches keep the error memory and
            resize the warm-start factors, bytes are counted at the ranks in force, and checkpoints
            resume exactly. With a ``rank_policy``, the policy says which parameters are sent exactly
            and the adaptive rank sets the others'. See :mod:`gradpress.adaptive`.
        auto_rank: an :class:`~gradpress.autorank.AutoRank`: the rank is chosen once, at the first
            compressed iteration, as the smallest from ``min_rank`` (32 by default) whose residual in the
            averaged gradients of the last warm-up iterations is at most ``noise_multiple`` times their noise
            (read from the workers' own gradients; ``criterion="energy"``: that carries ``threshold`` of their
            energy), the same on every rank, logged, checkpointed, then read as ``matrix_approximation_rank``.
            DDP hooks only; a mapping ``rank_policy`` keeps its own ranks. See :mod:`gradpress.autorank`.
        orient_matrices: ``True`` compresses a wide gradient (``n < m``) as its transpose, so that a model's
            ``(a, b)`` and ``(b, a)`` shapes share one batched product (fewer kernels, the same bytes);
            ``False``: PyTorch's ``(shape[0], -1)`` view always; ``"auto"`` (default): oriented on
            accelerators, not on the CPU (a strided pass each way there). A loaded checkpoint's wins.
        half_precision_wire: the 2-byte wires' format: ``"auto"`` (bf16 for bf16 gradients, else scaled
            fp16), ``"fp16"`` or ``"bf16"`` (fp32's range, no scale, 8 bits of mantissa against 11).
        orthogonalization: ``"auto"`` (Householder on the CPU, Cholesky-QR elsewhere), ``"householder"``,
            ``"cholesky"``.
        communicator: what the hook averages over instead of ``process_group`` (which must then be
            ``None``): any object with the engine's :class:`~gradpress.powersgd.transport.Communicator`
            methods, e.g. ``gradpress.integrations.torchft.FaultTolerantGroup(manager).communicator()``
            across torchft replica groups. One that decides whether steps count
            (:class:`~gradpress.powersgd.transport.StepDecision`) is asked at the iteration's last bucket,
            before anything is written: a step it refuses leaves the memory bitwise as it was.

    Non-finite iterations (AMP): when anything the hook averaged in an iteration is inf/NaN (on any
    rank: the sum carries it to all), the error memory and warm-start factors of every bucket, on every
    rank, stay bitwise as they were before that iteration, and the gradients handed to DDP are
    non-finite, so ``GradScaler.step`` skips it on every rank. The decision is taken on the device (no
    host sync; on the CPU one flag per iteration is read). ``iter`` still advances, as it does for
    :meth:`update_state`: a run that leaves such an iteration out and calls ``update_state()`` in its
    place continues with the same numbers. How: every bucket's output and new memory are written at the
    iteration's last bucket, once all are known to be finite (``gradpress.powersgd.StepCommit``). Under
    FSDP (:func:`gradpress.register_fsdp_comm_hook`) and the interleaved ZeRO step, each bucket commits alone.

    Example::

        state = PowerSGDState(None, matrix_approximation_rank=1, start_powerSGD_iter=10)
        ddp_model.register_comm_hook(state, powerSGD_hook)
        ...
        torch.save({"model": ddp_model.state_dict(), "powersgd": state.state_dict()}, path)
    """

    __slots__ = ("process_group", "start_powerSGD_iter", "compression_stats_logging_frequency",
                 "batch_tensors_with_same_shape", "comm_device", "iter", "next_stats_report", "_session",
                 "_params", "_comm", "lr_scheduler", "_lr_iter", "approximation_error_every_n_iters", "_auto",
                 "last_measured_iter", "_bucket_memory", "_waiting", "global_residual_every_n_iters", "overlap",
                 "_started", "__weakref__")

    def __init__(
        self,
        process_group: dist.ProcessGroup | None,
        matrix_approximation_rank: int = 1,
        start_powerSGD_iter: int = 1_000,
        min_compression_rate: float = 2,
        use_error_feedback: bool = True,
        warm_start: bool = True,
        orthogonalization_epsilon: float = 0,
        random_seed: int = 0,
        compression_stats_logging_frequency: int = 10_000,
        batch_tensors_with_same_shape: bool = False,
        comm_device: torch.device | str | None = None,
        num_iters_per_step: int | None = None,
        *,
        error_feedback: bool | None = None,
        bytes_per_weight: int | None = 4,
        lr_scheduler: Any = None,
        feedback_every_n_iters: int = 1,
        warm_up_beta_factor: float | None = None,
        warm_up_bytes_per_weight: int | None = None,
        approximation_error_every_n_iters: int | None = None,
        global_residual_every_n_iters: int | None = None,
        rank_policy: RankRules | None = None,
        adaptive_rank: AdaptiveRank | dict[str, Any] | None = None,
        auto_rank: AutoRank | dict[str, Any] | None = None,
        orient_matrices: bool | str = "auto",
        half_precision_wire: str = "auto",
        orthogonalization: str = "auto",
        overlap: str = "auto",
        communicator: Communicator | None = None,
    ) -> None:
        check_process_group(process_group, "PowerSGDState's first argument, process_group",
                            "the signature is PowerSGDState(process_group, matrix_approximation_rank, "
                            f"start_powerSGD_iter, ...): for rank {process_group!r} write "
                            f"PowerSGDState(None, matrix_approximation_rank={process_group!r}, ...)"
                            if isinstance(process_group, int) and not isinstance(process_group, bool) else "")
        check_communicator(communicator, process_group, "PowerSGDState")
        use_error_feedback = merged_error_feedback(use_error_feedback, error_feedback)
        check_lr_scheduler(lr_scheduler)
        check_schedule(start_powerSGD_iter, compression_stats_logging_frequency, approximation_error_every_n_iters,
                       global_residual_every_n_iters)
        config = EngineConfig(
            rank=matrix_approximation_rank, min_compression_rate=min_compression_rate,
            use_error_feedback=use_error_feedback, warm_start=warm_start,
            orthogonalization_epsilon=orthogonalization_epsilon, random_seed=random_seed,
            num_iters_per_step=num_iters_per_step, bytes_per_weight=bytes_per_weight,
            feedback_every_n_iters=feedback_every_n_iters, warm_up_beta_factor=warm_up_beta_factor,
            warm_up_steps=start_powerSGD_iter, warm_up_bytes_per_weight=warm_up_bytes_per_weight,
            orient=orient_matrices, half_precision_wire=half_precision_wire, orthogonalization=orthogonalization)
        check_warm_up(config)
        comm_device = checked_device(comm_device)
        self.overlap = checked_overlap(overlap, num_iters_per_step)
        self.process_group = process_group
        self.start_powerSGD_iter = start_powerSGD_iter
        self.compression_stats_logging_frequency = max(1, compression_stats_logging_frequency)
        self.batch_tensors_with_same_shape = bool(batch_tensors_with_same_shape)
        self.comm_device = comm_device
        self.iter = 0
        self.next_stats_report = 0
        # Per-bucket steps (commit_each_bucket) start only their first phase at submit; the last bucket
        # drains the rest, so the autograd thread never waits on the link mid-backward (docs/design.md#ordering).
        self._session = EngineSession(config, advance_on_submit=False)
        self._comm: Communicator | None = communicator
        self.lr_scheduler = lr_scheduler
        self._lr_iter = -1  # the iteration at which the learning rate was last read
        self.approximation_error_every_n_iters = approximation_error_every_n_iters
        self.global_residual_every_n_iters = global_residual_every_n_iters
        #: The iteration whose measurement :meth:`approximation_error` shows (``None``: none yet).
        self.last_measured_iter: int | None = None
        if isinstance(adaptive_rank, dict):  # the checkpoint form (unpickling)
            adaptive_rank = AdaptiveRank(**adaptive_rank)
        if adaptive_rank is not None and not isinstance(adaptive_rank, AdaptiveRank):
            raise TypeError(f"adaptive_rank must be None or a gradpress.AdaptiveRank(low, high, every, threshold), "
                            f"got {type(adaptive_rank).__name__}")
        # Parameters by stable key (DDP rebuilds its buckets), their names and ranks.
        self._params = ParameterKeys(config.rank, config.min_compression_rate, rank_policy, adaptive_rank)
        self._auto = auto_rank_decision(auto_rank, adaptive_rank, rank_policy)
        # A hook's per-bucket memory (BucketMemory), or its checkpoint form until that hook first runs.
        self._bucket_memory: BucketMemory | dict[Any, Any] = {}
        self._waiting = WaitingBuckets()  # the iteration's buckets, until its last (compress_with_step)
        self._started = StartedBuckets()  # the iteration's buckets whose P phase is issued (overlap="p-phase")

    # --- configuration, read-only (the memory's meaning depends on it) -----------------------------
    matrix_approximation_rank = _from_config("rank")
    min_compression_rate = _from_config("min_compression_rate")
    use_error_feedback = _from_config("use_error_feedback")
    error_feedback = _from_config("use_error_feedback")
    warm_start = _from_config("warm_start")
    orthogonalization_epsilon = _from_config("orthogonalization_epsilon")
    random_seed = _from_config("random_seed")
    num_iters_per_step = _from_config("num_iters_per_step")
    bytes_per_weight = _from_config("bytes_per_weight")
    warm_up_bytes_per_weight = _from_config("warm_up_bytes_per_weight")
    feedback_every_n_iters = _from_config("feedback_every_n_iters")
    warm_up_beta_factor = _from_config("warm_up_beta_factor")
    orient_matrices = _from_config("orient")
    half_precision_wire = _from_config("half_precision_wire")
    orthogonalization = _from_config("orthogonalization")

    @property
    def rank_policy(self) -> RankRules | None:
        """The ``rank_policy`` given (``None``: every matrix at ``matrix_approximation_rank``)."""
        return None if self._params.policy is None else self._params.policy.rules

    @property
    def adaptive_rank(self) -> AdaptiveRank | None:
        """The ``adaptive_rank`` given, as an :class:`~gradpress.adaptive.AdaptiveRank` (``None``: off)."""
        return self._params.adaptive

    @property
    def auto_rank(self) -> AutoRank | None:
        """The ``auto_rank`` given (``None``: off); :attr:`matrix_approximation_rank` holds its decision."""
        return None if self._auto is None else self._auto.rule

    @property
    def config(self) -> EngineConfig:
        """The engine configuration derived from the arguments."""
        return self._session.config

    # --- counters (PyTorch's names; bytes are gradpress's) -------------------------------------------
    total_numel_before_compression = _counter("numel_in")
    total_numel_after_compression = _counter("numel_sent")
    total_bytes_before_compression = _counter("bytes_in")
    total_bytes_after_compression = _counter("bytes_sent")

    # --- for wrappers and tools ------------------------------------------------------------------------
    @property
    def session(self) -> EngineSession:
        """The engine session this state drives (store, pipeline, commit, counters); see
        :mod:`gradpress.powersgd.session`."""
        return self._session

    def commit_each_bucket(self) -> None:
        """Write each bucket's output and memory as soon as its step ends, instead of all buckets of an
        iteration together at the last one. For wrappers that need each bucket's result at once (FSDP,
        the interleaved ZeRO step); a non-finite bucket then keeps its own memory, not every bucket's.
        ``ValueError`` with a communicator that decides whether steps count (it decides per iteration)."""
        if decision_of(self._comm) is not None:
            raise ValueError("PowerSGDState.commit_each_bucket(): this state's communicator decides whether each "
                             "iteration counts (a fault-tolerant group), which needs every bucket committed "
                             "together at the iteration's last one; FSDP and the interleaved ZeRO step are not "
                             "supported with it")
        self._session.commit_each_bucket = True

    def drain(self) -> None:
        """Run every step in flight to its end (a wrapper that must see all results before going on)."""
        self._session.drain()

    def memory_report(self) -> MemoryReport:
        """The bytes of error memory, factors and scratch this state holds, and the elements its plans
        send per compressed step (:class:`gradpress.powersgd.MemoryReport`)."""
        memory = self._bucket_memory
        return self._session.memory_report(() if isinstance(memory, dict) else memory.segments())

    def bucket_memory(self, build: Callable[[dict[Any, Any]], Any]) -> Any:
        """The per-bucket memory of a hook that keeps one (``batched_powerSGD_hook``): built at first use
        by ``build(saved)`` from the checkpoint's ``"padded"`` entry (``{}`` without one), then the same
        object until a checkpoint is loaded or the state moves to another model. It must satisfy
        :class:`BucketMemory`: the state saves it, rescales it and reads its measurements."""
        if isinstance(self._bucket_memory, dict):
            self._bucket_memory = build(self._bucket_memory)
        return self._bucket_memory

    # --- PyTorch's public methods --------------------------------------------------------------------
    def maybe_increase_iter(self, bucket: Any) -> None:
        """Count an iteration when the last bucket has been processed (PyTorch's contract)."""
        if bucket.is_last():
            self._params.end_iteration()
            self._advance()

    def _advance(self) -> None:
        self.iter += 1
        if self.iter == self.start_powerSGD_iter:  # PyTorch's message, then why the stats were zero so far
            self._session.end_warm_up()
            logger.info("Start to apply PowerSGD after %s iterations. (compression_stats() was (0, 0, 0) until "
                        "now: the first start_powerSGD_iter iterations are plain allreduce.)", self.iter)

    def update_state(self) -> None:
        """Advance the state by one iteration that the hook did not see (a skipped or accumulated step),
        and re-read the learning rate from ``lr_scheduler``.

        Call it on **every** rank (the iteration counter decides when compression starts, and all ranks
        must agree), between iterations, never while a backward pass is in flight.
        """
        if self._session.in_flight() or self._waiting or self._started:
            raise RuntimeError("PowerSGDState.update_state() was called while a backward pass is in flight")
        self._advance()
        self._sync_lr(force=True)

    def _sync_lr(self, force: bool = False) -> None:
        """Once per iteration: if the learning rate changed, rescale the error memory to the new one."""
        if self.lr_scheduler is None or (self._lr_iter == self.iter and not force):
            return
        self._lr_iter = self.iter
        factor = self._session.rescale_to_lr(self.lr_scheduler.get_last_lr()[0])
        if factor is not None and not isinstance(self._bucket_memory, dict):
            self._bucket_memory.scale_errors(factor)

    @property
    def communicator(self) -> Communicator | None:
        """What the hook averages over: the ``communicator`` given at construction, or the process group's
        once the first bucket made it (``None`` before)."""
        return self._comm

    # --- internals used by the hooks ------------------------------------------------------------------
    def _communicator(self) -> Communicator:
        if self._comm is None:
            self._comm = make_communicator(self.process_group, self.comm_device, issuer="powerSGD_hook")
        return self._comm

    # --- for hooks built on this state ---------------------------------------------------------------
    @staticmethod
    def of(state: Any, hook: str) -> "PowerSGDState":
        """``state`` if it is a :class:`PowerSGDState`, else a ``TypeError`` naming ``hook``."""
        if not isinstance(state, PowerSGDState):
            raise TypeError(f"{hook} expects a gradpress.PowerSGDState as its state, got "
                            f"{type(state).__name__}; construct one with gradpress.PowerSGDState(process_group, ...)")
        return state



def powerSGD_hook(state: PowerSGDState, bucket: dist.GradBucket) -> torch.futures.Future[Tensor]:
    r"""PowerSGD (Vogels et al., 2019) on each matrix of the bucket; vectors are averaged exactly.

    Register with ``ddp_model.register_comm_hook(state, powerSGD_hook)``. For the first
    ``state.start_powerSGD_iter`` iterations it is a plain allreduce. Then the buckets wait for the last
    one, and all of them are compressed in one step (one ``bmm`` per shape across the model):
      1. view each gradient as ``(shape[0], -1)``; compress it if the plan says so (see
         :func:`gradpress.powersgd.make_plan`); M = gradient + error memory; P = M Q;
      2. allreduce ``[P | uncompressed]``; orthogonalize P (batched Cholesky-QR); Q = M^T P; allreduce Q;
      3. gradient <- P Q^T; error memory <- M - that.

    With ``state.num_iters_per_step = k``, steps 2-4 are instead k one-sided iterations, each sending
    only P or only Q (see :func:`gradpress.powersgd.step.alternating_step`).

    The future completes with the bucket's buffer holding the result, on every rank.
    """
    state = PowerSGDState.of(state, "powerSGD_hook")
    fut = state.start_bucket(bucket)
    if fut is not None:
        return fut
    return state.compress_with_step(bucket, bucket.gradients(), bucket.buffer(), track=state.adaptive_rank is not None)


powersgd_hook = powerSGD_hook

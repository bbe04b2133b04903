"""What a :class:`~gradpress.PowerSGDState` reports: compression figures, approximation errors, global
residuals, ranks in force, and the periodic log line. A base class of ``PowerSGDState`` (its counters,
engine session and parameter keys are the state's own); the state's core is in :mod:`gradpress.hooks.powersgd`.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any, Protocol

from torch import Tensor, nn

from ..checkpoint import placement
from ..comm import link_bytes
from ..powersgd.memory import Segment
from ..diagnostics import ApproximationSummary, captured_energies, relative_errors, should_measure, summarize

__all__ = ["BucketMemory", "StateReport"]

# PowerSGDState's log lines keep the logger of the module users know it from.
logger = logging.getLogger("gradpress.hooks.powersgd")


class BucketMemory(Protocol):
    """Memory a hook keeps per bucket, outside the per-parameter store (``batched_powerSGD_hook``'s
    :class:`~gradpress.hooks.batched.PaddedBuckets`): what the state needs of it."""

    def segments(self) -> list[Segment]: ...

    def scale_errors(self, factor: float) -> None: ...

    def approximation_norms(self) -> dict[str, tuple[float, float]]: ...

    def global_residual_norms(self) -> dict[str, tuple[float, float]]: ...

    def state_dict(self) -> dict[int, dict[str, Any]]: ...


class _State(Protocol):
    """What :class:`StateReport`'s counting and logging methods use of the ``PowerSGDState`` they are part
    of: its counters and options, and the report's own methods."""

    iter: int
    start_powerSGD_iter: int
    next_stats_report: int
    compression_stats_logging_frequency: int
    approximation_error_every_n_iters: int | None
    global_residual_every_n_iters: int | None
    last_measured_iter: int | None
    total_numel_before_compression: int
    total_numel_after_compression: int
    total_bytes_before_compression: int
    total_bytes_after_compression: int

    def compression_stats(self) -> tuple[float, int, int]: ...

    def approximation_error_summary(self) -> ApproximationSummary | None: ...

    def global_residual_summary(self) -> ApproximationSummary | None: ...


class StateReport:
    """The reporting half of :class:`~gradpress.PowerSGDState` (see the module docstring).

    Uses the state's ``_session`` (:class:`~gradpress.powersgd.EngineSession`), ``_params``
    (:class:`~gradpress.hooks.parameters.ParameterKeys`), ``_bucket_memory`` (a hook's per-bucket memory, or
    its checkpoint form while unused: a ``dict``), counters and options.
    """

    __slots__ = ()
    _session: Any
    _params: Any
    _bucket_memory: Any
    last_measured_iter: int | None

    def auto_rank_captured(self) -> list[float] | None:
        """What ``auto_rank`` decided on: the captured energy E(k) of the averaged gradients for k = 1 ..
        ``max_rank`` (``[k - 1]``), pooled over the measured warm-up iterations and the workers (energies
        summed, then divided); ``None`` before the decision or without ``auto_rank`` (see
        :mod:`gradpress.autorank`)."""
        auto = getattr(self, "_auto", None)
        return None if auto is None or auto.captured is None else list(auto.captured)

    def auto_rank_noise_ratio(self) -> list[float] | None:
        """What ``auto_rank``'s noise criterion decided on: the residual over noise R(k) = (1 - E(k)) T / N
        of the averaged gradients for k = 1 .. ``max_rank`` (``[k - 1]``; T their energy, N their noise
        energy read from the workers' own gradients); ``None`` before the decision, without ``auto_rank``,
        or where the energy decided (``criterion="energy"``, one worker; see :mod:`gradpress.autorank`)."""
        auto = getattr(self, "_auto", None)
        return None if auto is None or auto.noise_ratio is None else list(auto.noise_ratio)

    def compression_stats(self: _State) -> tuple[float, int, int]:
        """``(rate, numel before, numel after)`` summed over every compressed bucket step so far.

        ``rate = before / after``. Counts follow the plan: ``n*m`` before and ``(n+m)*r`` after for a
        compressed matrix, ``numel`` for the rest. **(0, 0, 0) until iteration** ``start_powerSGD_iter``:
        the iterations before it are plain allreduce and compress nothing (the ``gradpress.hooks.powersgd``
        logger says at INFO level when compression starts). With ``warm_up_bytes_per_weight=2`` those
        iterations are counted too, each element once before and once after (rate 1 in elements; in
        :meth:`bytes_stats`, the half-precision wire's bytes).

        >>> PowerSGDState(None, start_powerSGD_iter=2).compression_stats()   # nothing compressed yet
        (0, 0, 0)
        """
        before, after = self.total_numel_before_compression, self.total_numel_after_compression
        return (before / after if after > 0 else 0, before, after)

    def bytes_stats(self: _State) -> tuple[float, int, int]:
        """``(rate, bytes before, bytes after)``: like :meth:`compression_stats`, in bytes, counting the
        gradients' dtype before and ``bytes_per_weight`` (the wire dtype) after. The global-residual
        sketch that measured iterations all-reduce (:meth:`global_residual`) is a diagnostic and is not
        counted, here or in :meth:`compression_stats`."""
        before, after = self.total_bytes_before_compression, self.total_bytes_after_compression
        return (before / after if after > 0 else 0, before, after)

    def link_bytes_stats(self) -> tuple[int, int, float]:
        """``(world size, bytes after, bytes on one rank's link)``: :meth:`bytes_stats`'s bytes after (the
        payload this rank handed to its allreduces) beside what its link carried for them, ring-equivalent:
        ``2 (W - 1) / W`` of the payload (:func:`gradpress.comm.link_bytes`), ``W`` the size of
        ``process_group`` now (a checkpoint of another world size is refused, so every counted byte was
        sent at it). Each factor starts on its own 64-byte line of the wire, and the padding, zero, is
        sent and not counted here or in :meth:`bytes_stats` (none at ranks that are multiples of 16 in
        fp32); neither are the fp16 wire's scale maxima nor the global-residual sketch.

        >>> PowerSGDState(None).link_bytes_stats()   # doctest: +SKIP
        (8, 0, 0.0)
        """
        world = placement(getattr(self, "process_group", None))["world_size"]
        after = self.total_bytes_after_compression  # type: ignore[attr-defined]
        return world, after, link_bytes("allreduce", after, world)

    def last_step_bytes_stats(self) -> tuple[float, int, int]:
        """``(rate, bytes before, bytes after)`` of the last iteration that compressed: the per-step
        reading that tables of "x fewer bytes per step" quote (:meth:`bytes_stats` is cumulative and
        includes the warm-up). ``(0, 0, 0)`` before the first compressed iteration.

        >>> state = PowerSGDState(None)   # doctest: +SKIP
        >>> state.last_step_bytes_stats()   # doctest: +SKIP
        (0, 0, 0)
        """
        before, after = self._session.last_step_bytes
        return (before / after if after > 0 else 0, before, after)

    def name_parameters(self, module: nn.Module | Iterable[tuple[str, Tensor]]) -> None:
        """Name parameters in :meth:`approximation_error` after ``module.named_parameters()`` (a DDP or
        FSDP wrapper's ``module.`` prefix is dropped) or after ``(name, parameter)`` pairs. The hook
        only sees DDP's buckets, which carry the parameters but not their names, so it learns them
        here; unnamed parameters appear as ``"#k"`` (the k-th parameter the state saw).

        >>> state = PowerSGDState(None, approximation_error_every_n_iters=100)   # doctest: +SKIP
        >>> state.name_parameters(ddp_model)                                      # doctest: +SKIP
        """
        self._params.name(module)

    def _norms(self, of_mean: bool) -> dict[str, tuple[float, float]]:
        """The last measured step's norms by name: the per-parameter memory's (``of_mean``: the global
        residual's sketched norms, else this worker's) and those of a hook's per-bucket memory."""
        name = self._params.namer()
        session = self._session
        norms = session.global_residual_norms() if of_mean else session.approximation_norms()
        named = {name(key): value for key, value in norms.items()}
        memory = self._bucket_memory
        if not isinstance(memory, dict):
            named.update(memory.global_residual_norms() if of_mean else memory.approximation_norms())
        return named

    def approximation_error(self) -> dict[str, float]:
        """``{parameter: ||M - P Q^T|| / ||M||}`` for every compressed parameter, at the last iteration
        that measured it (``approximation_error_every_n_iters``; empty before the first), on this rank:
        M is this rank's gradient plus error memory, P Q^T what every rank applied (see
        :mod:`gradpress.diagnostics`). Reads the values on the host (a device sync): call it when you
        want the numbers, not on every step.

        >>> state = PowerSGDState(None, approximation_error_every_n_iters=100)   # doctest: +SKIP
        >>> state.approximation_error()["lstm.weight_hh_l0"]                       # doctest: +SKIP
        0.41
        """
        return relative_errors(self._norms(False), str)

    def approximation_error_summary(self) -> ApproximationSummary | None:
        """:meth:`approximation_error` in one :class:`~gradpress.diagnostics.ApproximationSummary`
        (overall, mean, worst): ``None`` before the first measurement."""
        return summarize(self._norms(False), str)

    def global_residual(self) -> dict[str, float]:
        """``{parameter: ||mean M - P Q^T|| / ||mean M||}`` for every compressed parameter, at the last
        iteration that measured it (the same iterations as :meth:`approximation_error`): how much of the
        workers' *averaged* matrix the applied ``P Q^T`` misses, the same on every rank. Estimated with a
        seeded Gaussian sketch of 16 columns (exact for matrices of at most 16 columns, and 0 when P Q^T
        is the mean); see :mod:`gradpress.diagnostics`. Measuring adds one all-reduce of ``n x 16`` per
        matrix to each measured iteration, not counted in :meth:`bytes_stats`. Reads the values on the
        host."""
        return relative_errors(self._norms(True), str)

    def global_residual_summary(self) -> ApproximationSummary | None:
        """:meth:`global_residual` in one :class:`~gradpress.diagnostics.ApproximationSummary` (overall,
        mean, worst, ``captured_energy``): ``None`` before the first measurement."""
        return summarize(self._norms(True), str)

    def captured_energy(self) -> dict[str, float]:
        """``{parameter: 1 - global_residual^2}``: the share of the averaged matrix's energy the applied
        approximation captures, per compressed parameter (see :meth:`global_residual`)."""
        return captured_energies(self._norms(True), str)

    def ranks(self) -> dict[str, int]:
        """The rank each compressed parameter uses now (by name, as :meth:`approximation_error`): the
        :class:`~gradpress.adaptive.AdaptiveRank` in force, else the policy's or
        ``matrix_approximation_rank``, each capped at ``min(n, m)``. Parameters sent exactly are left
        out; empty before the first compressed iteration."""
        name = self._params.namer()
        return dict(sorted((name(key), rank) for key, rank in self._session.store.ranks().items()))

    def _measure(self: _State) -> bool:
        """Whether this iteration measures (and, if so, note it in ``last_measured_iter``)."""
        measure = should_measure(self.approximation_error_every_n_iters, self.iter - self.start_powerSGD_iter)
        if measure:
            self.last_measured_iter = self.iter
        return measure

    def _measure_global(self: _State) -> bool:
        """Whether this iteration measures the global residual (one more all-reduce, of a sketch)."""
        return should_measure(self.global_residual_every_n_iters, self.iter - self.start_powerSGD_iter)

    def _report_stats(self: _State) -> None:
        if self.iter >= self.next_stats_report:
            rate, before, after = self.compression_stats()
            logger.info("Compression stats: iter %s, total before compression %s, total after compression %s, "
                        "rate %s", self.iter, before, after, rate)
            measured = self.approximation_error_every_n_iters is not None and logger.isEnabledFor(logging.INFO)
            summary = self.approximation_error_summary() if measured else None
            if summary is not None:
                logger.info("Approximation error: overall %.4f, mean %.4f, worst %.4f (%s), over %s parameters",
                            summary.overall, summary.mean, summary.worst, summary.worst_name,
                            summary.parameters)
            measured = self.global_residual_every_n_iters is not None and logger.isEnabledFor(logging.INFO)
            global_summary = self.global_residual_summary() if measured else None
            if global_summary is not None:
                logger.info("Global residual (of the workers' mean, sketched): overall %.4f, captured energy %.4f, "
                            "worst %.4f (%s)", global_summary.overall, global_summary.captured_energy,
                            global_summary.worst, global_summary.worst_name)
            self.next_stats_report = self.iter + self.compression_stats_logging_frequency

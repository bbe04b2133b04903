"""The configuration of the :class:`~gradpress.aggregator.PowerSGD` aggregator (the reference's fields)."""

from __future__ import annotations

from dataclasses import dataclass

from ..diagnostics import check_measure_every
from ..powersgd.config import EngineConfig

__all__ = ["Config"]


@dataclass(frozen=True)
class Config:
    """Configuration of :class:`PowerSGD` (the reference's fields and defaults, plus ``random_seed``).

    Args:
        rank: rank r of each approximation (each matrix uses ``min(n, m, r)``); lower is more aggressive.
        min_compression_rate: compress an ``n x m`` gradient only if ``n*m > (n+m)*r*rate``.
        num_iters_per_step: one-sided power iterations per step, each sending one rank-r factor
            (P or Q, alternating); lower is more aggressive. 1 sends half of classic PowerSGD, 2 about
            the same. ``None``: classic two-sided PowerSGD (as :func:`gradpress.powerSGD_hook`).
        start_compressing_after_num_steps: exact averaging for this many steps first.
        random_seed: seeds the initial factors, identically on every worker.
        bytes_per_weight: precision of what goes on the wire (P, Q, uncompressed gradients), as in
            :class:`gradpress.PowerSGDState`: 2 = half (bf16 for bf16 gradients, else fp16 scaled so
            the sum cannot overflow), 4 = fp32, 8 = fp64. ``None`` (default, the reference's
            behaviour): the working precision (fp32 for fp16/bf16/fp32 gradients, fp64 for fp64).
        feedback_every_n_iters: add the error memory back into the gradient only on every n-th
            compressed step (every step's residual is accumulated); 1 is standard PowerSGD.
        warm_up_beta_factor: beta in (0, 1]: during the first ``start_compressing_after_num_steps``
            compressed steps the stored residual is ``beta * residual``; ``None``: off. Needs
            ``start_compressing_after_num_steps > 0`` (the damping lasts as long as the exact warm-up).
        warm_up_bytes_per_weight: the wire of the exact averages of the first
            ``start_compressing_after_num_steps`` steps: ``None`` (default) the gradients' own precision;
            2 the half-precision wire of ``bytes_per_weight=2`` (bf16 for bf16 gradients, else fp16, each
            gradient scaled by its own power of two so the sum cannot overflow). Counted as sent.
        approximation_error_every_n_iters: measure each compressed matrix's approximation error on
            every n-th compressed step (the first included), on the device; read it with
            :meth:`PowerSGD.approximation_error` (:mod:`gradpress.diagnostics`). ``None``: never.
        global_residual_every_n_iters: the same for the global residual of the workers' mean
            (:meth:`PowerSGD.global_residual`), which costs one more all-reduce (of a sketch) on each
            measured step. ``None``: never.
        orient_matrices, half_precision_wire, orthogonalization: as in :class:`gradpress.PowerSGDState`
            (compress wide gradients as their transpose; the 2-byte wires' format, ``"auto"``, ``"fp16"``
            or ``"bf16"``; ``"auto"``, ``"householder"`` or ``"cholesky"``).

    >>> Config(rank=2, bytes_per_weight=2).engine_config().bytes_per_weight
    2
    """

    rank: int
    min_compression_rate: float = 2
    num_iters_per_step: int | None = 1
    start_compressing_after_num_steps: int = 100
    random_seed: int = 0
    bytes_per_weight: int | None = None
    feedback_every_n_iters: int = 1
    warm_up_beta_factor: float | None = None
    warm_up_bytes_per_weight: int | None = None
    approximation_error_every_n_iters: int | None = None
    global_residual_every_n_iters: int | None = None
    orient_matrices: bool | str = "auto"
    half_precision_wire: str = "auto"
    orthogonalization: str = "auto"

    def __post_init__(self) -> None:
        check_measure_every(self.approximation_error_every_n_iters)
        check_measure_every(self.global_residual_every_n_iters, "global_residual_every_n_iters")
        steps = self.start_compressing_after_num_steps
        if isinstance(steps, bool) or not isinstance(steps, int) or steps < 0:
            raise ValueError(f"start_compressing_after_num_steps must be an integer >= 0, got {steps!r}")
        self.engine_config()  # validates the engine's fields
        if self.warm_up_beta_factor is not None and steps == 0:
            raise ValueError("warm_up_beta_factor damps the error memory during the first "
                             "start_compressing_after_num_steps compressed steps, so it needs "
                             "start_compressing_after_num_steps > 0 (got 0); set both, or leave "
                             "warm_up_beta_factor=None")

    def engine_config(self) -> EngineConfig:
        """The engine's view of this configuration (error feedback and warm start on)."""
        return EngineConfig(rank=self.rank, min_compression_rate=self.min_compression_rate,
                            use_error_feedback=True, warm_start=True, random_seed=self.random_seed,
                            num_iters_per_step=self.num_iters_per_step, bytes_per_weight=self.bytes_per_weight,
                            feedback_every_n_iters=self.feedback_every_n_iters,
                            warm_up_beta_factor=self.warm_up_beta_factor,
                            warm_up_steps=self.start_compressing_after_num_steps,
                            warm_up_bytes_per_weight=self.warm_up_bytes_per_weight, orient=self.orient_matrices,
                            half_precision_wire=self.half_precision_wire, orthogonalization=self.orthogonalization)

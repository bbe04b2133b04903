"""Engine configuration shared by the DDP hooks and the standalone aggregator."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .backend import backend_for
from .linalg import ORTHOGONALIZATIONS

__all__ = ["HALF_PRECISION_WIRES", "EngineConfig"]

#: The values of ``half_precision_wire``.
HALF_PRECISION_WIRES = ("auto", "fp16", "bf16")


@dataclass(frozen=True)
class EngineConfig:
    """How one PowerSGD step compresses (the part of the configuration the engine needs).

    ``rank``: the requested approximation rank r (each matrix uses ``min(n, m, r)``).
    ``min_compression_rate``: compress a matrix only if ``n*m > (n+m)*r*rate``.
    ``use_error_feedback``: keep the residual and add it to the next gradient (PowerSGD, Alg. 2).
    ``warm_start``: reuse last step's Q as the starting point of this step's power iteration.
    ``orthogonalization_epsilon``: added to column norms in the rank-1 orthogonalization.
    ``random_seed``: seeds the initial Q, identically on every rank and device.
    ``num_iters_per_step``: ``None`` for classic PowerSGD (P = M Q, Q = M^T P, two collectives per
    step); an integer k >= 1 for the alternating scheme of k one-sided iterations per step (one
    collective each, every low-rank piece used; see :func:`gradpress.powersgd.step.alternating_step`).
    ``bytes_per_weight``: precision of what is allreduced (P, Q, uncompressed tensors): ``None`` sends the
    working dtype; 2 = half precision (bf16 for bf16 gradients, else fp16, scaled by a power of two
    one per tensor, agreed on by a max-allreduce so that the sum cannot overflow), 4 = fp32, 8 = fp64.
    ``feedback_every_n_iters``: add the error memory back into the gradient on every n-th compressed
    step only (the residual of every step is accumulated); 1 is standard PowerSGD.
    ``warm_up_beta_factor``, ``warm_up_steps``: store ``beta * residual`` instead of the residual during
    the first ``warm_up_steps`` compressed steps (``None``: no damping).
    ``warm_up_bytes_per_weight``: the wire of the exact averages before compression starts
    (:meth:`warm_up_wire_dtype`): ``None`` sends the gradients' own dtype; 2 = the half-precision wire of
    ``bytes_per_weight=2`` (bf16 for bf16 gradients, else fp16 scaled one power of two per tensor).
    ``half_precision_wire``: which half precision the 2-byte wires send: ``"auto"`` (bf16 for bf16
    gradients, else fp16 scaled per tensor), ``"fp16"`` or ``"bf16"`` (a plain cast: fp32's range, 8 bits
    of mantissa, no max-allreduce) for every gradient dtype.
    ``orthogonalization``: how P (and Q in the alternating scheme) is orthonormalized: a name of
    :data:`~gradpress.powersgd.linalg.ORTHOGONALIZATIONS` (``"householder"``, ``"cholesky"``) or ``"auto"``,
    the device's choice (:mod:`gradpress.powersgd.backend`: Householder QR on the CPU, Cholesky-QR elsewhere).
    ``orient``: ``True`` views each compressed gradient as a tall matrix, its longer side first
    (``(shape[0], -1)`` transposed where that is wide), so that a model's transposed pairs of shapes (a
    transformer's ``(4d, d)`` and ``(d, 4d)``) share one batched product; ``False``: PyTorch's
    ``(shape[0], -1)`` always; ``"auto"``: the device's backend decides (:meth:`orientation`: oriented on
    accelerators, where it saves kernel launches; not on the CPU, where a transposed gradient costs a
    strided pass each way). The bytes sent are the same; a transposed matrix is approximated from its
    other side.
    """

    rank: int = 1
    min_compression_rate: float = 2.0
    use_error_feedback: bool = True
    warm_start: bool = True
    orthogonalization_epsilon: float = 0.0
    random_seed: int = 0
    num_iters_per_step: int | None = None
    bytes_per_weight: int | None = None
    feedback_every_n_iters: int = 1
    warm_up_beta_factor: float | None = None
    warm_up_steps: int = 0
    warm_up_bytes_per_weight: int | None = None
    half_precision_wire: str = "auto"
    orthogonalization: str = "auto"
    orient: bool | str = "auto"

    def __post_init__(self) -> None:
        if isinstance(self.rank, bool) or not isinstance(self.rank, int) or self.rank < 1:
            raise ValueError(f"rank (matrix_approximation_rank) must be an integer >= 1, got {self.rank!r}")
        if isinstance(self.min_compression_rate, bool) or not isinstance(self.min_compression_rate, (int, float)) \
                or not self.min_compression_rate >= 0:
            raise ValueError(f"min_compression_rate must be a number >= 0, got {self.min_compression_rate!r}")
        if not isinstance(self.orthogonalization_epsilon, (int, float)) or not self.orthogonalization_epsilon >= 0:
            raise ValueError(
                f"orthogonalization_epsilon must be a number >= 0, got {self.orthogonalization_epsilon!r}")
        if isinstance(self.random_seed, bool) or not isinstance(self.random_seed, int) or self.random_seed < 0:
            raise ValueError(f"random_seed must be an integer >= 0, got {self.random_seed!r}")
        if not (isinstance(self.orient, bool) or self.orient == "auto"):
            raise ValueError(f"orient (orient_matrices) must be True, False or 'auto', got {self.orient!r}")
        for name in ("use_error_feedback", "warm_start"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name} must be a bool, got {getattr(self, name)!r}")
        k = self.num_iters_per_step
        if k is not None and (isinstance(k, bool) or not isinstance(k, int) or k < 1):
            raise ValueError(f"num_iters_per_step must be None (classic PowerSGD) or an integer >= 1, got {k!r}")
        if k is not None and not self.warm_start:
            raise ValueError("num_iters_per_step requires warm_start=True: each iteration starts from the "
                             "previous iteration's factor")
        if self.bytes_per_weight is not None and (isinstance(self.bytes_per_weight, bool)
                                                  or self.bytes_per_weight not in (2, 4, 8)):
            raise ValueError(f"bytes_per_weight must be 2 (fp16, or bf16 for bf16 gradients), 4 (fp32) or 8 "
                             f"(fp64), got {self.bytes_per_weight!r}")
        n = self.feedback_every_n_iters
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"feedback_every_n_iters must be an integer >= 1, got {n!r}")
        beta = self.warm_up_beta_factor
        if beta is not None and (isinstance(beta, bool) or not isinstance(beta, (int, float))
                                 or not 0 < beta <= 1):
            raise ValueError(f"warm_up_beta_factor must be None (off) or a number in (0, 1], got {beta!r}")
        if isinstance(self.warm_up_steps, bool) or not isinstance(self.warm_up_steps, int) or self.warm_up_steps < 0:
            raise ValueError(f"warm_up_steps must be an integer >= 0, got {self.warm_up_steps!r}")
        warm_up_bytes = self.warm_up_bytes_per_weight
        if warm_up_bytes is not None and (isinstance(warm_up_bytes, bool) or not isinstance(warm_up_bytes, int)
                                          or warm_up_bytes != 2):
            raise ValueError(f"warm_up_bytes_per_weight must be None (the gradients' own precision) or 2 (the "
                             f"half-precision wire of bytes_per_weight=2), got {warm_up_bytes!r}")
        if self.half_precision_wire not in HALF_PRECISION_WIRES:
            raise ValueError(f"half_precision_wire must be one of {', '.join(map(repr, HALF_PRECISION_WIRES))}, "
                             f"got {self.half_precision_wire!r}")
        if self.half_precision_wire != "auto" and self.bytes_per_weight != 2 and warm_up_bytes is None:
            raise ValueError(f"half_precision_wire={self.half_precision_wire!r} chooses the format of a 2-byte wire: "
                             f"give bytes_per_weight=2 or warm_up_bytes_per_weight=2 with it (bytes_per_weight is "
                             f"{self.bytes_per_weight!r})")
        if self.orthogonalization != "auto" and self.orthogonalization not in ORTHOGONALIZATIONS:
            raise ValueError(f"orthogonalization must be 'auto' or one of "
                             f"{', '.join(map(repr, sorted(ORTHOGONALIZATIONS)))}, got {self.orthogonalization!r}")

    def wire_dtype(self, grad_dtype: torch.dtype, work_dtype: torch.dtype) -> torch.dtype:
        """The dtype P, Q and the uncompressed tensors are allreduced in, for gradients of ``grad_dtype``."""
        if self.bytes_per_weight is None:
            return work_dtype
        if self.bytes_per_weight == 2:
            return self._half(grad_dtype)
        return torch.float32 if self.bytes_per_weight == 4 else torch.float64

    def orientation(self, device: torch.device) -> bool:
        """Whether gradients on ``device`` are compressed oriented (``orient``, resolved: ``"auto"`` asks
        the device's backend)."""
        if isinstance(self.orient, bool):
            return self.orient
        return backend_for(device).orients_matrices

    def warm_up_wire_dtype(self, grad_dtype: torch.dtype) -> torch.dtype:
        """The dtype the exact averages before compression starts send, for gradients of ``grad_dtype``:
        that dtype itself, or with ``warm_up_bytes_per_weight=2`` the half-precision wire
        ``bytes_per_weight=2`` selects (bf16 for bf16 gradients, else fp16)."""
        if self.warm_up_bytes_per_weight is None:
            return grad_dtype
        return self._half(grad_dtype)

    def _half(self, grad_dtype: torch.dtype) -> torch.dtype:
        """The 2-byte wire's dtype for gradients of ``grad_dtype`` (``half_precision_wire``)."""
        if self.half_precision_wire == "bf16" or (self.half_precision_wire == "auto" and grad_dtype == torch.bfloat16):
            return torch.bfloat16
        return torch.float16

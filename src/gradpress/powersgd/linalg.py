"""Batched orthogonalization and matrix views used by the PowerSGD engine.

Everything here is pure tensor math: no process groups, no buckets.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["as_matrix_shape", "orthogonalize_"]

_LOW_PRECISION = (torch.float16, torch.bfloat16)


def as_matrix_shape(shape: torch.Size | tuple[int, ...]) -> tuple[int, int]:
    """The ``(n, m)`` matrix view PowerSGD uses for a tensor: ``(shape[0], prod(shape[1:]))``.

    A 0-d tensor is ``(1, 1)``; a 1-d tensor of length ``n`` is ``(n, 1)``; an empty ``(0, 5)`` is
    ``(0, 5)`` (``numel // shape[0]`` would be undefined).

    >>> as_matrix_shape((64, 3, 3, 3))
    (64, 27)
    """
    if len(shape) == 0:
        return (1, 1)
    m = 1
    for size in shape[1:]:
        m *= int(size)
    return (int(shape[0]), m)


def orthogonalize_(matrices: Tensor, epsilon: float = 0.0) -> Tensor:
    """Orthonormalize the columns of each matrix in a batch ``(B, n, r)``, in place; returns it.

    Contract:
      * the computation runs in fp32 (fp64 stays fp64), whatever the input dtype (house rule "fp32 numerics");
      * the result is finite and has orthonormal columns for *every* input, including all-zero or
        rank-deficient matrices: Householder QR completes the basis instead of dividing by zero, so a
        vanishing gradient can never poison warm-start memory with NaN (PyTorch's Gram-Schmidt does
        unless ``orthogonalization_epsilon`` is set);
      * ``epsilon`` is kept for PyTorch compatibility: the rank-1 path divides by ``norm + epsilon``;
      * the result does not depend on where ``matrices`` sits in memory (it is computed on a copy).

    Rank 1 (the common case) is a normalization; larger ranks use batched ``torch.linalg.qr``.
    """
    if matrices.dim() != 3 or matrices.shape[2] > matrices.shape[1]:
        raise ValueError(
            f"orthogonalize_ expects a batch of tall matrices (B, n, r) with r <= n, got shape "
            f"{tuple(matrices.shape)}"
        )
    # Always on a fresh copy: LAPACK and BLAS round differently at different alignments, and where a
    # factor sits in the wire buffer depends on the bucket's layout (see gradpress.powersgd.memory).
    work = matrices.float() if matrices.dtype in _LOW_PRECISION else matrices.clone()
    if work.shape[2] == 1:
        norms = torch.linalg.vector_norm(work, dim=1, keepdim=True)
        degenerate = norms == 0
        work.div_(norms.masked_fill(degenerate, 1.0).add_(epsilon))
        # A zero column becomes e_1: any unit vector works, this one is the same on every rank.
        work[:, :1, :] += degenerate
    else:
        q, _ = torch.linalg.qr(work, mode="reduced")
        work.copy_(q)
    matrices.copy_(work)
    return matrices

"""Batched orthogonalization and matrix views used by the PowerSGD engine.

Everything here is pure tensor math: no process groups, no buckets.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from .backend import backend_for
from .seeding import seeded_normal, upload

__all__ = ["ORTHOGONALIZATIONS", "as_matrix_shape", "completion", "orthogonalize_", "orthogonalize_groups_",
           "scale_to_unit_"]

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


def orthogonalize_(matrices: Tensor, epsilon: float = 0.0, method: str = "auto") -> Tensor:
    """Orthonormalize the columns of each matrix in a batch ``(B, n, r)``, in place; returns it.

    Contract:
      * the computation runs in fp32 (fp64 stays fp64), whatever the input dtype (house rule "fp32 numerics");
      * the result is finite and has orthonormal columns for *every* finite input, including all-zero,
        rank-deficient and ill-conditioned matrices: a deficient matrix gets its basis completed (see
        :func:`orthogonalize_groups_`) instead of a division by zero, so a vanishing gradient can never
        poison warm-start memory with NaN (PyTorch's Gram-Schmidt does unless ``orthogonalization_epsilon``
        is set);
      * ``epsilon`` is kept for PyTorch compatibility: the rank-1 path divides by ``norm + epsilon``;
      * nothing is read on the host, and the number of ops does not depend on ``B``.

    Rank 1 (the common case) is a normalization; larger ranks use batched Householder QR on the CPU and
    batched Cholesky-QR elsewhere (``method``: see :func:`orthogonalize_groups_`, on one group).

    >>> import torch
    >>> q = orthogonalize_(torch.randn(2, 10, 3))
    >>> torch.allclose(q.transpose(1, 2) @ q, torch.eye(3).expand(2, 3, 3), atol=1e-5)
    True
    """
    if matrices.dim() != 3 or matrices.shape[2] > matrices.shape[1]:
        raise ValueError(
            f"orthogonalize_ expects a batch of tall matrices (B, n, r) with r <= n, got shape "
            f"{tuple(matrices.shape)}"
        )
    work = matrices.float() if matrices.dtype in _LOW_PRECISION else matrices
    orthogonalize_groups_([work], epsilon, method)
    if work is not matrices:
        matrices.copy_(work)
    return matrices


#: The shifts of the Cholesky factorizations (the first, then the others), times the Gram's trace and
#: fp64's epsilon.
_SHIFT = 100.0
_LATER_SHIFT = 1.0
#: A column whose squared norm orthogonal to the columns before it is below this fraction of its own
#: squared norm is numerically dependent (its new direction is under 1e-5 of its length).
_DEPENDENT = 1e-10

#: Below this a float64 matrix's largest |value| counts as zero (its reciprocal stays finite).
_TINY = 1e-290

_completions: dict[tuple[int, int, torch.device, torch.dtype], Tensor] = {}
_identities: dict[tuple[int, torch.device, torch.dtype], Tensor] = {}


def _identity(r: int, device: torch.device, dtype: torch.dtype) -> Tensor:
    """The ``(r, r)`` identity on ``device``, built once per (r, device, dtype): a kernel saved per call."""
    key = (r, torch.device(device), dtype)
    found = _identities.get(key)
    if found is None:
        found = _identities[key] = torch.eye(r, device=device, dtype=dtype)
    return found


def completion(n: int, r: int, device: torch.device, dtype: torch.dtype) -> Tensor:
    """A fixed ``(n, r)`` matrix with well-conditioned columns (a seeded Gaussian draw scaled by
    ``1/sqrt(n)``), the same on every rank and device: what a deficient factor is completed with.
    Drawn on the CPU once per shape, device and dtype, and moved without a blocking copy."""
    key = (n, r, torch.device(device), dtype)
    found = _completions.get(key)
    if found is None:
        drawn = seeded_normal((n, r), 0x0C0FFEE, n, r).to(dtype) / max(1, n) ** 0.5
        found = _completions[key] = upload(drawn, torch.device(device))
    return found


def orthogonalize_groups_(groups: list[Tensor], epsilon: float = 0.0, method: str = "auto") -> None:
    """Orthonormalize the columns of every matrix of several batches ``(B_i, n_i, r_i)`` (fp32 or fp64,
    ``r_i <= n_i``), in place, in a number of ops that depends on the number of batches, not of matrices.

    Rank 1: a normalization (a zero column becomes ``e_1``). Larger ranks: ``method="householder"``, one
    batched ``torch.linalg.qr`` per batch (on the CPU one LAPACK call, the fastest there: measured 4x faster
    than the Cholesky path on GPT-2 small's factors, benchmarks/orthogonalize.py); ``"cholesky"`` (on
    a GPU, where ATen's QR of a tall matrix loops over cuSOLVER per matrix), batches of one rank together,
    in float64 (the factors are small: the Gram and the triangular factors are ``(N, r, r)``): Cholesky-QR
    on the Gram matrices of all ``N`` matrices (one ``bmm`` per batch into one buffer, one ``cholesky_ex``
    and one triangular inverse for all, one ``bmm`` per batch to apply):

    0. *Scale* (fp64 inputs only): each matrix is divided by its largest |value|, so its Gram can neither
       underflow nor overflow (fp32 values cannot in fp64).
    1. *Dependent columns.* The Gram G of each matrix is factored with a shift ``s`` of 100 epsilon times
       its trace; ``L_jj^2 - s`` is about the squared norm of column j orthogonal to the columns before
       it. A column where that is below 1e-10 of its own squared norm (its new direction is under 1e-5 of
       its length), or whose factorization failed, is numerically dependent:
       it is replaced by the same column of a fixed well-conditioned matrix (:func:`completion`, scaled
       to the matrix's root-mean-square column norm), as Householder QR completes a basis. The other
       columns, hence the span of the matrix, are kept exactly. Decided on the device: no host read.
       (Replacing the columns in the first pass's output instead would save this factorization, but it
       loses the span: a later column's component along a replaced direction would be projected out.)
    2. *Shifted Cholesky-QR3* (Fukaya et al., 2020): a pass with the same shift (well defined for any
       condition number), then two passes with a shift of epsilon times the trace (so that no
       factorization fails on rounding): orthonormal to fp64 precision (measured against Householder
       QR on spectra down to 1e-20, duplicated columns, zero matrices and values of 1e-30 and 1e15:
       tests/engine/test_plan_linalg.py).

    ``epsilon``: the rank-1 path divides by ``norm + epsilon`` (PyTorch's option). ``method``: a name of
    :data:`ORTHOGONALIZATIONS`, or ``"auto"``: the device's choice (:mod:`gradpress.powersgd.backend`,
    Householder on the CPU, Cholesky-QR elsewhere).
    """
    if method != "auto" and method not in ORTHOGONALIZATIONS:
        raise ValueError(f"method must be 'auto' or one of {', '.join(map(repr, sorted(ORTHOGONALIZATIONS)))}, "
                         f"got {method!r}")
    by_rank: dict[int, list[Tensor]] = {}
    for matrices in groups:
        if matrices.shape[0] and matrices.shape[2]:
            by_rank.setdefault(int(matrices.shape[2]), []).append(matrices)
    for r, members in by_rank.items():
        if r == 1:
            for matrices in members:
                _normalize_(matrices, epsilon)
        else:
            chosen = backend_for(members[0].device).orthogonalization if method == "auto" else method
            ORTHOGONALIZATIONS[chosen](members)


def _normalize_(work: Tensor, epsilon: float) -> None:
    """Rank 1: each column divided by ``its norm + epsilon``, the norm accumulated in float64 so that no
    finite column over- or underflows on the way (an fp32 column of 1e20s has a squared norm past fp32's
    range, one of 1e-25s one below it: both gave a zero or wrongly scaled update); float64 columns are
    first scaled by a power of two (exact) to a largest |value| in [0.5, 1)."""
    if work.dtype == torch.float64:
        scale_to_unit_(work, dim=1)
    norms = torch.linalg.vector_norm(work, dim=1, keepdim=True, dtype=torch.float64)
    degenerate = norms == 0
    work.div_(norms.masked_fill_(degenerate, 1.0).add_(epsilon))
    # A zero column becomes e_1: any unit vector works, this one is the same on every rank.
    work[:, :1, :] += degenerate


def scale_to_unit_(matrices: Tensor, dim: int | tuple[int, ...] = (1, 2)) -> Tensor:
    """Multiply ``matrices`` in place by a power of two per slice (``dim``: the dimensions each largest
    |value| is taken over; default: per matrix of a batch), so that each slice's largest |value| lies in
    [0.5, 1); an all-zero or non-finite slice is left as it is. Exact (a power of two only moves the
    exponent, barring subnormals), so a product with the result rounds exactly as one with the input does,
    scaled: what PowerSGD's warm-start factor needs to keep ``P = M Q`` of the size of ``M`` instead of its
    square. Returns ``matrices``."""
    peaks = torch.linalg.vector_norm(matrices, ord=float("inf"), dim=dim, keepdim=True)
    exponent = torch.frexp(peaks).exponent
    exponent.masked_fill_(~torch.isfinite(peaks) | (peaks == 0), 0)
    return matrices.mul_(torch.exp2(exponent.neg_().to(matrices.dtype)))


def _householder_(groups: list[Tensor]) -> None:
    """:func:`orthogonalize_groups_` by Householder QR: one batched ``torch.linalg.qr`` per batch."""
    for matrices in groups:
        matrices.copy_(torch.linalg.qr(matrices, mode="reduced")[0])


def _cholesky_qr_(groups: list[Tensor]) -> None:
    """:func:`orthogonalize_groups_` for batches of one rank ``r >= 2``."""
    device, r = groups[0].device, groups[0].shape[2]
    dtype = torch.float64
    sizes = [x.shape[0] for x in groups]
    total = sum(sizes)
    flat = torch.empty(sum(x.numel() for x in groups), device=device, dtype=dtype)
    xs = [piece.view(x.shape) for piece, x in zip(flat.split([x.numel() for x in groups]), groups)]
    torch._foreach_copy_(xs, groups)
    spare = [torch.empty_like(x) for x in xs]
    if groups[0].dtype == torch.float64:
        for x in xs:
            x.div_(torch.linalg.vector_norm(x, ord=float("inf"), dim=(1, 2), keepdim=True).clamp_min_(_TINY))
    gram = torch.empty(total, r, r, device=device, dtype=dtype)
    grams = list(gram.split(sizes))
    diagonal = gram.diagonal(dim1=1, dim2=2)
    unit = torch.finfo(dtype).eps

    def factor(sources: list[Tensor], relative_shift: float) -> tuple[Tensor, Tensor, Tensor]:
        """The lower Cholesky factor of each shifted Gram, the shift and the failure flags."""
        for x, g in zip(sources, grams):
            torch.bmm(x.transpose(1, 2), x, out=g)
        shift = diagonal.sum(-1).mul_(relative_shift * unit)
        diagonal.add_(shift.unsqueeze(1))
        lower, info = torch.linalg.cholesky_ex(gram)
        return lower, shift, info

    # 1. Replace the dependent columns: (L_jj^2 - s) / (G_jj + s) is about the squared share of column j's
    # norm that is orthogonal to the columns before it (the shift keeps a zero column's share at zero).
    lower, shift, info = factor(xs, _SHIFT)
    trace = shift / (_SHIFT * unit)
    shift = shift.unsqueeze(1)
    new = lower.diagonal(dim1=1, dim2=2).square().sub_(shift)
    dependent = (new <= diagonal * _DEPENDENT) | (info > 0).unsqueeze(1)  # (a failed factor: NaN, and info > 0)
    scale = torch.add(trace / r, trace == 0).sqrt_()  # the root-mean-square column norm; 1 for a zero matrix
    for x, mask, factor_scale in zip(xs, dependent.split(sizes), scale.split(sizes)):
        filler = completion(x.shape[1], r, device, dtype).expand_as(x) * factor_scale.view(-1, 1, 1)
        torch.where(mask.unsqueeze(1), filler, x, out=x)
    # 2. Shifted Cholesky-QR, then Cholesky-QR twice: x -> spare -> x -> spare, copied back below.
    eye = _identity(r, device, dtype).expand(total, r, r)
    sources, targets = xs, spare
    for relative_shift in (_SHIFT, _LATER_SHIFT, _LATER_SHIFT):
        inverse = torch.linalg.solve_triangular(factor(sources, relative_shift)[0], eye, upper=False)
        for x, y, inv in zip(sources, targets, inverse.split(sizes)):
            torch.bmm(x, inv.transpose(1, 2), out=y)
        sources, targets = targets, sources
    torch._foreach_copy_(groups, sources)


#: The orthogonalizations of rank >= 2 factors, by the name ``EngineConfig.orthogonalization`` and
#: :func:`orthogonalize_groups_` take: each orthonormalizes the columns of batches ``(B_i, n_i, r)`` of one
#: rank r, in place, with the contract of :func:`orthogonalize_groups_`.
ORTHOGONALIZATIONS: dict[str, Callable[[list[Tensor]], None]] = {
    "householder": _householder_,
    "cholesky": _cholesky_qr_,
}

"""Plan arithmetic and orthogonalization: pure functions, checked against PyTorch and linear algebra."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import _should_compress

from gradpress.powersgd.linalg import as_matrix_shape, orthogonalize_
from gradpress.powersgd import make_plan, should_compress


@given(st.integers(1, 5000), st.integers(1, 5000), st.integers(1, 8), st.floats(0, 20))
def test_should_compress_is_pytorchs_rule(n, m, rank, rate):
    assert should_compress(n, m, rank, rate) == _should_compress(n, m, rank, rate)[0]


def test_plan_groups_offsets_and_arithmetic():
    shapes = [(64, 32, 3, 3), (64,), (), (64, 32, 3, 3), (4, 64), (128, 64)]
    plan = make_plan(shapes, rank=2, min_compression_rate=2)
    assert [t.compressed for t in plan.tensors] == [True, False, False, True, False, True]
    assert [t.offset for t in plan.tensors] == [0, 18432, 18496, 18497, 36929, 37185]
    assert [g.members for g in plan.groups] == [(0, 3), (5,)]
    assert plan.uncompressed == (1, 2, 4)
    expected_sent = 2 * (64 + 288) * 2 + (128 + 64) * 2 + 64 + 1 + 256
    assert plan.numel_sent == expected_sent
    assert plan.numel == sum(math.prod(s) for s in shapes)
    assert plan.p_numel == 2 * 64 * 2 + 128 * 2 and plan.q_numel == 2 * 288 * 2 + 64 * 2


def test_plan_rank_is_capped_and_vectors_never_compressed():
    plan = make_plan([(3, 100), (1000,)], rank=8, min_compression_rate=0)
    assert plan.tensors[0].rank == 3 and plan.tensors[0].compressed
    assert not plan.tensors[1].compressed


@pytest.mark.parametrize("kwargs, name", [({"rank": 0, "min_compression_rate": 2}, "rank"),
                                          ({"rank": 1, "min_compression_rate": -1}, "min_compression_rate")])
def test_plan_rejects_bad_config(kwargs, name):
    with pytest.raises(ValueError, match=name):
        make_plan([(4, 4)], **kwargs)


def test_as_matrix_shape():
    assert as_matrix_shape(()) == (1, 1)
    assert as_matrix_shape((7,)) == (7, 1)
    assert as_matrix_shape((64, 3, 3, 3)) == (64, 27)


def _assert_orthonormal(q, atol):
    eye = torch.eye(q.shape[2], dtype=torch.float64).expand(q.shape[0], -1, -1)
    gram = q.double().transpose(1, 2) @ q.double()
    torch.testing.assert_close(gram, eye, atol=atol, rtol=0)


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 4), st.integers(1, 40), st.integers(1, 6), st.sampled_from(["random", "zero", "deficient"]),
       st.sampled_from([torch.float32, torch.float64, torch.float16, torch.bfloat16]),
       st.sampled_from(["householder", "cholesky"]))
def test_orthogonalize_gives_orthonormal_finite_columns(batch, n, rank, kind, dtype, method):
    rank = min(rank, n)
    g = torch.Generator().manual_seed(n * 31 + rank)
    m = torch.randn(batch, n, rank, generator=g)
    if kind == "zero":
        m.zero_()
    elif kind == "deficient":
        m[:, :, -1] = 0
    m = m.to(dtype)
    out = orthogonalize_(m, method=method)
    assert out is m and out.dtype == dtype
    assert torch.isfinite(out).all()
    _assert_orthonormal(out, atol={torch.float16: 3e-3, torch.bfloat16: 3e-2}.get(dtype, 1e-5))


def test_orthogonalize_spans_the_input():
    m = torch.randn(3, 20, 4, dtype=torch.float64)
    q = orthogonalize_(m.clone())
    # Projecting the input on span(q) changes nothing.
    torch.testing.assert_close(q @ (q.transpose(1, 2) @ m), m)


def test_orthogonalize_names_a_bad_method():
    with pytest.raises(ValueError, match="method"):
        orthogonalize_(torch.zeros(1, 3, 2), method="qr")


def test_orthogonalize_rejects_wide_matrices():
    with pytest.raises(ValueError, match=r"\(B, n, r\)"):
        orthogonalize_(torch.zeros(1, 2, 3))


def _spectrum(n, r, decades, dtype, generator):
    """A (n, r) matrix whose singular values fall evenly (in log) over ``decades`` decades."""
    u, _ = torch.linalg.qr(torch.randn(n, r, dtype=torch.float64, generator=generator))
    v, _ = torch.linalg.qr(torch.randn(r, r, dtype=torch.float64, generator=generator))
    return ((u * torch.logspace(0, -decades, r, dtype=torch.float64)) @ v.T).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("n, r", [(768, 32), (40, 32), (32, 32), (100, 4), (3, 2)])
def test_cholesky_qr_against_householder_on_adversarial_spectra(n, r, dtype):
    """Cholesky-QR against Householder QR (LAPACK, float64): orthonormal to the working precision for
    condition numbers up to 1e20, duplicated columns, a zero matrix, a rank-1 matrix at 1e-30 and 1e15;
    and for well-conditioned matrices the same span as Householder's to rounding."""
    g = torch.Generator().manual_seed(n + r)
    decades = [0, 2, 4, 6, 8, 10, 14, 20]
    batch = [_spectrum(n, r, d, dtype, g) for d in decades]
    duplicated = _spectrum(n, r, 1, dtype, g)
    duplicated[:, -1] = duplicated[:, 0]
    rank_one = torch.randn(n, 1, dtype=dtype, generator=g) @ torch.randn(1, r, dtype=dtype, generator=g)
    batch += [duplicated, torch.zeros(n, r, dtype=dtype), rank_one * 1e-30, rank_one * 1e15]
    x = torch.stack(batch)
    q = orthogonalize_(x.clone(), method="cholesky")
    assert torch.isfinite(q).all()
    _assert_orthonormal(q, atol=1e-6 if dtype == torch.float32 else 1e-12)
    # Well conditioned (up to 1e4): span(q) is span(x) as Householder finds it.
    householder, _ = torch.linalg.qr(x[:3].double())
    projector = q[:3].double() @ q[:3].double().transpose(1, 2)
    torch.testing.assert_close(projector, householder @ householder.transpose(1, 2),
                               atol=1e-5 if dtype == torch.float32 else 1e-10, rtol=0)
    # Whatever the spectrum, no direction of x stronger than 1e-5 of its largest is lost.
    lost = x.double() - q.double() @ (q.double().transpose(1, 2) @ x.double())
    assert (lost.norm(dim=(1, 2)) <= 1e-5 * x.double().norm(dim=(1, 2)) + 1e-300).all()


def test_orthogonalize_groups_batches_shapes_and_ranks_together():
    """Several batches of several shapes and ranks in one call give what each gives alone."""
    from gradpress.powersgd.linalg import orthogonalize_groups_
    g = torch.Generator().manual_seed(0)
    groups = [torch.randn(3, 50, 4, generator=g), torch.randn(2, 20, 4, generator=g),
              torch.randn(2, 30, 1, generator=g), torch.randn(1, 8, 8, generator=g)]
    alone = [orthogonalize_(x.clone(), method="cholesky") for x in groups]
    together = [x.clone() for x in groups]
    orthogonalize_groups_(together, method="cholesky")
    for a, b in zip(alone, together):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=0)

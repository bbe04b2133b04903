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
       st.sampled_from([torch.float32, torch.float64, torch.float16, torch.bfloat16]))
def test_orthogonalize_gives_orthonormal_finite_columns(batch, n, rank, kind, dtype):
    rank = min(rank, n)
    g = torch.Generator().manual_seed(n * 31 + rank)
    m = torch.randn(batch, n, rank, generator=g)
    if kind == "zero":
        m.zero_()
    elif kind == "deficient":
        m[:, :, -1] = 0
    m = m.to(dtype)
    out = orthogonalize_(m)
    assert out is m and out.dtype == dtype
    assert torch.isfinite(out).all()
    _assert_orthonormal(out, atol={torch.float16: 3e-3, torch.bfloat16: 3e-2}.get(dtype, 1e-5))


def test_orthogonalize_spans_the_input():
    m = torch.randn(3, 20, 4, dtype=torch.float64)
    q = orthogonalize_(m.clone())
    # Projecting the input on span(q) changes nothing.
    torch.testing.assert_close(q @ (q.transpose(1, 2) @ m), m)


def test_orthogonalize_rejects_wide_matrices():
    with pytest.raises(ValueError, match=r"\(B, n, r\)"):
        orthogonalize_(torch.zeros(1, 2, 3))

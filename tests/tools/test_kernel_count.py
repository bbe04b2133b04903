"""The kernels a compressed step issues, counted (gradpress.tools.bench.kernels): a regression pin for
GPT-2 small's 148 gradient shapes at rank 32 (the hook in DDP's default buckets, and the aggregator's
default scheme), and the counter's own checks."""

from __future__ import annotations

import pytest
import torch

from gradpress.tools.bench.kernels import count_aggregator_kernels, count_hook_kernels, is_kernel

#: GPT-2 small at rank 32 (BENCHMARKS.md, "Kernels per compressed step"): the bounds the engine keeps. The
#: classic hook's step on the accelerator path: 120 with the fp32 wire, 150 with the fp16 one; the
#: aggregator's default scheme (one alternating iteration): 150 on both paths.
HOOK_BOUNDS = {False: 120, True: 150}
AGGREGATOR_BOUND = 150
#: What this code counts (benchmarks/kernel_count.py), pinned: a change shows here and in BENCHMARKS.md.
PINNED = {("hook", "meta", False): 120, ("hook", "meta", True): 146, ("hook", "cpu", False): 101,
          ("hook", "cpu", True): 129, ("aggregator", "meta", False): 109, ("aggregator", "meta", True): 122,
          ("aggregator", "cpu", False): 89, ("aggregator", "cpu", True): 103}


def test_the_counter_skips_views_and_allocations_and_counts_the_rest():
    assert not is_kernel(torch.ops.aten.view.default) and not is_kernel(torch.ops.aten.empty.memory_format)
    assert not is_kernel(torch.ops.aten.transpose.int) and not is_kernel(torch.ops.aten.split.Tensor)
    assert is_kernel(torch.ops.aten.bmm.default) and is_kernel(torch.ops.aten._foreach_copy_.default)


@pytest.mark.parametrize("kwargs, name", [({"hook": "ours"}, "hook"), ({"path": "cuda"}, "path"),
                                          ({"iterations": 3}, "iterations")])
def test_bad_arguments_are_named(kwargs, name):
    with pytest.raises(ValueError, match=name):
        count_hook_kernels(shapes=[(4, 4)], **kwargs)


def test_ops_do_not_grow_with_the_number_of_matrices():
    """Twelve same-shape layers cost the ops of one: the step batches across buckets and matrices."""
    one = count_hook_kernels(shapes=[(64, 48), (48,)], rank=4, path="meta").ops
    twelve = count_hook_kernels(shapes=[(64, 48), (48,)] * 12, rank=4, path="meta").ops
    assert twelve == one


@pytest.mark.slow
@pytest.mark.parametrize("fp16_wire", [False, True], ids=["fp32", "fp16"])
def test_gpt2_small_compressed_step_stays_within_its_kernel_budget(fp16_wire):
    cpu = count_hook_kernels("gpt2", rank=32, fp16_wire=fp16_wire, path="cpu")
    meta = count_hook_kernels("gpt2", rank=32, fp16_wire=fp16_wire, path="meta")
    assert cpu.buckets == 13 and cpu.collectives == (4 if fp16_wire else 2)  # DDP's buckets; one step for all
    assert meta.ops <= HOOK_BOUNDS[fp16_wire], (meta.ops, meta.by_op)
    assert (cpu.ops, meta.ops) == (PINNED["hook", "cpu", fp16_wire], PINNED["hook", "meta", fp16_wire]), \
        (cpu.by_op, meta.by_op)
    # The accelerator path orthogonalizes without Householder QR (a cuSOLVER loop per matrix on a GPU);
    # the CPU path takes one batched LAPACK QR per shape group.
    assert "aten.linalg_qr" not in meta.by_op and cpu.by_op.get("aten.linalg_qr", 0) <= 8
    assert "aten.clone" not in cpu.by_op and "aten.clone" not in meta.by_op


@pytest.mark.slow
@pytest.mark.parametrize("fp16_wire", [False, True], ids=["fp32", "fp16"])
def test_the_aggregators_default_scheme_stays_within_its_kernel_budget_on_both_paths(fp16_wire):
    for path in ("meta", "cpu"):
        count = count_aggregator_kernels("gpt2", rank=32, fp16_wire=fp16_wire, path=path)
        assert count.ops <= AGGREGATOR_BOUND and count.ops == PINNED["aggregator", path, fp16_wire], count.by_op
        # One all-reduce a step (one side's factors with the uncompressed tensors), two with the fp16 wire's maxima.
        assert count.collectives == (0 if path == "meta" else 2 if fp16_wire else 1)


def test_two_alternating_iterations_cost_about_twice_one():
    one = count_aggregator_kernels("gpt2", rank=32, path="meta", num_iters_per_step=1).ops
    two = count_aggregator_kernels("gpt2", rank=32, path="meta", num_iters_per_step=2).ops
    assert one < two <= 2 * one

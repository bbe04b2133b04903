"""Property-based fuzzing (hypothesis) of the plan, the engine and the configuration's errors.

Shapes (0-d, 1-d, tall, wide, 4-d conv-like, empty, and empty lists), gradient dtypes (fp16, bf16,
fp32, fp64), ranks, ``min_compression_rate``, ``num_iters_per_step``, ``bytes_per_weight`` and
``feedback_every_n_iters`` are drawn at random. Properties:

* the plan's counts (per-tensor matrix view, rank, compressed or not, offsets, groups, P/Q/uncompressed
  sizes, ``numel_sent``, ``numel_sent_per_step``, ``mean_numel_sent``) and the aggregator's floats and
  bytes per step equal a direct computation written here from the documented rules;
* a world of W = 2..4 workers, simulated in one process (each worker's engine task is stepped phase by
  phase and every collective is reduced across the W buffers by :func:`run_world`): the elements and
  dtype on the wire are the plan's, all workers end with bit-identical outputs, and at full rank
  (``rank >= min(n, m)``, ``min_compression_rate=0``) the output is the exact mean gradient;
* error feedback conserves mass over several steps, in float64: on every worker, for every compressed
  tensor, ``sum of applied updates + final error memory == sum of that worker's gradients`` (the applied
  update is the shared compressed mean); averaged over workers, for every tensor,
  ``sum of updates + mean error == mean of the gradient sums``;
* invalid configurations and inputs raise ``ValueError``/``TypeError`` naming the argument.

Runs are bounded and reproducible: ``derandomize=True`` and no example database (CI runs pytest with
``-p no:cacheprovider``), a fixed number of examples per property (the file takes seconds). For a longer
local fuzz with fresh random examples, set ``GRADPRESS_FUZZ_EXAMPLES``::

    GRADPRESS_FUZZ_EXAMPLES=2000 python3 -m pytest tests/engine/test_fuzz.py -p no:cacheprovider

(hypothesis then prints a ``@reproduce_failure`` blob / seed for any failure it finds).
"""

from __future__ import annotations

import math
import os
from fractions import Fraction

import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from gradpress import Config, PowerSGD
from gradpress.powersgd import EngineConfig, Segment, compress_step, make_plan
from gradpress.powersgd.memory import work_dtype_for

_LONG_RUN = int(os.environ.get("GRADPRESS_FUZZ_EXAMPLES", "0"))


def fuzz(max_examples: int):
    """Bounded, reproducible settings; ``GRADPRESS_FUZZ_EXAMPLES`` turns them into a long random fuzz."""
    return settings(max_examples=_LONG_RUN or max_examples, deadline=None, database=None,
                    derandomize=not _LONG_RUN, print_blob=True,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


DTYPES = [torch.float16, torch.bfloat16, torch.float32, torch.float64]


# --- shapes -----------------------------------------------------------------------------------------------

def shape_strategy(size: int) -> st.SearchStrategy[tuple[int, ...]]:
    """0-d, 1-d, tall, wide, square, 4-d conv-like and empty shapes, sides up to about ``size``."""
    side = st.integers(1, size)
    small = st.integers(1, max(1, size // 3))
    return st.one_of(
        st.just(()),
        st.tuples(st.integers(0, size)),                                       # 1-d (or empty)
        st.tuples(side, side).map(lambda t: (t[0] + t[1], t[1])),              # tall
        st.tuples(side, side).map(lambda t: (t[0], t[0] + t[1])),              # wide
        st.tuples(side, side),                                                 # anything 2-d
        st.tuples(side, small, st.integers(1, 3), st.integers(1, 3)),          # conv weight
        st.tuples(st.lists(st.integers(0, 4), min_size=1, max_size=3), st.integers(0, 3))  # empty: a 0 inside
        .map(lambda t: (*t[0][:t[1]], 0, *t[0][t[1]:])),
    )


def shape_lists(size: int, max_size: int, min_size: int = 0) -> st.SearchStrategy[list[tuple[int, ...]]]:
    """Lists of shapes (empty unless ``min_size``), drawn from a small pool so that same-shape groups
    are common."""
    return st.lists(shape_strategy(size), min_size=1, max_size=4).flatmap(
        lambda pool: st.lists(st.sampled_from(pool), min_size=min_size, max_size=max_size))


# Rates that are exact binary fractions (so the float comparison in the plan equals the exact one here),
# plus infinity (nothing compressed).
RATES = st.one_of(st.integers(0, 12), st.integers(0, 160).map(lambda k: k / 8), st.just(math.inf))
ITERS = st.sampled_from([None, 1, 2, 3, 4])
BYTES = st.sampled_from([None, 2, 4, 8])


# --- the plan, computed directly -------------------------------------------------------------------------

def direct_plan(shapes, rank, rate):
    """Per tensor ``(numel, (n, m), r, compressed)`` from the documented rules: view ``(shape[0], -1)``
    (0-d is 1x1), ``r = min(n, m, rank)``, compress iff 2+ dims, not empty and ``n*m > (n+m)*r*rate``."""
    rows = []
    for shape in shapes:
        numel = math.prod(shape)
        n, m = (shape[0], math.prod(shape[1:])) if shape else (1, 1)
        r = min(n, m, rank)
        cheaper = rate != math.inf and Fraction(rate) * r * (n + m) < n * m
        rows.append((numel, (n, m), r, len(shape) >= 2 and numel > 0 and cheaper))
    return rows


def direct_sent(rows, first_iteration, iterations, orient=False):
    """Elements one step sends: classic (``iterations=None``) sends P and Q; the alternating scheme
    sends P on even iterations and Q on odd ones; the uncompressed tensors travel once. ``orient``: P is
    the longer side's factor (the engine compresses a wide matrix as its transpose)."""
    sides = [((max(n, m), min(n, m)) if orient else (n, m), r) for _, (n, m), r, c in rows if c]
    p = sum(n * r for (n, _m), r in sides)
    q = sum(m * r for (_n, m), r in sides)
    rest = sum(numel for numel, _, _, c in rows if not c)
    if iterations is None:
        return p + q + rest
    return rest + sum(p if i % 2 == 0 else q for i in range(first_iteration, first_iteration + iterations))


@pytest.mark.parametrize("orient", [False, True])
@fuzz(500)
@given(shape_lists(300, 10), st.integers(1, 20), RATES)
@example([(0, 5), (5, 0), (), (7,), (2, 0, 3)], 1, 0)  # empty matrices: a (0, 5) is a 0x5 matrix
@example([(4, 4), (6, 3), (2, 2), (8, 8)], 1, 2)  # ties n*m == (n+m)*r*rate are not compressed
def test_plan_counts_match_a_direct_computation(orient, shapes, rank, rate):
    plan = make_plan(shapes, rank, rate, orient=orient)
    assert make_plan([torch.Size(s) for s in shapes], rank, rate, orient=orient) == plan
    rows = direct_plan(shapes, rank, rate)
    assert len(plan.tensors) == len(shapes)
    offset = 0
    for i, (tensor, (numel, matrix, r, compressed)) in enumerate(zip(plan.tensors, rows)):
        assert (tensor.index, tensor.shape, tensor.numel, tensor.offset) == (i, tuple(shapes[i]), numel, offset)
        assert tensor.matrix == matrix and tensor.compressed == compressed
        assert tensor.transposed == (orient and compressed and matrix[0] < matrix[1])
        assert tensor.oriented == (matrix[::-1] if tensor.transposed else matrix)
        if numel:
            assert tensor.rank == r
        assert tensor.numel_sent == ((matrix[0] + matrix[1]) * r if compressed else numel)
        offset += numel
    assert plan.numel == offset
    assert plan.uncompressed == tuple(i for i, row in enumerate(rows) if not row[3])
    assert [t.index for t in plan.compressed] == [i for i, row in enumerate(rows) if row[3]]
    assert plan.uncompressed_numel == sum(row[0] for row in rows if not row[3])

    # Groups: one per oriented (n, m, r) of the compressed tensors, in order of first appearance, laid out back
    # to back.
    def oriented(matrix):
        return (max(matrix), min(matrix)) if orient else matrix

    keys = list(dict.fromkeys((*oriented(row[1]), row[2]) for row in rows if row[3]))
    assert [(g.n, g.m, g.rank) for g in plan.groups] == keys
    p = q = 0
    for group, (n, m, r) in zip(plan.groups, keys):
        members = tuple(i for i, row in enumerate(rows) if row[3] and (*oriented(row[1]), row[2]) == (n, m, r))
        assert group.members == members and group.batch == len(members)
        assert (group.p_offset, group.q_offset) == (p, q)
        p, q = p + len(members) * n * r, q + len(members) * m * r
    assert (plan.p_numel, plan.q_numel) == (p, q)

    assert plan.numel_sent == direct_sent(rows, 0, None) == plan.numel_sent_per_step(None)
    assert plan.mean_numel_sent(None) == plan.numel_sent
    assert plan.compression_rate == (plan.numel / plan.numel_sent if plan.numel_sent else 0.0)
    for k in range(1, 6):
        for first in range(0, 5):
            assert plan.numel_sent_per_step(k, first) == direct_sent(rows, first, k, orient)
        # Step s starts at iteration s*k: the mean over two consecutive steps is the mean over all.
        two_steps = direct_sent(rows, 0, k, orient) + direct_sent(rows, k, k, orient)
        assert plan.mean_numel_sent(k) == pytest.approx(two_steps / 2, rel=1e-12, abs=0)


def wire_itemsize(bytes_per_weight, grad_dtype):
    """Bytes per element on the wire: ``bytes_per_weight``, else the working precision (fp64 for fp64
    gradients, fp32 for the rest)."""
    if bytes_per_weight is not None:
        return bytes_per_weight
    return 8 if grad_dtype == torch.float64 else 4


@fuzz(120)
@given(shape_lists(12, 6, min_size=1), st.lists(st.sampled_from(DTYPES), min_size=1, max_size=6),
       st.integers(1, 4), RATES, ITERS, BYTES, st.integers(0, 2), st.integers(1, 4))
def test_aggregator_floats_and_bytes_match_the_plan(shapes, dtypes, rank, rate, iterations, bytes_per_weight,
                                                    warm_up, steps):
    """``PowerSGD``'s per-step figures and its running totals (exact steps first, then compressed ones)."""
    dtypes = [dtypes[i % len(dtypes)] for i in range(len(shapes))]
    params = [torch.zeros(s, dtype=d) for s, d in zip(shapes, dtypes)]
    config = Config(rank=rank, min_compression_rate=rate, num_iters_per_step=iterations,
                    start_compressing_after_num_steps=warm_up, bytes_per_weight=bytes_per_weight)
    powersgd = PowerSGD(params, config, init_sync=False)
    oriented = config.engine_config().orientation(torch.device("cpu"))

    rows = direct_plan(shapes, rank, rate)
    mean_sent = direct_sent(rows, 0, None) if iterations is None else \
        (direct_sent(rows, 0, iterations, oriented)
         + direct_sent(rows, iterations, iterations, oriented)) / 2
    assert powersgd.numel == sum(row[0] for row in rows)
    assert powersgd.floats_per_step == pytest.approx(mean_sent, rel=1e-12, abs=0)
    expected_bytes = 0.0
    for dtype in set(dtypes):
        mine = [row for row, d in zip(rows, dtypes) if d == dtype]
        sent = direct_sent(mine, 0, None) if iterations is None else \
            (direct_sent(mine, 0, iterations, oriented)
             + direct_sent(mine, iterations, iterations, oriented)) / 2
        expected_bytes += sent * wire_itemsize(bytes_per_weight, dtype)
    assert powersgd.bytes_per_step == pytest.approx(expected_bytes, rel=1e-12, abs=0)

    floats = bytes_ = 0
    generator = torch.Generator().manual_seed(0)
    for step in range(steps):
        grads = [torch.randn(s, generator=generator, dtype=torch.float64).to(d) for s, d in zip(shapes, dtypes)]
        powersgd.aggregate_(grads)
        for dtype in dict.fromkeys(dtypes):
            mine = [row for row, d in zip(rows, dtypes) if d == dtype]
            if step < warm_up:  # exact averaging: every element, in the gradient's own dtype
                sent, itemsize = sum(row[0] for row in mine), dtype.itemsize
            else:
                first = (step - warm_up) * (iterations or 0)
                sent = direct_sent(mine, first, iterations, oriented)
                itemsize = wire_itemsize(bytes_per_weight, dtype)
            floats += sent
            bytes_ += sent * itemsize
        assert all(torch.isfinite(g).all() for g in grads)
    assert (powersgd.total_floats_sent, powersgd.total_bytes_sent) == (floats, bytes_)


# --- a simulated world of W workers ---------------------------------------------------------------------

class _Ready:
    __slots__ = ("buffer",)

    def __init__(self, buffer):
        self.buffer = buffer

    def wait(self):
        return self.buffer


class SimulatedCommunicator:
    """One worker's end of a simulated group: it records each collective; :func:`run_world` performs it."""

    def __init__(self, world_size):
        self.world_size = world_size
        self.pending = None
        self.sent = []  # (op, numel, dtype) of every collective, in order

    def allreduce_sum(self, buffer):
        return self._start("sum", buffer)

    def allreduce_max(self, buffer):
        return self._start("max", buffer)

    def _start(self, op, buffer):
        assert self.pending is None, "a task yielded without waiting for its previous collective"
        assert buffer.dim() == 1 and buffer.is_contiguous()
        self.pending = (op, buffer)
        self.sent.append((op, buffer.numel(), buffer.dtype))
        return _Ready(buffer)


def run_world(tasks, comms):
    """Run one engine task per worker in lockstep: each task runs to its next collective, then that
    collective is performed across all workers (sum or max, in the buffers' dtype), until all finish.
    Every worker must issue the same collectives in the same order ("same order on every rank" in docs/design.md)."""
    while True:
        done = []
        for task in tasks:
            try:
                next(task)
                done.append(False)
            except StopIteration:
                done.append(True)
        if all(done):
            return
        assert not any(done), "some workers finished while others started a collective"
        ops = [comm.pending for comm in comms]
        for comm in comms:
            comm.pending = None
        assert len({(op, b.numel(), b.dtype) for op, b in ops}) == 1, "workers disagree on the collective"
        buffers = torch.stack([b for _, b in ops])
        reduced = buffers.sum(0) if ops[0][0] == "sum" else buffers.amax(0)
        for _, buffer in ops:
            buffer.copy_(reduced)


class World:
    """W workers, each with its own segment (error memory, factors) for the same plan."""

    def __init__(self, shapes, dtype, config, world_size):
        self.shapes, self.dtype, self.config = shapes, dtype, config
        self.plan_oriented = config.orientation(torch.device("cpu"))
        plan = make_plan(shapes, config.rank, config.min_compression_rate, orient=self.plan_oriented)
        self.plan = plan
        self.segments = [Segment(plan, list(range(len(shapes))), torch.device("cpu"), work_dtype_for(dtype))
                         for _ in range(world_size)]
        self.comms = [SimulatedCommunicator(world_size) for _ in range(world_size)]
        self.compressed_step = 0

    def step(self, grads_per_worker):
        """One compressed step: every worker's gradients are replaced in place. Returns the elements
        the engine announced it would send (the same on every worker)."""
        started = [compress_step(seg, grads, comm, self.config, self.compressed_step)
                   for seg, grads, comm in zip(self.segments, grads_per_worker, self.comms)]
        assert len({sent for _, sent in started}) == 1
        run_world([task for task, _ in started], self.comms)
        self.compressed_step += 1
        return started[0][1]

    def errors(self, worker):
        """Worker's error memory per tensor index, as float64 tensors of the gradient's shape (zero for
        uncompressed tensors)."""
        memory = self.segments[worker].export(self.config)
        return [memory[i].error.reshape(s).double() if i in memory else torch.zeros(s, dtype=torch.float64)
                for i, s in enumerate(self.shapes)]


def draw_grads(generator, shapes, dtype, world_size, scale):
    return [[(torch.randn(s, generator=generator, dtype=torch.float64) * scale).to(dtype) for s in shapes]
            for _ in range(world_size)]


def wire_dtype(bytes_per_weight, dtype):
    if bytes_per_weight is None:
        return work_dtype_for(dtype)
    if bytes_per_weight == 2:
        return torch.bfloat16 if dtype == torch.bfloat16 else torch.float16
    return {4: torch.float32, 8: torch.float64}[bytes_per_weight]


def wire_padding(world, first_iteration):
    """The zeros the step's collectives carry besides the plan's elements: each factor rounded up to a
    64-byte line (:mod:`gradpress.powersgd.layout`), and the line before the Q region where the uncompressed
    tensors travel with a Q phase."""
    plan, layout = world.plan, world.segments[0].layout
    p_pad, q_pad = layout.p_numel - plan.p_numel, layout.numel - layout.q_start - plan.q_numel
    iterations = world.config.num_iters_per_step
    if iterations is None:
        return p_pad + q_pad
    sides = [(first_iteration + i) % 2 == 0 for i in range(iterations)] if plan.groups else [True]
    between = layout.q_start - layout.unsent_end if not sides[0] and plan.uncompressed_numel else 0
    return sum(p_pad if right else q_pad for right in sides) + between


def check_wire(world, sent, first_iteration):
    """The sum-allreduces of the step just run carry the plan's element count (and the factors' alignment
    padding, zeros), in the wire dtype."""
    config = world.config
    expected = wire_dtype(config.bytes_per_weight, world.dtype)
    for comm in world.comms:
        sums = [(numel, dtype) for op, numel, dtype in comm.sent if op == "sum"]
        assert sum(numel for numel, _ in sums) == sent + wire_padding(world, first_iteration)
        assert sent == direct_sent(direct_plan(world.shapes, config.rank, config.min_compression_rate),
                                   first_iteration, config.num_iters_per_step, world.plan_oriented)
        assert all(dtype == expected for numel, dtype in sums if numel)
        maxes = [(numel, dtype) for op, numel, dtype in comm.sent if op == "max"]
        # The fp16 wire agrees on its scales with one max before each sum, of one float per tensor span;
        # nothing else uses max.
        assert not maxes or expected == torch.float16
        assert all(op == "sum" for (before, *_), (op, *_) in zip(comm.sent, comm.sent[1:]) if before == "max")
        if maxes:
            rows = direct_plan(world.shapes, config.rank, config.min_compression_rate)
            assert sum(numel for numel, _ in maxes) == direct_scales(rows, config.num_iters_per_step)
        comm.sent.clear()


def direct_scales(rows, iterations):
    """Floats in the fp16 wire's max-allreduces over one step: one per non-empty tensor span of each
    collective (a P or Q factor of each compressed matrix, each uncompressed tensor), one for a classic
    first collective with nothing in it; without compressed matrices, only the first collective is sent."""
    compressed = sum(1 for row in rows if row[3])
    rest = sum(1 for numel, _, _, c in rows if not c and numel)
    if iterations is None:
        return max(1, compressed + rest) + compressed
    return rest + compressed * iterations


def relative_error(got, want):
    """Frobenius-norm error of ``got`` relative to ``want`` (absolute where ``want`` is ~zero)."""
    return (got.double() - want).norm().item() / max(want.norm().item(), 1e-30)


# Relative error allowed for the full-rank output: the gradients' own rounding plus the working precision.
# fp16/bf16 outputs may be off by about an ulp, not half of one: with error feedback, the previous step's
# rounding residual is fed back into this step's output (which is what error feedback is for).
EXACT_TOLERANCE = {torch.float16: 4 * torch.finfo(torch.float16).eps,
                   torch.bfloat16: 4 * torch.finfo(torch.bfloat16).eps,
                   torch.float32: 1e-4, torch.float64: 1e-9}


@pytest.mark.slow
@fuzz(250)
@given(shape_lists(8, 5), st.sampled_from(DTYPES), st.integers(2, 4), st.sampled_from([None, 2, 3, 4]),
       st.sampled_from([None, 4, 8]), st.booleans(), st.sampled_from([1.0, 1e3]), st.integers(0, 2**31 - 1))
# Rank <= 2 with 2^16 elements: the engine's elementwise decompression path on the CPU.
@example([(32768, 2), (2, 32768), (5,)], torch.float32, 2, None, None, True, 1.0, 0)
@example([(32768, 2), (2, 32768), (5,)], torch.float32, 3, 2, None, True, 1.0, 0)
def test_full_rank_world_reproduces_the_exact_mean(shapes, dtype, world_size, iterations, bytes_per_weight,
                                                   error_feedback, scale, seed):
    """At full rank every step's output is the mean of the W workers' gradients, on every worker, and the
    wire carries exactly the plan's elements. (``num_iters_per_step=1`` is left out: a single one-sided
    iteration projects on one side only, so it is exact only over two steps. ``bytes_per_weight=2`` is
    left out: a half-precision wire is lossy by design; the conservation property covers it.)"""
    full_rank = max([min(matrix) for _, matrix, _, _ in direct_plan(shapes, 1, 0)] + [1])
    config = EngineConfig(rank=full_rank, min_compression_rate=0, num_iters_per_step=iterations,
                          bytes_per_weight=bytes_per_weight, use_error_feedback=error_feedback)
    world = World(shapes, dtype, config, world_size)
    assert all(t.compressed for t in world.plan.tensors if len(t.shape) >= 2 and t.numel)
    generator = torch.Generator().manual_seed(seed)
    # The working precision: fp64 only when both the gradients and the wire are fp64.
    precise = torch.float64 if wire_dtype(bytes_per_weight, dtype) == torch.float64 == dtype else torch.float32
    tolerance = max(EXACT_TOLERANCE[dtype], EXACT_TOLERANCE[precise])
    for step in range(3):
        grads = draw_grads(generator, shapes, dtype, world_size, scale)
        mean = [torch.stack([g[i].double() for g in grads]).mean(0) for i in range(len(shapes))]
        sent = world.step(grads)
        check_wire(world, sent, step * (iterations or 0))
        for i in range(len(shapes)):
            for worker in range(1, world_size):
                assert torch.equal(grads[worker][i], grads[0][i]), "workers disagree on the output"
            assert grads[0][i].dtype == dtype
            assert relative_error(grads[0][i], mean[i]) <= tolerance, (i, shapes[i], step)


@fuzz(250)
@given(shape_lists(8, 5), st.sampled_from(DTYPES), st.integers(1, 4), st.integers(1, 3), RATES, ITERS, BYTES,
       st.integers(1, 3), st.integers(2, 5), st.integers(0, 2**31 - 1))
# Large matrices take the engine's elementwise rank-1/2 decompression path on the CPU.
@example([(256, 256), (256, 256), (256,)], torch.float32, 2, 2, 0, None, None, 1, 2, 0)
@example([(300, 220)], torch.float32, 3, 1, 0, 2, 2, 2, 3, 1)
def test_error_feedback_conserves_mass(shapes, dtype, world_size, rank, rate, iterations, bytes_per_weight,
                                       feedback_every, steps, seed):
    config = EngineConfig(rank=rank, min_compression_rate=rate, num_iters_per_step=iterations,
                          bytes_per_weight=bytes_per_weight, feedback_every_n_iters=feedback_every)
    world = World(shapes, dtype, config, world_size)
    generator = torch.Generator().manual_seed(seed)
    total_in = [[torch.zeros(s, dtype=torch.float64) for s in shapes] for _ in range(world_size)]
    total_out = [torch.zeros(s, dtype=torch.float64) for s in shapes]
    for step in range(steps):
        grads = draw_grads(generator, shapes, dtype, world_size, 1.0)
        for worker in range(world_size):
            for acc, g in zip(total_in[worker], grads[worker]):
                acc += g.double()
        sent = world.step(grads)
        check_wire(world, sent, step * (iterations or 0))
        for i in range(len(shapes)):
            assert all(torch.equal(grads[w][i], grads[0][i]) for w in range(world_size))
            assert torch.isfinite(grads[0][i]).all()
            total_out[i] += grads[0][i].double()

    # Rounding errors add up over the steps, each bounded by eps times the largest magnitude around.
    scale = 4 * steps * max([g.abs().max().item() for per_worker in total_in for g in per_worker if g.numel()],
                            default=1.0)
    # Compressed tensors: the residual is what the worker subtracted, in the working precision (also for
    # fp16/bf16 gradients with 2+ alternating iterations since the fix that
    # test_alternating_low_precision_conserves_mass_to_working_precision pins down).
    work_eps = torch.finfo(work_dtype_for(dtype)).eps
    # Uncompressed tensors are averaged through the wire and written back in the gradients' dtype.
    wire_eps = max(torch.finfo(dtype).eps, torch.finfo(wire_dtype(bytes_per_weight, dtype)).eps)
    errors = [world.errors(worker) for worker in range(world_size)]
    for i, tensor in enumerate(world.plan.tensors):
        if tensor.compressed:
            for worker in range(world_size):
                torch.testing.assert_close(total_out[i] + errors[worker][i], total_in[worker][i],
                                           rtol=0, atol=work_eps * scale)
        mean_in = torch.stack([total_in[w][i] for w in range(world_size)]).mean(0)
        mean_error = torch.stack([errors[w][i] for w in range(world_size)]).mean(0)
        tolerance = (work_eps if tensor.compressed else wire_eps) * scale
        torch.testing.assert_close(total_out[i] + mean_error, mean_in, rtol=0, atol=tolerance)


def test_alternating_low_precision_conserves_mass_to_working_precision():
    """Minimal reproducer: one fp16 3x2 gradient, rank 1, two alternating iterations, one worker, two
    steps. Classic PowerSGD (and ``num_iters_per_step=1``) keep ``sum g == sum out + e`` to fp32
    precision, since the residual is taken against what was written into the gradient."""
    from gradpress.comm import LocalCommunicator

    config = EngineConfig(rank=1, min_compression_rate=0, num_iters_per_step=2)
    segment = Segment(make_plan([(3, 2)], 1, 0), [0], torch.device("cpu"), torch.float32)
    generator = torch.Generator().manual_seed(0)
    total_in = torch.zeros(3, 2, dtype=torch.float64)
    total_out = torch.zeros(3, 2, dtype=torch.float64)
    for step in range(2):
        grad = torch.randn(3, 2, generator=generator).half()
        total_in += grad.double()
        task, _ = compress_step(segment, [grad], LocalCommunicator(), config, step)
        for _ in task:
            pass
        total_out += grad.double()
    error = segment.error_views[0].double()
    torch.testing.assert_close(total_out + error, total_in, rtol=0, atol=1e-5)


# --- errors --------------------------------------------------------------------------------------------------

NON_NUMBERS = st.sampled_from(["2", [1], (), b"x", 1j])
NAN = st.just(math.nan)
NEGATIVE = st.floats(max_value=0, exclude_max=True)


def not_an_int_at_least(low):
    """Values an integer field ``>= low`` must refuse."""
    return st.one_of(st.integers(max_value=low - 1), st.floats(), st.booleans(), NON_NUMBERS)


# Per field of EngineConfig, values it must refuse (None is refused where it is not an allowed value).
BAD_ENGINE_VALUES = {
    "rank": st.one_of(not_an_int_at_least(1), st.none()),
    "min_compression_rate": st.one_of(NEGATIVE, NAN, st.booleans(), NON_NUMBERS, st.none()),
    "orthogonalization_epsilon": st.one_of(NEGATIVE, NAN, NON_NUMBERS, st.none()),
    "random_seed": st.one_of(not_an_int_at_least(0), st.none()),
    "use_error_feedback": st.one_of(st.integers(), st.floats(), NON_NUMBERS, st.none()),
    "warm_start": st.one_of(st.integers(), st.floats(), NON_NUMBERS, st.none()),
    "num_iters_per_step": not_an_int_at_least(1),
    "bytes_per_weight": st.one_of(st.integers(), st.floats(), st.booleans(), NON_NUMBERS)
    .filter(lambda v: isinstance(v, bool) or v not in (2, 4, 8)),
    "feedback_every_n_iters": st.one_of(not_an_int_at_least(1), st.none()),
    "warm_up_beta_factor": st.one_of(st.floats().filter(lambda b: not 0 < b <= 1), st.booleans(), NON_NUMBERS),
    "warm_up_steps": st.one_of(not_an_int_at_least(0), st.none()),
}


def field_and_bad_value(table):
    return st.one_of([st.tuples(st.just(name), values) for name, values in table.items()])


@fuzz(300)
@given(field_and_bad_value(BAD_ENGINE_VALUES))
def test_engine_config_refuses_bad_values_naming_the_field(field_value):
    name, value = field_value
    with pytest.raises((ValueError, TypeError), match=name):
        EngineConfig(**{name: value})


@fuzz(150)
@given(field_and_bad_value({
    **{name: BAD_ENGINE_VALUES[name] for name in ("rank", "min_compression_rate", "num_iters_per_step",
                                                  "random_seed", "bytes_per_weight", "feedback_every_n_iters",
                                                  "warm_up_beta_factor")},
    "start_compressing_after_num_steps": not_an_int_at_least(0)}))
def test_aggregator_config_refuses_bad_values_naming_the_field(field_value):
    name, value = field_value
    kwargs = {"rank": 1, name: value}
    if name == "warm_up_beta_factor":
        kwargs["start_compressing_after_num_steps"] = 5  # so the value itself is what is wrong
    with pytest.raises((ValueError, TypeError), match=name):
        Config(**kwargs)


@fuzz(40)
@given(st.integers(1, 4), st.booleans(), ITERS, st.booleans())
def test_alternating_iterations_need_warm_start(rank, error_feedback, iterations, warm_start):
    kwargs = dict(rank=rank, use_error_feedback=error_feedback, num_iters_per_step=iterations, warm_start=warm_start)
    if iterations is not None and not warm_start:
        with pytest.raises(ValueError, match="num_iters_per_step"):
            EngineConfig(**kwargs)
    else:
        assert EngineConfig(**kwargs).num_iters_per_step == iterations


BAD_SHAPES = st.one_of(
    st.tuples(st.integers(max_value=-1), st.integers(0, 3)),               # a negative size
    st.tuples(st.integers(0, 3), st.floats()),                             # a float size
    st.tuples(st.booleans()), st.none(), st.integers(), st.floats(), st.text(min_size=1, max_size=3),
    st.just((None, 2)), st.just(((2,), 3)),
)


@fuzz(200)
@given(st.data(), shape_lists(20, 4), st.integers(1, 8), RATES)
def test_make_plan_refuses_bad_input_naming_the_argument(data, shapes, rank, rate):
    what = data.draw(st.sampled_from(["rank", "min_compression_rate", "shapes", "a shape"]))
    if what == "rank":
        rank = data.draw(st.one_of(not_an_int_at_least(1), st.none()))
    elif what == "min_compression_rate":
        rate = data.draw(st.one_of(NEGATIVE, NAN, st.booleans(), NON_NUMBERS, st.none()))
    elif what == "shapes":
        shapes = data.draw(st.one_of(st.none(), st.integers(), st.floats(), st.text(max_size=3)))
    else:
        position = data.draw(st.integers(0, len(shapes)))
        shapes = [*shapes[:position], data.draw(BAD_SHAPES), *shapes[position:]]
        what = rf"shapes\[{position}\]"
    with pytest.raises((ValueError, TypeError), match=what):
        make_plan(shapes, rank, rate)


@fuzz(60)
@given(shape_lists(6, 4, min_size=1), st.sampled_from(DTYPES), st.data())
def test_aggregator_refuses_mismatched_gradients(shapes, dtype, data):
    powersgd = PowerSGD([torch.zeros(s, dtype=dtype) for s in shapes], Config(rank=1), init_sync=False)
    count = data.draw(st.integers(0, len(shapes) + 2).filter(lambda c: c != len(shapes)))
    grads = [torch.zeros(shapes[i % len(shapes)], dtype=dtype) for i in range(count)]
    with pytest.raises(ValueError, match=f"expected {len(shapes)} gradients"):
        powersgd.aggregate_(grads)
    index = data.draw(st.integers(0, len(shapes) - 1))
    wrong = data.draw(shape_strategy(6).filter(lambda s: s != tuple(shapes[index])))
    grads = [torch.zeros(s, dtype=dtype) for s in shapes]
    grads[index] = torch.zeros(wrong, dtype=dtype)
    with pytest.raises(ValueError, match=f"gradient #{index} has shape"):
        powersgd.aggregate_(grads)


def _aggregate_once(gradient):
    params = [torch.zeros(gradient.shape, dtype=gradient.dtype) if isinstance(gradient, torch.Tensor)
              else torch.zeros(4, 4)]
    powersgd = PowerSGD(params, Config(rank=4, min_compression_rate=0, start_compressing_after_num_steps=0,
                                       num_iters_per_step=None), init_sync=False)
    return powersgd.aggregate([gradient])


# Found by fuzzing: gradients of a dtype PowerSGD cannot handle (int64 raised from div_, complex64 ran and
# returned a wrong "mean", since the engine transposes where it should conjugate, a list raised
# AttributeError 'is_sparse'); now refused by name.
@pytest.mark.parametrize("gradient", [
    pytest.param(torch.ones(4, 4, dtype=torch.int64), id="int64"),
    pytest.param(torch.ones(4, 4, dtype=torch.complex64), id="complex64"),
    pytest.param([[1.0] * 4] * 4, id="list"),
])
def test_aggregator_refuses_gradients_that_are_not_real_floating_tensors(gradient):
    with pytest.raises((TypeError, ValueError), match="gradient"):
        _aggregate_once(gradient)

"""No host sync on the engine's hot path, also when a step is not finite.

On a GPU, reading a tensor's value to the host (``bool(t)``, ``t.item()``, ``t.nonzero()``, boolean-mask
indexing, ``t.tolist()``) waits for the stream: a stall of the autograd thread, once per bucket per
step if the engine did it. These tests need no GPU: they run the engine on CPU tensors as it runs on an
accelerator (its device backend: ``gradpress.powersgd.backend.forced(DEVICE)``) and fail on any such read,
caught twice over: at the Python methods, and at the ATen ops a value read goes through (``aten._local_scalar_dense``
behind ``item``/``bool``/``int``/``float``, ``aten.nonzero``, indexing with a boolean mask), seen by a
``TorchDispatchMode`` whatever Python or C++ code issues them. A third test runs the engine on the
``meta`` device, which has no values to read at all.
"""

from __future__ import annotations

import contextlib

import pytest
import torch

from distributed import run
from host_reads import (CountSyncingOps, ForbidBlockingUploads, ForbidSyncingOps, HostRead, as_on_an_accelerator,
                        no_host_reads)
import gradpress
from gradpress import Config, PowerSGD
from gradpress.comm import LocalCommunicator
from gradpress.hooks.batched import PaddedBuckets
from gradpress.powersgd import EngineConfig, Segment, make_plan
from gradpress.powersgd.seeding import upload
from gradpress.powersgd.step import average_step, compress_step

WORLD = 2

# Two same-shape matrices (one group), another shape, a vector (uncompressed), a 4-d tensor.
SHAPES = [(8, 6), (8, 6), (5, 7), (3,), (6, 2, 2, 2)]
BAD = 1  # the tensor that gets a non-finite gradient

CONFIGS = {
    "classic": {},
    "classic-no-feedback": {"use_error_feedback": False},
    "classic-no-warm-start": {"warm_start": False},
    "classic-fp16-wire": {"bytes_per_weight": 2},
    "classic-feedback-every-2-beta": {"feedback_every_n_iters": 2, "warm_up_beta_factor": 0.5, "warm_up_steps": 2},
    "one-iteration": {"num_iters_per_step": 1},
    "three-iterations": {"num_iters_per_step": 3},
    "three-iterations-fp16-wire": {"num_iters_per_step": 3, "bytes_per_weight": 2},
}

def _gradients(step, bad, dtype=torch.float32, device="cpu"):
    generator = torch.Generator().manual_seed(100 + step)
    grads = [torch.randn(shape, generator=generator, dtype=dtype) for shape in SHAPES]
    if bad:
        grads[BAD][2, 3] = float("nan")
        grads[BAD][0, 1] = float("inf")
    return [g.to(device) for g in grads]


def _segment(config, dtype=torch.float32, device="cpu"):
    plan = make_plan(SHAPES, config.rank, config.min_compression_rate)
    return Segment(plan, list(range(len(SHAPES))), torch.device(device), dtype)


def _memory_is_finite(segment, with_p, error_feedback=True):
    """Error memory (with error feedback; else ``error_memory`` is scratch) and warm-start factors (Q; P too in
    the alternating scheme, where it is memory)."""
    factors = segment.q if not with_p else torch.cat([segment.p, segment.q])
    finite_memory = not error_feedback or bool(torch.isfinite(segment.error_memory).all())
    return bool(torch.isfinite(factors).all()) and finite_memory


def _run(segment, grads, config, compressed_step, measure=False):
    task, _ = compress_step(segment, grads, LocalCommunicator(), config, compressed_step, measure=measure,
                            global_residual=measure)
    for handle in task:
        handle.wait()


# --- no host reads -------------------------------------------------------------------------------------

def test_the_guard_catches_reads_python_and_aten_alike():
    x = torch.tensor([1.0, float("nan")])
    for read in (lambda: bool(x.isfinite().all()), lambda: x[0].item(), lambda: x.nonzero(),
                 lambda: x.tolist(), lambda: x[x.isfinite()], lambda: float(x[0])):
        with pytest.raises(HostRead), no_host_reads():
            read()
    # C++ calls that no Python method sees: boolean-mask assignment (the pre-15.4 engine zeroed
    # error memory this way) and torch.equal.
    with pytest.raises(HostRead), ForbidSyncingOps():
        x[~x.isfinite()] = 0
    with pytest.raises(HostRead), ForbidSyncingOps():
        torch.equal(x, x)
    with no_host_reads():  # and what the engine does instead passes
        finite = x.isfinite().all(dim=0, keepdim=True)
        torch.where(finite, x, torch.zeros_like(x), out=x)
        x.masked_fill_(~finite, 0)


@pytest.mark.parametrize("non_finite", [False, True], ids=["finite", "non-finite"])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_engine_steps_read_nothing_on_the_host(name, non_finite):
    config = EngineConfig(rank=2, min_compression_rate=0, random_seed=3, **CONFIGS[name])
    segment = _segment(config)
    with as_on_an_accelerator(), no_host_reads():
        for compressed_step in range(4):
            grads = _gradients(compressed_step, non_finite and compressed_step == 1)
            _run(segment, grads, config, compressed_step)
    assert _memory_is_finite(segment, config.num_iters_per_step is not None, config.use_error_feedback)


@pytest.mark.parametrize("non_finite", [False, True], ids=["finite", "non-finite"])
@pytest.mark.parametrize("name", ["classic", "classic-no-warm-start", "classic-fp16-wire",
                                  "classic-feedback-every-2-beta", "three-iterations"])
def test_measuring_steps_read_nothing_on_the_host(name, non_finite):
    # Both diagnostics: the per-worker norms at the commit and the global residual's sketch (drawn on the
    # CPU, moved, all-reduced, kept or not at the commit). The accelerator path measures what the CPU one does.
    config = EngineConfig(rank=2, min_compression_rate=0, random_seed=3, **CONFIGS[name])
    on_cpu, on_device = _segment(config), _segment(config)
    for compressed_step in range(4):
        bad = non_finite and compressed_step == 2
        _run(on_cpu, _gradients(compressed_step, bad), config, compressed_step, measure=True)
        with as_on_an_accelerator(), no_host_reads():
            _run(on_device, _gradients(compressed_step, bad), config, compressed_step, measure=True)
        torch.testing.assert_close(on_device.global_residual_norms(), on_cpu.global_residual_norms())
        torch.testing.assert_close(on_device.approximation_norms(), on_cpu.approximation_norms())
    assert bool(torch.isfinite(on_device.global_residual_norms()).all())


@pytest.mark.parametrize("num_iters", [None, 1, 2])
def test_aggregator_steps_read_nothing_on_the_host(num_iters):
    params = [torch.zeros(shape) for shape in SHAPES]
    powersgd = PowerSGD(params, Config(rank=2, min_compression_rate=0, num_iters_per_step=num_iters,
                                       start_compressing_after_num_steps=1))
    with as_on_an_accelerator(), no_host_reads():
        for step in range(4):
            powersgd.aggregate_(_gradients(step, bad=step == 2))
    for segment in powersgd.session.store.segments.values():
        assert _memory_is_finite(segment, num_iters is not None)


@pytest.mark.parametrize("measure", [False, True], ids=["", "measured"])
@pytest.mark.parametrize("name", ["classic", "classic-fp16-wire", "three-iterations"])
def test_engine_runs_on_a_device_without_values(name, measure):
    # On "meta" every read of a value raises, in Python and in C++: no mock needed, and the engine
    # takes the accelerator path because reading there is not free.
    # Nor is anything copied from the host blocking: the seeded factors of the first step, the fp16 wire's
    # span tables and the residual's sketch go up asynchronously (a blocking upload waits for a GPU's stream).
    config = EngineConfig(rank=2, min_compression_rate=0, **CONFIGS[name])
    segment = _segment(config, device="meta")
    for compressed_step in range(3):
        grads = _gradients(compressed_step, False, device="meta")
        with ForbidBlockingUploads():
            _run(segment, grads, config, compressed_step, measure)
    if measure:
        assert segment.global_residual_norms().device.type == "meta"
    # The device-side commit ran (there is no value to read on "meta"): its candidate memory was built
    # in the workspace, on that device.
    assert segment.workspace.nbytes > 0
    assert all(flat.device.type == "meta" for flat in segment.workspace._buffers.values())


@pytest.mark.parametrize("num_iters", [None, 2])
@pytest.mark.parametrize("bytes_per_weight", [4, 2])
def test_aggregator_uploads_nothing_blocking(num_iters, bytes_per_weight):
    params = [torch.zeros(shape, device="meta") for shape in SHAPES]
    powersgd = PowerSGD(params, Config(rank=2, min_compression_rate=0, num_iters_per_step=num_iters,
                                       start_compressing_after_num_steps=1, bytes_per_weight=bytes_per_weight))
    grads = [[torch.empty(shape, device="meta") for shape in SHAPES] for _ in range(4)]
    with ForbidBlockingUploads():
        for step_grads in grads:
            powersgd.aggregate_(step_grads)


@pytest.mark.parametrize("wire", [None, torch.float16, torch.bfloat16], ids=["fp32", "fp16", "bf16"])
def test_exact_averaging_uploads_nothing_blocking(wire):
    # The iterations before compression and the tensors no plan compresses: an fp16 wire builds its span
    # tables on the host each step and must not wait for the device to move them.
    tensors = [torch.empty(shape, device="meta") for shape in [(8, 6), (3,), (5, 7)]]
    with ForbidBlockingUploads():
        for handle in average_step(tensors, LocalCommunicator(), wire_dtype=wire):
            handle.wait()


def test_the_upload_guard_catches_blocking_copies():
    host = torch.ones(3)
    with pytest.raises(HostRead), ForbidBlockingUploads():
        host.to("meta")
    with pytest.raises(HostRead), ForbidBlockingUploads():
        torch.empty(3, device="meta").copy_(host)
    with ForbidBlockingUploads():  # what the engine does instead passes
        upload(host, torch.device("meta"))
        torch.empty(3, device="meta").copy_(host, non_blocking=True)
        assert upload(host, torch.device("cpu")) is host


@pytest.mark.parametrize("num_iters", [None, 2])
def test_on_the_cpu_a_step_reads_one_flag_and_keeps_the_memory_in_its_two_buffers(num_iters):
    config = EngineConfig(rank=2, min_compression_rate=0, num_iters_per_step=num_iters)
    segment = _segment(config)
    _run(segment, _gradients(0, False), config, 0)
    buffers = {segment.error_memory.data_ptr(), segment.m_memory.data_ptr()}
    before = [w.clone() for w in segment.error_views]
    counter = CountSyncingOps()
    with counter:
        _run(segment, _gradients(1, False), config, 1)
    assert counter.count == 1  # the step's all-finite flag: free on the CPU, and it saves a full pass
    # M was built in the second buffer, which became the memory: no buffer of the memory's size allocated.
    assert {segment.error_memory.data_ptr(), segment.m_memory.data_ptr()} == buffers
    assert not all(torch.equal(a, b) for a, b in zip(before, segment.error_views))


# --- a non-finite step: every buffer as before it -------------------------------------------------------

@pytest.mark.parametrize("path", ["cpu", "accelerator"])
@pytest.mark.parametrize("name", ["classic", "classic-fp16-wire", "one-iteration", "three-iterations"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_a_non_finite_step_leaves_memory_and_factors_bitwise_as_before(name, path, dtype):
    config = EngineConfig(rank=2, min_compression_rate=0, random_seed=11, **CONFIGS[name])
    with_p = config.num_iters_per_step is not None
    segment = _segment(config, dtype)
    p_numel, q_start = segment.layout.p_numel, segment.layout.q_start
    with as_on_an_accelerator() if path == "accelerator" else contextlib.nullcontext():
        _run(segment, _gradients(0, False, dtype), config, 0)
        before = (segment.error_memory.clone(), segment.wire.clone())
        grads = _gradients(1, True, dtype)
        _run(segment, grads, config, 1)
    # The step reports the overflow (an AMP GradScaler skips it) ...
    assert not torch.isfinite(grads[BAD]).all()
    # ... and leaves the error memory and the warm-start factors exactly as they were.
    assert torch.equal(segment.error_memory, before[0])
    assert torch.equal(segment.q, before[1][q_start:])
    if with_p:  # P is memory in the alternating scheme (in the classic one, scratch)
        assert torch.equal(segment.p, before[1][:p_numel])
    # The next step is finite again.
    grads = _gradients(2, False, dtype)
    _run(segment, grads, config, 2)
    assert all(torch.isfinite(g).all() for g in grads)


# --- on every rank -----------------------------------------------------------------------------------

def _non_finite_on_rank_0(rank, world, num_iters, accelerator_path):
    params = [torch.zeros(shape) for shape in SHAPES]
    powersgd = PowerSGD(params, Config(rank=2, min_compression_rate=0, num_iters_per_step=num_iters,
                                       start_compressing_after_num_steps=0, random_seed=9))
    out = []
    with as_on_an_accelerator() if accelerator_path else contextlib.nullcontext():
        for step in range(3):
            grads = _gradients(step + 10 * rank, bad=step == 1 and rank == 0)
            powersgd.aggregate_(grads)
            (segment,) = powersgd.session.store.segments.values()
            out.append((segment.error_memory.clone(), (segment.p.clone(), segment.q.clone()),
                        [g.clone() for g in grads], bool(powersgd.finite)))
    return out


@pytest.mark.parametrize("accelerator_path", [False, True], ids=["cpu", "accelerator"])
@pytest.mark.parametrize("num_iters", [None, 2])
def test_a_non_finite_gradient_on_one_rank_leaves_every_rank_as_before(num_iters, accelerator_path):
    results = run(_non_finite_on_rank_0, WORLD, num_iters, accelerator_path)
    for steps in results:
        work, (p, q), grads, finite = steps[1]
        assert not finite and not torch.isfinite(grads[BAD]).all()  # every rank sees the overflow
        assert torch.equal(work, steps[0][0])  # the error memory is as before the step
        assert torch.equal(q, steps[0][1][1])  # and so is Q
        if num_iters is not None:  # and P, where it is memory
            assert torch.equal(p, steps[0][1][0])
        assert steps[2][3] and all(torch.isfinite(g).all() for g in steps[2][2])  # the next step is finite
    # The factors are means: identical on every rank, skipped or not (in the classic scheme P is no
    # memory: it stays NaN until the next step overwrites it).
    for step in range(3):
        torch.testing.assert_close(results[0][step][1], results[1][step][1], rtol=0, atol=0, equal_nan=True)


def _hook_steps(rank, world, hook_name, num_iters, measure_every=None, overlap="auto"):
    from gradpress.tools.bench.buckets import FakeBucket

    params = [torch.zeros(shape) for shape in SHAPES]
    buckets = [FakeBucket(0, params[2:], False, torch.float32), FakeBucket(1, params[:2], True, torch.float32)]
    state = gradpress.PowerSGDState(None, matrix_approximation_rank=2, start_powerSGD_iter=2, min_compression_rate=0,
                                    num_iters_per_step=num_iters, approximation_error_every_n_iters=measure_every,
                                    global_residual_every_n_iters=measure_every, overlap=overlap)
    hook = getattr(gradpress, hook_name)
    with as_on_an_accelerator(), no_host_reads():
        for step in range(5):
            grads = dict(zip(map(id, params), _gradients(step + 10 * rank, bad=step == 3 and rank == 1)))
            for bucket in buckets:
                torch._foreach_copy_(bucket.gradients(), [grads[id(p)] for p in bucket.parameters()])
            for future in [hook(state, bucket) for bucket in buckets]:
                future.wait()
    measured = measure_every is None or (state.global_residual() and state.approximation_error())
    # The per-parameter memory and the batched hook's per-bucket memory.
    segments = [*state.session.segments(), *PaddedBuckets.of(state).segments()]
    assert hook_name != "batched_powerSGD_hook" or PaddedBuckets.of(state).segments()
    return bool(measured) and all(_memory_is_finite(segment, num_iters is not None) for segment in segments)


@pytest.mark.parametrize("measure_every", [None, 2], ids=["", "measured"])
@pytest.mark.parametrize("hook_name, num_iters, overlap", [
    ("powerSGD_hook", None, "none"), ("powerSGD_hook", 2, "none"), ("batched_powerSGD_hook", None, "none"),
    ("powerSGD_hook", None, "p-phase")])
def test_ddp_hooks_read_nothing_on_the_host(hook_name, num_iters, overlap, measure_every):
    # measured: every other compressed step also all-reduces the global residual's sketch, over gloo. A
    # non-finite step (rank 1, step 3) leaves every bucket's memory finite, also with each bucket's P issued
    # as it arrives.
    assert all(run(_hook_steps, WORLD, hook_name, num_iters, measure_every, overlap))

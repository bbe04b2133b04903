"""The engine's seams, each through the public configuration: the backend switch, the wire codecs (bf16 for
fp32 gradients is one of them), the orthogonalization registry, the factors' layout on the wire, and the
warm start's range (rank 1 from 1e-23 to 3e18)."""

from __future__ import annotations

import contextlib

import pytest
import torch

from host_reads import CountSyncingOps, as_on_an_accelerator
from gradpress import Config, PowerSGD
from gradpress.comm import LocalCommunicator
from gradpress.powersgd import EngineConfig, Segment, compress_step, make_plan
from gradpress.powersgd.backend import CPU, DEVICE, backend_for, forced
from gradpress.powersgd.layout import ALIGNMENT_BYTES
from gradpress.powersgd.wire import CastWire, NativeWire, ScaledFp16Wire, wire_codec

PATHS = ["cpu", "accelerator"]


def _path(path: str):
    return as_on_an_accelerator() if path == "accelerator" else contextlib.nullcontext()


# --- the warm start's range ---------------------------------------------------------------------------------

def _relative_errors(scale: float, rank: int, iterations: int | None, steps: int = 4) -> list[float]:
    """Each step's ``||output - g|| / ||g||`` of the aggregator on a rank-1 gradient ``g`` of ``scale``, and the
    error memory's size after the last, relative to ``g``."""
    powersgd = PowerSGD([torch.zeros(64, 32)], Config(rank=rank, num_iters_per_step=iterations, min_compression_rate=0,
                                                      start_compressing_after_num_steps=0), init_sync=False)
    gradient = scale * torch.outer(torch.linspace(-1, 1, 64), torch.linspace(1, 2, 32)) / 32
    errors = []
    for _ in range(steps):
        output = gradient.clone()
        powersgd.aggregate_([output])
        errors.append(float((output.double() - gradient.double()).norm() / gradient.double().norm()))
    memory = powersgd.session.store.export()[0].error
    assert torch.isfinite(memory).all()
    return errors + [float(memory.double().norm() / gradient.double().norm())]


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("scale", [3e18, 5e9, 1e-23])
@pytest.mark.parametrize("rank, iterations", [(1, None), (2, None), (1, 1)])
def test_compression_does_not_depend_on_the_gradients_scale(scale, rank, iterations, path):
    """A gradient's compression is the same at any scale (a loss-scaled AMP gradient, a diverging or a
    vanishing layer): each step's relative error equals the one at scale 1, and classic PowerSGD reproduces
    a rank-1 gradient exactly at every step. The column norms of rank-1 factors are taken in float64 and
    the warm-start Q is rescaled by a power of two, so neither P = M Q (of M's scale squared before) nor its
    norm over- or underflows. Before, from 4e9 the update was zero from the second step on and the error
    memory grew without bound; near 1e-23 it was 98% wrong."""
    with _path(path):
        at_one, scaled = _relative_errors(1.0, rank, iterations), _relative_errors(scale, rank, iterations)
    assert scaled == pytest.approx(at_one, abs=1e-5), (at_one, scaled)
    if iterations is None:
        assert max(scaled) < 1e-5


# --- the backend -------------------------------------------------------------------------------------------

def test_the_backend_is_chosen_by_device_and_forced_for_tests():
    assert backend_for(torch.device("cpu")) is CPU and backend_for(torch.device("meta")) is DEVICE
    with forced(DEVICE):
        assert backend_for(torch.device("cpu")) is DEVICE
        with forced(CPU):
            assert backend_for(torch.device("meta")) is CPU
        assert backend_for(torch.device("cpu")) is DEVICE
    assert backend_for(torch.device("cpu")) is CPU
    with pytest.raises(TypeError, match="backend"):
        with forced("device"):  # type: ignore[arg-type]
            pass


@pytest.mark.parametrize("iterations", [None, 1])
def test_on_the_device_backend_a_step_reads_nothing_where_the_cpu_reads_one_flag(iterations):
    config = EngineConfig(rank=2, min_compression_rate=0, num_iters_per_step=iterations)
    shapes = [(12, 8), (12, 8), (5, 9), (4,)]
    for backend, reads in ((CPU, 1), (DEVICE, 0)):
        segment = Segment(make_plan(shapes, 2, 0), list(range(4)), torch.device("cpu"), torch.float32)
        with forced(backend):
            for step in range(2):
                counter = CountSyncingOps()
                with counter:
                    grads = [torch.randn(s) for s in shapes]
                    task, _ = compress_step(segment, grads, LocalCommunicator(), config, step)
                    for _ in task:
                        pass
                assert counter.count == reads, backend


# --- the wire ----------------------------------------------------------------------------------------------

def test_wire_codecs_by_dtype():
    assert isinstance(wire_codec(torch.float32, torch.float32), NativeWire)
    assert isinstance(wire_codec(torch.float16, torch.float32), ScaledFp16Wire)
    assert isinstance(wire_codec(torch.float16, torch.float16), NativeWire)
    bf16 = wire_codec(torch.bfloat16, torch.float32)
    assert isinstance(bf16, CastWire) and bf16.dtype == torch.bfloat16 and not bf16.needs_spans
    assert EngineConfig(bytes_per_weight=2, half_precision_wire="bf16").wire_dtype(torch.float32, torch.float32) \
        == torch.bfloat16
    assert EngineConfig(bytes_per_weight=2).wire_dtype(torch.float32, torch.float32) == torch.float16
    assert EngineConfig(bytes_per_weight=2).wire_dtype(torch.bfloat16, torch.float32) == torch.bfloat16
    assert EngineConfig(bytes_per_weight=2, half_precision_wire="fp16").wire_dtype(torch.bfloat16, torch.float32) \
        == torch.float16


class _Recording(LocalCommunicator):
    """One worker, recording each collective's operation and dtype."""

    def __init__(self) -> None:
        super().__init__()
        self.sent: list[tuple[str, torch.dtype, int]] = []

    def allreduce_sum(self, buffer):
        self.sent.append(("sum", buffer.dtype, buffer.numel()))
        return super().allreduce_sum(buffer)

    def allreduce_max(self, buffer):
        self.sent.append(("max", buffer.dtype, buffer.numel()))
        return super().allreduce_max(buffer)


@pytest.mark.parametrize("path", PATHS)
def test_a_bf16_wire_for_fp32_gradients_sends_bf16_and_no_maxima(path):
    """``half_precision_wire="bf16"``: P, Q and the uncompressed tensors travel as bf16 (half the bytes of
    fp32, fp32's range: no scale to agree on, so no max-allreduce), and the result is the fp32 wire's to
    bf16's precision (8 bits of mantissa)."""
    shapes = [(40, 24), (40, 24), (16,)]
    outputs = {}
    for wire, options in (("fp32", {}), ("bf16", {"bytes_per_weight": 2, "half_precision_wire": "bf16"})):
        config = EngineConfig(rank=24, min_compression_rate=0, use_error_feedback=False, **options)
        segment = Segment(make_plan(shapes, 24, 0), [0, 1, 2], torch.device("cpu"), torch.float32)
        comm = _Recording()
        grads = [torch.randn(s, generator=torch.Generator().manual_seed(i)) for i, s in enumerate(shapes)]
        with _path(path):
            task, _ = compress_step(segment, grads, comm, config, 0)
            for _ in task:
                pass
        outputs[wire] = grads
        assert {op for op, _, _ in comm.sent} == {"sum"}
        assert {dtype for _, dtype, _ in comm.sent} == {torch.bfloat16 if wire == "bf16" else torch.float32}
    for a, b in zip(outputs["fp32"], outputs["bf16"]):
        assert (a - b).abs().max() <= 2 ** -7 * 4 * a.abs().max()


def test_half_precision_wire_is_checked():
    with pytest.raises(ValueError, match="half_precision_wire must be one of 'auto', 'fp16', 'bf16'"):
        EngineConfig(bytes_per_weight=2, half_precision_wire="fp8")
    with pytest.raises(ValueError, match="half_precision_wire='bf16' chooses the format of a 2-byte wire"):
        EngineConfig(half_precision_wire="bf16")
    EngineConfig(warm_up_bytes_per_weight=2, half_precision_wire="bf16")  # the warm-up's wire is one too


# --- the orthogonalization registry ----------------------------------------------------------------------

def test_orthogonalization_names_its_registry():
    with pytest.raises(ValueError, match="orthogonalization must be 'auto' or one of 'cholesky', 'householder'"):
        EngineConfig(orthogonalization="qr")
    with pytest.raises(ValueError, match="orthogonalization"):
        Config(rank=2, orthogonalization="gram-schmidt")


# --- the layout ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("rank", [1, 3, 16])
def test_every_factor_starts_on_its_own_line_of_the_wire(rank, dtype):
    """Each matrix's P and Q^T (as its error memory and M) starts on a 64-byte line: where BLAS rounds by
    alignment, a matrix's numbers then do not depend on which matrices share its bucket or group (a resumed
    DDP run's first iteration lays the buckets out otherwise). The padding is zero and the spans of the
    fp16 wire tile the wire."""
    shapes = [(17, 5), (17, 5), (9,), (33, 7), (6, 2, 3), (17, 5)]
    segment = Segment(make_plan(shapes, rank, 0), list(range(len(shapes))), torch.device("cpu"), dtype)
    ps, qs = segment.p_views, segment.q_views
    assert len(ps) == len(qs) == 5
    for view in [*ps, *qs, *segment.error_views]:
        assert view.data_ptr() % ALIGNMENT_BYTES == 0
    spans = segment.wire_spans()
    assert sum(spans.sizes) == segment.wire.numel()
    assert segment.q.data_ptr() % ALIGNMENT_BYTES == 0
    for p in ps:
        p.fill_(1.0)
    for q in qs:
        q.fill_(1.0)
    padding = segment.wire.numel() - segment.plan.numel_sent
    assert int((segment.wire == 0).sum()) == padding + segment.plan.uncompressed_numel  # only the padding is left

"""The one exact-average primitive (gradpress.comm.average): its blocking, asynchronous, DDP-future and
pipeline forms give PyTorch's numbers bit for bit (2 gloo ranks with different tensors)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from distributed import run
from gradpress import comm


def _tensors(rank: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(rank)
    return [torch.randn(5, 3, generator=gen), torch.randn(4, generator=gen, dtype=torch.float64),
            torch.randn(2, 2, generator=gen), torch.randn(6, generator=gen).to(torch.float16)]


def _pytorch_mean(tensors: list[torch.Tensor], wire: torch.dtype | None = None) -> list[torch.Tensor]:
    """PyTorch's recipe (average_parameters, fp16_compress_hook): per dtype, flat / W cast first, summed."""
    out = [t.clone() for t in tensors]
    for group in comm.device_groups(out):
        flat = torch.cat([out[i].reshape(-1) for i in group]).to(wire or out[group[0]].dtype)
        flat.div_(dist.get_world_size())
        dist.all_reduce(flat)
        offset = 0
        for i in group:
            out[i].copy_(flat[offset: offset + out[i].numel()].view_as(out[i]))
            offset += out[i].numel()
    return out


def forms(rank: int, world: int) -> dict[str, bool]:
    out = {}
    for wire in (None, torch.float16, torch.bfloat16):
        want = _pytorch_mean(_tensors(rank), wire)
        blocking = _tensors(rank)
        sent = comm.average_tensors_(blocking, wire_dtype=wire)
        pending_tensors = _tensors(rank)
        pending = comm.start_average(pending_tensors, wire_dtype=wire)
        untouched = all(torch.equal(a, b) for a, b in zip(pending_tensors, _tensors(rank))
                        # (here the 1-D tensors are alone in their dtype: without a cast, averaged in place)
                        if (wire or a.dtype) != a.dtype or a.dim() != 1)
        pending.wait()
        out[f"blocking {wire}"] = all(torch.equal(a, b) for a, b in zip(blocking, want))
        out[f"async {wire}"] = all(torch.equal(a, b) for a, b in zip(pending_tensors, want)) and untouched
        out[f"bytes {wire}"] = sent == pending.bytes_sent == sum(t.numel() * (wire or t.dtype).itemsize
                                                                 for t in blocking)
    # The DDP-future form, on one flat bucket (in place) and through an fp16 wire.
    for wire in (None, torch.float16):
        bucket = torch.cat([t.reshape(-1).float() for t in _tensors(rank)])
        want = _pytorch_mean([bucket], wire)[0]
        result = comm.start_average([bucket], wire_dtype=wire).get_future().wait()
        out[f"future {wire}"] = result is bucket and torch.equal(bucket, want)
    # The pipeline form over the engine's communicator.
    tensors = [t for t in _tensors(rank) if t.dtype == torch.float32]
    want = _pytorch_mean(tensors)
    task = comm.average_task(tensors, comm.ProcessGroupCommunicator())
    handle = next(task)
    handle.wait()
    try:
        next(task)
    except StopIteration as done:
        flat = done.value
    out["task"] = all(torch.equal(a, b) for a, b in zip(tensors, want)) and flat.numel() == 19
    return out


def test_every_form_gives_pytorchs_mean_bitwise():
    for result in run(forms, 2):
        assert all(result.values()), {k: v for k, v in result.items() if not v}


def test_one_worker_builds_the_wire_and_sends_nothing():
    tensors = [torch.tensor([1.0, 2.0]), torch.tensor([3.0 + 2 ** -12], dtype=torch.float32)]
    pending = comm.start_average(tensors, wire_dtype=torch.float16, world_size=1)
    assert pending.works == [] and pending.bytes_sent == 6
    assert pending.wait()[1].item() == 3.0  # rounded to the fp16 wire, as with more workers
    assert bool(pending.finite())
    with pytest.raises(StopIteration):
        next(comm.average_task(tensors, comm.LocalCommunicator()))


def test_a_pending_average_finishes_from_saved_buffers():
    tensors = [torch.zeros(2, 2), torch.zeros(3, dtype=torch.float64)]
    buffers = [torch.arange(4.0), torch.arange(3.0, dtype=torch.float64)]
    assert [t.tolist() for t in comm.PendingAverage(tensors, buffers).wait()] == [[[0.0, 1.0], [2.0, 3.0]],
                                                                                  [0.0, 1.0, 2.0]]
    with pytest.raises(ValueError, match="2 \\(device, dtype\\) groups"):
        comm.PendingAverage(tensors, buffers[:1])
    with pytest.raises(ValueError, match="one tensor"):
        comm.PendingAverage(tensors, buffers).get_future()


def _small_and_mixed(rank: int) -> list[torch.Tensor]:
    """Outer-gradient-like tensors: values near 1e-5 (fp16 subnormals once divided by W), one near 1e3
    beside one near 1e-7 (one shared scale would flush the latter), an fp64 one, an empty one."""
    gen = torch.Generator().manual_seed(10 + rank)
    sign = torch.randint(0, 2, (300,), generator=gen) * 2 - 1
    return [sign * (0.5 + torch.rand(300, generator=gen)) * 1e-5, (1 + torch.rand(7, generator=gen)) * 1e3,
            (1 + torch.rand(3, 4, generator=gen)) * 1e-7, torch.randn(5, generator=gen, dtype=torch.float64) * 1e-6,
            torch.empty(0)]


def _relative_errors(got: list[torch.Tensor], want: list[torch.Tensor]) -> list[float]:
    return [float((g.double() - w).abs().max() / w.abs().max()) for g, w in zip(got, want) if w.numel()]


def scaled_fp16(rank: int, world: int) -> dict[str, object]:
    exact = [t.double() for t in _small_and_mixed(rank)]
    for t in exact:
        dist.all_reduce(t)
        t.div_(world)
    out: dict[str, object] = {}
    tensors = _small_and_mixed(rank)
    pending = comm.start_average(tensors, wire_dtype=torch.float16, scaled=True)
    out["untouched before wait"] = all(torch.equal(a, b) for a, b in zip(tensors, _small_and_mixed(rank)))
    buffers = [b.clone() for b in pending.wait_collectives()]
    scales = [s.clone() for s in pending.scales]
    out["scaled"] = _relative_errors(pending.wait(), exact)
    out["one scale per non-empty tensor"] = [s.numel() for s in scales] == [3, 1]
    out["bytes"] = pending.bytes_sent == 2 * sum(t.numel() for t in tensors)
    resumed = comm.PendingAverage([torch.empty_like(t) for t in tensors], buffers, scales=scales).wait()
    out["resumed bitwise"] = all(torch.equal(a, b) for a, b in zip(resumed, tensors))
    plain = comm.start_average(_small_and_mixed(rank), wire_dtype=torch.float16).wait()
    out["unscaled"] = _relative_errors(plain, exact)
    return out


def test_a_scaled_fp16_wire_keeps_fp16_precision_for_small_tensors():
    for result in run(scaled_fp16, 2):
        assert result["untouched before wait"] and result["one scale per non-empty tensor"] and result["bytes"]
        assert result["resumed bitwise"]
        assert max(result["scaled"]) < 1e-3, result["scaled"]  # fp16's precision (2^-11), whatever the magnitude
        assert result["unscaled"][0] > 4e-3, result["unscaled"]  # the plain cast: subnormals near 1e-5 / W


def test_a_scaled_fp16_wire_alone_and_on_the_meta_device():
    from host_reads import ForbidBlockingUploads, no_host_reads

    tensors = _small_and_mixed(0)
    pending = comm.start_average([t.clone() for t in tensors], wire_dtype=torch.float16, world_size=1, scaled=True)
    assert pending.works == [] and len(pending.scales) == 2
    assert max(_relative_errors(pending.wait(), [t.double() for t in tensors])) < 1e-3
    zeros = comm.start_average([torch.zeros(3), torch.tensor([float("inf"), 1.0])], wire_dtype=torch.float16,
                               world_size=1, scaled=True)
    assert zeros.scales[0].tolist() == [1.0, 1.0] and not bool(zeros.finite())  # all zero / not finite: scale 1
    # Largest magnitudes among fp32's subnormals (below 2^-126): the scale stops at 2^-126, so the wire
    # stays finite and a tensor of them keeps fp16's precision (its values / 2^-126 are normal fp16 numbers).
    tiny = [torch.tensor([3e-39, -1e-40, 2e-39]), torch.tensor([1e-45, 0.0]), torch.tensor([1.0, -2.0])]
    averaged = comm.start_average([t.clone() for t in tiny], wire_dtype=torch.float16, world_size=1, scaled=True)
    assert bool(averaged.finite()), averaged.buffers
    got = averaged.wait()
    assert max(_relative_errors(got[:1] + got[2:], [tiny[0].double(), tiny[2].double()])) < 1e-3
    assert float(got[1][0]) > 0 and float(got[1][1]) == 0.0  # the smallest subnormal survives as itself
    meta = [t.to("meta") for t in tensors]
    with no_host_reads(), ForbidBlockingUploads():  # lengths uploaded non-blocking, nothing read back
        comm.start_average(meta, wire_dtype=torch.float16, world_size=1, scaled=True).wait()
    with pytest.raises(ValueError, match="scaled=True needs wire_dtype=torch.float16"):
        comm.start_average(tensors, wire_dtype=torch.bfloat16, world_size=1, scaled=True)

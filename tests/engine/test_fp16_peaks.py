"""The fp16 wire's per-span peaks: on the CPU, long spans (gradients) take their largest |value| from one
``aminmax`` per span instead of ``_foreach_norm(inf)``; both must give the same numbers, NaN and infinities
included, since the peaks decide every scale on the wire."""


import pytest
import torch

from gradpress.powersgd.backend import CPU, DEVICE

LONG = CPU.SPAN_REDUCTIONS  # type: ignore[attr-defined]


def _spans(*values: torch.Tensor) -> list[torch.Tensor]:
    buffer = torch.cat([v.reshape(-1) for v in values])
    return list(buffer.split([v.numel() for v in values]))


def _peaks(views: list[torch.Tensor]) -> torch.Tensor:
    return CPU.peaks(views)


def _norms(views: list[torch.Tensor]) -> torch.Tensor:
    """The device backend's peaks: one ``_foreach_norm(inf)``."""
    return DEVICE.peaks(views)


def _cases() -> list[list[torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    big = [torch.randn(LONG + 7, generator=g) * m for m in (1e3, 1.0, 1e-8)]
    negative = torch.randn(LONG, generator=g).abs_().neg_()
    negative[17] = -7.5                                       # its largest |value| is a minimum
    with_nan, with_inf, with_minus_inf = (torch.randn(LONG, generator=g) for _ in range(3))
    with_nan[5], with_inf[9], with_minus_inf[11] = float("nan"), float("inf"), float("-inf")
    return [big, [negative, torch.zeros(LONG)], [with_nan, with_inf, with_minus_inf],
            [torch.randn(2 * LONG, generator=g), torch.randn(3, generator=g)]]   # one short span: mean still long


@pytest.mark.parametrize("case", range(4))
def test_the_cpu_peaks_of_long_spans_are_the_inf_norms(case: int) -> None:
    spans = _spans(*_cases()[case])
    assert sum(v.numel() for v in spans) >= LONG * len(spans)   # the aminmax branch
    got, want = _peaks(spans), _norms(spans)
    assert got.dtype == torch.float32
    assert torch.equal(got.isnan(), want.isnan())
    assert torch.equal(got.nan_to_num(0.0), want.nan_to_num(0.0))


def test_short_spans_keep_one_foreach_norm() -> None:
    spans = _spans(torch.randn(30), torch.randn(40).neg_(), torch.zeros(5))
    assert torch.equal(_peaks(spans), _norms(spans))


def test_the_aminmax_branch_is_taken_on_long_spans(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []
    monkeypatch.setattr(torch, "aminmax", lambda v: calls.append(v.numel()) or (v.amin(), v.amax()))
    _peaks(_spans(torch.randn(LONG), torch.randn(LONG)))
    assert calls == [LONG, LONG]
    calls.clear()
    _peaks(_spans(torch.randn(100)))
    assert calls == []

"""benchmarks/network: what can be checked without root or a network (CI has neither to spare)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks" / "network"))

import netns  # noqa: E402
import run  # noqa: E402


def test_rates_in_tc_spelling() -> None:
    assert netns.parse_rate("100mbit") == 1e8 and netns.parse_rate("1gbit") == 1e9 and netns.parse_rate("10Gbit") == 1e10
    with pytest.raises(ValueError, match="100mbit, 1gbit or 10gbit"):
        netns.parse_rate("fast")


def test_refuses_clearly_without_root(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(netns.os, "geteuid", lambda: 1000)
    with pytest.raises(netns.NetworkError, match="needs root"):
        netns.check_can_build()
    assert run.main(["--rates", "1gbit"]) == 2
    err = capsys.readouterr().err
    assert "needs root" in err and len(err.strip().splitlines()) == 1
    with pytest.raises(netns.NetworkError, match="needs root"):
        netns.Network(2, "1gbit").__enter__()


def test_floor_is_compute_plus_ring_allreduce_bytes_over_the_rate() -> None:
    # 2 ranks: a ring allreduce moves (2 (n-1) / n) x bytes = the bytes once; 125 MB at 1 Gbit/s is 1 s.
    assert run.floor_ms(45.0, 16.0, 125e6, 2, 1e9) == pytest.approx(45 + 16 + 1000)
    assert run.floor_ms(0.0, 0.0, 125e6, 4, 1e9) == pytest.approx(1500)


def test_markdown_reports_floor_and_ratio_per_cell() -> None:
    def cell(method: str, step: float, hook: float, blocked: float, nbytes: float) -> dict:
        parts = {"step": step, "forward": 1.0, "backward": 2.0, "optimizer": 3.0, "hook": hook, "blocked": blocked}
        return {"method": method, "workload": "shapes", "world_size": 2, "rate": "1gbit", "median_ms": parts,
                "mean_ms": parts, "bytes_per_step": nbytes}
    text = run.markdown([cell("noop", 50.0, 0.0, 0.0, 0.0), cell("allreduce", 450.0, 10.0, 0.0, 44.7e6),
                         cell("powersgd:2", 100.0, 30.0, 10.0, 0.3e6)])
    row = next(line for line in text.splitlines() if line.startswith("| powersgd:2 "))
    floor = 50 + 20 + 1000 * 0.3e6 * 8 / 1e9
    assert f"| {floor:.1f} | {100 / floor:.2f}x | {100 / 450:.2f}x |" in row


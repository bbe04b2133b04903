"""benchmarks/network: what can be checked without root or a network (CI has neither to spare)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks" / "network"))

import netns  # noqa: E402
import run  # noqa: E402


def test_rates_in_tc_spelling() -> None:
    assert netns.parse_rate("100mbit") == 1e8 and netns.parse_rate("1gbit") == 1e9
    assert netns.parse_rate("10Gbit") == 1e10
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
    assert f"| {floor:.1f} | {100 / floor:.2f}x | {100 / 450:.2f}x | 1 round |" in row
    rounds = cell("powersgd:2", 100.0, 30.0, 10.0, 0.3e6) | {"round_step_ms": [104.2, 97.0, 99.9]}
    assert run.markdown([rounds]).splitlines()[-1].endswith("| 97-104 (3) |")



def test_time_to_target_interpolates_between_evaluations_in_either_direction() -> None:
    import tta

    curve = [{"time_s": 0.0, "metric": 90.0}, {"time_s": 10.0, "metric": 8.0}, {"time_s": 20.0, "metric": 4.0}]
    assert tta.time_to_target(curve, 6.0, lower_is_better=True) == pytest.approx(15.0)
    assert tta.time_to_target(curve, 8.0, lower_is_better=True) == pytest.approx(10.0)
    assert tta.time_to_target(curve, 3.9, lower_is_better=True) is None
    accuracy = [{"time_s": 0.0, "metric": 0.1}, {"time_s": 4.0, "metric": 0.9}]
    assert tta.time_to_target(accuracy, 0.5, lower_is_better=False) == pytest.approx(2.0)
    assert tta.time_to_target(accuracy, 0.95, lower_is_better=False) is None


def test_time_to_accuracy_table_compares_with_allreduce_and_says_when_not_reached() -> None:
    import tta

    def row(method: str, label: str, times: list[float], metrics: list[float]) -> dict:
        return {"method": method, "label": label, "metric_name": "perplexity", "metric": metrics[-1],
                "time_per_step_s": 0.05, "bytes_per_step": 1000.0,
                "curve": [{"time_s": t, "metric": m} for t, m in zip(times, metrics)]}
    report = {"task": "charlm", "world_size": 2, "target": 5.0,
              "rates": {"100mbit": [row("allreduce", "allreduce", [0, 10, 20], [90, 6, 5]),
                                    row("powersgd:4", "powersgd r=4", [0, 4, 8], [90, 6, 5]),
                                    row("multi:4", "multi r=4", [0, 4, 8], [90, 7, 6])]}}
    lines = tta.markdown(report).splitlines()
    assert "charlm, 2 ranks, 100mbit, target perplexity <= 5:" in lines
    assert "| powersgd r=4 | 8.0 | 2.50x | 5.000 | 50.0 | 1.0 kB |" in lines
    assert "| multi r=4 | not reached | n/a | 6.000 | 50.0 | 1.0 kB |" in lines


def test_tta_refuses_clearly_without_root(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    import tta

    monkeypatch.setattr(netns.os, "geteuid", lambda: 1000)
    assert tta.main(["--target", "4.5"]) == 2
    assert "needs root" in capsys.readouterr().err


def test_ranks_of_one_node_share_its_namespace_and_address() -> None:
    net = netns.Network(4, "1gbit", ranks_per_node=2)
    assert [net.namespace(r) for r in range(4)] == ["gpnet-r0", "gpnet-r0", "gpnet-r1", "gpnet-r1"]
    assert [net.address(r) for r in range(4)] == ["10.77.0.1", "10.77.0.1", "10.77.0.2", "10.77.0.2"]
    assert net._shapers() == [("gpnet-r0", "eth0"), ("gpnet-r1", "eth0"), ("gpnet-br", "p0"), ("gpnet-br", "p1")]
    assert netns.Network(2, "1gbit").namespace(1) == "gpnet-r1"
    with pytest.raises(ValueError, match="ranks_per_node must be a positive divisor of world_size=4, got 3"):
        netns.Network(4, "1gbit", ranks_per_node=3)


def test_composed_time_to_target_is_warm_up_steps_plus_later_steps_at_the_short_runs_step_times() -> None:
    import tta

    def row(method: str, points: list[tuple[int, float, float]]) -> dict:
        return {"method": method, "label": method, "metric_name": "perplexity",
                "curve": [{"step": s, "time_s": t, "metric": m} for s, t, m in points]}
    # The full run: allreduce reaches 5.0 at step 30, powersgd at step 40 (interpolated), warm-up 10 steps.
    full = {"command": "tta.py --start-iter 10", "rates": {"1gbit": [
        row("allreduce", [(0, 0.0, 90.0), (20, 1.0, 7.0), (40, 2.0, 3.0)]),
        row("powersgd:4", [(0, 0.0, 90.0), (20, 1.0, 7.0), (40, 2.0, 5.0)])]}}
    # The short run (warm-up 2 steps): allreduce 1 s a step throughout; powersgd 1 s in its warm-up, then
    # 0.1 s (its first interval, 0.3 s a step, builds its state and is left out).
    short = {"task": "gpt-wide", "world_size": 2, "start_iter": 2, "rates": {"100mbit": [
        row("allreduce", [(0, 0.0, 90.0), (2, 2.0, 80.0), (4, 4.0, 70.0), (6, 6.0, 60.0)]),
        row("powersgd:4", [(0, 0.0, 90.0), (2, 2.0, 80.0), (4, 2.6, 70.0), (6, 2.8, 60.0), (8, 3.0, 50.0)])]}}
    lines = tta.composed_markdown(short, full, 5.0).splitlines()
    assert "| allreduce | 1000.0 | 1000.0 | 30.0 | 30.0 | 1.00x |" in lines
    # 10 warm-up steps at 1 s, then 30 steps at 0.1 s: 13 s.
    assert "| powersgd:4 | 1000.0 | 100.0 | 40.0 | 13.0 | 2.31x |" in lines
    with pytest.raises(ValueError, match="no evaluation at its warm-up's end"):
        tta.composed_markdown({**short, "start_iter": 3}, full, 5.0)

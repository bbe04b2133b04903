"""benchmarks/quality_study.py's pure functions: interpolation, steps to a target, the baseline and the table."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

_PATH = Path(__file__).resolve().parents[2] / "benchmarks" / "quality_study.py"
_SPEC = importlib.util.spec_from_file_location("quality_study", _PATH)
qs = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(qs)


def _curve(values: list[float], every: int = 40) -> list[dict]:
    return [{"step": every * i, "metric": v} for i, v in enumerate(values)]


def _run(label: str, method: str, lr: float, values: list[float], per_step: float, momentum: float = 0.9) -> dict:
    return {"label": label, "task": "charlm", "workers": 2, "steps": 80, "seed": 0, "start_iter": 8, "lr": lr,
            "momentum": momentum, "method": method, "options": {}, "curve": _curve(values), "final": values[-1],
            "bytes_per_step": per_step, "bytes_allreduce_per_step": 1000.0, "command": "x"}


def test_metric_at_interpolates_and_clamps() -> None:
    curve = _curve([10.0, 6.0, 4.0])
    assert qs.metric_at(curve, 40) == 6.0
    assert qs.metric_at(curve, 60) == pytest.approx(5.0)
    assert qs.metric_at(curve, 500) == 4.0


def test_steps_to_reach_first_crossing() -> None:
    curve = _curve([10.0, 6.0, 7.0, 4.0])
    assert qs.steps_to_reach(curve, 6.5) == pytest.approx(35.0)
    assert qs.steps_to_reach(curve, 5.0) == pytest.approx(80 + 40 * (7.0 - 5.0) / 3.0)
    assert qs.steps_to_reach(curve, 3.0) is None


def test_table_uses_the_best_allreduce_as_baseline() -> None:
    runs = [_run("ar-lr1", "allreduce", 1.0, [10.0, 6.0, 5.0], 1000.0),
            _run("ar-lr2", "allreduce", 2.0, [10.0, 5.0, 4.0], 1000.0),
            _run("psgd", "powersgd:4", 2.0, [10.0, 6.0, 4.06], 50.0)]
    text = qs.table(runs)
    assert "Baseline ar-lr2" in text
    row = next(line for line in text.splitlines() if line.startswith("| psgd "))
    # baseline mid (step 40) = 5.0, reached at 40; psgd reaches 5.0 at 40 + 40 * (6 - 5) / (6 - 4.06)
    assert f"| {(40 + 40 / 1.94) / 40:.3f} |" in row
    assert "| +1.50% |" in row and "| 20.00x |" in row
    # mean of the last 3 evaluations: (10 + 6 + 4.06) / (10 + 5 + 4) - 1
    assert f"| {100 * (20.06 / 19 - 1):+.2f}% |" in row
    # 8 warm-up steps of allreduce (1000 B), then 72 of 50 B
    assert row.endswith(f"| {80 * 1000 / (8 * 1000 + 72 * 50):.2f}x |")


def test_each_optimizer_and_batch_size_has_its_own_baseline() -> None:
    sgd = _run("sgd-ar", "allreduce", 1.0, [10.0, 5.0, 4.0], 1000.0)
    adamw = {**_run("adamw-ar", "allreduce", 3e-3, [10.0, 6.0, 5.0], 1000.0), "optimizer": "adamw", "batch": 32}
    adamw_psgd = {**_run("adamw-psgd", "powersgd:4", 3e-3, [10.0, 6.0, 5.05], 50.0), "optimizer": "adamw",
                  "batch": 32}
    text = qs.table([sgd, adamw, adamw_psgd])
    assert "Baseline sgd-ar" in text and "Baseline adamw-ar (charlm, 2 workers, adamw, lr 0.003)" in text
    row = next(line for line in text.splitlines() if line.startswith("| adamw-psgd "))
    assert "| adamw | 32 |" in row and "| +1.00% |" in row  # against the AdamW baseline, not SGD's 4.0

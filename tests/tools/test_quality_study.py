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


def test_a_gpu_run_is_compared_with_allreduce_on_its_own_device() -> None:
    """A GPU's kernels round differently: a run on cuda never takes the CPU's allreduce as its baseline, even
    one that ended lower, and records without a device (older runs) count as the CPU's."""
    cpu = _run("ar-cpu", "allreduce", 1.0, [10.0, 5.0, 3.0], 1000.0)
    gpu = {**_run("ar-gpu", "allreduce", 1.0, [10.0, 5.0, 4.0], 1000.0), "device": "cuda"}
    psgd = {**_run("psgd-gpu", "powersgd:4", 1.0, [10.0, 6.0, 4.04], 50.0), "device": "cuda"}
    text = qs.table([cpu, gpu, psgd])
    assert "Baseline ar-cpu (charlm, 2 workers, sgd" in text
    assert "Baseline ar-gpu (charlm, 2 workers, on cuda, sgd" in text
    row = next(line for line in text.splitlines() if line.startswith("| psgd-gpu "))
    assert "| +1.00% |" in row  # against 4.0 on its device, not the CPU's 3.0


def test_a_baseline_at_its_target_from_the_start_gives_no_steps_ratio() -> None:
    """A baseline whose first evaluation is already at its mid-run metric (a run too short to learn)
    reached it at step 0: the steps ratio is "-", not a division by zero."""
    text = qs.table([_run("ar", "allreduce", 1.0, [5.0, 5.0, 5.0], 1000.0),
                     _run("psgd", "powersgd:4", 1.0, [6.0, 5.5, 5.0], 50.0)])
    row = next(line for line in text.splitlines() if line.startswith("| psgd "))
    assert "| 5.50 | 5.00 | - | never | +0.00% |" in row  # smoothed, the run stays above 5.0


@pytest.mark.slow
def test_both_study_scripts_write_the_same_record(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """quality_study.py (gloo processes) and replica_study.py (threads) build their JSON with one function:
    the same fields, and on 2 workers of allreduce the same training; ``--table`` reads both."""
    import json
    import os
    import subprocess
    import sys

    common = ["--task", "charlm", "--steps", "6", "--start-iter", "2", "--evals", "2", "--methods", "allreduce",
              "--out", str(tmp_path)]
    env = os.environ | {"OMP_NUM_THREADS": "1"}
    bench = _PATH.parent
    for script, extra, label in (("quality_study.py", ["--workers", "2"], "processes"),
                                 ("replica_study.py", ["--replicas", "2"], "threads")):
        done = subprocess.run([sys.executable, str(bench / script), *common, *extra, "--label", label], env=env,
                              capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-2000:]
    processes = json.loads((tmp_path / "processes.json").read_text())
    threads = json.loads((tmp_path / "threads.json").read_text())
    assert set(threads) - set(processes) == {"replicas", "simulated", "elapsed_s"}
    assert processes["device"] == threads["device"] == "cpu"
    assert set(processes) <= set(threads)
    assert (threads["replicas"], threads["workers"], threads["simulated"]) == (2, 2, "threads")
    assert threads["config"] == processes["config"]
    assert threads["digest"] == processes["digest"]  # the same data order and initial weights
    assert [p["step"] for p in threads["curve"]] == [p["step"] for p in processes["curve"]]
    assert processes["ppl_end"] == processes["curve"][-1]["metric"]
    assert processes["bytes_per_step"] == processes["bytes_allreduce_per_step"] > 0
    assert qs.main(["--table", "--out", str(tmp_path)]) == 0  # in this process: it only reads the records
    printed = capsys.readouterr().out
    assert "processes" in printed and "threads" in printed


def test_forced_orthogonalization_reaches_the_steps_call(monkeypatch: pytest.MonkeyPatch) -> None:
    """``--orthogonalization cholesky`` makes the CPU step run the accelerator path's Cholesky-QR, through the
    engine's own option (no patching): the study's PowerSGD options carry it, and a step built from them
    calls the registry's Cholesky-QR, not Householder."""
    import torch

    from gradpress.comm import LocalCommunicator
    from gradpress.powersgd import EngineConfig, Segment, compress_step, linalg, make_plan

    options = qs.with_orthogonalization({"bytes_per_weight": 2}, "cholesky")
    assert options == {"bytes_per_weight": 2, "orthogonalization": "cholesky"}
    calls: list[str] = []
    for name in ("cholesky", "householder"):
        method = linalg.ORTHOGONALIZATIONS[name]
        monkeypatch.setitem(linalg.ORTHOGONALIZATIONS, name,
                            lambda groups, name=name, method=method: calls.append(name) or method(groups))
    for method in ("cholesky", "auto"):
        config = EngineConfig(rank=4, min_compression_rate=0, orthogonalization=method)
        segment = Segment(make_plan([(40, 12)], 4, 0), [0], torch.device("cpu"), torch.float32)
        task, _ = compress_step(segment, [torch.randn(40, 12)], LocalCommunicator(), config, 0)
        for _ in task:
            pass
    assert calls == ["cholesky", "householder"]  # "auto" on the CPU: Householder

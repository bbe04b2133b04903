"""``gradpress demo``: end to end on 2 local gloo workers, argument errors, and worker failures."""

from __future__ import annotations

import functools
import json
import multiprocessing as mp
import subprocess
import sys
from pathlib import Path

import pytest

import gradpress
from gradpress.cli import demo
from gradpress.cli.demo import WorkerFailure, run_workers
from gradpress.cli.main import main
from gradpress.workloads.digits import DemoConfig, make_model


def _demo_children() -> list:
    """The demo's worker processes still alive (other tests' persistent worker pools don't count)."""
    return [p for p in mp.active_children() if p.name.startswith("gradpress-demo")]


def _floats_sent_by_hand(shapes: list[tuple[int, ...]], rank: int, min_rate: float) -> int:
    """PowerSGD's per-step payload, from the rule itself: ``(n + m) r`` per compressed matrix."""
    total = 0
    for shape in shapes:
        numel = 1
        for size in shape:
            numel *= size
        if len(shape) < 2:
            total += numel
            continue
        n, m = shape[0], numel // shape[0]
        r = min(n, m, rank)
        total += (n + m) * r if (n + m) * r * min_rate < n * m else numel
    return total


def test_demo_runs_both_methods_and_reports_consistent_traffic(tmp_path: Path,
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "demo.json"
    code = main(["demo", "--workers", "2", "--steps", "12", "--start-iter", "4", "--rank", "2",
                 "--json", str(out)])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    assert "ranks agree" in captured.out
    assert "allreduce" in captured.out and "powersgd" in captured.out

    report = json.loads(out.read_text())
    methods = report["methods"]
    assert set(methods) == {"allreduce", "powersgd"}
    assert report["workers"] == 2 and report["config"]["steps"] == 12

    shapes = [tuple(p.shape) for p in make_model(DemoConfig(**report["config"])).parameters()]
    plan = gradpress.make_plan(shapes, 2, report["config"]["min_compression_rate"])
    allreduce, powersgd = methods["allreduce"], methods["powersgd"]
    assert allreduce["floats_per_step"] == plan.numel == sum(p.numel() for p in
                                                             make_model(DemoConfig()).parameters())
    assert powersgd["floats_per_step"] == plan.numel_sent == _floats_sent_by_hand(shapes, 2, 2.0)
    assert powersgd["floats_per_step"] < allreduce["floats_per_step"]
    assert powersgd["compression_rate"] == pytest.approx(plan.numel / plan.numel_sent)

    # PowerSGDState.compression_stats() counted exactly the plan's payload on each compressed step.
    assert powersgd["compressed_steps"] == 12 - 4
    assert powersgd["stats"]["numel_after"] == plan.numel_sent * 8
    assert powersgd["stats"]["numel_before"] == plan.numel * 8
    assert report["cross_check"]["ok"]

    assert report["ranks_agree"]
    for entry in methods.values():
        assert entry["ranks_agree"] and len(entry["checksums"]) == 2
        assert entry["checksums"][0] == entry["checksums"][1]
        assert 0.0 <= entry["test_accuracy"] <= 1.0 and entry["train_loss"] > 0
        assert entry["steps"] == 12


@pytest.mark.parametrize("option", ["--workers", "--steps", "--rank"])
def test_demo_rejects_values_below_one(option: str, capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["demo", option, "0"])
    err = capsys.readouterr().err
    assert code == 2
    assert option in err and ">= 1" in err
    assert len(err.strip().splitlines()) == 1


def test_demo_rejects_start_iter_not_below_steps(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["demo", "--steps", "5", "--start-iter", "5"]) == 2
    assert "--start-iter" in capsys.readouterr().err


def test_help_exits_zero(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--help"]) == 0
    assert "demo" in capsys.readouterr().out
    assert main(["demo", "--help"]) == 0
    assert "--workers" in capsys.readouterr().out
    assert main([]) == 2


def test_python_dash_m_gradpress() -> None:
    proc = subprocess.run([sys.executable, "-m", "gradpress", "demo", "--help"], capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "--workers" in proc.stdout


def test_worker_crash_stops_the_others_and_reports_the_traceback(monkeypatch: pytest.MonkeyPatch,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    # The demo builds its DemoConfig in the parent and ships it to the workers as a dict, so this makes
    # rank 1 raise at step 5 while rank 0 is inside a collective.
    monkeypatch.setattr(demo, "DemoConfig", functools.partial(DemoConfig, fail_at_step=5, fail_rank=1))
    code = main(["demo", "--steps", "30", "--start-iter", "4", "--timeout", "60"])
    err = capsys.readouterr().err
    assert code == 1
    assert "worker rank 1 failed during allreduce" in err
    assert "Traceback" in err and "injected failure on rank 1 at step 5" in err
    assert "stopped all workers" in err
    assert _demo_children() == []


def test_run_workers_raises_worker_failure() -> None:
    with pytest.raises(WorkerFailure, match="injected failure on rank 0 at step 6"):
        run_workers(DemoConfig(steps=10, start_iter=4, fail_at_step=6, fail_rank=0), 2, timeout=60,
                    methods=("powersgd",))
    assert _demo_children() == []

"""``gradpress bench``: presets, argument errors, the table, one real quick run; the benchmark scripts."""

from __future__ import annotations

import json
import math
import runpy
from pathlib import Path
from typing import Any

import pytest

import gradpress
from gradpress.bench import overhead
from gradpress.cli import bench
from gradpress.cli.main import main
from gradpress.zoo import build_model

ROOT = Path(__file__).resolve().parent.parent


def fake_result(model: str = "resnet18-cifar", rank: int = 1) -> dict[str, Any]:
    mib = 1 << 20
    return {"model": model, "rank": rank,
            "median_ms": {"allreduce": 2.0, "ours": 13.0, "torch_batched": 52.5, "torch": 36.25},
            "overhead_ms": {"ours": 11.0, "torch_batched": 50.5, "torch": 34.25},
            "ratio_ours_vs_torch_batched": 11.0 / 50.5, "ratio_ours_vs_torch": None,
            "memory": {"ours": {"total": 42.8 * mib}, "torch_batched": {"total": 43.25 * mib}}}


def test_table_formatting() -> None:
    header, rule, row = bench.format_results([fake_result()])
    assert header.split()[:3] == ["model", "r", "allreduce"] and set(rule) <= {"-", " "}
    assert row.split() == ["resnet18-cifar", "1", "2.0", "11.0", "50.5", "34.2", "0.22x", "n/a", "42.8", "/", "43.2"]


@pytest.fixture
def recorded(monkeypatch) -> list[dict[str, Any]]:
    """Replace the measurement with a recorder that returns fake results."""
    calls: list[dict[str, Any]] = []

    def fake_run(**kwargs: Any) -> dict[str, Any]:
        calls.append(kwargs)
        results = [fake_result(m, r) for m in kwargs["models"] for r in kwargs["ranks"]]
        return {"results": results, "total_seconds": 1.0, "environment": {"num_threads": 2},
                "command": kwargs["command"]}

    monkeypatch.setattr(overhead, "run_benchmark", fake_run)
    return calls


@pytest.mark.parametrize("argv, expected", [
    ([], bench.PRESETS["quick"]),
    (["--quick"], bench.PRESETS["quick"]),
    (["--full"], bench.PRESETS["full"]),
    (["--full", "--ranks", "2,2,8", "--models", "resnet18,gpt2"],
     {**bench.PRESETS["full"], "ranks": [2, 8], "models": ["resnet18", "gpt2"]}),
    (["--rounds", "2", "--block", "1", "--warmup", "0"],
     {**bench.PRESETS["quick"], "rounds": 2, "block": 1, "warmup": 0}),
])
def test_presets_and_overrides(capsys, recorded, argv: list[str], expected: dict[str, Any]) -> None:
    assert main(["bench", *argv]) == 0
    (call,) = recorded
    assert {k: call[k] for k in expected} == expected and call["threads"] is None
    out = capsys.readouterr().out
    rows = [line.split()[:2] for line in out.splitlines()[2:] if line.strip()][:len(expected["models"]) * len(
        expected["ranks"])]
    assert rows == [[m, str(r)] for m in expected["models"] for r in expected["ranks"]]
    # The recorded command reproduces the settings.
    assert main(call["command"].split()[1:]) == 0 and recorded[1] == call


def test_json_output(capsys, recorded, tmp_path: Path) -> None:
    path = tmp_path / "bench.json"
    assert main(["bench", "--threads", "1", "--json", str(path)]) == 0
    assert json.loads(path.read_text())["results"][0]["overhead_ms"]["ours"] == 11.0
    assert recorded[0]["threads"] == 1
    assert main(["bench", "--json", str(tmp_path)]) == 1  # a folder: cannot write
    assert "gradpress bench: error: --json" in capsys.readouterr().err


@pytest.mark.parametrize("argv, message", [
    (["--models", "resnet19"], "argument --models: unknown model 'resnet19'; choose from resnet18, resnet50, "
                               "resnet18-cifar, gpt2, lstm-wikitext2"),
    (["--ranks", "0"], "argument --ranks: must be integers >= 1"),
    (["--rounds", "0"], "argument --rounds: must be an integer >= 1, got 0"),
    (["--warmup", "-1"], "argument --warmup: must be an integer >= 0"),
    (["--quick", "--full"], "argument --full: not allowed with argument --quick"),
])
def test_bad_arguments(capsys, recorded, argv: list[str], message: str) -> None:
    assert main(["bench", *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1 and not recorded


def test_quick_run_measures_all_hooks(capsys, tmp_path: Path) -> None:
    """The real thing, smallest settings (about 10 s on 2 cores): worker processes via ``python -m``."""
    path = tmp_path / "bench.json"
    assert main(["bench", "--block", "2", "--warmup", "1", "--json", str(path)]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[2].split()[:2] == ["resnet18-cifar", "1"]
    (result,) = json.loads(path.read_text())["results"]
    assert result["steps"] == {"allreduce": 6, "ours": 2, "torch_batched": 2, "torch": 2}  # 3 workers x 2
    assert all(math.isfinite(v) and v > 0 for v in result["median_ms"].values())
    plan = gradpress.make_plan([p.shape for p in build_model("resnet18-cifar").parameters()], 1, 2)
    assert result["compression_rate"] == pytest.approx(plan.compression_rate)
    assert result["memory"]["ours"]["total"] <= result["memory"]["target_bytes"]


def test_scripts_still_work(capsys) -> None:
    floats = runpy.run_path(str(ROOT / "benchmarks" / "floats.py"), run_name="floats")
    assert floats["main"](["--models", "resnet18,gpt2", "--ranks", "1", "--iters", "1"]) == 0
    out = capsys.readouterr().out
    assert "| resnet18 | 1 | 11,173,962 | 45,935 (243x) |" in out and "| gpt2 | 1 | 124,439,808 |" in out
    script = runpy.run_path(str(ROOT / "benchmarks" / "overhead.py"), run_name="overhead")
    assert script["main"] is overhead.main and script["make_buckets"] is overhead.make_buckets
    with pytest.raises(SystemExit) as exc:
        script["main"](["--help"], prog="python benchmarks/overhead.py")
    assert exc.value.code == 0 and "--isolate" in capsys.readouterr().out

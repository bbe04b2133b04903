"""``gradpress bench``: presets, argument errors, the table, one real quick run; the benchmark scripts."""

from __future__ import annotations

import json
import math
import runpy
from pathlib import Path
from typing import Any

import pytest

import gradpress
from gradpress.tools.bench import overhead, summary
from gradpress.tools.cli import bench
from gradpress.tools.cli.main import main
from gradpress.tools.zoo import build_model

ROOT = Path(__file__).resolve().parents[2]


def stats(median: float | None, q1: float = 0.0, q3: float = 0.0) -> dict[str, Any]:
    return {"values": [], "median": median, "iqr": None if median is None else [q1, q3]}


def fake_result(model: str = "resnet18-cifar", rank: int = 1, rounds: int = 8,
                ours_iqr: tuple[float, float] = (10.5, 11.75)) -> dict[str, Any]:
    mib = 1 << 20
    return {"model": model, "rank": rank, "steps": {"ours": 3 * rounds},
            "median_ms": {"allreduce": 2.0, "ours": 13.0, "torch_batched": 52.5, "torch": 36.25},
            "overhead_ms": {"ours": 11.0, "torch_batched": 50.5, "torch": 34.25},
            "ratio_ours_vs_torch_batched": 11.0 / 50.5, "ratio_ours_vs_torch": None,
            "by_round": {"count": rounds,
                         "step_ms": {"allreduce": stats(2.0, 1.9, 2.25), "ours": stats(13.0, 12.5, 13.5),
                                     "torch_batched": stats(52.5, 50.0, 55.0), "torch": stats(36.25, 35.0, 38.0)},
                         "overhead_ms": {"ours": stats(11.0, *ours_iqr), "torch_batched": stats(50.5, 48.0, 53.0),
                                         "torch": stats(34.25, 33.0, 36.0)},
                         "ratio_ours_vs": {"torch_batched": stats(11.0 / 50.5, 0.2, 0.235), "torch": stats(None)}},
            "memory": {"ours": {"total": 42.8 * mib}, "torch_batched": {"total": 43.25 * mib}}}


def test_table_formatting() -> None:
    """Every time and ratio comes with its spread over rounds: median [q1, q3]."""
    header, rule, row = bench.format_results([fake_result()])
    assert header.split()[:3] == ["model", "r", "allreduce"] and set(rule) <= {"-", " "}
    assert row.split() == ["resnet18-cifar", "1", "2.0", "[1.9,", "2.2]", "11.0", "[10.5,", "11.8]", "50.5",
                           "[48.0,", "53.0]", "34.2", "[33.0,", "36.0]", "0.22x", "[0.20,", "0.23]", "n/a", "42.8",
                           "/", "43.2"]


def test_iqr() -> None:
    assert summary.iqr([]) is None and summary.iqr([3.0]) == [3.0, 3.0]
    assert summary.iqr([1.0, 2.0, 3.0, 4.0, 5.0]) == [2.0, 4.0]
    assert summary.iqr([4.0, 1.0, 3.0, 2.0]) == [1.75, 3.25]


def fake_part(rounds_ms: dict[str, list[list[float]]], round_offset: int = 0) -> dict[str, Any]:
    """A :func:`gradpress.tools.bench.harness.measure` result with the given timings (ms) and nothing measured."""
    return {"model": "m", "rank": 1, "params": 100, "buckets": [60, 40], "round_offset": round_offset,
            "rounds_ms": rounds_ms, "times_ms": {name: [t for block in blocks for t in block]
                                                 for name, blocks in rounds_ms.items()},
            "state_bytes": {}, "plan": {"sent": 10, "p": 4, "q": 6}}


def test_summarize_spread_over_rounds_in_one_worker() -> None:
    """One worker, all hooks interleaved: each round's overhead against that round's allreduce."""
    ar = [[1.0, 1.0], [2.0, 2.0], [1.0, 1.0]]
    part = fake_part({"allreduce": ar, "ours": [[11.0, 13.0], [12.0, 14.0], [31.0, 31.0]],
                      "torch_batched": [[41.0, 41.0], [42.0, 42.0], [41.0, 41.0]],
                      "torch": [[21.0, 21.0], [22.0, 22.0], [41.0, 41.0]]})
    r = summary.summarize([part])
    assert r["steps"] == {"allreduce": 6, "ours": 6, "torch_batched": 6, "torch": 6}
    assert r["overhead_ms"]["ours"] == pytest.approx(13.5 - 1.0)  # pooled medians, as before
    by_round = r["by_round"]
    assert by_round["count"] == 3
    assert by_round["step_ms"]["allreduce"] == {"values": [1.0, 2.0, 1.0], "median": 1.0, "iqr": [1.0, 1.5]}
    assert by_round["overhead_ms"] == {
        "ours": {"values": [11.0, 11.0, 30.0], "median": 11.0, "iqr": [11.0, 20.5]},
        "torch_batched": {"values": [40.0, 40.0, 40.0], "median": 40.0, "iqr": [40.0, 40.0]},
        "torch": {"values": [20.0, 20.0, 40.0], "median": 20.0, "iqr": [20.0, 30.0]}}
    ratios = by_round["ratio_ours_vs"]
    assert ratios["torch_batched"]["values"] == pytest.approx([0.275, 0.275, 0.75])
    assert ratios["torch_batched"]["iqr"] == pytest.approx([0.275, 0.5125])
    assert ratios["torch"]["median"] == pytest.approx(0.55) and ratios["torch"]["iqr"] == pytest.approx([0.55, 0.65])


def test_summarize_pairs_isolated_workers_by_round() -> None:
    """--isolate: one worker per hook and round; a round's ratio pairs workers of the same round."""
    parts = [fake_part({"allreduce": [[1.0]], name: [[1.0 + ms]]}, round_offset=k)
             for k, overheads in enumerate([(10.0, 40.0, 20.0), (12.0, 30.0, -1.0)])
             for name, ms in zip(summary.COMPARED, overheads)]
    by_round = summary.summarize(parts)["by_round"]
    assert by_round["count"] == 2
    assert {name: s["values"] for name, s in by_round["overhead_ms"].items()} == {
        "ours": [10.0, 12.0], "torch_batched": [40.0, 30.0], "torch": [20.0, -1.0]}
    assert by_round["ratio_ours_vs"]["torch_batched"]["values"] == pytest.approx([0.25, 0.4])
    assert by_round["ratio_ours_vs"]["torch"]["values"] == [0.5]  # no ratio to a negative overhead


@pytest.mark.parametrize("load, cores, threads, results, expected", [
    (0.5, 2, 1, [fake_result()], []),
    (None, 2, 1, [fake_result()], []),  # no load average on this OS: not a reason by itself
    (2.5, 2, 1, [fake_result()], ["the 1-minute load average (2.5) is above the 2 usable cores"]),
    (2.0, 2, 2, [fake_result()], []),  # at the core count: not above it
    (0.5, 2, 4, [fake_result()], ["4 intra-op threads on 2 usable cores"]),
    (0.5, 2, 1, [fake_result(rounds=2)], ["resnet18-cifar r=1: 2 round(s), too few for a spread"]),
    # ours' quartiles 11 ms apart; torch's overhead is 23.25 ms above ours: fine; the batched one too.
    (0.5, 2, 1, [fake_result(ours_iqr=(5.0, 16.0))], []),
    # 24 ms apart: wider than ours vs torch (23.25 ms), not than ours vs torch batched (39.5 ms).
    (0.5, 2, 1, [fake_result(ours_iqr=(0.0, 24.0))],
     ["resnet18-cifar r=1: the spread of the overheads over rounds (24.0 ms, the wider interquartile range) "
      "is not below the difference between ours and torch (23.2 ms)"]),
    (3.0, 1, 2, [fake_result(), fake_result("resnet50", 4, rounds=1)],
     ["load average (3.0) is above the 1 usable cores", "2 intra-op threads on 1 usable cores",
      "resnet50 r=4: 1 round(s)"]),
])
def test_trust_warnings(load: float | None, cores: int, threads: int, results: list[dict[str, Any]],
                        expected: list[str]) -> None:
    """Fabricated loads, threads and timings; no clock involved."""
    warnings = summary.trust_warnings(results, load, cores, threads)
    assert len(warnings) == len(expected) and all(e in w for e, w in zip(expected, warnings))


@pytest.fixture
def recorded(monkeypatch) -> list[dict[str, Any]]:
    """Replace the measurement with a recorder that returns fake results."""
    calls: list[dict[str, Any]] = []

    def fake_run(**kwargs: Any) -> dict[str, Any]:
        calls.append(kwargs)
        results = [fake_result(m, r, kwargs["rounds"]) for m in kwargs["models"] for r in kwargs["ranks"]]
        warnings = summary.trust_warnings(results, 0.5, 2, kwargs["threads"])
        return {"results": results, "total_seconds": 1.0, "environment": {"num_threads": kwargs["threads"]},
                "command": kwargs["command"],
                "trust": {"trusted": not warnings, "warnings": warnings, "cores": 2, "threads": kwargs["threads"],
                          "load_avg_1min": {"start": 0.5, "end": 0.25}}}

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
    (["--threads", "2", "--isolate"], {**bench.PRESETS["quick"], "threads": 2, "isolate": True}),
    (["--full", "--no-isolate"], bench.PRESETS["full"]),
])
def test_presets_and_overrides(capsys, recorded, argv: list[str], expected: dict[str, Any]) -> None:
    assert main(["bench", *argv]) == 0
    (call,) = recorded
    assert {k: call[k] for k in expected} == expected
    out = capsys.readouterr().out
    rows = [line.split()[:2] for line in out.splitlines()[2:] if line.strip()][:len(expected["models"]) * len(
        expected["ranks"])]
    assert rows == [[m, str(r)] for m in expected["models"] for r in expected["ranks"]]
    # The recorded command reproduces the settings.
    assert main(call["command"].split()[1:]) == 0 and recorded[1] == call


def test_presets_are_trustworthy_by_construction() -> None:
    """One intra-op thread (no OpenMP fork/join to wait on), all hooks in one worker, enough rounds for a
    spread."""
    for preset in bench.PRESETS.values():
        assert preset["threads"] == 1 and preset["isolate"] is False
        assert preset["rounds"] >= summary.MIN_ROUNDS_FOR_SPREAD and preset["rounds"] * preset["block"] >= 15


def test_summary_and_untrusted_warning(capsys, recorded) -> None:
    assert main(["bench"]) == 0
    out = capsys.readouterr().out
    assert "median [first quartile, third quartile] over 8 rounds; 24 timed steps per hook" in out
    assert "1 intra-op thread(s), 2 cores, 1-minute load 0.5 -> 0.2" in out and "WARNING" not in out
    assert "s in all (1 s measuring)" in out
    assert main(["bench", "--threads", "4", "--rounds", "2"]) == 0
    warnings = [line for line in capsys.readouterr().out.splitlines() if line.startswith("WARNING")]
    assert warnings == ["WARNING: this result cannot be trusted: 4 intra-op threads on 2 usable cores: OpenMP "
                        "fork/joins wait for threads that are not running (use --threads 1)",
                        "WARNING: this result cannot be trusted: resnet18-cifar r=1: 2 round(s), too few for a "
                        "spread (use --rounds 3 or more)"]


def test_json_output(capsys, recorded, tmp_path: Path) -> None:
    path = tmp_path / "bench.json"
    assert main(["bench", "--threads", "3", "--json", str(path)]) == 0
    report = json.loads(path.read_text())
    assert report["results"][0]["overhead_ms"]["ours"] == 11.0
    assert report["results"][0]["by_round"]["overhead_ms"]["ours"]["iqr"] == [10.5, 11.75]
    assert report["trust"]["trusted"] is False and "3 intra-op threads" in report["trust"]["warnings"][0]
    assert report["command_seconds"] > 0
    assert recorded[0]["threads"] == 3
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


@pytest.mark.slow
def test_quick_run_measures_all_hooks(capsys, tmp_path: Path) -> None:
    """The real thing, small settings (about 6 s on 2 cores): one worker process via ``python -m``."""
    path = tmp_path / "bench.json"
    assert main(["bench", "--rounds", "3", "--block", "1", "--warmup", "0", "--json", str(path)]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[2].split()[:2] == ["resnet18-cifar", "1"]
    report = json.loads(path.read_text())
    (result,) = report["results"]
    assert result["steps"] == {"allreduce": 3, "ours": 3, "torch_batched": 3, "torch": 3}  # 3 rounds x 1
    assert result["by_round"]["count"] == 3
    for stats_ in result["by_round"]["overhead_ms"].values():
        assert len(stats_["values"]) == 3 and stats_["iqr"][0] <= stats_["median"] <= stats_["iqr"][1]
    assert report["trust"]["threads"] == 1 and report["environment"]["num_threads"] == 1
    assert report["trust"]["trusted"] == (not report["trust"]["warnings"])
    assert all(math.isfinite(v) and v > 0 for v in result["median_ms"].values())
    plan = gradpress.make_plan([p.shape for p in build_model("resnet18-cifar").parameters()], 1, 2)
    assert result["compression_rate"] == pytest.approx(plan.compression_rate)
    # The state holds the M = g + e buffer beside the error memory (design.md, "One step"): the rest stays
    # within the target of gradients + P + Q + one bucket.
    ours = result["memory"]["ours"]
    assert ours["m_buffer"] == ours["error_memory"] > 0
    assert ours["total"] - ours["m_buffer"] <= result["memory"]["target_bytes"]


def test_scripts_still_work(capsys) -> None:
    floats = runpy.run_path(str(ROOT / "benchmarks" / "floats.py"), run_name="floats")
    assert floats["main"](["--models", "resnet18,gpt2", "--ranks", "1", "--iters", "1"]) == 0
    out = capsys.readouterr().out
    assert "| resnet18 | 1 | 11,173,962 | 45,935 (243x) |" in out and "| gpt2 | 1 | 124,439,808 |" in out
    script = runpy.run_path(str(ROOT / "benchmarks" / "overhead.py"), run_name="overhead")
    assert script["main"] is overhead.main
    with pytest.raises(SystemExit) as exc:
        script["main"](["--help"], prog="python benchmarks/overhead.py")
    assert exc.value.code == 0 and "--isolate" in capsys.readouterr().out


def test_the_users_own_model_is_accepted_as_by_inspect(capsys, recorded) -> None:
    assert main(["bench", "--models", "user_models:two_layer,resnet18"]) == 0
    assert recorded[0]["models"] == ["user_models:two_layer", "resnet18"]
    for model, message in [("user_models:missing", "module 'user_models' has no attribute 'missing'"),
                           ("user_models:not_a_module", "not a torch.nn.Module"),
                           ("no_such_module_xyz:build", "cannot import module 'no_such_module_xyz'")]:
        assert main(["bench", "--models", model]) == 2
        err = capsys.readouterr().err
        assert f"argument --models: model {model!r}" in err or message in err
        assert message in err and err.count("\n") == 1
    assert len(recorded) == 1


@pytest.mark.slow
def test_a_user_model_is_measured(capsys, tmp_path: Path) -> None:
    path = tmp_path / "bench.json"
    assert main(["bench", "--models", "user_models:two_layer", "--rounds", "3", "--block", "1", "--warmup", "0",
                 "--json", str(path)]) == 0
    (result,) = json.loads(path.read_text())["results"]
    assert result["model"] == "user_models:two_layer"
    plan = gradpress.make_plan([p.shape for p in build_model("user_models:two_layer").parameters()], 1, 2)
    assert result["compression_rate"] == pytest.approx(plan.compression_rate)

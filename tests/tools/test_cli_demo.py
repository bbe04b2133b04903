"""``gradpress demo``: end to end on 2 local gloo workers, argument errors, and worker failures."""

from __future__ import annotations

import functools
import io
import json
import math
import multiprocessing as mp
import os
import subprocess
import sys
import threading
import time
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any, Callable

import pytest

import gradpress
import models
from gradpress.tools.cli import demo
from gradpress.tools.cli.demo import WorkerFailure, run_workers
from gradpress.tools.cli.demo.plot import make_figure
from gradpress.tools.cli.demo.failures import WorkerError, failure_report, is_peer_loss
from gradpress.tools.cli.demo import supervisor
from gradpress.tools.cli.demo.supervisor import Ledger, StepReporter, supervise
from gradpress.comm import CollectiveError
from gradpress.tools.cli.main import build_parser, main
from gradpress.tools.workloads import DemoConfig, default_start_iter, get_task, parse_methods
from gradpress.tools.workloads.methods import SPARSELOCO


def _demo_children() -> list:
    """The demo's worker processes still alive (other tests' persistent worker pools don't count)."""
    return [p for p in mp.active_children() if p.name.startswith("gradpress-demo")]


def _floats_sent_by_hand(shapes: list[tuple[int, ...]], rank: int, min_rate: float) -> int:
    """PowerSGD's per-step payload, from the rule itself: ``(n + m) r`` per compressed matrix."""
    return models.floats_sent_by_hand(shapes, rank, min_rate)


@pytest.mark.slow
def test_demo_end_to_end_writes_three_files_consistent_with_the_plan(tmp_path: Path,
                                                                     capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "out"
    code = main(["demo", "--workers", "2", "--steps", "12", "--start-iter", "4",
                 "--methods", "allreduce,fp16,powersgd:2,multi:2,localsgd:4", "--out", str(out),
                 "--bandwidth", "100mbit"])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    assert sorted(p.name for p in out.iterdir()) == ["demo.json", "demo.md", "demo.png"]
    assert (out / "demo.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "ranks agree" in captured.out and f"to {out}/" in captured.out
    assert "MODELLED" in captured.out

    report = json.loads((out / "demo.json").read_text())
    methods = report["methods"]
    assert list(methods) == ["allreduce", "fp16", "powersgd:2", "multi:2", "localsgd:4"]
    assert report["workers"] == 2 and report["config"]["steps"] == 12 and report["task"] == "digits"
    assert report["command"] == ("gradpress demo --workers 2 --steps 12 --start-iter 4 --methods "
                                 f"allreduce,fp16,powersgd:2,multi:2,localsgd:4 --out {out} --bandwidth 100mbit")
    md = (out / "demo.md").read_text()
    assert all(m["label"] in md for m in methods.values()) and "demo.png" in md

    shapes = [tuple(p.shape) for p in get_task("digits").model(0).parameters()]
    plan = gradpress.make_plan(shapes, 2, report["config"]["min_compression_rate"])
    numel = sum(math.prod(s) for s in shapes)
    allreduce, fp16, powersgd, multi, localsgd = methods.values()
    assert allreduce["bytes_per_step"] == 4 * numel == 4 * plan.numel
    assert fp16["bytes_per_step"] * 2 == allreduce["bytes_per_step"]
    assert powersgd["bytes_per_step"] == 4 * _floats_sent_by_hand(shapes, 2, 2.0) == 4 * plan.numel_sent
    # The bytes ratio is the plan's compression ratio.
    assert allreduce["bytes_per_step"] / powersgd["bytes_per_step"] == pytest.approx(plan.compression_rate)
    assert powersgd["compression_ratio"] == pytest.approx(plan.compression_rate)
    # Multi-iteration sends one factor per step: half of classic on the compressed matrices.
    compressed_half = (plan.p_numel + plan.q_numel) / 2
    assert multi["bytes_per_step"] == pytest.approx(4 * (plan.uncompressed_numel + compressed_half))
    # Totals: plain steps before start_iter, then compressed ones; PowerSGDState counted the same bytes.
    assert powersgd["bytes_total"] == 4 * (4 * numel + 8 * plan.numel_sent)
    assert powersgd["counted"]["bytes_after"] == 8 * 4 * plan.numel_sent and powersgd["counted"]["ok"]
    assert multi["counted"]["ok"] and report["bytes_check_ok"]
    # Local SGD: 4 synchronous steps, averages at steps 5 and 9, and a final one so that ranks agree.
    assert localsgd["synchronizations"] == 4 + 2 + 1 and allreduce["synchronizations"] == 12
    assert localsgd["bytes_total"] == 7 * 4 * numel and localsgd["compression_ratio"] == 4
    assert localsgd["counted"] == {"averages": 2, "bytes_averaged": 2 * 4 * numel, "link_bytes": 2 * 4 * numel,
                                   "ok": True}  # on 2 workers an allreduce's link carries 2 (2 - 1) / 2 = 1 payload
    # Totals over the whole run, warm-up included, and what the run saved against allreduce.
    assert [m["bytes_warm_up"] for m in methods.values()] == [4 * 4 * numel, 4 * 2 * numel] + [4 * 4 * numel] * 3
    for entry in methods.values():
        assert entry["total_ratio"] == pytest.approx(allreduce["bytes_total"] / entry["bytes_total"])
    assert powersgd["total_ratio"] < powersgd["compression_ratio"] / 2  # the warm-up weighs on a short run
    header = next(line for line in captured.out.splitlines() if line.startswith("method "))
    assert "total MB" in header and "total ratio" in header
    assert f"{powersgd['bytes_total'] / 1e6:.3g}" in next(line for line in captured.out.splitlines()
                                                         if line.startswith("powersgd r=2 "))
    _check_figure(report)
    for entry in methods.values():
        assert entry["ranks_agree"] and len(set(entry["checksums"])) == 1
        assert 0.0 <= entry["metric"] <= 1.0 and entry["test_loss"] > 0 and entry["steps"] == 12
        assert entry["curve"][-1]["bytes"] == entry["bytes_total"] and entry["curve"][-1]["step"] == 12
        times = [point["time_s"] for point in entry["curve"]]  # rank 0's training time: time-to-accuracy
        assert times[0] == 0.0 and times == sorted(times) and 0 < times[-1] <= entry["wall_time_s"] + 1e-9
        ring = 2 * (2 - 1) / 2
        assert entry["modelled_time_s"] == pytest.approx(entry["wall_time_s"] + ring * entry["bytes_total"] / 12.5e6)


@pytest.mark.slow
def test_demo_streaming_and_compressed_diloco_methods_send_what_the_formulas_say(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The streaming and compressed-outer-gradient demo methods: bytes from the payload formulas (written out
    here), counted by the averager."""
    out = tmp_path / "out"
    code = main(["demo", "--workers", "2", "--steps", "20", "--start-iter", "4", "--methods",
                 "streaming:4,diloco-int8:4,diloco-int4:4,sparseloco:4", "--out", str(out)])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    methods = json.loads((out / "demo.json").read_text())["methods"]
    shapes = [tuple(p.shape) for p in get_task("digits").model(0).parameters()]
    numel = sum(math.prod(s) for s in shapes)
    warm_up = 4 * 4 * numel
    chunks = lambda size: -(-numel // size)  # noqa: E731
    int8 = numel + 4 * chunks(1024)
    int4 = (numel + 1) // 2 + 4 * chunks(1024)
    k = round(SPARSELOCO["density"] * 4096)
    topk = -(-chunks(4096) * k // 4) + 4 * chunks(4096) + 2 * chunks(4096) * k  # 2-bit codes, scales, int16 indices
    # One fragment, H=4 after 4 synchronous steps: the anchor is broadcast at the last of them (fp32,
    # every parameter), every sync at steps 5, 9, 13, 17 is an outer step with a compressed payload, and
    # the run ends on a final plain average (step 20 is no sync step).
    anchor = 4 * numel
    for spec, payload in [("diloco-int8:4", int8), ("diloco-int4:4", int4), ("sparseloco:4", topk)]:
        entry = methods[spec]
        assert entry["bytes_per_step"] == pytest.approx(payload / 4), spec
        assert entry["bytes_total"] == warm_up + anchor + 4 * payload + 4 * numel, spec
        # On 2 workers each rank's link carries what it hands over: an all-gather's (W - 1) = 1 payload,
        # the allreduces' 2 (W - 1) / W = 1, the anchor's broadcast once.
        assert entry["counted"] == {"averages": 4, "bytes_averaged": anchor + 4 * payload,
                                    "link_bytes": anchor + 4 * payload, "ok": True}, spec
        assert entry["link_bytes_per_step"] == pytest.approx(payload / 4), spec
        assert entry["link_bytes_total"] == entry["bytes_total"], spec
        assert entry["ranks_agree"]
    # Streaming: 4 fragments, one sent at every step after warm-up, each parameter once per 4 steps.
    streaming = methods["streaming:4"]
    assert streaming["bytes_per_step"] == numel  # 4 numel bytes per period of 4 steps
    assert streaming["bytes_total"] == warm_up + anchor + 4 * 4 * numel + 4 * numel
    assert streaming["counted"]["ok"] and streaming["ranks_agree"]


def _check_figure(report: dict) -> None:
    """What a person needs to read the plot without the README."""
    fig = make_figure(report)
    fig.canvas.draw()
    axes = fig.axes
    # The dotted warm-up line is in the legend, with what it means.
    start = report["config"]["start_iter"]
    legend = [t.get_text() for t in axes[0].get_legend().get_texts()]
    assert f"step {start}: warm-up ends, compression / local steps start" in legend
    # Methods with equal curves (allreduce, fp16) are drawn differently (and the warm-up line too).
    styles = {line.get_label(): (line.get_linestyle(), line.get_marker()) for line in axes[0].get_lines()}
    assert len(set(styles.values())) == len(styles)
    # The bytes panels start after the warm-up, so compressed methods are not squeezed by it.
    for entry in report["methods"].values():
        (line,) = [ln for ln in axes[1].get_lines() if ln.get_label() == entry["label"]]
        assert max(line.get_xdata()) == pytest.approx((entry["bytes_total"] - entry["bytes_warm_up"]) / 1e6)
        assert min(line.get_xdata()) > 0
    # Log axes carry no minor tick labels (they overlapped on the perplexity axis).
    for ax in axes:
        for axis in (ax.xaxis, ax.yaxis):
            if axis.get_scale() == "log":
                assert all(t.get_text() == "" for t in axis.get_minorticklabels())
    import matplotlib.pyplot as plt
    plt.close(fig)


@pytest.mark.slow
def test_demo_char_language_model_task(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["demo", "--task", "charlm", "--workers", "2", "--steps", "4", "--start-iter", "2",
                 "--methods", "powersgd:1", "--out", str(tmp_path)])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    report = json.loads((tmp_path / "demo.json").read_text())
    entry = report["methods"]["powersgd:1"]
    assert report["metric_name"] == "perplexity" and "test ppl" in captured.out
    # The measured recipe's lr and fp16 wire (the rank is the command's): said in the header, counted in bytes.
    assert report["lr"] == 2.0 and report["config"]["powersgd_options"] == {"bytes_per_weight": 2}
    assert "SGD lr 2 momentum 0.9, seed 0; the measured recipe (docs/tuning.md): lr 2 for every method, " \
           "PowerSGD with an fp16 wire" in captured.out
    plan = gradpress.make_plan([p.shape for p in get_task("charlm").model(0).parameters()], 1, 2.0)
    assert entry["bytes_per_step"] == 2 * plan.numel_sent and entry["counted"]["bytes_after"] == 2 * 2 * plan.numel_sent
    # Perplexity is exp(mean held-out cross-entropy) and starts near the vocabulary size.
    assert entry["metric"] == pytest.approx(math.exp(entry["test_loss"]))
    assert entry["curve"][0]["metric"] > 50 and entry["metric"] < entry["curve"][0]["metric"]
    assert entry["counted"]["ok"] and entry["ranks_agree"]
    _check_figure(report)  # a log perplexity axis


@pytest.mark.parametrize("argv, words", [
    (["--task", "mnist"], ["unknown task 'mnist'", "digits", "charlm"]),
    (["--methods", "allreduce,topk"], ["unknown method 'topk'", "allreduce", "fp16", "powersgd", "multi"]),
    (["--methods", "fp16:2"], ["takes no rank"]),
    (["--methods", "powersgd:0"], ["integer >= 1"]),
    (["--rank", "0"], ["--rank", ">= 1"]),
    (["--bandwidth", "fast"], ["--bandwidth", "1gbit"]),
    (["--warm-up-beta", "1.5"], ["--warm-up-beta", "(0, 1]"]),
    (["--lr", "0"], ["--lr", "> 0"]),
    (["--powersgd-options", "[2]"], ["--powersgd-options", "JSON object"]),
    (["--powersgd-options", '{"bytes_per_weight": 3}'], ["--powersgd-options", "bytes_per_weight must be 2"]),
    (["--powersgd-options", '{"rnak": 2}'], ["--powersgd-options", "rnak"]),
])
def test_demo_bad_arguments_give_one_line_errors(argv, words, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["demo", *argv]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1, err
    for word in words:
        assert word in err


def test_parse_bandwidth_units() -> None:
    assert demo.parse_bandwidth("1gbit") == 125e6
    assert demo.parse_bandwidth("100mbit") == demo.parse_bandwidth("100Mbit/s") == 12.5e6
    assert demo.parse_bandwidth("10Gbps") == 1.25e9
    assert demo.parse_bandwidth("125MB/s") == 125e6
    with pytest.raises(Exception, match="1gbit"):
        demo.parse_bandwidth("0mbit")


def test_demo_defaults_are_the_documented_ones() -> None:
    args = build_parser().parse_args(["demo"])
    assert args.workers == 4 and args.task == "digits" and args.rank is None and args.start_iter is None
    assert args.lr is None and args.powersgd_options is None
    assert demo.DEFAULT_RANKS == (1, 2)
    assert [m.label for m in parse_methods(args.methods, demo.DEFAULT_RANKS)] == [
        "allreduce", "fp16", "powersgd r=1", "powersgd r=2", "multi r=1", "multi r=2", "localsgd H=8", "diloco H=8"]
    assert str(args.out) == "gradpress-demo"


def _resolved_run(argv: list[str], monkeypatch: pytest.MonkeyPatch) -> tuple[DemoConfig, list[str]]:
    """The DemoConfig and method labels ``gradpress demo ARGV`` hands to its workers (none is started)."""
    seen: dict = {}

    def capture(config, workers, **kwargs):
        seen.update(config=config, methods=[m.label for m in kwargs["methods"]])
        raise demo.Interrupted({})

    monkeypatch.setattr(demo, "run_workers", capture)
    assert main(["demo", *argv]) == 130
    return seen["config"], seen["methods"]


@pytest.mark.parametrize("task, lr, rank", [("charlm", 2.0, 22), ("charlm-wide", 1.0, 22), ("gpt", 0.1, 16),
                                           ("gpt-wide", 0.05, 22)])
def test_demo_applies_the_measured_recipe_where_the_command_line_leaves_it_out(
        task: str, lr: float, rank: int, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    config, labels = _resolved_run(["--task", task], monkeypatch)
    assert config.lr == lr and config.resolved_lr() == lr  # for every method: the allreduce baseline too
    assert config.powersgd_options == {"bytes_per_weight": 2}
    assert labels == ["allreduce", "fp16", f"powersgd r={rank}", f"multi r={rank}", "localsgd H=8", "diloco H=8"]
    resolved = demo.resolve(build_parser().parse_args(["demo", "--task", task]))
    assert resolved.recipe == (f"the measured recipe (docs/tuning.md): lr {lr:g} for every method, PowerSGD rank "
                               f"{rank} with an fp16 wire")
    # Task.lr and DemoConfig's defaults stay the task's own: the benchmarks' commands reproduce their numbers.
    assert get_task("charlm").lr == get_task("charlm-wide").lr == 0.5
    assert DemoConfig(task=task).resolved_lr() == get_task(task).lr and DemoConfig().powersgd_options is None


def test_the_users_lr_rank_and_options_override_the_recipe(monkeypatch: pytest.MonkeyPatch) -> None:
    config, labels = _resolved_run(["--task", "charlm", "--lr", "0.5", "--rank", "1,4", "--methods",
                                    "allreduce,powersgd,multi:8"], monkeypatch)
    assert config.lr == 0.5 and labels == ["allreduce", "powersgd r=1", "powersgd r=4", "multi r=8"]
    assert config.powersgd_options == {"bytes_per_weight": 2}  # the part not overridden
    config, labels = _resolved_run(["--task", "charlm", "--powersgd-options", "{}"], monkeypatch)
    assert config.powersgd_options == {} and config.lr == 2.0 and "powersgd r=22" in labels
    config, _ = _resolved_run(["--task", "gpt", "--powersgd-options", '{"bytes_per_weight": 4, "warm_start": true}'],
                              monkeypatch)
    assert config.powersgd_options == {"bytes_per_weight": 4, "warm_start": True}
    parse = build_parser().parse_args
    resolved = demo.resolve(parse(["demo", "--task", "charlm", "--lr", "1", "--methods", "powersgd:4"]))
    assert resolved.recipe == "the measured recipe (docs/tuning.md): PowerSGD with an fp16 wire"
    assert demo.resolve(parse(["demo", "--task", "charlm", "--lr", "1", "--rank", "3", "--powersgd-options",
                               "{}"])).recipe is None
    # Without a PowerSGD method the options do not apply, and the report does not mention them.
    resolved = demo.resolve(parse(["demo", "--task", "charlm-wide", "--methods", "allreduce,fp16"]))
    assert resolved.powersgd_options is None and resolved.lr == 1.0
    assert resolved.recipe == "the measured recipe (docs/tuning.md): lr 1 for every method"


@pytest.mark.parametrize("task", ["digits"])
def test_tasks_without_a_measured_recipe_keep_their_defaults(task: str, monkeypatch: pytest.MonkeyPatch) -> None:
    argv = [] if task == "digits" else ["--task", task]
    config, labels = _resolved_run(argv, monkeypatch)
    # What the demo ran before the recipes existed, field for field.
    assert config == DemoConfig(task=task, steps=300, start_iter=30, seed=0, evals=15)
    assert labels == ["allreduce", "fp16", "powersgd r=1", "powersgd r=2", "multi r=1", "multi r=2", "localsgd H=8",
                      "diloco H=8"]
    assert demo.resolve(build_parser().parse_args(["demo", *argv])).recipe is None


def test_the_header_says_which_recipe_was_applied() -> None:
    from gradpress.tools.cli.demo.report import _header
    summary = {"task": "charlm", "task_description": "character-level LSTM", "parameters": 1000, "workers": 2,
               "backend": "gloo", "config": {"steps": 300, "momentum": 0.9, "seed": 0}, "batch_size": 16, "lr": 2.0}
    plain = ("charlm: character-level LSTM; 1,000 parameters; 2 workers (gloo), 300 steps x batch 16 per worker, "
             "SGD lr 2 momentum 0.9, seed 0")
    assert _header(summary) == _header({**summary, "recipe": None}) == plain
    note = "the measured recipe (docs/tuning.md): lr 2 for every method, PowerSGD rank 22 with an fp16 wire"
    assert _header({**summary, "recipe": note}) == f"{plain}; {note}"


def test_progress_prints_milestones_when_not_a_terminal() -> None:
    stream = io.StringIO()
    progress = demo.Progress(stream)
    for step in range(1, 11):
        progress("powersgd r=1", step, 10, 1.0 / step)
    lines = stream.getvalue().splitlines()
    assert len(lines) == 2 and "5/10" in lines[0] and "10/10" in lines[1] and "#" * 24 in lines[1]


@pytest.mark.parametrize("option", ["--workers", "--steps", "--rank"])
def test_demo_rejects_values_below_one(option: str, capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["demo", option, "0"])
    err = capsys.readouterr().err
    assert code == 2
    assert option in err and ">= 1" in err
    assert len(err.strip().splitlines()) == 1


def test_demo_rejects_start_iter_not_below_steps_and_says_what_to_change(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["demo", "--steps", "5", "--start-iter", "5"]) == 2
    err = capsys.readouterr().err
    assert "--start-iter 4 or less" in err and "--steps 6 or more" in err and "leave --start-iter out" in err
    assert len(err.strip().splitlines()) == 1


def test_default_warm_up_scales_with_steps() -> None:
    assert [default_start_iter(n) for n in (1, 10, 40, 300, 1000)] == [2, 2, 4, 30, 100]
    assert DemoConfig().start_iter == default_start_iter(DemoConfig().steps)


@pytest.mark.slow
def test_short_run_on_one_worker_succeeds_and_reports_that_nothing_was_sent(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # --steps 10 without --start-iter (the warm-up scales down), and one worker: nothing crosses a wire.
    code = main(["demo", "--workers", "1", "--steps", "10", "--methods", "allreduce,powersgd:1,localsgd:2,diloco:2",
                 "--out", str(tmp_path)])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    report = json.loads((tmp_path / "demo.json").read_text())
    assert report["config"]["start_iter"] == 2 and report["bytes_check_ok"]
    for entry in report["methods"].values():
        assert entry["bytes_per_step"] == entry["bytes_total"] == 0, entry["label"]
        assert entry["compression_ratio"] is None and entry["total_ratio"] is None
        assert all(point["bytes"] == 0 for point in entry["curve"])
    assert report["methods"]["powersgd:1"]["counted"]["bytes_after"] > 0  # the payload was still compressed
    rows = [line for line in captured.out.splitlines() if line.startswith(("allreduce ", "powersgd ", "localsgd "))]
    assert len(rows) == 3 and all(" 0 B " in row and "n/a" in row for row in rows)
    assert "1 worker: a collective with no peer sends nothing" in captured.out
    assert "all 1 workers" not in captured.out and "1 methods" not in captured.err


def test_help_exits_zero(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--help"]) == 0
    assert "demo" in capsys.readouterr().out
    assert main(["demo", "--help"]) == 0
    assert "--workers" in capsys.readouterr().out
    assert main([]) == 2


@pytest.mark.slow
def test_python_dash_m_gradpress() -> None:
    proc = subprocess.run([sys.executable, "-m", "gradpress", "demo", "--help"], capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "--workers" in proc.stdout


@pytest.mark.slow
def test_worker_crash_stops_the_others_and_reports_the_traceback(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    # The demo builds its DemoConfig in the parent and ships it to the workers as a dict, so this makes
    # rank 1 raise at step 5 while rank 0 is inside a collective.
    monkeypatch.setattr(demo, "DemoConfig", functools.partial(DemoConfig, fail_at_step=5, fail_rank=1))
    code = main(["demo", "--workers", "2", "--steps", "30", "--start-iter", "4", "--timeout", "120",
                 "--collective-timeout", "120", "--out", str(tmp_path)])
    err = capsys.readouterr().err
    assert code == 1
    # Rank 1 is the root cause however the two workers' messages arrived: rank 0's error is a collective
    # that lost its peer, a consequence.
    assert "worker rank 1 failed during allreduce:" in err
    assert "Traceback" in err and "injected failure on rank 1 at step 5" in err
    assert "worker rank 0 failed" not in err and "probably stuck" not in err
    assert "stopped all workers" in err
    assert "before any method finished; nothing written" in err and not (tmp_path / "demo.json").exists()
    assert _demo_children() == []


@pytest.mark.slow
def test_run_workers_raises_worker_failure() -> None:
    with pytest.raises(WorkerFailure, match="injected failure on rank 0 at step 6"):
        run_workers(DemoConfig(steps=10, start_iter=4, fail_at_step=6, fail_rank=0), 2, timeout=60,
                    methods=parse_methods("powersgd:1", []))
    assert _demo_children() == []


def _interrupt_at_once(*args, **kwargs):
    raise demo.Interrupted({})


@pytest.mark.parametrize("argv, warning", [
    (["--methods", "allreduce,powersgd:4", "--rank", "1,2"], "warning: --rank 1,2 is not used"),
    (["--methods", "allreduce", "--rank", "2"], "warning: --rank 2 is not used"),
    (["--workers", "5"], "warning: 5 workers on 2 cores"),
    (["--steps", "2"], "warning: --steps 2 is all warm-up"),
])
def test_demo_warns_about_arguments_that_do_nothing_or_overload_the_machine(
        argv, warning, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(demo, "run_workers", _interrupt_at_once)
    monkeypatch.setattr(demo, "usable_cores", lambda: 2)
    assert main(["demo", *argv]) == 130
    err = capsys.readouterr().err
    assert warning in err
    assert "nothing written" in err


def test_demo_gives_no_warning_for_used_arguments(monkeypatch: pytest.MonkeyPatch,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(demo, "run_workers", _interrupt_at_once)
    monkeypatch.setattr(demo, "usable_cores", lambda: 2)
    assert main(["demo", "--methods", "powersgd,allreduce", "--rank", "1,2", "--workers", "4"]) == 130
    err = capsys.readouterr().err
    assert "warning" not in err
    assert main(["demo", "--methods", "powersgd:1", "--workers", "1"]) == 130
    assert "1 worker, 1 method x" in capsys.readouterr().err


@pytest.mark.slow
def test_ctrl_c_reports_and_writes_the_methods_that_finished(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    class CtrlCDuringSecondMethod(demo.Progress):
        def __call__(self, label: str, step: int, steps: int, loss: float) -> None:
            if label == "powersgd r=1":
                raise KeyboardInterrupt  # what Ctrl-C raises in the parent
            super().__call__(label, step, steps, loss)

    monkeypatch.setattr(demo, "Progress", CtrlCDuringSecondMethod)
    code = main(["demo", "--workers", "2", "--steps", "6", "--methods", "allreduce,powersgd:1,fp16",
                 "--out", str(tmp_path)])
    captured = capsys.readouterr()
    assert code == 130
    report = json.loads((tmp_path / "demo.json").read_text())
    assert list(report["methods"]) == ["allreduce"]
    assert report["stopped"] == {"kind": "interrupted", "reason": "Ctrl-C", "method": "powersgd r=1",
                                 "methods": ["allreduce", "powersgd r=1", "fp16"]}
    assert "INTERRUPTED: 1 of 3 methods finished; stopped during powersgd r=1; not run: fp16 (Ctrl-C)" in captured.out
    assert "interrupted; reporting the 1 method that finished" in captured.err
    assert _demo_children() == []


def test_version_does_not_import_torch() -> None:
    code = ("import sys; from gradpress.tools.cli.main import main; status = main(['--version']); "
            "print('torch imported' if 'torch' in sys.modules else 'no torch'); sys.exit(status)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines() == [f"gradpress {gradpress.__version__}", "no torch"]


def _no_process_left(pids: list[int]) -> bool:
    for pid in pids:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            continue
        return False
    return True


@pytest.mark.slow
def test_workers_run_in_the_callers_environment_at_the_call(monkeypatch: pytest.MonkeyPatch) -> None:
    """Set after the server the workers are forked from has started, a variable still reaches them, as it
    would reach spawned interpreters: gloo fails on the interface it names."""
    if supervisor.context().get_start_method() == "forkserver":
        from multiprocessing import forkserver

        forkserver.ensure_running()
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "gpnosuchif0")
    with pytest.raises(WorkerFailure, match="Unable to find address for: gpnosuchif0"):
        run_workers(DemoConfig(steps=3, start_iter=2), 2, methods=parse_methods("allreduce", []),
                    collective_timeout=20)
    assert _demo_children() == []


KILLED = "worker rank 1 was killed by SIGKILL"


@pytest.mark.slow
@pytest.mark.parametrize("kind, spec, issuer, words", [
    ("sigkill", "fp16", "71,754 float16 values over 2 ranks in fp16_compress_hook, bucket 0", KILLED),
    ("hang", "allreduce", "71,754 float32 values over 2 ranks in allreduce_hook, bucket 0",
     "worker rank 1 was still running and reported no error: it is probably stuck"),
    ("sigkill", "powersgd:1", "float32 values over 2 ranks in powerSGD_hook", KILLED),
    ("sigkill", "localsgd:2", "71,754 float32 values over 2 ranks in PeriodicModelAverager.average_parameters, step 6",
     KILLED),
])
def test_a_dead_or_stuck_worker_is_named_and_the_others_say_which_collective_and_hook_failed(
        kind: str, spec: str, issuer: str, words: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A lost or stuck worker: rank 1 is killed (SIGKILL) or sleeps inside step 6; rank 0's collective fails
    (the reset connection, or the 5 s collective timeout), its error names the collective and the hook,
    the report names rank 1, and no worker process is left."""
    started: list[int] = []
    process = supervisor.context().Process
    real_start = process.start

    def start(self: object) -> None:
        real_start(self)
        started.append(self.pid)  # type: ignore[attr-defined]

    monkeypatch.setattr(process, "start", start)
    if kind == "hang":
        # Once rank 0 has failed, the supervisor listens up to SETTLE_TIME (10 s) for the others' errors or
        # exits; a stuck rank 1 sends neither, so all of it would be waited out. 2 s here: what is asserted
        # comes from rank 0's error, which started the settling, and rank 1 still running after it.
        monkeypatch.setattr(supervisor, "supervise", functools.partial(supervisor.supervise, settle=2.0))
    begin = time.monotonic()
    with pytest.raises(WorkerFailure) as failure:
        run_workers(DemoConfig(steps=40, start_iter=4, fail_at_step=6, fail_rank=1, fail_kind=kind), 2, timeout=120,
                    methods=parse_methods(spec, []), collective_timeout=5)
    report = str(failure.value)
    assert words in report
    label = {"powersgd:1": "powersgd r=1", "localsgd:2": "localsgd H=2"}.get(spec, spec)
    assert f"worker rank 0 also failed during {label}" in report
    assert "CollectiveError: allreduce (sum) of " in report and f"{issuer} failed" in report
    if kind == "hang":
        assert "did not take part within the process group's timeout" in report
        assert time.monotonic() - begin < 60  # the collective timeout, not the run's
    assert len(started) == 2 and _demo_children() == [] and _no_process_left(started)


# --- which worker caused a failure, whatever order the messages arrive in ------------------------------

def _traceback(exception_line: str) -> str:
    return f'Traceback (most recent call last):\n  File "training.py", line 240, in train\n{exception_line}\n'


INJECTED = "RuntimeError: injected failure on rank 1 at step 5 (DemoConfig.fail_at_step)"
LOST_PEER = ("gradpress.comm.errors.CollectiveError: allreduce (sum) of 71,754 float32 values over 2 ranks in "
             "allreduce_hook, bucket 0 failed: RuntimeError: Connection closed by peer [127.0.0.1]:41234")
ROOT_CAUSE = ("error", 1, "allreduce", _traceback(INJECTED), False)
CONSEQUENCE = ("error", 0, "allreduce", _traceback(LOST_PEER), True)


@pytest.mark.parametrize("arrival", [[ROOT_CAUSE, CONSEQUENCE], [CONSEQUENCE, ROOT_CAUSE]], ids=["root-first",
                                                                                                 "consequence-first"])
@pytest.mark.parametrize("exit_codes", [[1, 1], [None, 1], [1, None], [-6, 1]])
def test_the_report_names_the_worker_that_failed_on_its_own_whatever_arrived_first(arrival, exit_codes) -> None:
    """Rank 1 raised; rank 0's collective then lost its peer. The report blames rank 1 in either arrival
    order, whether or not either process had exited yet (rank 0 aborting at exit, -6, included)."""
    ledger = Ledger(parse_methods("allreduce", []), 2)
    for msg in arrival:
        ledger.receive(msg)
    report = failure_report(ledger.errors, exit_codes)
    lines = report.splitlines()
    assert lines[0] == "worker rank 1 failed during allreduce:"
    assert INJECTED in lines and "Traceback (most recent call last):" in lines
    assert ("worker rank 0 also failed during allreduce, as a consequence (its collective lost a peer): "
            f"{LOST_PEER}") in lines
    assert "worker rank 0 failed" not in report and "probably stuck" not in report and "killed" not in report
    assert lines[-1] == "stopped all workers"
    reversed_ledger = Ledger(parse_methods("allreduce", []), 2)
    for msg in reversed(arrival):
        reversed_ledger.receive(msg)
    assert failure_report(reversed_ledger.errors, exit_codes) == report


def test_a_worker_that_died_without_a_traceback_or_hangs_is_the_root_cause_not_the_peers_it_broke() -> None:
    consequence = {0: WorkerError("fp16", _traceback(LOST_PEER), consequence=True)}
    killed = failure_report(consequence, [1, -9]).splitlines()
    assert killed[0] == "worker rank 1 was killed by SIGKILL without a traceback (any output it printed is above)"
    assert killed[1].startswith("worker rank 0 also failed during fp16, as a consequence")
    stuck = failure_report(consequence, [1, None]).splitlines()
    assert stuck[0].startswith("worker rank 1 was still running and reported no error: it is probably stuck")
    # Every worker's collective failed and none is left to blame: one traceback in full, the rest as lines.
    both = {**consequence, 1: WorkerError("fp16", _traceback(LOST_PEER), consequence=True)}
    lines = failure_report(both, [1, 1]).splitlines()
    assert lines[0].startswith("every worker failed in a collective (none on its own") and \
        lines[0].endswith("worker rank 0 failed during fp16:")
    assert LOST_PEER in lines and lines[-2].startswith("worker rank 1 also failed during fp16, as a consequence")
    # Two workers that raised on their own are both shown in full, in rank order.
    own = {0: WorkerError("fp16", _traceback("ValueError: a"), False),
           1: WorkerError(None, _traceback("OSError: b"), False)}
    lines = failure_report(own, [1, 1]).splitlines()
    assert lines.index("worker rank 0 failed during fp16:") < lines.index("worker rank 1 failed:")


def test_only_collectives_that_lost_a_peer_count_as_consequences() -> None:
    def raised(make: Callable[[], BaseException]) -> BaseException:
        try:
            make()
        except BaseException as exc:  # noqa: BLE001
            return exc
        raise AssertionError("nothing raised")

    def chained() -> None:
        try:
            raise CollectiveError("allreduce (sum) of 4 float32 values over 2 ranks in allreduce_hook failed")
        except CollectiveError as exc:
            raise RuntimeError("the hook's future failed") from exc

    assert is_peer_loss(CollectiveError("barrier over 2 ranks in the demo's start failed"))
    assert is_peer_loss(raised(chained))
    # DDP re-raises a comm hook's error from its future as a plain RuntimeError carrying only the text,
    # here a peer that timed out (no "connection closed" in it).
    assert is_peer_loss(RuntimeError(
        "Got the following error when running the callback: CollectiveError: allreduce (sum) of 4 float32 values "
        "over 2 ranks in allreduce_hook, bucket 0 failed (a peer did not take part within the process group's "
        "timeout: it died, is stuck, or is far behind): RuntimeError: [gloo] Timed out waiting 5000ms for recv"))
    assert is_peer_loss(torch_dist_error("Connection closed by peer [127.0.0.1]:4242"))
    assert is_peer_loss(RuntimeError("[gloo/transport/tcp/pair.cc:534] Connection reset by peer"))
    assert not is_peer_loss(RuntimeError("injected failure on rank 1 at step 5 (DemoConfig.fail_at_step)"))
    assert not is_peer_loss(ValueError("bad shape")) and not is_peer_loss(KeyboardInterrupt())


def torch_dist_error(message: str) -> BaseException:
    import torch.distributed as dist
    return dist.DistBackendError(message)


# --- the stall timeout ---------------------------------------------------------------------------------

class _FakeProcess:
    """What :func:`supervise` reads of a worker process: its exit code (set when the fake worker returns)."""

    def __init__(self) -> None:
        self.exitcode: int | None = None

    def join(self, timeout: float | None = None) -> None:
        pass


def _supervise_fakes(methods: str, workers: int, script: Callable[[int, Callable[[tuple], None]], None],
                     timeout: float, startup: float = 0.0) -> Ledger:
    """Supervise ``workers`` threads running ``script(rank, send)``, each over its own pipe as the demo's
    workers are (``mp.Pipe``); the ledger of what was heard."""
    ledger = Ledger(parse_methods(methods, []), workers)
    channels: dict[Connection, int] = {}
    procs = [_FakeProcess() for _ in range(workers)]
    for rank in range(workers):
        reader, writer = mp.Pipe(duplex=False)
        channels[reader] = rank

        def body(rank: int = rank, writer: Connection = writer) -> None:
            script(rank, writer.send)
            writer.close()
            procs[rank].exitcode = 0

        threading.Thread(target=body, daemon=True).start()
    supervise(ledger, channels, procs, timeout=timeout, startup=startup)
    return ledger


def _finished(spec: str, label: str, rank: int) -> dict[str, Any]:
    """A worker's result for a method, with every field the report and the plot read."""
    curve = [{"step": 0, "train_loss": None, "test_loss": 2.3, "metric": 0.1, "bytes": 0, "time_s": 0.0},
             {"step": 6, "train_loss": 1.0, "test_loss": 1.1, "metric": 0.8, "bytes": 6000, "time_s": 0.5}]
    return {"method": spec, "label": label, "rank": rank, "world_size": 2, "steps": 6, "metric_name": "accuracy",
            "metric": 0.8, "test_loss": 1.1, "train_loss": 1.0, "wall_time_s": 0.5, "time_per_step_s": 0.5 / 6,
            "numel": 250, "bytes_per_step": 1000, "bytes_allreduce_per_step": 1000, "compression_ratio": 1.0,
            "bytes_total": 6000, "bytes_warm_up": 2000, "bytes_allreduce_total": 6000, "total_ratio": 1.0,
            "synchronizations": 6, "approximation_error": None, "approximation_errors": None, "curve": curve,
            "checksum": 1.5, "digest": "ab", "backend": "gloo"}


def test_a_slow_run_that_keeps_stepping_outlasts_the_stall_timeout() -> None:
    """Starting takes longer than the timeout (within the start-up allowance) and each method takes 1.5
    times the timeout, but once started the workers report a step every twentieth of it."""
    timeout = 1.0

    def slow(rank: int, send: Callable[[tuple], None]) -> None:
        time.sleep(1.5 * timeout)  # importing torch, joining the group: nothing to report
        for spec, label in [("allreduce", "allreduce"), ("fp16", "fp16")]:
            send(("started", rank, label))
            end = time.monotonic() + 1.5 * timeout
            while time.monotonic() < end:
                send(("step", rank, label))
                time.sleep(timeout / 20)
            send(("result", rank, spec, {"rank": rank}))

    begin = time.monotonic()
    ledger = _supervise_fakes("allreduce,fp16", 2, slow, timeout, startup=10 * timeout)
    assert time.monotonic() - begin >= 4.5 * timeout  # three times the timeout, not stopped
    assert ledger.completed() == {"allreduce": [{"rank": 0}, {"rank": 1}], "fp16": [{"rank": 0}, {"rank": 1}]}


def test_workers_that_never_start_trip_the_timeout_plus_the_start_up_allowance() -> None:
    release = threading.Event()
    begin = time.monotonic()
    try:
        with pytest.raises(WorkerFailure) as failure:
            _supervise_fakes("allreduce", 2, lambda rank, send: release.wait(60), timeout=0.5, startup=1.0)
    finally:
        release.set()
    assert 1.5 <= time.monotonic() - begin < 1.5 + 10
    assert failure.value.kind == "stalled" and failure.value.completed == {} and failure.value.stopped == "allreduce"
    assert str(failure.value).startswith("the run stalled while starting: no worker started within 1.5 s "
                                         "(--timeout 0.5, plus 1 s for joining the process group)")


def test_a_stalled_method_trips_the_timeout_and_the_finished_ones_are_kept() -> None:
    timeout = 2.0
    last_sent: dict[int, float] = {}
    release = threading.Event()

    def stalls_in_the_second_method(rank: int, send: Callable[[tuple], None]) -> None:
        send(("started", rank, "allreduce"))
        send(("result", rank, "allreduce", {"rank": rank}))
        send(("started", rank, "powersgd r=1"))
        for step in range(3):
            send(("step", rank, "powersgd r=1"))
            if rank == 0:
                send(("progress", 0, "powersgd r=1", step + 1, 40, 1.0))
        last_sent[rank] = time.monotonic()
        release.wait(60)  # stuck: sends nothing more

    try:
        with pytest.raises(WorkerFailure) as failure:
            _supervise_fakes("allreduce,powersgd:1,fp16", 2, stalls_in_the_second_method, timeout)
        stopped_after = time.monotonic() - max(last_sent.values())
    finally:
        release.set()
    assert timeout <= stopped_after < timeout + 10  # about the timeout after the last report (load: the margin)
    exc = failure.value
    assert exc.kind == "stalled" and exc.stopped == "powersgd r=1"
    assert exc.completed == {"allreduce": [{"rank": 0}, {"rank": 1}]}
    assert exc.reason == "no worker reported progress for 2 s (the last evaluation was at step 3 of 40)"
    report = str(exc).splitlines()
    assert report[0].startswith("the run stalled during powersgd r=1: no worker reported progress for 2 s")
    assert "--timeout 2 stops a run after that long without progress" in report[0]
    assert report[-1] == "stopped all workers"


def test_the_step_reporter_reports_at_most_once_per_interval_and_torch_calls_it() -> None:
    import torch
    from torch.optim.optimizer import register_optimizer_step_post_hook

    now = [0.0]
    sent: list[tuple] = []
    reporter = StepReporter(sent.append, rank=1, interval=1.0, clock=lambda: now[0])
    reporter.label = "fp16"
    for t in (0.0, 0.5, 0.99, 1.0, 1.2, 2.5):
        now[0] = t
        reporter(None, (), {})
    assert sent == [("step", 1, "fp16")] * 3  # at 0, 1.0 and 2.5
    param = torch.nn.Parameter(torch.ones(2))
    optimizer = torch.optim.SGD([param], lr=0.1)
    handle = register_optimizer_step_post_hook(reporter)
    try:
        now[0] = 10.0
        param.grad = torch.ones(2)
        optimizer.step()
    finally:
        handle.remove()
    assert len(sent) == 4


def test_a_stalled_run_still_writes_the_methods_every_worker_finished(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                       capsys: pytest.CaptureFixture[str]) -> None:
    """``gradpress demo`` with workers that finish allreduce, then stall in powersgd r=1: exit 1, and
    allreduce is in demo.json and the table, with how and where the run stopped."""
    seen: dict[str, Any] = {}

    def fake_workers(config, workers, *, timeout, methods, on_progress, collective_timeout):
        seen.update(timeout=timeout, labels=[m.label for m in methods])

        def script(rank: int, send: Callable[[tuple], None]) -> None:
            send(("result", rank, "allreduce", _finished("allreduce", "allreduce", rank)))
            send(("step", rank, "powersgd r=1"))
            release.wait(60)

        release = threading.Event()
        try:
            ledger = _supervise_fakes(",".join(m.spec for m in methods), workers, script, timeout)
        finally:
            release.set()
        return ledger.completed()

    monkeypatch.setattr(demo, "run_workers", fake_workers)
    code = main(["demo", "--workers", "2", "--steps", "6", "--methods", "allreduce,powersgd:1,fp16", "--timeout",
                 "1", "--out", str(tmp_path)])
    captured = capsys.readouterr()
    assert code == 1 and seen["timeout"] == 1.0
    assert "the run stalled during powersgd r=1: no worker reported progress for 1 s" in captured.err
    assert "the run stalled; reporting the 1 method that finished" in captured.err
    report = json.loads((tmp_path / "demo.json").read_text())
    assert list(report["methods"]) == ["allreduce"]
    assert report["stopped"] == {"kind": "stalled", "reason": "no worker reported progress for 1 s",
                                 "method": "powersgd r=1", "methods": ["allreduce", "powersgd r=1", "fp16"]}
    note = ("STALLED: 1 of 3 methods finished; stopped during powersgd r=1; not run: fp16 (no worker reported "
            "progress for 1 s)")
    assert note in captured.out and note in (tmp_path / "demo.md").read_text()
    assert any(line.startswith("allreduce ") for line in captured.out.splitlines())


@pytest.mark.slow
def test_a_real_worker_that_hangs_trips_the_stall_timeout_and_no_worker_is_left() -> None:
    """One worker sleeps inside step 6, outside any collective (with two, the other's collective would
    time out too, and the two timeouts race): the stall timeout stops it 8 s after its last report, and
    the report says where. (8 s: the largest gap between a worker's reports before step 6 was 0.1 s on
    an idle 2-core machine, with the tests' server preloading what a worker imports, distributed.py;
    without that preload, when each worker imported torch._dynamo and scikit-learn between its first
    report and its first step, it was 3-6 s beside other work, and 10 s with a dozen busy processes.)"""
    timeout = 8
    # The server the worker is forked from, up and done preloading, as in a whole run of the suite:
    # when this test starts it, that is start-up time, which the run also allows only `timeout` more.
    warm = supervisor.context().Process(target=int)
    warm.start()
    warm.join()
    begin = time.monotonic()
    with pytest.raises(WorkerFailure) as failure:
        run_workers(DemoConfig(steps=40, start_iter=4, fail_at_step=6, fail_rank=0, fail_kind="hang"), 1,
                    timeout=timeout, methods=parse_methods("allreduce,fp16", []), collective_timeout=300)
    assert failure.value.kind == "stalled" and failure.value.completed == {} and failure.value.stopped == "allreduce"
    report = str(failure.value).splitlines()
    assert report[0].startswith(f"the run stalled during allreduce: no worker reported progress for {timeout} s (the "
                                "last evaluation was at step 5 of 40)")
    assert report[1:] == ["stopped all workers"]
    assert time.monotonic() - begin < 120
    assert _demo_children() == []

"""``gradpress check``: the correctness checks pass on gloo, a broken hook fails them, bad --model values
are clear errors, and the advice's predicted times equal the ring formula on the model's arithmetic."""

from __future__ import annotations

import doctest
import json
import math
import re
from fractions import Fraction
from pathlib import Path

import pytest
import torch
from torch import nn

from distributed import run
import gradpress.tools.check
import gradpress.tools.check.advice
import gradpress.tools.check.loader
import gradpress.tools.check.wire
import gradpress.tools.quality_map
from gradpress.averaging.outer_settings import advise_outer
from gradpress.tools.check import Link, candidate_methods, predict, recommend, run_correctness
from gradpress.tools.check.advice import BUCKET_BYTES, model_width, recipe_rule, recommended_powersgd
from gradpress.tools.cli.main import main


# --- correctness, on gloo ranks ------------------------------------------------------------------------------

def _correctness(rank, world_size, local_world_size):
    return [(i.name, i.ok, i.reason) for i in run_correctness(torch.device("cpu"), local_world_size=local_world_size)]


def _unaveraged(state, bucket):
    """A broken hook: hands back this rank's own gradient, never averaged."""
    future = torch.futures.Future()
    future.set_result(bucket.buffer())
    return future


def _broken(rank, world_size):
    return [(i.name, i.ok, i.reason) for i in run_correctness(torch.device("cpu"), hooks={"powersgd": _unaveraged})]


def test_every_correctness_item_passes_on_two_nodes_of_two_ranks():
    items = run(_correctness, 4, 2)
    assert all(result == items[0] for result in items)  # the same report on every rank
    failed = [item for item in items[0] if not item[1]]
    assert not failed, failed
    names = [item[0] for item in items[0]]
    assert any(name.startswith("hierarchical_wrapper") for name in names)
    assert "non-finite step skipped on every rank" in names and len(names) == 9


def test_a_hook_that_skips_the_averaging_fails_with_a_clear_line():
    items = dict((name, (ok, reason)) for name, ok, reason in run(_broken, 2)[0])
    ok, reason = items["full-rank PowerSGD equals allreduce"]
    assert not ok and "max |hook - mean| / max |mean|" in reason and "> 1.0e-04" in reason
    assert not items["compressed training keeps ranks identical"][0]
    assert items["allreduce_hook equals the mean"][0]  # the other hooks are untouched


def test_an_unknown_hook_role_is_rejected_before_any_collective():
    with pytest.raises(ValueError, match="unknown role.*'powersdg'.*valid roles: powersgd"):
        run_correctness(torch.device("cpu"), hooks={"powersdg": _unaveraged})


# --- the CLI ----------------------------------------------------------------------------------------------

def with_batch() -> tuple[nn.Module, torch.Tensor]:
    return nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 4)), torch.randn(8, 32)


@pytest.mark.parametrize("model, message", [
    ("resnet19", "--model 'resnet19' is not a model name; give resnet18-cifar"),
    ("no_such_module:f", "--model 'no_such_module:f': cannot import module 'no_such_module'"),
    ("user_models:NOT_CALLABLE", "'NOT_CALLABLE' is an object of type int, not a function"),
    ("user_models:not_a_module",
     "returned an object of type dict; expected an nn.Module or (nn.Module, example_batch)"),
    ("user_models:needs_arguments", "must be callable with no arguments, but needs_arguments() is missing"),
])
def test_bad_model_values_are_clear_errors(capsys, model, message):
    assert main(["check", "--model", model]) == 2
    err = capsys.readouterr().err
    assert err.startswith("gradpress check: error: ") and message in err, err


@pytest.mark.slow
def test_one_process_report_with_a_user_batch(capsys, tmp_path):
    path = tmp_path / "check.json"
    assert main(["check", "--model", "test_cli_check:with_batch", "--iters", "1", "--json", str(path),
                 "--diloco-period", "20", "--max-steps", "800", "--world-size", "2"]) == 0
    out = capsys.readouterr().out
    report = json.loads(path.read_text())
    assert report["ok"] and report["world_size"] == 1 and "PASS  full-rank PowerSGD equals allreduce" in out
    assert report["model_info"]["step_source"].startswith("measured")
    # Its matrices are 64 x 32 and 4 x 64: width 32, so the recipes' rule gives rank 4 on the fp16 wire.
    assert (report["model_info"]["width"], report["model_info"]["powersgd_rank"]) == (32, 4)
    assert {p["name"] for p in report["predictions"]} >= {"allreduce", "powersgd-r4-fp16", "local-sgd-h8"}
    assert "PowerSGD's rank for its width 32: 4" in out
    assert report["recommendation"]["method"] == "allreduce"  # one rank: nothing to send
    assert "link: one rank, nothing to measure" in out
    assert all(p["comm_ms"] == 0 for p in report["predictions"])
    # DiLoCo's outer settings read the run's length: 800 steps on 2 replicas (--world-size), not the 200-step rows
    outer = advise_outer(20, 2, steps=800)
    assert outer.status == "measured" and outer.arguments != advise_outer(20, 2).arguments
    diloco = next(p for p in report["predictions"] if p["name"] == "diloco-h20")
    assert diloco["config"] == f"OuterOptimizerAverager(period=20, {outer.arguments})"
    assert report["diloco_outer"]["max_steps"] == 800
    assert f"DiLoCo every 20 steps in a run of 800 steps: {outer.arguments} (measured)" in out


def width_192() -> tuple[nn.Module, torch.Tensor]:
    """A model of width 192, a width the quality map has no row for."""
    return nn.Sequential(nn.Linear(192, 192), nn.ReLU(), nn.Linear(192, 192), nn.ReLU(), nn.Linear(192, 8)), \
        torch.randn(4, 192)


@pytest.mark.slow
def test_the_report_holds_one_powersgd_rank_the_maps_with_its_label_and_bytes(capsys, tmp_path):
    path = tmp_path / "check.json"
    assert main(["check", "--model", "test_cli_check:width_192", "--optimizer", "adamw", "--tokens-per-step", "4096",
                 "--iters", "1", "--json", str(path)]) == 0
    out = capsys.readouterr().out
    report = json.loads(path.read_text())
    info, quality = report["model_info"], report["quality"]
    # No AdamW rows at width 192: the width rule's rank (2 x sqrt(192) = 27.7, up the ladder), said so; the
    # recipes' rule's 22 (width x 1/8, at most 22) is not printed beside it.
    assert (info["width"], info["powersgd_rank"], quality["method"], quality["status"]) == (
        192, 32, "powersgd:32", "beyond the map (rule)")
    label = "beyond the map (rule: 2 x sqrt(width) x (4,096 / 2,048)^0.125 up the ladder = 32; not measured at 192)"
    assert info["powersgd_source"] == f"by the quality map's width rule, {label}" and quality["status_text"] == label
    # DiLoCo's row and its own line carry the outer settings advised for its period (64: the nearest measured, 50)
    outer = advise_outer(64)
    assert gradpress.tools.check.advice.outer_advice(64, 1) == outer   # one rank: the advice's default count
    assert gradpress.tools.check.advice.outer_advice(20, 8) == advise_outer(20, 8) != advise_outer(20)
    diloco = next(p for p in report["predictions"] if p["name"] == "diloco-h64")
    assert diloco["config"] == f"OuterOptimizerAverager(period=64, {outer.arguments})" == \
        "OuterOptimizerAverager(period=64, outer_lr=0.5, outer_momentum=0)"
    assert report["diloco_outer"]["status"] == "nearest measured" and outer.evidence.period == 50
    assert "DiLoCo every 64 steps: outer_lr=0.5, outer_momentum=0 (nearest measured)" in out
    assert info["powersgd_options"] == {"bytes_per_weight": 2, "warm_up_bytes_per_weight": 2}
    assert f"PowerSGD's rank for its width 192: 32 by the quality map's width rule, {label}; " in out
    assert f"quality map (adamw, 4,096 tokens/step from --tokens-per-step): {label}, powersgd:32" in out
    assert "at most 22" not in out and "measured, powersgd" not in out and "r22" not in out
    # Its bytes on this model's own shapes, as the table's candidate sends them.
    shapes = [tuple(p.shape) for p in width_192()[0].parameters()]
    sent = 32 * (192 + 192) * 2 * 2 + 8 * 192 * 2 + (192 + 192 + 8) * 2  # P and Q of two matrices; the rest exact
    assert info["powersgd_bytes_per_step"] == sent
    assert info["allreduce_bytes_per_step"] == 4 * sum(math.prod(s) for s in shapes)
    assert info["powersgd_bytes_ratio"] == pytest.approx(info["allreduce_bytes_per_step"] / sent)
    assert f"{info['powersgd_bytes_ratio']:.1f}x fewer bytes than allreduce's" in out
    rows = {p["name"]: p for p in report["predictions"]}
    assert {name for name in rows if name.startswith("powersgd")} == {"powersgd-r4-fp32", "powersgd-r32-fp16"}
    assert rows["powersgd-r32-fp16"]["bytes_per_step"] == sent and not rows["powersgd-r32-fp16"]["note"]
    assert rows["powersgd-r32-fp16"]["config"] == ("PowerSGDState(pg, matrix_approximation_rank=32, "
                                                   "bytes_per_weight=2, warm_up_bytes_per_weight=2)")
    assert rows["powersgd-r4-fp32"]["note"] == "rank below 32: more steps to the same loss"
    assert "powersgd-r32-fp16" in info["hook_compute_ms"]


def test_the_powersgd_choice_is_the_maps_rank_or_the_rule_said_so():
    from gradpress.tools.check.report import powersgd_choice
    from gradpress.tools.quality_map import advise

    shapes = [(192, 192), (192,), (192, 192), (8, 192)]
    choice = powersgd_choice(shapes, advise(192, "adamw", 4096))
    assert (choice["powersgd_rank"], choice["powersgd_advised"]) == (32, True)
    assert choice["powersgd_bytes_per_step"] == candidate_methods(
        shapes, recommended=(32, choice["powersgd_options"]))[2 + 1].bytes_per_step  # allreduce, fp16, r4, r32
    # Without the map's inputs: the rule, and the report says it is the rule.
    choice = powersgd_choice(shapes, None)
    assert choice["powersgd_rank"] == recipe_rule().rank(192) == 22 and choice["powersgd_options"] == {
        "bytes_per_weight": 2}
    assert choice["powersgd_source"].startswith(
        "by the measured recipes' rule (width x 1/8, at most 22; give --optimizer")
    # Where the map advises the fp16 hook: the rank it measured behind, for comparison, not advised.
    choice = powersgd_choice(_task_shapes("gpt"), advise(128, "sgd", 4 * 16 * 64, task="gpt"))
    assert (choice["powersgd_rank"], choice["powersgd_advised"]) == (16, False)
    assert choice["powersgd_source"] == ("for comparison, not advised: the quality map, measured to fall behind, "
                                         "advises the fp16 hook")


def test_tokens_per_step_says_how_to_count_accumulation_and_its_default():
    from gradpress.tools.check.report import TOKENS_PER_STEP_HELP

    assert "micro-batch tokens x accumulation steps x ranks" in TOKENS_PER_STEP_HELP
    assert "Default: the model's example batch x ranks" in TOKENS_PER_STEP_HELP
    page = " ".join((Path(__file__).resolve().parents[2] / "docs" / "check.md").read_text().split())
    assert "micro-batch tokens x accumulation steps x ranks" in page and "one micro-batch and no accumulation" in page


def test_the_check_page_shows_the_rank_line_the_report_prints():
    import gradpress.tools.zoo
    from gradpress.tools.check.report import _rank_line, powersgd_choice
    from gradpress.tools.quality_map import advise

    page = (Path(__file__).resolve().parents[2] / "docs" / "check.md").read_text()
    charlm = _task_shapes("charlm")
    assert _rank_line({"width": 256, **powersgd_choice(charlm, None)}) + "\n" in page   # no --optimizer: the rule
    gpt2 = [tuple(p.shape) for p in gradpress.tools.zoo.build_model("gpt2").parameters()]
    assert model_width(gpt2) == 768 and "--model gpt2 --optimizer adamw --tokens-per-step 491520" in page
    line = _rank_line({"width": 768, **powersgd_choice(gpt2, advise(768, "adamw", 491520))})
    assert line + "\n" in page
    assert ("beyond the map (rule: 2 x sqrt(width) x (491,520 / 2,048)^0.125 up the ladder = 128; not measured at 768)"
            in line)


# --- the recommended rank follows the model's width ---------------------------------------------------------

def _task_shapes(name):
    from gradpress.tools.workloads.tasks import TASKS

    with torch.device("meta"):
        return [p.shape for p in TASKS[name].build().parameters() if p.requires_grad]


@pytest.mark.parametrize("name, width", [("charlm", 256), ("charlm-wide", 512), ("gpt", 128), ("gpt-wide", 256)])
def test_the_rank_rule_gives_every_measured_recipe_its_rank(name, width):
    from gradpress.tools.workloads.tasks import TASKS

    recipe = TASKS[name].recipe
    assert model_width(_task_shapes(name)) == width  # d_model of the transformers, hidden size of the LSTMs
    assert recommended_powersgd(_task_shapes(name)) == (recipe.rank, recipe.powersgd_options["bytes_per_weight"])


def test_check_advises_rank_16_on_the_width_128_transformer_and_22_on_wider_models():
    names = {m.name for m in candidate_methods(_task_shapes("gpt"))}
    assert "powersgd-r16-fp16" in names and "powersgd-r22-fp16" not in names
    assert "powersgd-r22-fp16" in {m.name for m in candidate_methods(_task_shapes("gpt-wide"))}
    assert recommended_powersgd([(4096, 1024)] * 3)[0] == recipe_rule().cap  # wider than measured: the cap
    assert recommended_powersgd([(256, 64), (64, 64)])[0] == 8                 # narrower: width x ratio
    rows = predict(candidate_methods(_task_shapes("gpt")), Link(2, 100e-6, 12.5e6), 100.0)
    assert recommend(rows)[0].name == "powersgd-r16-fp16"  # on a slow link, at the gpt's own rank


def test_tuning_doc_states_the_rule_the_code_applies():
    text = (Path(__file__).resolve().parents[2] / "docs" / "tuning.md").read_text()
    (ratio, cap), = re.findall(r"rank = width / (\d+), at most (\d+)", text)
    rule = recipe_rule()
    assert (Fraction(1, int(ratio)), int(cap)) == (rule.ratio, rule.cap)


# --- the advice's arithmetic --------------------------------------------------------------------------------

SHAPES = [(512, 256), (512,), (64, 64)]


def test_predicted_times_equal_the_ring_formula():
    link = Link(world_size=4, latency_s=50e-6, busbw=1e9)
    hook = {"allreduce": 0.5, "powersgd-r4-fp32": 3.0, "powersgd-r22-fp16": 4.0}
    rows = {row.name: row for row in predict(candidate_methods(SHAPES), link, 100.0, hook)}
    numel = 512 * 256 + 512 + 64 * 64
    # r (n + m) per compressed matrix, the vector exactly. The 64x64 matrix is compressed at rank 4
    # (4096 / (4 * 128) = 8 >= min_compression_rate 2) but not at rank 22 (4096 / 2816 < 2): sent exactly.
    powersgd_r4 = 4 * (512 + 256) + 512 + 4 * (64 + 64)
    powersgd_r22 = 22 * (512 + 256) + 512 + 64 * 64
    expected_bytes = {"allreduce": numel * 4, "fp16": numel * 2, "powersgd-r4-fp32": powersgd_r4 * 4,
                      "powersgd-r22-fp16": powersgd_r22 * 2, "local-sgd-h8": numel * 4 / 8,
                      "diloco-h64": numel * 4 / 64}
    collectives = {"allreduce": 1, "fp16": 1, "powersgd-r4-fp32": 2, "powersgd-r22-fp16": 4,
                   "local-sgd-h8": 1 / 8, "diloco-h64": 1 / 64}
    for name, nbytes in expected_bytes.items():
        row = rows[name]
        assert row.bytes_per_step == pytest.approx(nbytes)
        ring_ms = 1000 * (collectives[name] * 50e-6 * 2 * 3 + nbytes * 2 * 3 / 4 / 1e9)
        assert row.predicted_ms == pytest.approx(100.0 + hook.get(name, 0.0) + ring_ms)
    ordered = predict(candidate_methods(SHAPES), link, 100.0, hook)
    assert [r.predicted_ms for r in ordered] == sorted(r.predicted_ms for r in ordered)


def test_a_slow_link_recommends_compression_and_a_fast_one_allreduce():
    shapes = [(2048, 2048)] * 4  # 64 MiB of fp32 gradients: three DDP buckets
    assert math.ceil(4 * 2048 * 2048 * 4 / BUCKET_BYTES) == 3
    slow = predict(candidate_methods(shapes), Link(2, 100e-6, 12.5e6), 100.0, {"powersgd-r4-fp32": 5.0})
    best, reason = recommend(slow)
    assert best.name == "powersgd-r22-fp16" and "compress" in reason and "MB in" in reason
    # Rank 4 sends fewer bytes, so its step is predicted faster, but it is never the advice: it needs more
    # steps to the same loss (the report's note says so).
    by_name = {row.name: row for row in slow}
    assert by_name["powersgd-r4-fp32"].predicted_ms < best.predicted_ms
    assert "more steps to the same loss" in by_name["powersgd-r4-fp32"].note and not best.note
    fast = predict(candidate_methods(shapes), Link(2, 5e-6, 50e9), 100.0,
                   {"powersgd-r4-fp32": 5.0, "powersgd-r22-fp16": 6.0})
    best, reason = recommend(fast)
    assert best.name == "allreduce" and "allreduce is enough" in reason


def test_bad_link_and_step_values_are_rejected():
    with pytest.raises(ValueError, match="busbw=0"):
        Link(2, 1e-4, 0.0)
    with pytest.raises(ValueError, match="step_ms=-1"):
        predict(candidate_methods(SHAPES), Link(2, 1e-4, 1e9), -1.0)


@pytest.mark.parametrize("module", [gradpress.tools.check, gradpress.tools.check.advice, gradpress.tools.check.loader,
                                    gradpress.tools.check.wire, gradpress.tools.quality_map])
def test_the_documented_examples_run(module):
    result = doctest.testmod(module)
    assert result.attempted and not result.failed


def test_the_link_bytes_table_is_what_each_method_carries_at_the_world_sizes():
    from gradpress import QuantizeInt4
    from gradpress.tools.check.advice import candidate_methods
    from gradpress.tools.check.report import link_bytes_table

    shapes = [(256, 256), (256,)]
    methods = candidate_methods(shapes)
    table = link_bytes_table(shapes, methods, 4, diloco_period=64)
    assert table["world_sizes"] == [4, 8, 64, 512]
    for method in methods:
        assert table["methods"][method.name] == [2 * (w - 1) / w * method.bytes_per_step for w in table["world_sizes"]]
    payload = QuantizeInt4().payload_bytes(256 * 257)
    assert table["methods"]["diloco-h64 int4 all-gather"] == [(w - 1) * payload / 64 for w in table["world_sizes"]]
    assert all(t < a for t, a in zip(table["methods"]["diloco-h64 int4 two-shot"][1:],
                                    table["methods"]["diloco-h64 int4 all-gather"][1:]))

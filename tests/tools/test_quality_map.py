"""The quality map: its rows are the study's JSONs, and its advice follows the rows."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from gradpress.tools.check.advice import model_width, recipe_rule
from gradpress.tools.quality_map import (ADAMW_OPTIONS, FP16_WIRE, HALF_WARM_UP_EVIDENCE, MEASURED, QUALITY_TARGET,
                                         advise, rank_for_width, recipe_options, rule_evidence, width_rule_rank)
from gradpress.tools.workloads.tasks import SEQUENCE, get_task

RESULTS = Path(__file__).resolve().parents[2] / "benchmarks" / "results"


def _runs() -> list[dict]:
    return [json.loads(p.read_text()) | {"path": p} for p in sorted(RESULTS.glob("quality*/*.json"))]


def _best_allreduce(run: dict, runs: list[dict]) -> dict:
    """The baseline of ``run``: the allreduce of its setting (task, workers, batch, optimizer, seed, steps, device)
    that ended lowest."""
    return min((r for r in runs if _setting(r) == _setting(run) and r["method"] == "allreduce"),
               key=lambda r: r["ppl_end"])


def _setting(run: dict) -> tuple:
    config = run.get("config") or {}
    return (config.get("task"), run["workers"], config.get("batch_size"), config.get("optimizer", "sgd"),
            config.get("seed"), config.get("steps"), run.get("device", "cpu"))


@pytest.mark.parametrize("row", MEASURED, ids=lambda m: m.label)
def test_each_row_is_its_runs_json_against_the_best_allreduce_of_its_setting(row) -> None:
    runs = _runs()
    run = json.loads((RESULTS / f"{row.label}.json").read_text())
    config = run["config"]
    task = get_task(row.task)
    # a fixed rank, or the rank AutoRank chose in that run (a run whose AutoRank chose r is the run given r
    # from the start, tests/features/test_auto_rank.py)
    options = dict(config["powersgd_options"])
    chosen = options.pop("auto_rank", None) and run["auto_rank"]["rank"]
    assert config["task"] == row.task and (chosen or int(run["method"].split(":")[1])) == row.rank
    assert run["method"].startswith("powersgd:")
    # the fp16 wire; the rows measured after the half-precision warm-up joined the AdamW recipe, that too
    assert options in (FP16_WIRE, recipe_options(row.optimizer))
    assert config["lr"] == pytest.approx(row.lr)
    assert {"h100": "cuda"}.get(row.device, row.device) == run.get("device", "cpu")
    assert config.get("optimizer", "sgd") == row.optimizer
    assert run["workers"] * (config["batch_size"] or task.batch_size) * SEQUENCE == row.tokens_per_step
    baseline = _best_allreduce(run, runs)
    assert 100 * (run["ppl_end"] / baseline["ppl_end"] - 1) == pytest.approx(row.end_vs_allreduce, abs=0.005)
    lowest = min(p["metric"] for p in run["curve"]) / min(p["metric"] for p in baseline["curve"])
    assert 100 * (lowest - 1) == pytest.approx(row.best_vs_allreduce, abs=0.005)
    assert run["bytes_allreduce_per_step"] / run["bytes_per_step"] == pytest.approx(row.bytes_ratio, abs=0.005)
    assert row.holds == (row.best_vs_allreduce <= QUALITY_TARGET)


@pytest.mark.parametrize("task", sorted({m.task for m in MEASURED}))
def test_rows_carry_the_tasks_width_and_the_rank_rule(task: str) -> None:
    width = model_width([tuple(p.shape) for p in get_task(task).build().parameters()])
    rows = [m for m in MEASURED if m.task == task]
    assert {m.width for m in rows} == {width}
    recipe = get_task(task).recipe
    if recipe is None:  # data seen once (the width axis; 8 workers' worth at 128): no recipe of its own
        assert "stdlib" in task and {m.optimizer for m in rows} == {"adamw"}
        return
    # the recipes' rule's rank, and higher ones where the rule's fell behind
    assert min(m.rank for m in rows) == rank_for_width(width) == recipe_rule().rank(width)
    assert recipe.rank == rank_for_width(width)


def test_the_width_rule_is_the_smallest_rank_that_held_at_each_measured_width() -> None:
    # At each measured AdamW width, at its smallest measured batch: the rule's rank held (the mean over its
    # seeds) and the measured rank below it fell behind, on data seen once where the width was measured on
    # it (at 128 the repeated text's rank 24 held, mean +1.24%). A width whose rows said otherwise breaks the rule.
    # (At 512 nothing below the rule's rank was measured: what AutoRank chose there held.)
    rows = [m for m in MEASURED if m.optimizer == "adamw"]
    widths = sorted({m.width for m in rows})
    assert widths == [128, 256, 384, 512]
    evidence = rule_evidence("adamw")
    for width in widths:
        here = [m for m in rows if m.width == width]
        once = [m.tokens_per_step for m in here if m.seen_once]
        if once:  # a width measured on data seen once: those rows from their smallest batch up
            here = [m for m in here if m.seen_once or m.tokens_per_step < min(once)]
        tokens = min(m.tokens_per_step for m in here)
        at = [m for m in here if m.tokens_per_step == tokens]
        rank = width_rule_rank(width)
        held = [m.best_vs_allreduce for m in at if m.rank == rank]
        assert held and sum(held) / len(held) <= QUALITY_TARGET, (width, rank, held)
        below = max((m.rank for m in at if m.rank < rank), default=None)
        behind = [m.best_vs_allreduce for m in at if m.rank == below]
        assert below is None or sum(behind) / len(behind) > QUALITY_TARGET, (width, below, behind)
        assert {m.rank for m in evidence if m.width == width} == {rank, below} - {None}
    assert below is None and width == 512
    # 2 x sqrt(width), at least 32, up the ladder the map measures on; past its top the product rounded up
    assert [width_rule_rank(w) for w in (64, 128, 192, 256, 384, 512, 768, 1024, 4096, 8192, 10 ** 5)] == [
        32, 32, 32, 32, 48, 48, 64, 64, 128, 192, 633]
    assert width_rule_rank(2) == 2 and width_rule_rank(48) == 32  # never more than the width
    with pytest.raises(ValueError, match="width must be an integer >= 1"):
        width_rule_rank(0)


def _tokens(sequences: int) -> int:
    return sequences * SEQUENCE


def test_advice_follows_the_rows() -> None:
    # Measured within the target at this batch: PowerSGD at the rule's rank (width / 8), fp16 wire, and with
    # AdamW a half-precision warm-up; with SGD the warm-up the SGD recipes were measured with.
    advice = advise(128, "adamw", _tokens(128), task="gpt")
    assert (advice.method, advice.rank, advice.status, advice.powersgd_options) == (
        "powersgd", 16, "measured", {"bytes_per_weight": 2, "warm_up_bytes_per_weight": 2})
    assert advise(128, "sgd", _tokens(32), task="gpt").powersgd_options == {"bytes_per_weight": 2}
    assert advice.lr == 3e-3 and "-0.38%" in advice.reason
    # At 32 sequences the rule's rank fell behind on average over three seeds (+1.23%, +2.68%, +2.85%):
    # the next measured rank whose seeds held on average, 24, with the figures of every seed.
    advice = advise(128, "adamw", _tokens(32), task="gpt")
    assert (advice.method, advice.rank, advice.status) == ("powersgd", 24, "measured")
    assert "rank 16 was behind" in advice.reason and "+1.23%, +2.68%, +2.85% with seeds 0, 1, 2" in advice.reason
    assert [m.rank for m in advice.evidence] == [24, 24, 24, 16, 16, 16]
    # Between 32 (where 16 fell behind) and 128 (where it held): 24, measured only at 32, is beyond its map.
    advice = advise(128, "adamw", _tokens(100), task="gpt")
    assert (advice.rank, advice.status) == (24, "beyond the map")
    assert advise(128, "adamw", _tokens(200), task="gpt").evidence[0].tokens_per_step == _tokens(256)
    # A failure at this batch or a smaller one: the fp16 hook, with the failure's figure.
    advice = advise(128, "sgd", _tokens(64), task="gpt")
    assert (advice.method, advice.rank, advice.status, advice.spec) == ("fp16", None, "measured to fall behind", "fp16")
    assert "+4.3%" in advice.reason and advice.lr == 0.1
    assert advise(256, "sgd", _tokens(1024), task="gpt-wide").method == "fp16"
    # Larger than every measured batch, nothing failed: PowerSGD, said to be beyond the map.
    advice = advise(128, "adamw", _tokens(1024), task="gpt")
    assert (advice.method, advice.status) == ("powersgd", "beyond the map")
    # Another model with AdamW: the width rule's rank, no lr, beyond the map, at any batch, larger at a larger
    # batch; the rows it rests on.
    advice = advise(768, "adamw", _tokens(1024))
    assert (advice.rank, advice.status, advice.lr, advice.measured_width) == (96, "beyond the map (rule)", None, None)
    assert advice.status_text == ("beyond the map (rule: 2 x sqrt(width) x (65,536 / 2,048)^0.125 up the ladder = 96; "
                                  "not measured at 768)")
    assert advise(768, "adamw", _tokens(32)).status_text == ("beyond the map (rule: 2 x sqrt(width) up the ladder = "
                                                             "64; not measured at 768)")
    assert "width 384: 48 held, 32 fell behind" in advice.reason and advice.evidence == rule_evidence("adamw")
    assert "width 512: 48 held;" in advice.reason or "width 512: 48 held)" in advice.reason
    assert advise(768, "adamw", _tokens(16)).rank == 64
    # A GPT of the width family the map has no rows for, as the demo asks: the rule too.
    assert advise(640, "adamw", _tokens(32), task="gpt-stdlib-w640").status == "beyond the map (rule)"
    assert advise(640, "adamw", _tokens(32), task="digits").status == "not measured"
    # With SGD: the nearest measured width's rows, borrowed, and what they said there in the status text.
    advice = advise(768, "sgd", _tokens(32))
    assert (advice.rank, advice.status, advice.measured_width, advice.width, advice.lr) == (22, "borrowed", 512, 768,
                                                                                            None)
    assert advice.status_text == "borrowed (nearest measured width 512; not measured at 768)"
    assert "width 512 (the nearest measured to 768)" in advice.reason
    advice = advise(200, "sgd", _tokens(64))
    assert advice.method == "fp16" and "width 256" in advice.reason
    assert advice.status_text == ("borrowed (nearest measured width 256, measured to fall behind there; "
                                  "not measured at 200)")


def test_a_users_model_is_advised_from_data_seen_once_where_its_width_was_measured_there() -> None:
    # At width 128 and 8 workers' worth the repeated text's rank 16 held (best -0.38%) and on data seen once
    # it fell behind (+3.93%; rank 24 +1.63%, rank 32 +0.18%). A user's model reads the latter from that
    # batch up; the demo's gpt task, which is the repeated text, keeps its own rows.
    advice = advise(128, "adamw", _tokens(128))
    assert (advice.rank, advice.status) == (32, "measured"), advice.reason
    assert {m.task for m in advice.evidence} == {"gpt-stdlib"} and "gpt-stdlib (data seen once)" in advice.reason
    assert "rank 16 was behind" in advice.reason and "rank 24 was behind" in advice.reason
    assert advise(128, "adamw", _tokens(128), task="gpt").rank == 16
    # At 16 and 32 workers' worth (2 x 128, 2 x 256) rank 32 held on data seen once too; past them, the rank
    # that held there, beyond the map; no repeated-text row from 8 workers' worth up is read.
    for sequences in (256, 512):
        advice = advise(128, "adamw", _tokens(sequences))
        assert (advice.rank, advice.status) == (32, "measured") and all(m.seen_once for m in advice.evidence)
    for sequences in (1024, 4096):
        advice = advise(128, "adamw", _tokens(sequences))
        assert (advice.rank, advice.status) == (32, "beyond the map"), advice.reason
        assert all(m.seen_once for m in advice.evidence if m.tokens_per_step >= _tokens(128))
    # At 2 and 4 workers' worth too: rank 24 held on the repeated text at both, on data seen once only at 4.
    advice = advise(128, "adamw", _tokens(32))
    assert (advice.rank, advice.status) == (32, "measured") and "rank 24 was behind" in advice.reason
    assert all(m.seen_once for m in advice.evidence)
    assert advise(128, "adamw", _tokens(64)).rank == 24 and advise(128, "adamw", _tokens(32), task="gpt").rank == 24
    # Width 256, measured on data seen once at 2, 4, 8 and 16 workers' worth: rank 32 at 2, where it held on
    # the mean of three seeds; 48 at 4, where 32 fell behind on the mean of two, at 8, where 32 fell behind
    # again (+1.90%) and 48 held, and at 16, where 32 fell behind a third time (+2.09%) and 48 held; beyond
    # the map above it, where the repeated text's rows (still the demo task's) said rank 32 measured up to
    # 32 workers' worth.
    assert (advise(256, "adamw", _tokens(32)).rank, advise(256, "adamw", _tokens(32)).status) == (32, "measured")
    for sequences in (64, 96, 128, 192, 256):
        advice = advise(256, "adamw", _tokens(sequences))
        assert (advice.rank, advice.status) == (48, "measured") and "rank 32 was behind" in advice.reason
    evidence = [(m.rank, m.tokens_per_step) for m in advice.evidence]  # the loop's last: 16 workers' worth
    assert evidence[0] == (48, _tokens(256)) and (32, _tokens(256)) in evidence, evidence
    miss = advise(256, "adamw", _tokens(128)).evidence[-1]  # each batch names its own rank 32's miss
    assert (miss.rank, miss.tokens_per_step) == (32, _tokens(128))
    above = advise(256, "adamw", _tokens(512))
    assert (above.rank, above.status) == (48, "beyond the map") and all(m.seen_once for m in above.evidence)
    assert advise(256, "adamw", _tokens(512), task="gpt-wide").status == "measured"


def test_below_the_smallest_batch_measured_on_data_seen_once_the_repeated_texts_rows_stand(monkeypatch) -> None:
    # The map without width 128's rows on data seen once at 2 and 4 workers' worth: below 8 workers' worth
    # the repeated text's rows are read, from 8 up the rows on data seen once.
    from gradpress.tools import quality_map

    rows = tuple(m for m in MEASURED if not (m.seen_once and m.width == 128 and m.tokens_per_step < _tokens(128)))
    monkeypatch.setattr(quality_map, "MEASURED", rows)
    advice = quality_map.advise(128, "adamw", _tokens(32))
    assert advice.rank == 24 and {m.task for m in advice.evidence} == {"gpt"}, advice.reason
    assert {m.task for m in quality_map.advise(128, "adamw", _tokens(128)).evidence} == {"gpt-stdlib"}


ODD_WIDTHS = (96, 192, 320, 384, 640, 768, 1024, 1536, 2048, 3072, 4096, 5120)


@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
def test_no_advice_is_labelled_measured_at_a_width_no_row_has(optimizer: str) -> None:
    # The map borrows the nearest measured width's rows for any other width: that is said, never "measured".
    measured_widths = {m.width for m in MEASURED if m.optimizer == optimizer}
    widths = sorted({2 ** k for k in range(6, 14)} | set(ODD_WIDTHS))  # 64 .. 8192
    batches = sorted({m.tokens_per_step for m in MEASURED} | {512, 3000, 10 ** 6})
    seen = set()
    for width in widths:
        for tokens in batches:
            advice = advise(width, optimizer, tokens)
            seen.add(advice.status)
            record = advice.to_dict()
            if width in measured_widths:
                assert advice.status != "borrowed" and advice.measured_width == width, (width, tokens)
                continue
            # AdamW: the width rule; SGD: the nearest measured width's rows
            assert advice.status == {"adamw": "beyond the map (rule)", "sgd": "borrowed"}[optimizer], (width, tokens)
            assert record["status"] == advice.status and "measured" not in record["status_text"].split(" (")[0]
            if advice.status == "beyond the map (rule)":
                assert advice.rank == width_rule_rank(width, tokens) and advice.measured_width is None
                assert record["status_text"].endswith(f"= {advice.rank}; not measured at {width})")
            if advice.status == "borrowed":
                assert advice.measured_width in measured_widths and advice.measured_width != width
                assert advice.nearest_status in ("measured", "beyond the map", "measured to fall behind")
                assert record["status_text"].startswith(f"borrowed (nearest measured width {advice.measured_width}")
                assert record["status_text"].endswith(f"not measured at {width})")
    assert {"measured", {"adamw": "beyond the map (rule)", "sgd": "borrowed"}[optimizer]} <= seen


def test_with_sgd_a_failure_below_the_batch_wins_whatever_held_above_it() -> None:
    # With SGD the larger batches fell behind: once the advice leaves PowerSGD as the batch grows, it does
    # not come back.
    for width in (128, 256, 512):
        methods = [advise(width, "sgd", _tokens(s)).method for s in (8, 16, 32, 64, 128, 256, 512, 4096)]
        first = methods.index("fp16") if "fp16" in methods else len(methods)
        assert methods[first:] == ["fp16"] * (len(methods) - first), (width, methods)


def _mean_best(rows: list) -> float:
    return sum(m.best_vs_allreduce for m in rows) / len(rows)


@pytest.mark.parametrize("setting", sorted({(m.task, m.optimizer, m.tokens_per_step) for m in MEASURED}))
def test_the_advice_at_a_measured_batch_is_the_lowest_rank_whose_seeds_held_there(setting) -> None:
    task, optimizer, tokens = setting
    rows = [m for m in MEASURED if (m.task, m.optimizer) == (task, optimizer)]
    width = rows[0].width

    def held(rank: int, at: int) -> bool | None:
        """Whether ``rank``'s seeds at ``at`` tokens held on average (None: not measured there)."""
        there = [m for m in rows if m.rank == rank and m.tokens_per_step == at]
        return _mean_best(there) <= QUALITY_TARGET if there else None

    def ok(rank: int) -> bool:
        """Held at the nearest measured batch at least as large as this one, and at the nearest one no
        larger (this one where it was measured)."""
        batches = [m.tokens_per_step for m in rows if m.rank == rank]
        above = min((t for t in batches if t >= tokens), default=None)
        below = max((t for t in batches if t <= tokens), default=None)
        return above is not None and held(rank, above) is True and (below is None or held(rank, below) is True)

    ranks = sorted({m.rank for m in rows})
    advice = advise(width, optimizer, tokens, task=task)
    if any(ok(r) for r in ranks):
        chosen = min(r for r in ranks if ok(r))
        assert (advice.method, advice.rank, advice.status) == ("powersgd", chosen, "measured"), advice.reason
        assert {m.label for m in rows if m.rank == chosen and m.tokens_per_step == tokens} <= {
            m.label for m in advice.evidence}
        if held(chosen, tokens) is None:  # not measured at this batch: bracketed by batches that held
            assert any(m.rank == chosen and m.tokens_per_step > tokens for m in advice.evidence)
        # every lower rank measured here fell behind here or at the nearest smaller batch
        assert all(not ok(r) for r in ranks if r < chosen)
    else:
        def untried(rank: int) -> bool:
            """Held at the nearest measured batch below this one, never measured at or above it."""
            batches = [m.tokens_per_step for m in rows if m.rank == rank]
            below = max((t for t in batches if t <= tokens), default=None)
            return max(batches) < tokens and below is not None and held(rank, below) is True

        if any(untried(r) for r in ranks):  # a rank that held below and is untried here: beyond the map
            assert (advice.method, advice.rank, advice.status) == (
                "powersgd", min(r for r in ranks if untried(r)), "beyond the map"), advice.reason
        else:
            assert advice.method == "fp16" and advice.status == "measured to fall behind", advice.reason


def test_seeds_of_one_setting_are_read_by_their_mean(monkeypatch) -> None:
    from gradpress.tools import quality_map
    from gradpress.tools.quality_map import Measured

    def row(best: float, seed: int) -> Measured:
        return Measured("wide", 256, "adamw", 2048, 32, best, best, 10.0, 1e-3, f"s{seed}", seed)

    monkeypatch.setattr(quality_map, "MEASURED", (row(1.2, 0), row(2.0, 1)))   # mean 1.6: behind
    advice = advise(256, "adamw", 2048, task="wide")
    assert advice.method == "fp16" and "best +1.6%, the mean of 2 seeds" in advice.reason
    assert [m.label for m in advice.evidence] == ["s0", "s1"]
    monkeypatch.setattr(quality_map, "MEASURED", (row(1.2, 0), row(1.6, 1)))   # mean 1.4: held
    advice = advise(256, "adamw", 2048, task="wide")
    assert (advice.method, advice.status) == ("powersgd", "measured")
    assert "ended +1.20%, +1.60% with seeds 0, 1 (best +1.40% on average)" in advice.reason


@pytest.mark.parametrize("kwargs, words", [
    ({"width": 128, "optimizer": "adam", "tokens_per_step": 64}, "optimizer must be one of sgd, adamw, got 'adam'"),
    ({"width": 0, "optimizer": "sgd", "tokens_per_step": 64}, "width must be an integer >= 1, got 0"),
    ({"width": 128, "optimizer": "sgd", "tokens_per_step": 0}, "tokens_per_step must be an integer >= 1, got 0"),
])
def test_bad_settings_are_named(kwargs, words) -> None:
    with pytest.raises(ValueError, match=words.replace("(", r"\(").replace(")", r"\)")):
        advise(**kwargs)


def _resolve(*argv: str):
    from gradpress.tools.cli import demo
    from gradpress.tools.cli.main import build_parser
    return demo.resolve(build_parser().parse_args(["demo", *argv]))


def test_the_demos_recommended_method_resolves_from_the_map_and_says_so() -> None:
    resolved = _resolve("--task", "gpt", "--optimizer", "adamw", "--workers", "2", "--batch-size", "64",
                        "--methods", "allreduce,recommended")
    assert [m.label for m in resolved.methods] == ["allreduce", "powersgd r=16"]
    assert resolved.lr == 3e-3 and resolved.powersgd_options == {"bytes_per_weight": 2, "warm_up_bytes_per_weight": 2}
    assert "with an fp16 wire, a half-precision warm-up" in resolved.recipe
    rec = resolved.recommended
    assert rec["method"] == "powersgd:16" and rec["status"] == "measured" and rec["global_batch"] == 128
    assert rec["status_text"] == "measured" and rec["measured_width"] == rec["width"]  # the demo's own task's rows
    assert rec["tokens_per_step"] == 128 * SEQUENCE and rec["width"] == 128 and rec["optimizer"] == "adamw"
    assert rec["evidence"] == ["quality-adamw/adamw-gpt-w2b64-powersgd16-fp16-lr3e-3"]
    # SGD on 4 workers of 16 sequences: PowerSGD was measured +4.3% behind there; the fp16 hook instead.
    resolved = _resolve("--task", "gpt", "--workers", "4", "--methods", "recommended")
    assert [m.label for m in resolved.methods] == ["fp16"]
    assert resolved.recommended["status"] == "measured to fall behind"
    assert resolved.lr == 0.1  # the SGD recipe's, as without recommended
    # The user's own lr and options win; a duplicate of a listed method runs once.
    resolved = _resolve("--task", "gpt", "--optimizer", "adamw", "--workers", "2", "--batch-size", "64", "--lr",
                        "1e-3", "--powersgd-options", '{"bytes_per_weight": 4}', "--methods", "powersgd:16,recommended")
    assert [m.label for m in resolved.methods] == ["powersgd r=16"]
    assert resolved.lr == 1e-3 and resolved.powersgd_options == {"bytes_per_weight": 4}
    # Without recommended nothing is resolved, and AdamW still takes the map's lr for a measured task.
    resolved = _resolve("--task", "gpt", "--optimizer", "adamw", "--methods", "allreduce")
    assert resolved.recommended is None and resolved.lr == 3e-3
    assert _resolve("--task", "digits", "--optimizer", "adamw", "--methods", "allreduce").lr is None


@pytest.mark.slow
def test_demo_json_says_what_recommended_resolved_to(tmp_path: Path) -> None:
    from gradpress.tools.cli.main import main
    out = tmp_path / "out"
    assert main(["demo", "--workers", "2", "--steps", "6", "--start-iter", "2", "--methods", "allreduce,recommended",
                 "--out", str(out)]) == 0
    report = json.loads((out / "demo.json").read_text())
    rec = report["recommended"]
    width = model_width([tuple(p.shape) for p in get_task("digits").build().parameters()])
    assert rec["status"] == "not measured" and rec["method"] == f"powersgd:{rank_for_width(width)}"
    assert list(report["methods"]) == ["allreduce", rec["method"]]


# --- gradpress check reads the map ----------------------------------------------------------------------

def test_check_does_not_recommend_powersgd_where_the_map_measured_it_behind() -> None:
    import torch

    from gradpress.tools.check.advice import candidate_methods, predict, recommend
    from gradpress.tools.check.link import Link
    from gradpress.tools.check.report import _mark_measured_behind, quality

    with torch.device("meta"):
        shapes = [tuple(p.shape) for p in get_task("gpt").build().parameters()]
    rows = predict(candidate_methods(shapes), Link(4, 100e-6, 12.5e6), 200.0)  # 100 Mbit/s, 4 ranks
    assert recommend(rows)[0].name.startswith("powersgd")                       # on bytes alone
    behind = quality(128, "sgd", 4 * 16 * SEQUENCE, "--tokens-per-step", task="gpt")
    assert behind["method"] == "fp16" and behind["status"] == "measured to fall behind"
    best, _ = recommend(_mark_measured_behind(rows, behind))
    assert best.name == "fp16"
    held = quality(128, "adamw", 2 * 64 * SEQUENCE, "--tokens-per-step", task="gpt")
    assert held["status"] == "measured" and recommend(_mark_measured_behind(rows, held))[0].name.startswith("powersgd")
    assert quality(128, None, 1000, None)["status"] == quality(128, "sgd", None, None)["status"] == "not asked"


def test_tokens_of_an_example_batch() -> None:
    import torch

    from gradpress.tools.check.report import batch_tokens

    assert batch_tokens((torch.zeros(16, 64, dtype=torch.long), torch.zeros(16, 64, dtype=torch.long))) == 1024
    assert batch_tokens((torch.zeros(32, 1, 8, 8), torch.zeros(32, dtype=torch.long))) == 32


@pytest.mark.slow
def test_check_reports_the_quality_map_for_a_demo_task(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from gradpress.tools.cli.main import main

    path = tmp_path / "check.json"
    assert main(["check", "--model", "gpt", "--optimizer", "sgd", "--iters", "1", "--json", str(path)]) == 0
    out = capsys.readouterr().out
    quality = json.loads(path.read_text())["quality"]
    # One rank of 16 sequences of 64: the map's gpt rows with SGD held at 2 x 16 sequences.
    assert quality["tokens_per_step"] == 16 * SEQUENCE and quality["tokens_source"] == "the example batch on every rank"
    assert (quality["status"], quality["method"]) == ("measured", "powersgd:16")
    assert ("quality map (sgd, 1,024 tokens/step from the example batch on every rank): measured, powersgd:16 "
            "(PowerSGDState(..., matrix_approximation_rank=16, bytes_per_weight=2))") in out
    # With AdamW the state to build carries the half-precision warm-up too.
    assert main(["check", "--model", "gpt", "--optimizer", "adamw", "--tokens-per-step", "4096", "--iters", "1"]) == 0
    assert ("measured, powersgd:24 (PowerSGDState(..., matrix_approximation_rank=24, bytes_per_weight=2, "
            "warm_up_bytes_per_weight=2))") in capsys.readouterr().out


def test_the_tuning_guide_shows_the_maps_rows() -> None:
    from gradpress.tools.quality_map import markdown_table

    guide = (Path(__file__).resolve().parents[2] / "docs" / "tuning.md").read_text()
    assert markdown_table() in guide


def test_the_tuning_guide_names_the_labels_as_advise_writes_them() -> None:
    guide = " ".join((Path(__file__).resolve().parents[2] / "docs" / "tuning.md").read_text().split())
    assert f"`{advise(768, 'adamw', 2048).status_text}`" in guide
    assert f"`{advise(768, 'sgd', 2048).status_text}`" in guide
    assert "`borrowed`" in guide and ", beyond the map there" in guide and ", measured to fall behind there" in guide
    widths = {o: sorted({m.width for m in MEASURED if m.optimizer == o}) for o in ("adamw", "sgd")}
    assert widths == {"adamw": [128, 256, 384, 512], "sgd": [128, 256, 512]}  # as the guide's status rows say
    assert "with AdamW 128, 256, 384 and 512 were measured" in guide
    assert "with SGD 128, 256 and 512 were measured" in guide
    for width, rank in ((192, 32), (768, 64), (4096, 128)):  # the widths the guide names, with the rule's rank
        advice = advise(width, "adamw", 2048)
        assert (advice.rank, advice.status) == (rank, "beyond the map (rule)")
        assert f"{width}" in guide and f"rank {rank}" in guide


def test_a_higher_measured_rank_that_held_is_advised_over_the_rules_rank_that_fell_behind(monkeypatch) -> None:
    from gradpress.tools import quality_map
    from gradpress.tools.quality_map import Measured

    def row(rank: int, tokens: int, best: float) -> Measured:
        return Measured("wide", 256, "adamw", tokens, rank, best, best, 10.0, 1e-3, f"r{rank}-t{tokens}")

    monkeypatch.setattr(quality_map, "MEASURED", (row(22, 2048, 2.9), row(32, 2048, 1.1)))
    advice = advise(256, "adamw", 2048, task="wide")
    assert (advice.method, advice.rank, advice.status) == ("powersgd", 32, "measured")
    assert [m.label for m in advice.evidence] == ["r32-t2048", "r22-t2048"] and "rank 22 was behind" in advice.reason
    # Larger than the batch where 32 held: still 32, beyond the map. Smaller: 32 too, the rank measured to
    # hold at a larger batch (22 fell behind at that batch, and nothing says it holds at this one).
    assert (advise(256, "adamw", 8192, task="wide").rank, advise(256, "adamw", 8192, task="wide").status) == (
        32, "beyond the map")
    assert (advise(256, "adamw", 1024, task="wide").rank, advise(256, "adamw", 1024, task="wide").status) == (
        32, "measured")
    # Every measured rank behind at this batch: the fp16 hook.
    monkeypatch.setattr(quality_map, "MEASURED", (row(22, 2048, 2.9), row(32, 2048, 1.9)))
    assert advise(256, "adamw", 2048, task="wide").method == "fp16"


@pytest.mark.parametrize("half, full", HALF_WARM_UP_EVIDENCE, ids=lambda label: label.rsplit("/", 1)[-1])
def test_each_half_precision_warm_up_run_is_its_settings_run_with_that_warm_up(half, full) -> None:
    # The AdamW recipe's warm-up: each run differs from its full-precision twin in that option alone.
    runs = {label: json.loads((RESULTS / f"{label}.json").read_text()) for label in (half, full)}
    options = {label: run["config"].pop("powersgd_options") for label, run in runs.items()}
    assert options[half] == ADAMW_OPTIONS and options[full] == FP16_WIRE
    assert runs[half]["config"] == runs[full]["config"] and runs[half]["method"] == runs[full]["method"]
    # It sent the warm-up at half the bytes, the compressed steps alike.
    sent = {label: run["curve"][-1]["bytes"] for label, run in runs.items()}
    warm_up = runs[full]["config"]["start_iter"] * runs[full]["bytes_allreduce_per_step"]
    assert sent[full] - sent[half] == warm_up // 2 and runs[half]["bytes_per_step"] == runs[full]["bytes_per_step"]


def test_the_half_precision_warm_up_costs_no_measured_quality() -> None:
    # Over its runs the final perplexity against allreduce's is within the target on average, and the mean
    # of its differences from the full-precision twins is inside the seeds' own noise (half the spread
    # between the seeds of one full-precision setting).
    runs = _runs()

    def end_vs_allreduce(label: str) -> float:
        run = json.loads((RESULTS / f"{label}.json").read_text())
        return 100 * (run["ppl_end"] / _best_allreduce(run, runs)["ppl_end"] - 1)

    half = [end_vs_allreduce(h) for h, _ in HALF_WARM_UP_EVIDENCE]
    differences = [h - end_vs_allreduce(f) for h, (_, f) in zip(half, HALF_WARM_UP_EVIDENCE)]
    seeds = [end_vs_allreduce(f) for _, f in HALF_WARM_UP_EVIDENCE if "gpt-w2b16-powersgd24" in f]
    assert len(seeds) == 3 and sum(half) / len(half) <= QUALITY_TARGET
    assert abs(sum(differences) / len(differences)) <= (max(seeds) - min(seeds)) / 2


# --- when to start compressing ---------------------------------------------------------------------------

def test_the_start_rule_states_the_warm_up_lengths_measured() -> None:
    import re

    from gradpress.tools.quality_map import START_RULE

    def end_vs_allreduce(label: str) -> float:
        run = json.loads((RESULTS / "quality-adamw" / f"{label}.json").read_text())
        base = json.loads((RESULTS / "quality-adamw" / "adamw-gpt-w2b16-allreduce-lr3e-3.json").read_text())
        assert _setting(run) == _setting(base) and run["config"]["lr"] == base["config"]["lr"]
        return 100 * (run["ppl_end"] / base["ppl_end"] - 1)

    starts = [int(s) for s in re.search(r"step (\d+), (\d+) or (\d+)", START_RULE).groups()]
    stated = [float(s) for s in re.findall(r"\+(\d+\.\d)%", START_RULE)]
    measured = [end_vs_allreduce(f"adamw-gpt-w2b16-powersgd16-fp16-start{s}-lr3e-3") for s in starts]
    measured.append(end_vs_allreduce("adamw-gpt-w2b16-powersgd16-fp16-lr3e-3"))  # from step 80
    assert stated == [round(m, 1) for m in measured]
    assert all(m > QUALITY_TARGET for m in measured[:-1]) and measured[-1] <= QUALITY_TARGET
    for label in (f"adamw-gpt-w2b16-powersgd16-fp16-start{s}-lr3e-3" for s in starts):
        config = json.loads((RESULTS / "quality-adamw" / f"{label}.json").read_text())["config"]
        assert config["start_iter"] in starts and config["steps"] == 800


def test_an_early_start_is_warned_about_only_with_a_learning_rate_warm_up() -> None:
    from gradpress.tools.quality_map import early_start_warning

    assert early_start_warning(80, 80, "adamw") is None and early_start_warning(100, 80, "adamw") is None
    assert early_start_warning(2, 80, "sgd") is None  # a constant rate has no warm-up to wait for
    warning = early_start_warning(20, 80, "adamw")
    assert warning is not None and "step 20" in warning and "step 80" in warning and "+2.2%" in warning
    assert advise(128, "adamw", 2048, task="gpt").start is not None
    assert advise(128, "sgd", 4 * 16 * SEQUENCE, task="gpt").start is None  # the fp16 hook: no warm-up


@pytest.mark.slow
def test_the_demo_warns_when_recommended_starts_before_adamws_warm_up_ends(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from gradpress.tools.cli.main import main

    out = tmp_path / "out"
    assert main(["demo", "--task", "gpt", "--optimizer", "adamw", "--workers", "2", "--batch-size", "2",
                 "--steps", "30", "--start-iter", "2", "--methods", "recommended", "--out", str(out)]) == 0
    rec = json.loads((out / "demo.json").read_text())["recommended"]
    assert rec["method"] == advise(128, "adamw", 2 * 2 * SEQUENCE, task="gpt").spec
    assert rec["method"].startswith("powersgd:")
    assert "step 2, before the learning-rate warm-up ends at step 3" in rec["warning"]
    assert "leave --start-iter out" in capsys.readouterr().err


def test_the_width_rule_with_its_batch_term_holds_at_every_batch_the_map_measured() -> None:
    """The oracle is the map's own rows (AdamW, data seen once where a width was measured on it, as
    ``advise`` reads them for a user's model): at every measured width and batch, the rule's rank was
    trained there and held, and the measured rank below it (above the floor) fell behind. Without the
    batch term, width 256 from 4 workers' worth up gets 32, which fell behind; with a larger exponent,
    width 128 at 32 workers' worth would get 48, one ladder step more than the 32 that held."""
    from gradpress.tools.quality_map import RULE_BATCH_EXPONENT, RULE_FLOOR, _seen_once_first, _settings

    rows = [m for m in MEASURED if m.optimizer == "adamw"]
    checked = 0
    for width in sorted({m.width for m in rows}):
        here = _seen_once_first([m for m in rows if m.width == width])
        for tokens in sorted({m.tokens_per_step for m in here}):
            rank = width_rule_rank(width, tokens)
            held = _settings([m for m in here if m.rank == rank]).get(tokens)
            assert held is not None and held.holds, (width, tokens, rank)
            below = [k for k in {m.rank for m in here} if RULE_FLOOR <= k < rank]
            for k in below:
                setting = _settings([m for m in here if m.rank == k]).get(tokens)
                assert setting is None or not setting.holds, (width, tokens, k)
            checked += 1
            if width == 256 and tokens >= _tokens(64):
                assert rank == 48 and width_rule_rank(width) == 32 and not _settings(
                    [m for m in here if m.rank == 32])[tokens].holds
    assert checked == 13
    assert width_rule_rank(128, _tokens(512)) == 32
    assert RULE_BATCH_EXPONENT == 0.125 and 2 * math.sqrt(128) * 16 ** 0.13 > 32   # a larger exponent: 48 there

"""The short-period warning of DiLoCo's outer settings against the runs it quotes
(``benchmarks/results/diloco-outer``: the replica simulator's GPT, every method from the same weights and
data order), and its logging once per setting."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from gradpress import OuterOptimizerAverager
from gradpress.averaging import outer_settings
from gradpress.averaging.outer_settings import MEASURED_LOSSES, short_period_loss, warn_if_measured_to_lose

RUNS = Path(__file__).resolve().parents[2] / "benchmarks" / "results" / "diloco-outer"


def _runs() -> dict[str, dict]:
    return {run["label"]: run for run in (json.loads(p.read_text()) for p in sorted(RUNS.glob("*.json")))}


def _diloco(runs: dict[str, dict]) -> list[tuple[int, int, float, float, float, float, int, int]]:
    """``(replicas, period, outer_lr, outer_momentum, vs allreduce, no sync vs allreduce, steps, seed)`` of every
    DiLoCo run whose replicas have an allreduce and a no-sync run of the same seed and length beside it."""
    out = []
    for label, run in runs.items():
        if not run["method"].startswith("diloco:"):
            continue
        prefix = label.split("-diloco")[0]
        base, nosync = runs.get(prefix + "-allreduce"), runs.get(prefix + "-nosync")
        if base is None or nosync is None:
            continue
        assert {run["config"][k] for k in ("seed", "steps")} == {base["config"][k] for k in ("seed", "steps")} \
            == {nosync["config"][k] for k in ("seed", "steps")}, label
        out.append((run["workers"], int(run["method"].split(":")[1]), run["config"]["outer_lr"],
                    run["config"]["outer_momentum"], run["ppl_end"] / base["ppl_end"] - 1,
                    nosync["ppl_end"] / base["ppl_end"] - 1, run["config"]["steps"], run["config"]["seed"]))
    return out


def best_measured(measured: list[tuple[int, int, float, float, float, float, int, int]]) -> list[tuple]:
    """Per (replicas, period, steps): the outer setting with the lowest mean over its seeds, among those
    measured on the most seeds there, as a :class:`MeasuredBest` tuple (figures rounded to 3 places)."""
    from statistics import mean

    out = []
    for replicas, period, steps in sorted({(m[0], m[1], m[6]) for m in measured}):
        here = [m for m in measured if (m[0], m[1], m[6]) == (replicas, period, steps)]
        by_setting: dict[tuple[float, float], list[tuple]] = {}
        for m in here:
            by_setting.setdefault((m[2], m[3]), []).append(m)
        most = max(len(v) for v in by_setting.values())
        (lr, momentum), runs = min(((k, v) for k, v in by_setting.items() if len(v) == most),
                                   key=lambda kv: mean(m[4] for m in kv[1]))

        def vs(setting: tuple[float, float]) -> float:
            return round(mean(m[4] for m in by_setting[setting]), 3)
        out.append((replicas, period, lr, momentum, vs((lr, momentum)), vs((1.0, 0.0)), vs((0.7, 0.9)),
                    round(mean(m[5] for m in runs), 3), steps, most))
    return out


def test_every_quoted_loss_is_a_measured_run_that_ended_behind_no_sync():
    measured = _diloco(_runs())
    assert measured, f"no runs in {RUNS}"
    for row in MEASURED_LOSSES:
        match = [m for m in measured if m[:4] == (row.replicas, row.period, row.outer_lr, row.outer_momentum)
                 and m[6:] == (row.steps, row.seed)]
        assert len(match) == 1, row
        _, _, _, _, vs_allreduce, no_sync, _, _ = match[0]
        assert (round(vs_allreduce, 3), round(no_sync, 3)) == (row.vs_allreduce, row.no_sync_vs_allreduce), row
        assert vs_allreduce > no_sync, row


def test_the_warning_covers_every_measured_run_that_lost_to_no_sync_and_none_of_the_advised_settings():
    measured = _diloco(_runs())
    for replicas, period, outer_lr, momentum, vs_allreduce, no_sync, steps, seed in measured:
        if vs_allreduce > no_sync:
            assert (replicas, period, outer_lr, momentum, round(vs_allreduce, 3), round(no_sync, 3), steps, seed) \
                in MEASURED_LOSSES
            assert short_period_loss(period, outer_lr, momentum) is not None, (replicas, period, outer_lr, momentum)
    # momentum 0 with an outer lr of 0.5 to 1.0 never lost to no sync, on any replica count: never warned
    advised = [m for m in measured if m[3] == 0.0 and 0.5 <= m[2] <= 1.0]
    assert advised and all(m[4] < m[5] for m in advised), advised
    assert all(short_period_loss(m[1], m[2], m[3]) is None for m in advised)


def test_the_averager_warns_once_per_setting_and_not_for_long_periods_or_no_momentum(caplog, monkeypatch):
    monkeypatch.setattr(outer_settings, "_warned", set())
    with caplog.at_level(logging.WARNING, logger="gradpress.averaging"):
        OuterOptimizerAverager(period=20)                       # the defaults: outer lr 0.7, momentum 0.9
        OuterOptimizerAverager(period=20)
        OuterOptimizerAverager(period=500)
        OuterOptimizerAverager(period=20, outer_lr=0.7, outer_momentum=0.0)
    warnings = [r.getMessage() for r in caplog.records if "measured to end behind not synchronizing" in r.getMessage()]
    assert len(warnings) == 1, warnings
    assert "OuterOptimizerAverager(period=20, outer_lr=0.7, outer_momentum=0.9)" in warnings[0]
    assert warn_if_measured_to_lose("X", 10, 1.0, 0.9) and not warn_if_measured_to_lose("X", 10, 1.0, 0.9)
    assert "in a run of 800 steps on 2 replicas they ended +5.5% (plain averaging +8.0%)" in warnings[0]


@pytest.mark.parametrize("period", [1, 10, 20])
def test_the_defaults_are_quoted_as_a_loss_at_short_periods_and_not_past_the_measured_ones(period):
    row = short_period_loss(period, 0.7, 0.9)
    assert row is not None and period <= row.period and (row.outer_lr, row.outer_momentum) == (0.7, 0.9)
    assert short_period_loss(max(r.period for r in MEASURED_LOSSES) + 1, 0.7, 0.9) is None


def test_the_best_settings_quoted_are_the_best_measured_at_each_setting():
    """Each :data:`MEASURED_BEST` row is, among the JSON's DiLoCo runs at its replicas, period and run length,
    the setting with the lowest mean final perplexity over the most seeds measured there, and its
    plain-averaging, defaults and no-sync figures are those runs' means; every setting measured has a row."""
    from gradpress.averaging.outer_settings import MEASURED_BEST

    assert [tuple(row) for row in MEASURED_BEST] == best_measured(_diloco(_runs()))
    for row in MEASURED_BEST:
        assert row.vs_allreduce < row.no_sync_vs_allreduce, row
        assert row.vs_allreduce < row.defaults_vs_allreduce or (row.outer_lr, row.outer_momentum) == (0.7, 0.9), row


def test_the_advice_reads_the_nearest_measured_setting_and_says_where_plain_averaging_won():
    from gradpress.averaging.outer_settings import MEASURED_BEST, advise_outer

    for row in MEASURED_BEST:
        advice = advise_outer(row.period, row.replicas, row.steps)
        assert (advice.outer_lr, advice.outer_momentum, advice.status) == (row.outer_lr, row.outer_momentum,
                                                                          "measured")
        assert advice.plain_averaging == (row.outer_lr == 1.0 and row.outer_momentum == 0.0)
        assert ("did not beat it" in advice.reason) == advice.plain_averaging
        # never warned in runs as short as those that lost; a longer run's advice may be settings that lost in
        # short ones (the defaults at 800 steps on 4 replicas): the warning cannot know the run's length, so
        # it names the longer run's figure (checked below)
        assert short_period_loss(row.period, advice.outer_lr, advice.outer_momentum) is None or row.steps > 200
    assert advise_outer(20, 16).evidence.replicas == 8 and advise_outer(20, 16).status == "nearest measured"
    assert advise_outer(30, 3).evidence.period == 20 and advise_outer(5).evidence.period == 10
    longest = max(row.period for row in MEASURED_BEST)
    beyond = advise_outer(2 * longest, 4)
    assert beyond.status == "beyond the measured periods" and beyond.evidence.period == longest
    # the run's length is read too: the nearest measured length at the period and replicas found first
    for row in MEASURED_BEST:
        assert advise_outer(row.period, row.replicas, 10 * row.steps).evidence.steps >= row.steps
    paper = advise_outer(500)
    assert (paper.outer_lr, paper.outer_momentum, paper.evidence) == (0.7, 0.9, None)
    for bad, match in [({"period": 0}, "period must be an integer >= 1, got 0"),
                       ({"period": 20, "replicas": 1}, "replicas must be None or an integer >= 2, got 1"),
                       ({"period": 20, "steps": 0}, "steps must be None or an integer >= 1, got 0")]:
        with pytest.raises(ValueError, match=match):
            advise_outer(**bad)

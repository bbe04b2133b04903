"""The short-period warning of DiLoCo's outer settings against the runs it quotes
(``benchmarks/results/diloco-outer``: the replica simulator's GPT, every method from the same weights and
data order), and its logging once per setting."""

from __future__ import annotations

import importlib.util
import logging
from pathlib import Path

import pytest

from gradpress import OuterOptimizerAverager
from gradpress.averaging import outer_settings
from gradpress.averaging.outer_settings import MEASURED_LOSSES, short_period_loss, warn_if_measured_to_lose

_spec = importlib.util.spec_from_file_location(
    "outer_table", Path(__file__).resolve().parents[2] / "benchmarks" / "outer_table.py")
assert _spec is not None and _spec.loader is not None
outer_table = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(outer_table)
RUNS, best_measured, diloco_runs, load_runs = (outer_table.RUNS, outer_table.best_measured,
                                               outer_table.diloco_runs, outer_table.load_runs)


def test_every_quoted_loss_is_a_measured_run_that_ended_behind_no_sync():
    measured = diloco_runs(load_runs())
    assert measured, f"no runs in {RUNS}"
    for row in MEASURED_LOSSES:
        match = [m for m in measured if m[:4] == (row.replicas, row.period, row.outer_lr, row.outer_momentum)
                 and m[6:] == (row.steps, row.seed)]
        assert len(match) == 1, row
        _, _, _, _, vs_allreduce, no_sync, _, _ = match[0]
        assert (round(vs_allreduce, 3), round(no_sync, 3)) == (row.vs_allreduce, row.no_sync_vs_allreduce), row
        assert vs_allreduce > no_sync, row


def test_the_warning_covers_every_measured_run_that_lost_to_no_sync_and_none_of_the_advised_settings():
    measured = diloco_runs(load_runs())
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

    assert [tuple(row) for row in MEASURED_BEST] == best_measured(diloco_runs(load_runs()))
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
    assert advise_outer(20, 32).evidence.replicas == 16 and advise_outer(20, 32).status == "nearest measured"
    assert advise_outer(20, 12).evidence.replicas == 16 and advise_outer(20, 12).status == "nearest measured"
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


def test_the_seed_mean_table_stars_the_advised_setting_of_each_measured_setting(capsys):
    """``benchmarks/outer_table.py`` prints every setting's mean over its seeds; the starred one of each
    (replicas, period, steps) is :data:`MEASURED_BEST`'s, and ``--rows`` prints those rows."""
    from gradpress.averaging.outer_settings import MEASURED_BEST

    assert outer_table.main([]) == 0
    starred = [line.split(" | ") for line in capsys.readouterr().out.splitlines() if " *" in line]
    assert sorted((int(c[0].strip("| ")), int(c[1]), int(c[2]), float(c[3]), float(c[4])) for c in starred) == \
        sorted((r.replicas, r.period, r.steps, r.outer_lr, r.outer_momentum) for r in MEASURED_BEST)
    assert outer_table.main(["--rows"]) == 0
    assert capsys.readouterr().out.count("MeasuredBest(") == len(MEASURED_BEST)

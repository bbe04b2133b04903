"""The noise criterion's default multiple against the quality study's own runs: ``benchmarks/rank_energy.py``
measured, at the end of each setting's warm-up, E(k), the mean's energy T and its noise energy N; the
quality map trained ranks there. The oracle is what those trainings did (their seeds' mean within the
quality target or not). The fit reads the settings on data seen about once (as pre-training reads its
data, and as the map's advice reads its rows for a user's model); on the repeated text, read 4-16 times
in 800 steps, both methods overfit and the map compares minima of overfitting curves: there the
multiple is only held to erring on the side of bytes."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from gradpress.autorank import DEFAULT_MIN_RANK, DEFAULT_NOISE_MULTIPLE, AutoRank

RESULTS = Path(__file__).resolve().parents[2] / "benchmarks/results/rank-energy"


def _measured(seen_once: bool = True) -> list[tuple[str, dict[str, Any], dict[int, Any]]]:
    """Every setting measured with its noise on data seen once (``seen_once=False``: on the repeated text):
    its name, the measurement, and each rank the quality map trained there (same task and tokens per
    step, AdamW), its seeds together."""
    from gradpress.tools.quality_map import _settings
    from gradpress.tools.quality_rows import CHARS_PER_SEQUENCE, MEASURED, SEEN_ONCE_MARK

    out = []
    for path in sorted(RESULTS.glob("*.json")):
        run = json.loads(path.read_text())
        if "noise" not in run or (SEEN_ONCE_MARK in run["task"]) != seen_once:
            continue
        rows = [m for m in MEASURED if (m.task, m.optimizer) == (run["task"], "adamw")]
        tokens = run["sequences"] * CHARS_PER_SEQUENCE
        trained = {rank: _settings([m for m in rows if m.rank == rank]).get(tokens) for rank in {m.rank for m in rows}}
        out.append((path.stem, run, {rank: s for rank, s in trained.items() if s is not None}))
    return out


def _points(seen_once: bool = True) -> list[tuple[float, bool, str, int]]:
    """(R(k), held, setting, k) for every rank the map trained at a measured setting, from the floor up."""
    return sorted((run["residual_over_noise"][rank - 1], s.holds, name, rank)
                  for name, run, trained in _measured(seen_once) for rank, s in trained.items()
                  if rank >= DEFAULT_MIN_RANK)


def _fit(points: list[tuple[float, bool, str, int]]) -> float:
    """The multiple halfway (geometrically) between the largest R that held and the smallest that fell."""
    held = max(r for r, ok, *_ in points if ok)
    fell = min(r for r, ok, *_ in points if not ok)
    assert held < fell, (held, fell)
    return math.sqrt(held * fell)


def test_the_residual_over_noise_separates_every_rank_the_study_trained() -> None:
    """From the floor up, every trained rank whose R(k) is within the default multiple held and every one
    above it fell behind, and the default is the fit (to two figures); the energy alone does not separate
    them (a rank that fell behind captured more than one that held)."""
    points = _points()
    assert len(points) >= 18 and sum(not ok for _, ok, *_ in points) >= 5
    assert all((r <= DEFAULT_NOISE_MULTIPLE) == ok for r, ok, *_ in points), points
    assert float(f"{_fit(points):.2g}") == DEFAULT_NOISE_MULTIPLE
    energy = sorted((run["captured"][rank - 1], s.holds) for _, run, trained in _measured()
                    for rank, s in trained.items() if rank >= DEFAULT_MIN_RANK)
    assert max(e for e, ok in energy if not ok) > min(e for e, ok in energy if ok)


def test_on_the_repeated_text_it_errs_only_towards_more_rank() -> None:
    """Where the text is read many times over, every trained rank within the multiple held; one that held
    above it (width 256's 32 at 8 workers' worth, the text read 16 times) is bytes the multiple asks for
    more, not quality it loses."""
    points = _points(seen_once=False)
    assert len(points) >= 3
    assert all(ok for r, ok, *_ in points if r <= DEFAULT_NOISE_MULTIPLE)
    assert [(name, rank) for r, ok, name, rank in points if r > DEFAULT_NOISE_MULTIPLE] == [
        ("gpt-wide-s128-lr0.0015-seed0", 32)]


def test_each_trained_rank_is_predicted_by_the_multiple_fitted_without_it() -> None:
    """Leave one out: the multiple fitted on the other settings' ranks says whether the left-out one
    holds, for every one of them."""
    points = _points()
    for i, (ratio, held, name, rank) in enumerate(points):
        assert (ratio <= _fit(points[:i] + points[i + 1:])) == held, (name, rank, ratio)


def test_the_default_rule_chooses_a_rank_that_held_wherever_the_study_trained_it() -> None:
    """The decision ``AutoRank()`` takes on each measured setting's E, T and N (the noise criterion, the
    floor of 32, and the width floor on the map's settings, where it changes nothing) is a rank that held
    there, wherever that rank was trained; and at every setting where the map's smallest rank that held
    is at or above the floor, it is that rank (no more bytes)."""
    from gradpress.tools.check.advice import model_width
    from gradpress.tools.workloads import get_task

    judged = 0
    for name, run, trained in _measured():
        rank = AutoRank().choose_by_noise(run["captured"], run["total"], run["noise"])
        # the width floor (the rule's rank for the task's width) changes none of these decisions: no bytes
        if trained:
            width = model_width([tuple(p.shape) for p in get_task(run["task"]).build().parameters()])
            assert AutoRank().choose_by_noise(run["captured"], run["total"], run["noise"], width) == rank, name
        if rank in trained:
            assert trained[rank].holds, (name, rank)
            judged += 1
        smallest = min((k for k, s in trained.items() if s.holds), default=None)
        if smallest is not None and smallest >= DEFAULT_MIN_RANK:
            assert rank == smallest, (name, rank, smallest)
    assert judged >= 12 and len([name for name, _, trained in _measured() if trained]) == 13

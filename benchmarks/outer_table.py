"""DiLoCo's outer settings over seeds: the table behind ``gradpress.averaging.outer_settings.MEASURED_BEST``.

Reads the replica simulator's runs in ``--out`` (default ``benchmarks/results/diloco-outer``; labels
``dil-gpt-r<W>[-seed<S>][-n<steps>]-<method>``, where a DiLoCo run's allreduce and no-sync baselines
share its prefix: ``dil-gpt-r4-seed1-allreduce``, ``dil-gpt-r4-seed1-nosync``). Each DiLoCo run is
compared with the allreduce run of its own seed and length (final perplexity), then, per (replicas,
period, run length), every outer setting's mean over the seeds it was measured on is printed; the
advised one (``*``) is the lowest mean among the settings measured on the most seeds there::

    python3 benchmarks/outer_table.py [--out DIR] [--rows]

``--rows`` prints the ``MeasuredBest(...)`` rows instead (what ``outer_settings.py`` holds; a test checks
it against the JSON). Reads JSON only; no training.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from statistics import mean
from typing import Any

RUNS = Path(__file__).resolve().parent / "results" / "diloco-outer"

#: ``(replicas, period, outer_lr, outer_momentum, vs allreduce, no sync vs allreduce, steps, seed)``
Measured = tuple[int, int, float, float, float, float, int, int]


def load_runs(folder: Path = RUNS) -> dict[str, dict[str, Any]]:
    """Every JSON record in ``folder`` by its label."""
    return {run["label"]: run for run in (json.loads(p.read_text()) for p in sorted(folder.glob("*.json")))}


def diloco_runs(runs: dict[str, dict[str, Any]]) -> list[Measured]:
    """Every DiLoCo run whose replicas have an allreduce and a no-sync run of the same seed and length beside
    it (the label's prefix), with its final perplexity and no sync's against that allreduce's."""
    out = []
    for label, run in runs.items():
        if not run["method"].startswith("diloco:"):
            continue
        prefix = label.split("-diloco")[0]
        base, nosync = runs.get(prefix + "-allreduce"), runs.get(prefix + "-nosync")
        if base is None or nosync is None:
            continue
        keys = ("seed", "steps")
        if not {run["config"][k] for k in keys} == {base["config"][k] for k in keys} == \
                {nosync["config"][k] for k in keys}:
            raise ValueError(f"{label}: its allreduce/no-sync baselines are of another seed or length")
        out.append((run["workers"], int(run["method"].split(":")[1]), run["config"]["outer_lr"],
                    run["config"]["outer_momentum"], run["ppl_end"] / base["ppl_end"] - 1,
                    nosync["ppl_end"] / base["ppl_end"] - 1, run["config"]["steps"], run["config"]["seed"]))
    return out


def by_setting(measured: list[Measured]) -> dict[tuple[int, int, int], dict[tuple[float, float], list[Measured]]]:
    """The runs grouped per (replicas, period, steps), then per (outer lr, outer momentum)."""
    groups: dict[tuple[int, int, int], dict[tuple[float, float], list[Measured]]] = {}
    for m in measured:
        groups.setdefault((m[0], m[1], m[6]), {}).setdefault((m[2], m[3]), []).append(m)
    return dict(sorted(groups.items()))


def best_setting(settings: dict[tuple[float, float], list[Measured]]) -> tuple[float, float]:
    """The setting with the lowest mean over its seeds among those measured on the most seeds."""
    most = max(len(v) for v in settings.values())
    return min((k for k, v in settings.items() if len(v) == most), key=lambda k: mean(m[4] for m in settings[k]))


def best_measured(measured: list[Measured]) -> list[tuple]:
    """Per (replicas, period, steps): :func:`best_setting` as a ``MeasuredBest`` tuple (figures rounded to 3
    places; plain averaging's, the defaults' and no sync's are their means over the seeds each has)."""
    out = []
    for (replicas, period, steps), settings in by_setting(measured).items():
        lr, momentum = best_setting(settings)
        runs = settings[(lr, momentum)]

        def vs(setting: tuple[float, float]) -> float:
            return round(mean(m[4] for m in settings[setting]), 3) if setting in settings else float("nan")
        out.append((replicas, period, lr, momentum, vs((lr, momentum)), vs((1.0, 0.0)), vs((0.7, 0.9)),
                    round(mean(m[5] for m in runs), 3), steps, len(runs)))
    return out


def markdown(measured: list[Measured]) -> str:
    """One row per (replicas, period, steps, setting): mean and spread over seeds against allreduce."""
    lines = ["| replicas | H | steps | outer lr | momentum | seeds | vs allreduce (mean) | per seed | no sync |",
             "|---|---|---|---|---|---|---|---|---|"]
    for (replicas, period, steps), settings in by_setting(measured).items():
        best = best_setting(settings)
        for (lr, momentum), runs in sorted(settings.items(), key=lambda kv: mean(m[4] for m in kv[1])):
            runs = sorted(runs, key=lambda m: m[7])
            seeds = ", ".join(f"{100 * m[4]:+.1f}%" for m in runs)
            mark = " *" if (lr, momentum) == best else ""
            lines.append(f"| {replicas} | {period} | {steps} | {lr:g} | {momentum:g} | {len(runs)} | "
                         f"{100 * mean(m[4] for m in runs):+.1f}%{mark} | {seeds} | "
                         f"{100 * mean(m[5] for m in runs):+.1f}% |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=str(RUNS), help="the folder of the replica simulator's JSON")
    parser.add_argument("--rows", action="store_true", help="print the MeasuredBest rows instead of the table")
    args = parser.parse_args(argv)
    measured = diloco_runs(load_runs(Path(args.out)))
    if not measured:
        parser.error(f"--out {args.out}: no DiLoCo run with its allreduce and no-sync baselines there")
    if args.rows:
        for row in best_measured(measured):
            print("    MeasuredBest(" + ", ".join(repr(v) for v in row) + "),")
    else:
        print(markdown(measured))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Where PowerSGD trains as well as allreduce: the quality study's map, and the advice read from it.

Every :data:`MEASURED` entry is one row of BENCHMARKS.md ("Does PowerSGD train as well as allreduce?"):
a PowerSGD configuration trained for 800 steps beside allreduce at allreduce's own tuned learning rate,
with the same data order and initial weights, and how its final perplexity compared. PowerSGD's averaged
update depends on the workers only through the global batch (``tests/engine/test_linearity.py``), so a row is
keyed by the model's width, the optimizer and the *tokens per step over all workers*, not by the worker
count: 2 workers x 64 sequences stands for 8 workers x 16.

:func:`advise` reads the map for a setting (the demo's ``recommended`` method, ``gradpress check``):

* PowerSGD with an fp16 wire (with AdamW its warm-up's exact averages too: :data:`ADAMW_OPTIONS`) at the
  smallest measured rank, from
  :func:`~gradpress.tools.check.advice.recipe_rule`'s rank for the width up, that held at the nearest
  measured batches on both sides of yours: its lowest perplexity within :data:`QUALITY_TARGET` of
  allreduce's (the mean over seeds where a setting was run with several) at the nearest measured batch
  at least as large as yours and at the nearest no larger (``"measured"``); or, past the largest
  measured batch, where that one held (``"beyond the map"``: read the global residual, docs/tuning.md);
* the fp16 allreduce hook (half the bytes, the same steps) where every measured rank fell behind at one
  of the batches nearest yours (``"measured to fall behind"``);
* PowerSGD with the rule's rank where nothing was measured for the optimizer or the task (``"not
  measured"``).

A model whose width no row has is read from the rows of the nearest measured width, and the advice says
so: its status is ``"borrowed"`` (:data:`BORROWED`), never ``"measured"``, and
:attr:`Advice.status_text` names both widths and what the borrowed rows said, e.g. ``borrowed (nearest
measured width 256; not measured at 768)``.

>>> advice = advise(width=128, optimizer="adamw", tokens_per_step=2 * 64 * 64)
>>> advice.method, advice.rank, advice.status, advice.powersgd_options
('powersgd', 16, 'measured', {'bytes_per_weight': 2, 'warm_up_bytes_per_weight': 2})
>>> advise(width=128, optimizer="sgd", tokens_per_step=4 * 16 * 64).method   # gpt, 4 workers, SGD: +4.3%
'fp16'
>>> advice = advise(width=768, optimizer="adamw", tokens_per_step=2 * 64 * 64)   # GPT-2's width: not measured
>>> advice.rank, advice.status, advice.status_text
(32, 'borrowed', 'borrowed (nearest measured width 256; not measured at 768)')
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any, Literal

__all__ = ["ADAMW_OPTIONS", "BORROWED", "FP16_WIRE", "HALF_WARM_UP_EVIDENCE", "MEASURED", "QUALITY_TARGET",
           "START_RULE", "Advice", "Measured", "advise", "early_start_warning", "markdown_table", "rank_for_width",
           "recipe_options"]

#: The quality target, in percent of allreduce's final perplexity.
QUALITY_TARGET = 1.5
#: The status of advice read from the rows of another width than the model's (the nearest measured one):
#: the rank those rows gave, not measured at this width (:attr:`Advice.status_text` says which widths).
BORROWED = "borrowed"
#: The PowerSGD options every measured recipe uses: P, Q and the uncompressed tensors in fp16 on the wire.
FP16_WIRE: dict[str, Any] = {"bytes_per_weight": 2}
#: With AdamW the exact averages of the warm-up go on the same half-precision wire too
#: (``warm_up_bytes_per_weight=2``): they are most of the recipe's bytes over a run and, on a slow link,
#: most of its time (BENCHMARKS.md, "The warm-up on the half-precision wire"), and they cost no measured
#: quality: the runs in :data:`HALF_WARM_UP_EVIDENCE` ended as close to allreduce as the same settings
#: with a full-precision warm-up. With SGD the recipes were measured with a full-precision warm-up only.
ADAMW_OPTIONS: dict[str, Any] = {"bytes_per_weight": 2, "warm_up_bytes_per_weight": 2}
#: The half-precision warm-up's runs (``benchmarks/results/quality-adamw/``), each beside the run of the
#: same setting and seed with a full-precision warm-up.
HALF_WARM_UP_EVIDENCE: tuple[tuple[str, str], ...] = tuple(
    (f"quality-adamw/adamw-{setting}-fp16-hwu-{rest}", f"quality-adamw/adamw-{setting}-fp16-{rest}")
    for setting, rest in [("gpt-w2b16-powersgd24", "lr3e-3"), ("gpt-w2b16-powersgd24", "lr3e-3-seed1"),
                          ("gpt-w2b16-powersgd24", "lr3e-3-seed2"), ("gpt-wide-w2b16-powersgd32", "lr1.5e-3"),
                          ("gpt-wide-w2b16-powersgd32", "lr1.5e-3-seed1")])


def recipe_options(optimizer: str) -> dict[str, Any]:
    """The PowerSGD options of the recipe for ``optimizer``: :data:`ADAMW_OPTIONS` for ``"adamw"``,
    :data:`FP16_WIRE` otherwise (a new dict each call).

    >>> recipe_options("adamw"), recipe_options("sgd")
    ({'bytes_per_weight': 2, 'warm_up_bytes_per_weight': 2}, {'bytes_per_weight': 2})
    """
    return dict(ADAMW_OPTIONS if optimizer == "adamw" else FP16_WIRE)


#: When every measured row starts compressing, and what starting sooner measured (BENCHMARKS.md, "The
#: warm-up's length"): a tenth of the run, which with AdamW is the end of its learning-rate warm-up.
_START_EVIDENCE = ("every measured row started at step 80 of 800; on gpt with AdamW, starting at step 2, 20 or 40 "
                   "ended +3.5%, +2.2% and +2.2% from allreduce instead of +1.2%")
START_RULE = f"start compressing when the learning-rate warm-up ends (start_powerSGD_iter; {_START_EVIDENCE})"
#: Characters per sequence in the demo's text tasks (``gradpress.tools.workloads.tasks.SEQUENCE``).
_SEQUENCE = 64


@dataclass(frozen=True)
class Measured:
    """One measured PowerSGD configuration against the tuned allreduce (one BENCHMARKS.md row).

    ``tokens_per_step``: over all workers. ``end_vs_allreduce``: final perplexity against allreduce's,
    in percent (negative: PowerSGD ended lower), against the allreduce run that ended lowest of those tried
    at this setting; ``best_vs_allreduce``: the same for the lowest perplexity of each run, what a run that
    keeps its best checkpoint gets (at 8 and more workers' worth of tokens the demo's text is seen many
    times over and the held-out perplexity turns up before the end: the final one then measures
    overfitting too). A row holds when its best is within :data:`QUALITY_TARGET`. ``bytes_ratio``:
    allreduce's bytes per step over PowerSGD's after the warm-up.
    ``lr``: the learning rate PowerSGD ran at (allreduce's best of those tried at momentum 0.9 for SGD, at
    this batch for AdamW). ``label``: the run's JSON in
    ``benchmarks/results/``. ``seed``: the data order and initial weights both runs shared; a setting
    measured with several seeds has one row per seed, and :func:`advise` reads their mean. ``device``:
    where both runs trained, ``"cpu"`` (this project's 2-core machines, Python 3.11) or ``"h100"`` (an
    NVIDIA H100 with Python 3.12, whose ``pydoc_data`` text differs: its runs are compared only with
    allreduce on the same machine).
    """

    task: str
    width: int
    optimizer: Literal["sgd", "adamw"]
    tokens_per_step: int
    rank: int
    end_vs_allreduce: float
    best_vs_allreduce: float
    bytes_ratio: float
    lr: float
    label: str
    seed: int = 0
    device: Literal["cpu", "h100"] = "cpu"

    @property
    def holds(self) -> bool:
        return self.best_vs_allreduce <= QUALITY_TARGET

    def describe(self) -> str:
        """``"gpt, AdamW, 2,048 tokens/step: rank 16 ended +1.23% (best +1.23%) at 11.2x fewer bytes"``."""
        return _describe(self, f"{self.end_vs_allreduce:+.2f}% (best {self.best_vs_allreduce:+.2f}%)")


def _describe(m: Measured, ended: str) -> str:
    """``m``'s setting, rank and bytes around ``ended``, the figures of one run or of its seeds."""
    where = "" if m.device == "cpu" else f" (on an {m.device.upper()})"
    return (f"{m.task}, {_OPTIMIZER_WORDS[m.optimizer]}, {m.tokens_per_step:,} tokens/step{where}: rank {m.rank} "
            f"ended {ended} at {m.bytes_ratio:.1f}x fewer bytes")


_OPTIMIZER_WORDS = {"sgd": "SGD", "adamw": "AdamW"}


def _row(task: str, width: int, optimizer: Literal["sgd", "adamw"], sequences: int, rank: int, end: float,
         best: float, bytes_ratio: float, lr: float, label: str, seed: int = 0,
         device: Literal["cpu", "h100"] = "cpu") -> Measured:
    return Measured(task, width, optimizer, sequences * _SEQUENCE, rank, end, best, bytes_ratio, lr, label, seed,
                    device)


@dataclass(frozen=True)
class _Setting:
    """One measured setting (task, optimizer, rank, tokens per step) over the seeds it was run with: it
    holds when the mean of their ``best_vs_allreduce`` is within :data:`QUALITY_TARGET`."""

    runs: tuple[Measured, ...]

    @property
    def rank(self) -> int:
        return self.runs[0].rank

    @property
    def tokens_per_step(self) -> int:
        return self.runs[0].tokens_per_step

    @property
    def best_vs_allreduce(self) -> float:
        return sum(m.best_vs_allreduce for m in self.runs) / len(self.runs)

    @property
    def holds(self) -> bool:
        return self.best_vs_allreduce <= QUALITY_TARGET

    def describe(self) -> str:
        """One run's :meth:`Measured.describe`, or every seed's figures and their mean."""
        if len(self.runs) == 1:
            return self.runs[0].describe()
        ends = ", ".join(f"{r.end_vs_allreduce:+.2f}%" for r in self.runs)
        seeds = ", ".join(str(r.seed) for r in self.runs)
        return _describe(self.runs[0], f"{ends} with seeds {seeds} (best {self.best_vs_allreduce:+.2f}% on average)")


def _settings(rows: list[Measured]) -> dict[int, _Setting]:
    """``rows`` (one rank's) by tokens per step, each batch's seeds together."""
    grouped: dict[int, list[Measured]] = {}
    for m in rows:
        grouped.setdefault(m.tokens_per_step, []).append(m)
    return {tokens: _Setting(tuple(sorted(runs, key=lambda m: m.seed))) for tokens, runs in grouped.items()}


#: The measured rows, each with an fp16 wire and compression from step 80 of 800 (BENCHMARKS.md).
#: SGD: momentum 0.9, 16 sequences per worker, 2 and 4 workers. AdamW: nanoGPT's (betas 0.9/0.95,
#: weight decay 0.1, warm-up then cosine), 2 workers x 16, 32, 64 or 128 sequences (2, 4, 8 and 16
#: workers' worth of 16), seeds 0, 1 and 2 at 2 x 16; 2 x 256 (32 workers' worth) on an H100, with the
#: recipe's half-precision warm-up (:data:`ADAMW_OPTIONS`).
MEASURED: tuple[Measured, ...] = (
    _row("charlm", 256, "sgd", 32, 22, 0.97, 0.97, 10.58, 2.0, "quality/study-charlm-w2-powersgd22-half-lr2.0"),
    _row("charlm", 256, "sgd", 64, 22, 0.23, 1.06, 10.58, 2.0, "quality/study-charlm-w4-powersgd22-half-lr2.0"),
    _row("charlm-wide", 512, "sgd", 32, 22, 0.66, 0.66, 19.59, 1.0,
         "quality/study-charlm-wide-w2-powersgd22-half-lr1.0"),
    _row("charlm-wide", 512, "sgd", 64, 22, -0.33, 0.47, 19.59, 2.0,
         "quality/study-charlm-wide-w4-powersgd22-half-lr2.0"),
    _row("gpt", 128, "sgd", 32, 16, 0.68, 0.68, 11.25, 0.1, "quality/study-gpt-w2-powersgd16-half-lr0.1"),
    _row("gpt", 128, "sgd", 64, 16, 4.34, 4.34, 11.25, 0.1, "quality/study-gpt-w4-powersgd16-half-lr0.1"),
    _row("gpt-wide", 256, "sgd", 32, 22, 1.18, 1.18, 16.45, 0.05, "quality/study-gpt-wide-w2-powersgd22-half-lr0.05"),
    _row("gpt-wide", 256, "sgd", 64, 22, 6.16, 6.16, 16.45, 0.05, "quality/study-gpt-wide-w4-powersgd22-half-lr0.05"),
    _row("gpt", 128, "adamw", 32, 16, 1.23, 1.23, 11.25, 3e-3, "quality-adamw/adamw-gpt-w2b16-powersgd16-fp16-lr3e-3"),
    _row("gpt", 128, "adamw", 32, 16, 2.68, 2.68, 11.25, 3e-3,
         "quality-adamw/adamw-gpt-w2b16-powersgd16-fp16-lr3e-3-seed1", seed=1),
    _row("gpt", 128, "adamw", 32, 16, 2.85, 2.85, 11.25, 3e-3,
         "quality-adamw/adamw-gpt-w2b16-powersgd16-fp16-lr3e-3-seed2", seed=2),
    _row("gpt", 128, "adamw", 32, 24, 0.97, 0.97, 7.50, 3e-3, "quality-adamw/adamw-gpt-w2b16-powersgd24-fp16-lr3e-3"),
    _row("gpt", 128, "adamw", 32, 24, 1.24, 1.24, 7.50, 3e-3,
         "quality-adamw/adamw-gpt-w2b16-powersgd24-fp16-lr3e-3-seed1", seed=1),
    _row("gpt", 128, "adamw", 32, 24, 1.52, 1.52, 7.50, 3e-3,
         "quality-adamw/adamw-gpt-w2b16-powersgd24-fp16-lr3e-3-seed2", seed=2),
    _row("gpt", 128, "adamw", 32, 32, 0.58, 0.58, 5.05, 3e-3, "quality-adamw/adamw-gpt-w2b16-powersgd32-fp16-lr3e-3"),
    _row("gpt", 128, "adamw", 32, 32, 0.33, 0.32, 5.05, 3e-3,
         "quality-adamw/adamw-gpt-w2b16-powersgd32-fp16-lr3e-3-seed1", seed=1),
    _row("gpt", 128, "adamw", 32, 32, 0.38, 0.38, 5.05, 3e-3,
         "quality-adamw/adamw-gpt-w2b16-powersgd32-fp16-lr3e-3-seed2", seed=2),
    _row("gpt", 128, "adamw", 64, 16, 1.79, 1.79, 11.25, 3e-3, "quality-adamw/adamw-gpt-w2b32-powersgd16-fp16-lr3e-3"),
    _row("gpt", 128, "adamw", 64, 24, 1.45, 1.45, 7.50, 3e-3, "quality-adamw/adamw-gpt-w2b32-powersgd24-fp16-lr3e-3"),
    _row("gpt", 128, "adamw", 128, 16, -1.52, -0.38, 11.25, 3e-3,
         "quality-adamw/adamw-gpt-w2b64-powersgd16-fp16-lr3e-3"),
    _row("gpt", 128, "adamw", 256, 16, -10.51, -0.56, 11.25, 3e-3,
         "quality-adamw/adamw-gpt-w2b128-powersgd16-fp16-lr3e-3"),
    _row("gpt", 128, "adamw", 512, 16, -7.68, -0.14, 11.25, 1.5e-3,
         "quality-adamw-gpu/adamw-gpt-w2b256-powersgd16-fp16-hwu-lr1.5e-3", device="h100"),
    _row("gpt-wide", 256, "adamw", 32, 22, 2.18, 2.18, 16.45, 1.5e-3,
         "quality-adamw/adamw-gpt-wide-w2b16-powersgd22-fp16-lr1.5e-3"),
    _row("gpt-wide", 256, "adamw", 32, 32, 1.30, 1.30, 11.31, 1.5e-3,
         "quality-adamw/adamw-gpt-wide-w2b16-powersgd32-fp16-lr1.5e-3"),
    _row("gpt-wide", 256, "adamw", 32, 32, 1.20, 1.20, 11.31, 1.5e-3,
         "quality-adamw/adamw-gpt-wide-w2b16-powersgd32-fp16-lr1.5e-3-seed1", seed=1),
    _row("gpt-wide", 256, "adamw", 32, 32, 0.99, 0.99, 11.31, 1.5e-3,
         "quality-adamw/adamw-gpt-wide-w2b16-powersgd32-fp16-lr1.5e-3-seed2", seed=2),
    _row("gpt-wide", 256, "adamw", 128, 32, -4.98, 0.10, 11.31, 1.5e-3,
         "quality-adamw/adamw-gpt-wide-w2b64-powersgd32-fp16-lr1.5e-3"),
    _row("gpt-wide", 256, "adamw", 256, 32, -20.10, -1.47, 11.31, 1.5e-3,
         "quality-adamw/adamw-gpt-wide-w2b128-powersgd32-fp16-lr1.5e-3"),
    _row("gpt-wide", 256, "adamw", 512, 32, -21.15, 0.87, 11.31, 7.5e-4,
         "quality-adamw-gpu/adamw-gpt-wide-w2b256-powersgd32-fp16-hwu-lr7.5e-4", device="h100"),
)


def rank_for_width(width: int) -> int:
    """PowerSGD's rank for a model of this width: the rule every measured recipe follows
    (:func:`gradpress.tools.check.advice.recipe_rule`: width / 8, at most 22, at least 1)."""
    return max(1, min(22, width // 8))


@dataclass(frozen=True)
class Advice:
    """What the map says for a setting.

    ``method``: ``"powersgd"`` (at ``rank`` with ``powersgd_options``) or ``"fp16"`` (the fp16 allreduce
    hook). ``status``: ``"measured"``, ``"beyond the map"``, ``"measured to fall behind"`` or ``"not
    measured"`` for the rows of the model's own width; :data:`BORROWED` (``"borrowed"``) where they are
    another width's, the nearest measured (``measured_width``, which is not ``width``): what those rows
    said there is then ``nearest_status``. :attr:`status_text` says it in words. ``lr``: the tuned
    allreduce learning rate measured on the same task and optimizer (``None``: none measured; the
    caller's default applies). ``evidence``: the rows the advice rests on. ``reason``: one sentence with
    the figures. ``width``: the model's width the advice was read for; ``measured_width``: the width of
    the rows read (``None`` where none were).
    """

    method: Literal["powersgd", "fp16"]
    rank: int | None
    powersgd_options: dict[str, Any]
    status: str
    reason: str
    lr: float | None = None
    evidence: tuple[Measured, ...] = field(default=())
    width: int | None = None
    measured_width: int | None = None
    nearest_status: str | None = None

    @property
    def status_text(self) -> str:
        """The status in words: ``status`` itself, or for :data:`BORROWED` advice which width it was read
        from and what that width's rows said, e.g. ``"borrowed (nearest measured width 256; not measured at
        768)"``, ``"borrowed (nearest measured width 256, beyond the map there; not measured at 768)"``."""
        if self.status != BORROWED:
            return self.status
        there = "" if self.nearest_status == "measured" else f", {self.nearest_status} there"
        return f"{BORROWED} (nearest measured width {self.measured_width}{there}; not measured at {self.width})"

    @property
    def spec(self) -> str:
        """The demo's ``--methods`` spelling: ``"powersgd:16"`` or ``"fp16"``."""
        return "fp16" if self.method == "fp16" else f"powersgd:{self.rank}"

    @property
    def start(self) -> str | None:
        """When to start compressing (:data:`START_RULE`; ``None`` for the fp16 hook, which needs no
        warm-up)."""
        return START_RULE if self.method == "powersgd" else None

    def to_dict(self) -> dict[str, Any]:
        return {"method": self.spec, "powersgd_options": dict(self.powersgd_options), "status": self.status,
                "status_text": self.status_text, "reason": self.reason, "start": self.start, "lr": self.lr,
                "width": self.width, "measured_width": self.measured_width,
                "evidence": [m.label for m in self.evidence]}


def _nearest_width(rows: list[Measured], width: int) -> int:
    return min({m.width for m in rows}, key=lambda w: (abs(math.log(w / width)), -w))


def advise(width: int, optimizer: str, tokens_per_step: int, task: str | None = None) -> Advice:
    """The map's advice for a model of ``width`` (:func:`gradpress.tools.check.advice.model_width`)
    trained with ``optimizer`` (``"sgd"`` or ``"adamw"``) at ``tokens_per_step`` over all workers. With
    ``task`` (a demo task) the task's own rows (``"not measured"`` for a task the map does not have, such
    as the digits CNN); without it (a user's model), the rows of the nearest measured width.
    The rank is the smallest measured rank, from :func:`rank_for_width`'s up, that was not measured behind
    allreduce at the nearest measured batch on either side of this one (a wider model may need more than
    the rule's cap; with SGD larger batches fell behind, with AdamW on gpt the smallest did); the
    learning rate, where the same task was measured with this optimizer, the tuned allreduce's at the
    nearest measured batch. Where the rows read are not of ``width`` (the nearest measured width stands
    in for it) the status is :data:`BORROWED`, whatever those rows said, and never ``"measured"``.
    """
    if optimizer not in _OPTIMIZER_WORDS:
        raise ValueError(f"optimizer must be one of {', '.join(_OPTIMIZER_WORDS)}, got {optimizer!r}")
    if not (isinstance(width, int) and width >= 1):
        raise ValueError(f"width must be an integer >= 1, got {width!r}")
    if not (isinstance(tokens_per_step, int) and tokens_per_step >= 1):
        raise ValueError(f"tokens_per_step must be an integer >= 1, got {tokens_per_step!r}")
    rank = rank_for_width(width)
    rows = [m for m in MEASURED if m.optimizer == optimizer]
    words = _OPTIMIZER_WORDS[optimizer]
    if task is not None and not any(m.task == task for m in MEASURED):
        return Advice("powersgd", rank, recipe_options(optimizer), "not measured",
                      f"PowerSGD was not measured on {task}: rank {rank} (width {width} / 8) with an fp16 wire is the "
                      "rule of the measured recipes; watch the global residual (docs/tuning.md)", width=width)
    if not rows:
        return Advice("powersgd", rank, recipe_options(optimizer), "not measured",
                      f"PowerSGD was not measured with {words}: rank {rank} (width {width} / 8) with an fp16 wire is "
                      "the rule of the measured recipes; watch the global residual (docs/tuning.md)", width=width)
    same_task = [m for m in rows if m.task == task]
    if same_task:
        rows, where = same_task, f"on {task}"
    else:
        near = _nearest_width(rows, width)
        rows = [m for m in rows if m.width == near]
        where = f"at width {near}" + ("" if near == width else f" (the nearest measured to {width})")
    measured_width = rows[0].width

    def read(advice: Advice) -> Advice:
        """``advice`` for ``width``: the rows' own status where they are of this width, else borrowed."""
        if measured_width == width:
            return replace(advice, width=width, measured_width=measured_width)
        return replace(advice, status=BORROWED, width=width, measured_width=measured_width,
                       nearest_status=advice.status)
    lr = None
    if same_task:
        lr = min(rows, key=lambda m: (abs(math.log(m.tokens_per_step / tokens_per_step)), m.tokens_per_step)).lr
    beyond: Advice | None = None
    failures: list[_Setting] = []
    for r in sorted({rank} | {m.rank for m in rows if m.rank > rank}):  # never below the rule's rank
        settings = _settings([m for m in rows if m.rank == r])
        below = max((t for t in settings if t <= tokens_per_step), default=None)
        above = min((t for t in settings if t >= tokens_per_step), default=None)
        behind = [settings[t] for t in (below, above) if t is not None and not settings[t].holds]
        if behind:  # behind at the nearest measured batch on either side: try a higher measured rank
            failures.append(behind[0])
            continue
        if above is not None:
            held = settings[above]
            return read(Advice("powersgd", r, recipe_options(optimizer), "measured",
                               f"{words} {where}: {held.describe()} (target {QUALITY_TARGET}%)" + _after(failures),
                               lr, _evidence(held, *failures)))
        if below is not None and beyond is None:
            held = settings[below]
            beyond = Advice("powersgd", r, recipe_options(optimizer), "beyond the map",
                            f"{words} {where}: the largest measured batch, {held.describe()}; yours, "
                            f"{tokens_per_step:,} tokens/step, is beyond it: read the global residual "
                            "(docs/tuning.md)" + _after(failures), lr, _evidence(held, *failures))
    if beyond is not None:
        return read(beyond)
    if failures:
        worst = failures[0]
        seeds = "" if len(worst.runs) == 1 else f", the mean of {len(worst.runs)} seeds"
        return read(Advice("fp16", None, {}, "measured to fall behind",
                           f"{words} {where}: PowerSGD was measured behind allreduce at {worst.tokens_per_step:,} "
                           f"tokens/step (rank {worst.rank}: best {worst.best_vs_allreduce:+.1f}%{seeds}, over the "
                           f"{QUALITY_TARGET}% target) and yours is {tokens_per_step:,}: the fp16 hook halves the "
                           "bytes and keeps allreduce's steps", lr, _evidence(*failures)))
    return Advice("powersgd", rank, recipe_options(optimizer), "not measured",
                  f"PowerSGD was not measured with {words} {where} at rank {rank} or above: rank {rank} (width "
                  f"{width} / 8) with an fp16 wire is the rule of the measured recipes; watch the global residual "
                  "(docs/tuning.md)", lr, width=width, measured_width=measured_width)


def early_start_warning(start_iter: int, lr_warmup_steps: int, optimizer: str) -> str | None:
    """A warning when PowerSGD would start compressing (``start_iter``) before the learning-rate
    warm-up ends (``lr_warmup_steps``), which every measured row avoided (:data:`START_RULE`); ``None``
    otherwise (SGD at a constant rate has no such warm-up).

    >>> early_start_warning(80, 80, "adamw") is None
    True
    >>> early_start_warning(20, 80, "adamw").split(":")[0]
    'compression starts at step 20, before the learning-rate warm-up ends at step 80'
    """
    if optimizer == "sgd" or start_iter >= lr_warmup_steps:
        return None
    return (f"compression starts at step {start_iter}, before the learning-rate warm-up ends at step "
            f"{lr_warmup_steps}: measured behind allreduce ({_START_EVIDENCE})")


def _after(failures: list[_Setting]) -> str:
    """What the advice passed over: the lower ranks measured behind allreduce."""
    return "".join(f"; rank {m.rank} was behind ({m.describe()})" for m in failures)


def _evidence(*settings: _Setting) -> tuple[Measured, ...]:
    return tuple(m for setting in settings for m in setting.runs)


def markdown_table() -> str:
    """:data:`MEASURED` as the markdown table docs/tuning.md shows (rows that miss the target in bold)."""
    lines = ["| task (width) | optimizer | tokens/step (sequences of 64) | rank | seed | final perplexity vs "
             "allreduce | best vs allreduce's best | bytes/step fewer | trained on |",
             "|---|---|---|---|---|---|---|---|---|"]
    for m in MEASURED:
        best = f"{m.best_vs_allreduce:+.2f}%"
        lines.append(f"| {m.task} ({m.width}) | {_OPTIMIZER_WORDS[m.optimizer]} | {m.tokens_per_step:,} "
                     f"({m.tokens_per_step // _SEQUENCE}) | {m.rank} | {m.seed} | {m.end_vs_allreduce:+.2f}% | "
                     f"{best if m.holds else f'**{best}**'} | {m.bytes_ratio:.1f}x | {m.device.upper()} |")
    return "\n".join(lines)

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

For a user's model (no ``task``), the rows on data seen about once (:attr:`Measured.seen_once`, as
pre-training reads its data) replace the repeated text's from the smallest batch they were measured at.

A model whose width no row has is never ``"measured"``. With AdamW its rank comes from the width rule
(:func:`width_rule_rank`: 2 x sqrt(width), at least 32, up the rank ladder, the smallest measured rank
that held at each measured width), status ``"beyond the map (rule)"`` (:data:`RULE`), e.g. ``beyond the map (rule:
2 x sqrt(width) up the ladder = 64; not measured at 768)``. With SGD (no width rule measured) it is read
from the rows of the nearest measured width: status ``"borrowed"`` (:data:`BORROWED`), and
:attr:`Advice.status_text` names both widths and what the borrowed rows said, e.g. ``borrowed (nearest
measured width 512; not measured at 768)``.

>>> advice = advise(width=128, optimizer="adamw", tokens_per_step=2 * 64 * 64)   # read on data seen once
>>> advice.method, advice.rank, advice.status, advice.powersgd_options
('powersgd', 32, 'measured', {'bytes_per_weight': 2, 'warm_up_bytes_per_weight': 2})
>>> advise(width=128, optimizer="adamw", tokens_per_step=2 * 64 * 64, task="gpt").rank   # the repeated text
16
>>> advise(width=128, optimizer="sgd", tokens_per_step=4 * 16 * 64).method   # gpt, 4 workers, SGD: +4.3%
'fp16'
>>> advice = advise(width=768, optimizer="adamw", tokens_per_step=2 * 16 * 64)   # GPT-2's width: not measured
>>> advice.rank, advice.status_text
(64, 'beyond the map (rule: 2 x sqrt(width) up the ladder = 64; not measured at 768)')
>>> advise(width=768, optimizer="adamw", tokens_per_step=2 * 64 * 64).status_text   # 4x the batch: the batch term
'beyond the map (rule: 2 x sqrt(width) x (8,192 / 2,048)^0.125 up the ladder = 96; not measured at 768)'
>>> advise(width=768, optimizer="sgd", tokens_per_step=2 * 16 * 64).status_text
'borrowed (nearest measured width 512; not measured at 768)'
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any, Literal

from ..autorank import DEFAULT_MIN_RANK, WIDTH_RULE_COEFFICIENT, up_the_ladder, width_rule
from .quality_rows import CHARS_PER_SEQUENCE, MEASURED, OPTIMIZER_WORDS, QUALITY_TARGET, Measured, describe_runs

__all__ = ["ADAMW_OPTIONS", "BORROWED", "FP16_WIRE", "HALF_WARM_UP_EVIDENCE", "MEASURED", "QUALITY_TARGET", "RULE",
           "RULE_BATCH_EXPONENT", "RULE_BATCH_TOKENS", "RULE_COEFFICIENT", "START_RULE", "Advice", "Measured", "advise",
           "early_start_warning", "markdown_table", "rank_for_width", "recipe_options", "rule_batch_factor",
           "rule_evidence", "width_rule_rank"]

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
        mean = f"(best {self.best_vs_allreduce:+.2f}% on average)"
        return describe_runs(self.runs[0], f"{ends} with seeds {seeds} {mean}")


def _settings(rows: list[Measured]) -> dict[int, _Setting]:
    """``rows`` (one rank's) by tokens per step, each batch's seeds together."""
    grouped: dict[int, list[Measured]] = {}
    for m in rows:
        grouped.setdefault(m.tokens_per_step, []).append(m)
    return {tokens: _Setting(tuple(sorted(runs, key=lambda m: m.seed))) for tokens, runs in grouped.items()}


#: The status of advice for a model whose width the map did not measure, from the width rule
#: (:func:`width_rule_rank`): with AdamW, any width without rows of its own.
RULE = "beyond the map (rule)"
#: The width rule, AdamW: the rank is ``RULE_COEFFICIENT * sqrt(width)``, at least ``RULE_FLOOR``, rounded up
#: to the rank ladder the map measures on (:data:`gradpress.autorank.RANK_LADDER`). At every measured AdamW
#: width (128, 256, 384, 512) that is the smallest measured rank that held at the smallest measured batch
#: (on data seen about once where the width was measured on it), and the measured rank below it fell
#: behind there (:func:`rule_evidence`; docs/tuning.md, "The width rule").
RULE_COEFFICIENT = WIDTH_RULE_COEFFICIENT
#: The width rule's smallest rank: at width 128 on data seen once, 2 x sqrt(width)'s 24 fell behind at 2 and
#: 8 workers' worth, where 32 held. It decides the rule only below width 256. ``AutoRank``'s default floor
#: is the same rank, for the same reason.
RULE_FLOOR = DEFAULT_MIN_RANK
#: The width rule's batch term: the rank grows as ``(tokens_per_step / RULE_BATCH_TOKENS) **
#: RULE_BATCH_EXPONENT`` above the batch the rule was fitted at (32 sequences of 64 tokens, 2 workers' worth
#: of 16; never below 1: smaller batches keep the width's rank). The averaged gradient's noise shrinks as
#: the batch grows, so a residual that hid under it at a small batch shows at a large one: at width 256 on
#: data seen once rank 32 held at 2,048 tokens per step and fell behind at 4,096, 8,192 and 16,384, where
#: 48 held; at width 128, 32 held up to 32,768 (2 x sqrt(128) x 16^(1/8) = 32 exactly): the largest
#: exponent the map's rows allow (docs/tuning.md, "The width rule").
RULE_BATCH_TOKENS = 2048
RULE_BATCH_EXPONENT = 0.125


def rule_batch_factor(tokens_per_step: int | None) -> float:
    """The width rule's batch term at ``tokens_per_step`` (over all workers): ``(tokens_per_step /
    RULE_BATCH_TOKENS) ** RULE_BATCH_EXPONENT``, at least 1; 1 where ``None``.

    >>> rule_batch_factor(2048), rule_batch_factor(1024), round(rule_batch_factor(8 * 2048), 3)
    (1.0, 1.0, 1.297)
    """
    if tokens_per_step is None:
        return 1.0
    if not (isinstance(tokens_per_step, int) and tokens_per_step >= 1):
        raise ValueError(f"tokens_per_step must be None or an integer >= 1, got {tokens_per_step!r}")
    return max(1.0, (tokens_per_step / RULE_BATCH_TOKENS) ** RULE_BATCH_EXPONENT)


def width_rule_rank(width: int, tokens_per_step: int | None = None) -> int:
    """The width rule's rank for a model of ``width`` trained at ``tokens_per_step`` over all workers: the
    smallest rank of :data:`~gradpress.autorank.RANK_LADDER` at least ``RULE_COEFFICIENT * sqrt(width) *``
    :func:`rule_batch_factor` ``(tokens_per_step)`` and at least :data:`RULE_FLOOR` (past the ladder's top,
    that product rounded up), at most ``width``. Without ``tokens_per_step``, the rule at the batch it was
    fitted at (no batch term).

    >>> [width_rule_rank(w) for w in (128, 256, 384, 512, 768, 4096)]
    [32, 32, 48, 48, 64, 128]
    >>> [width_rule_rank(192, t) for t in (2048, 8192)], width_rule_rank(768, 512 * 1024)   # GPT-2, 0.5M tokens
    ([32, 48], 128)
    """
    return width_rule(width, rule_batch_factor(tokens_per_step))


def _rule_words(width: int | None = None, tokens_per_step: int | None = None) -> str:
    """The width rule in words; with ``width``, the floor is named only where it raises the rank, and
    with ``tokens_per_step``, the batch term only where it is more than 1."""
    factor = rule_batch_factor(tokens_per_step)
    if width is None or tokens_per_step is None:
        batch = f" x (tokens/step / {RULE_BATCH_TOKENS:,})^{RULE_BATCH_EXPONENT:g} (at least 1)"
    else:
        batch = "" if factor == 1.0 else f" x ({tokens_per_step:,} / {RULE_BATCH_TOKENS:,})^{RULE_BATCH_EXPONENT:g}"
    floor = width is None or up_the_ladder(RULE_COEFFICIENT * math.sqrt(width) * factor) < RULE_FLOOR
    return f"{RULE_COEFFICIENT:g} x sqrt(width){batch}" + (f", at least {RULE_FLOOR}," if floor else "")


def rule_evidence(optimizer: str = "adamw") -> tuple[Measured, ...]:
    """The rows the width rule rests on: at each measured width, at its smallest measured batch, every seed
    of the rule's rank and of the largest measured rank below it; where a width was measured on data seen
    about once, from those rows (as :func:`advise` reads them for a user's model)."""
    rows = [m for m in MEASURED if m.optimizer == optimizer]
    evidence: list[Measured] = []
    for width in sorted({m.width for m in rows}):
        here = _seen_once_first([m for m in rows if m.width == width])
        tokens = min(m.tokens_per_step for m in here)
        here = [m for m in here if m.tokens_per_step == tokens]
        rank = width_rule_rank(width)
        below = max((m.rank for m in here if m.rank < rank), default=None)
        evidence += sorted((m for m in here if m.rank in (rank, below)), key=lambda m: (-m.rank, m.seed))
    return tuple(evidence)


def _rule_advice(width: int, optimizer: str, rows: list[Measured], tokens_per_step: int) -> Advice:
    """The width rule's advice for a ``width`` the map's ``rows`` (``optimizer``'s) do not have, at
    ``tokens_per_step``."""
    rank = width_rule_rank(width, tokens_per_step)
    evidence = rule_evidence(optimizer)
    fit = []
    for w in sorted({m.width for m in evidence}):
        held = width_rule_rank(w)
        below = sorted({m.rank for m in evidence if m.width == w and m.rank < held})
        fit.append(f"width {w}: {held} held" + "".join(f", {r} fell behind" for r in below))
    widths = ", ".join(str(w) for w in sorted({m.width for m in rows}))
    return Advice("powersgd", rank, recipe_options(optimizer), RULE,
                  f"{OPTIMIZER_WORDS[optimizer]} at width {width}, not measured (measured widths {widths}): the width "
                  f"rule's rank at {tokens_per_step:,} tokens/step, {_rule_words(width, tokens_per_step)} up the rank "
                  f"ladder = {rank}, the smallest measured rank that held at each measured width's smallest batch "
                  f"({'; '.join(fit)}), and more as the batch grows (48 from 2 x 32 sequences at width 256); "
                  f"AutoRank(max_rank={up_the_ladder(2 * rank)}) chooses one on your own gradients instead, against "
                  "the noise of their average (docs/tuning.md)",
                  None, evidence, width=width, tokens_per_step=tokens_per_step)


def rank_for_width(width: int) -> int:
    """PowerSGD's rank for a model of this width: the rule every measured recipe follows
    (:func:`gradpress.tools.check.advice.recipe_rule`: width / 8, at most 22, at least 1)."""
    return max(1, min(22, width // 8))


@dataclass(frozen=True)
class Advice:
    """What the map says for a setting.

    ``method``: ``"powersgd"`` (at ``rank`` with ``powersgd_options``) or ``"fp16"`` (the fp16 allreduce
    hook). ``status``: ``"measured"``, ``"beyond the map"``, ``"measured to fall behind"`` or ``"not
    measured"`` for the rows of the model's own width; :data:`RULE` (``"beyond the map (rule)"``) for the
    width rule's rank at a width without rows (AdamW); :data:`BORROWED` (``"borrowed"``) where they are
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
    tokens_per_step: int | None = None

    @property
    def status_text(self) -> str:
        """The status in words: ``status`` itself, or for :data:`BORROWED` advice which width it was read
        from and what that width's rows said, e.g. ``"borrowed (nearest measured width 256; not measured at
        768)"``, ``"borrowed (nearest measured width 256, beyond the map there; not measured at 768)"``."""
        if self.status == RULE:
            return (f"{RULE[:-1]}: {_rule_words(self.width, self.tokens_per_step)} up the ladder = {self.rank}; "
                    f"not measured at {self.width})")
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
    as the digits CNN; with AdamW, the width rule for a GPT it does not have); without it (a user's
    model), the rows of the model's width, else with AdamW the width rule (:data:`RULE`,
    :func:`width_rule_rank`), with SGD the rows of the nearest measured width.
    Without ``task``, from the smallest batch at which the width was measured on data seen about once (as
    pre-training reads its data: :attr:`Measured.seen_once`) up, those rows are read, not the repeated
    text's.
    The rank is the smallest measured rank, from :func:`rank_for_width`'s up, that was not measured behind
    allreduce at the nearest measured batch on either side of this one (a wider model may need more than
    the rule's cap; with SGD larger batches fell behind, with AdamW on gpt the smallest did); the
    learning rate, where the same task was measured with this optimizer, the tuned allreduce's at the
    nearest measured batch. Where the rows read are not of ``width`` (the nearest measured width stands
    in for it) the status is :data:`BORROWED`, whatever those rows said, and never ``"measured"``.

    >>> advise(512, "adamw", 2 * 16 * 64).rank, advise(640, "adamw", 2 * 16 * 64).status
    (48, 'beyond the map (rule)')
    """
    if optimizer not in OPTIMIZER_WORDS:
        raise ValueError(f"optimizer must be one of {', '.join(OPTIMIZER_WORDS)}, got {optimizer!r}")
    if not (isinstance(width, int) and width >= 1):
        raise ValueError(f"width must be an integer >= 1, got {width!r}")
    if not (isinstance(tokens_per_step, int) and tokens_per_step >= 1):
        raise ValueError(f"tokens_per_step must be an integer >= 1, got {tokens_per_step!r}")
    rank = rank_for_width(width)
    rows = [m for m in MEASURED if m.optimizer == optimizer]
    words = OPTIMIZER_WORDS[optimizer]
    if task is not None and not any(m.task == task for m in MEASURED):
        if optimizer == "adamw" and rows and task.startswith("gpt"):  # the rule's models: GPTs of any width
            return _rule_advice(width, optimizer, rows, tokens_per_step)
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
        if near != width and optimizer == "adamw":
            return _rule_advice(width, optimizer, rows, tokens_per_step)
        rows = _seen_once_first([m for m in rows if m.width == near])
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


def _seen_once_first(rows: list[Measured]) -> list[Measured]:
    """``rows`` (one width's), without the repeated text's from the smallest batch at which this width was
    measured on data seen about once: a user's pre-training reads its data about once, and the larger the
    batch, the more often the 800 steps read the repeated text (at 8 workers' worth its rank 16 held,
    -0.38%, where on data seen once it fell behind, +3.93%)."""
    once = min((m.tokens_per_step for m in rows if m.seen_once), default=None)
    return [m for m in rows if m.seen_once or once is None or m.tokens_per_step < once]


def _after(failures: list[_Setting]) -> str:
    """What the advice passed over: the lower ranks measured behind allreduce."""
    return "".join(f"; rank {m.rank} was behind ({m.describe()})" for m in failures)


def _evidence(*settings: _Setting) -> tuple[Measured, ...]:
    return tuple(m for setting in settings for m in setting.runs)


#: The training part of the repeated text (pydoc_data's ~465k characters less the held-out tenth), which
#: an 800-step run at ``t`` tokens per step reads ``800 t / _REPEATED_TEXT`` times.
_REPEATED_TEXT = 418_000


def markdown_table() -> str:
    """:data:`MEASURED` as the markdown table docs/tuning.md shows (rows that miss the target in bold)."""
    lines = ["| task (width) | data | optimizer | tokens/step (sequences of 64) | rank | seed | final perplexity vs "
             "allreduce | best vs allreduce's best | bytes/step fewer | trained on |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for m in MEASURED:
        best = f"{m.best_vs_allreduce:+.2f}%"
        sequences = m.tokens_per_step // CHARS_PER_SEQUENCE
        data = "seen once" if m.seen_once else f"repeated, read ~{m.tokens_per_step * 800 / _REPEATED_TEXT:.0f}x"
        lines.append(f"| {m.task} ({m.width}) | {data} | {OPTIMIZER_WORDS[m.optimizer]} | {m.tokens_per_step:,} "
                     f"({sequences}) | {m.rank} | {m.seed} | {m.end_vs_allreduce:+.2f}% | "
                     f"{best if m.holds else f'**{best}**'} | {m.bytes_ratio:.1f}x | {m.device.upper()} |")
    return "\n".join(lines)

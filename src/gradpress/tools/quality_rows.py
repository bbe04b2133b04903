"""The quality study's measured rows (BENCHMARKS.md, "Does PowerSGD train as well as allreduce?"), which
:mod:`gradpress.tools.quality_map` reads: each a PowerSGD configuration trained for 800 steps beside
allreduce at allreduce's own tuned learning rate, with the same data order and initial weights, and how
its perplexity compared (a test holds every row to its run's JSON in ``benchmarks/results/``).

>>> len({m.width for m in MEASURED if m.optimizer == "adamw"}) >= 3
True
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

__all__ = ["CHARS_PER_SEQUENCE", "MEASURED", "OPTIMIZER_WORDS", "QUALITY_TARGET", "SEEN_ONCE_MARK", "Measured",
           "describe_runs"]

#: The quality target, in percent of allreduce's final perplexity.
QUALITY_TARGET = 1.5
#: The mark of the tasks whose data a run reads about once (``gpt-stdlib``, ``gpt-stdlib-w384``, ...).
SEEN_ONCE_MARK = "stdlib"
#: Characters per sequence in the demo's text tasks (``gradpress.tools.workloads.tasks.SEQUENCE``).
CHARS_PER_SEQUENCE = 64


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
    measured with several seeds has one row per seed, and :func:`~gradpress.tools.quality_map.advise` reads
    their mean. ``device``:
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

    @property
    def seen_once(self) -> bool:
        """Whether the run read its data about once, as pre-training does (the tasks on Python's standard
        library), rather than a 465k-character text many times over (the others: from 8 workers' worth on,
        their rows measure a method's regularizing effect on a repeated text as much as its fidelity)."""
        return SEEN_ONCE_MARK in self.task

    def describe(self) -> str:
        """``"gpt, AdamW, 2,048 tokens/step: rank 16 ended +1.23% (best +1.23%) at 11.2x fewer bytes"``."""
        return describe_runs(self, f"{self.end_vs_allreduce:+.2f}% (best {self.best_vs_allreduce:+.2f}%)")


def describe_runs(m: Measured, ended: str) -> str:
    """``m``'s setting, rank and bytes around ``ended``, the figures of one run or of its seeds."""
    where = "" if m.device == "cpu" else f" (on an {m.device.upper()})"
    data = " (data seen once)" if m.seen_once else ""
    return (f"{m.task}{data}, {OPTIMIZER_WORDS[m.optimizer]}, {m.tokens_per_step:,} tokens/step{where}: rank {m.rank} "
            f"ended {ended} at {m.bytes_ratio:.1f}x fewer bytes")


OPTIMIZER_WORDS = {"sgd": "SGD", "adamw": "AdamW"}


def _row(task: str, width: int, optimizer: Literal["sgd", "adamw"], sequences: int, rank: int, end: float,
         best: float, bytes_ratio: float, lr: float, label: str, seed: int = 0,
         device: Literal["cpu", "h100"] = "cpu") -> Measured:
    return Measured(task, width, optimizer, sequences * CHARS_PER_SEQUENCE, rank, end, best, bytes_ratio, lr, label,
                    seed, device)


#: The measured rows, each with an fp16 wire and compression from step 80 of 800 (BENCHMARKS.md).
#: SGD: momentum 0.9, 16 sequences per worker, 2 and 4 workers. AdamW: nanoGPT's (betas 0.9/0.95,
#: weight decay 0.1, warm-up then cosine), 2 workers x 16, 32, 64 or 128 sequences (2, 4, 8 and 16
#: workers' worth of 16), seeds 0, 1 and 2 at 2 x 16; 2 x 256 (32 workers' worth) on an H100, with the
#: recipe's half-precision warm-up (:data:`~gradpress.tools.quality_map.ADAMW_OPTIONS`); widths 384 and
#: 512 (``gpt-stdlib-w<width>``, Python's standard library, seen about once) at 2 x 16, 384 at 2 x 32 and
#: 512 at 2 x 8 too, the same warm-up; gpt-stdlib (width 128, seen once) at 2 x 16, 32, 64, 128 and 256, ranks 24
#: and 32 at 2 x 32 with seeds 0 and 1;
#: gpt-wide-stdlib (256, seen once) at 2 x 16, rank 32 with seeds 0, 1 and 2, at 2 x 32, ranks 32 and 48
#: with seeds 0 and 1, at 2 x 64, ranks 32 and 48, and at 2 x 128, rank 48.
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
    # Data seen about once (gpt-stdlib), width 128, allreduce's rate tuned at each batch (6e-3 at 2-8 workers' worth):
    # rank 16 falls behind at every batch where the repeated text's held from 8 workers' worth on; 24 is
    # behind at 2 and 8 workers' worth (at 8, the rank AutoRank(0.995) chose in its run) and holds at 4 with
    # two seeds (+1.10%, +1.29%), 32 holds at every one.
    _row("gpt-stdlib", 128, "adamw", 32, 16, 3.79, 3.79, 11.25, 6e-3,
         "quality-stdlib/adamw-gpt-stdlib-w2b16-powersgd16-fp16-hwu-lr6e-3"),
    _row("gpt-stdlib", 128, "adamw", 32, 24, 1.97, 1.97, 7.50, 6e-3,
         "quality-stdlib/adamw-gpt-stdlib-w2b16-powersgd24-fp16-hwu-lr6e-3"),
    _row("gpt-stdlib", 128, "adamw", 32, 32, 0.72, 0.72, 5.05, 6e-3,
         "quality-stdlib/adamw-gpt-stdlib-w2b16-powersgd32-fp16-hwu-lr6e-3"),
    _row("gpt-stdlib", 128, "adamw", 64, 16, 3.59, 3.59, 11.25, 6e-3,
         "quality-stdlib/adamw-gpt-stdlib-w2b32-powersgd16-fp16-hwu-lr6e-3"),
    _row("gpt-stdlib", 128, "adamw", 64, 24, 1.10, 1.10, 7.50, 6e-3,
         "quality-stdlib/adamw-gpt-stdlib-w2b32-powersgd24-fp16-hwu-lr6e-3"),
    _row("gpt-stdlib", 128, "adamw", 64, 32, 0.05, 0.05, 5.05, 6e-3,
         "quality-stdlib/adamw-gpt-stdlib-w2b32-powersgd32-fp16-hwu-lr6e-3"),
    _row("gpt-stdlib", 128, "adamw", 64, 24, 1.29, 1.29, 7.50, 6e-3,
         "quality-stdlib/adamw-gpt-stdlib-w2b32-powersgd24-fp16-hwu-lr6e-3-seed1", seed=1),
    _row("gpt-stdlib", 128, "adamw", 64, 32, 0.75, 0.75, 5.05, 6e-3,
         "quality-stdlib/adamw-gpt-stdlib-w2b32-powersgd32-fp16-hwu-lr6e-3-seed1", seed=1),
    _row("gpt-stdlib", 128, "adamw", 128, 16, 3.93, 3.93, 11.25, 6e-3,
         "quality-stdlib/adamw-gpt-stdlib-w2b64-powersgd16-fp16-hwu-lr6e-3"),
    _row("gpt-stdlib", 128, "adamw", 128, 24, 1.63, 1.63, 7.50, 6e-3,
         "quality-stdlib/adamw-gpt-stdlib-w2b64-powersgdauto0.995-fp16-hwu-lr6e-3"),
    _row("gpt-stdlib", 128, "adamw", 128, 32, 0.18, 0.18, 5.05, 6e-3,
         "quality-stdlib/adamw-gpt-stdlib-w2b64-powersgd32-fp16-hwu-lr6e-3"),
    # 16 workers' worth: allreduce's best rate moved up (1.2e-2, 0.14% ahead of 6e-3); at it rank 32 holds.
    _row("gpt-stdlib", 128, "adamw", 256, 32, 0.57, 0.57, 5.05, 1.2e-2,
         "quality-stdlib/adamw-gpt-stdlib-w2b128-powersgd32-fp16-hwu-lr1.2e-2"),
    # 32 workers' worth (800 steps read 0.85 of the corpus), at 16 workers' worth's rate: rank 32 holds.
    _row("gpt-stdlib", 128, "adamw", 512, 32, 0.38, 0.38, 5.05, 1.2e-2,
         "quality-stdlib/adamw-gpt-stdlib-w2b256-powersgd32-fp16-hwu-lr1.2e-2"),
    # Width 256 on data seen about once (gpt-wide-stdlib), 2 x 16, allreduce's rate tuned (1.5e-3, between
    # 7.5e-4 and 3e-3): rank 24 falls behind, 32 holds on the mean of its seeds, 48 holds.
    _row("gpt-wide-stdlib", 256, "adamw", 32, 24, 2.37, 2.37, 15.13, 1.5e-3,
         "quality-stdlib/adamw-gpt-wide-stdlib-w2b16-powersgd24-fp16-hwu-lr1.5e-3"),
    _row("gpt-wide-stdlib", 256, "adamw", 32, 32, 1.54, 1.54, 11.31, 1.5e-3,
         "quality-stdlib/adamw-gpt-wide-stdlib-w2b16-powersgd32-fp16-hwu-lr1.5e-3"),
    _row("gpt-wide-stdlib", 256, "adamw", 32, 32, 1.05, 1.05, 11.31, 1.5e-3,
         "quality-stdlib/adamw-gpt-wide-stdlib-w2b16-powersgd32-fp16-hwu-lr1.5e-3-seed1", seed=1),
    _row("gpt-wide-stdlib", 256, "adamw", 32, 32, 1.21, 1.21, 11.31, 1.5e-3,
         "quality-stdlib/adamw-gpt-wide-stdlib-w2b16-powersgd32-fp16-hwu-lr1.5e-3-seed2", seed=2),
    _row("gpt-wide-stdlib", 256, "adamw", 32, 48, 0.55, 0.55, 7.61, 1.5e-3,
         "quality-stdlib/adamw-gpt-wide-stdlib-w2b16-powersgd48-fp16-hwu-lr1.5e-3"),
    # 4 workers' worth (2 x 32): allreduce's best rate doubles (3e-3; 1.5e-3 ends +0.55%, 6e-3 +6.6%); at it
    # the width rule's rank 32 falls behind on the mean of two seeds (+2.05%, +1.19%) and 48 holds (+1.17%, +0.67%).
    _row("gpt-wide-stdlib", 256, "adamw", 64, 32, 2.05, 2.05, 11.31, 3e-3,
         "quality-stdlib/adamw-gpt-wide-stdlib-w2b32-powersgd32-fp16-hwu-lr3e-3"),
    _row("gpt-wide-stdlib", 256, "adamw", 64, 48, 1.17, 1.17, 7.61, 3e-3,
         "quality-stdlib/adamw-gpt-wide-stdlib-w2b32-powersgd48-fp16-hwu-lr3e-3"),
    _row("gpt-wide-stdlib", 256, "adamw", 64, 32, 1.19, 1.19, 11.31, 3e-3,
         "quality-stdlib/adamw-gpt-wide-stdlib-w2b32-powersgd32-fp16-hwu-lr3e-3-seed1", seed=1),
    _row("gpt-wide-stdlib", 256, "adamw", 64, 48, 0.67, 0.67, 7.61, 3e-3,
         "quality-stdlib/adamw-gpt-wide-stdlib-w2b32-powersgd48-fp16-hwu-lr3e-3-seed1", seed=1),
    # 8 workers' worth (2 x 64): allreduce's rate stays at 3e-3 (6e-3 ends +2.81%); rank 32 falls behind again
    # and 48 holds with room.
    _row("gpt-wide-stdlib", 256, "adamw", 128, 32, 1.90, 1.90, 11.31, 3e-3,
         "quality-stdlib/adamw-gpt-wide-stdlib-w2b64-powersgd32-fp16-hwu-lr3e-3"),
    _row("gpt-wide-stdlib", 256, "adamw", 128, 48, -0.25, -0.25, 7.61, 3e-3,
         "quality-stdlib/adamw-gpt-wide-stdlib-w2b64-powersgd48-fp16-hwu-lr3e-3"),
    # 16 workers' worth (2 x 128), allreduce's rate stays at 3e-3 (6e-3 ends +1.13%): rank 48 holds, and 32
    # falls behind a third time (the rank AutoRank(0.996) chose here: E(32) 0.9967 at the end of the warm-up).
    _row("gpt-wide-stdlib", 256, "adamw", 256, 48, 0.40, 0.40, 7.61, 3e-3,
         "quality-stdlib/adamw-gpt-wide-stdlib-w2b128-powersgd48-fp16-hwu-lr3e-3"),
    _row("gpt-wide-stdlib", 256, "adamw", 256, 32, 2.09, 2.09, 11.31, 3e-3,
         "quality-stdlib/adamw-gpt-wide-stdlib-w2b128-powersgd32-fp16-hwu-lr3e-3"),
    # The width axis, on data seen about once; rank 48 at 2 x 16 is the rank AutoRank(0.995) chose in those
    # runs, and at 2 x 32 the width rule's, given from the start. Rank 32 at 2 x 32 is what AutoRank(0.995)
    # would have chosen there (E(32) 0.9959), given from the start.
    _row("gpt-stdlib-w384", 384, "adamw", 32, 32, 1.92, 1.92, 16.91, 7.5e-4,
         "quality-width/adamw-w384-w2b16-powersgd32-fp16-hwu-lr7.5e-4"),
    _row("gpt-stdlib-w384", 384, "adamw", 32, 48, 0.91, 0.91, 11.35, 7.5e-4,
         "quality-width/adamw-w384-w2b16-powersgdauto0.995-fp16-hwu-lr7.5e-4"),
    _row("gpt-stdlib-w384", 384, "adamw", 32, 48, 0.61, 0.61, 11.35, 7.5e-4,
         "quality-width/adamw-w384-w2b16-powersgd48-fp16-hwu-lr7.5e-4-seed1", seed=1),
    _row("gpt-stdlib-w384", 384, "adamw", 64, 32, 1.73, 1.73, 16.91, 1.5e-3,
         "quality-width/adamw-w384-w2b32-powersgd32-fp16-hwu-lr1.5e-3"),
    _row("gpt-stdlib-w384", 384, "adamw", 64, 48, 0.67, 0.67, 11.35, 1.5e-3,
         "quality-width/adamw-w384-w2b32-powersgd48-fp16-hwu-lr1.5e-3"),
    # Width 512 at 1 worker's worth (2 x 8): allreduce's rate tuned there too (7.5e-4, between 3.75e-4 and
    # 1.5e-3), and a second seed at that rate.
    _row("gpt-stdlib-w512", 512, "adamw", 16, 48, 0.78, 0.78, 15.08, 7.5e-4,
         "quality-width/adamw-w512-w2b8-powersgd48-fp16-hwu-lr7.5e-4"),
    _row("gpt-stdlib-w512", 512, "adamw", 16, 48, 0.44, 0.44, 15.08, 7.5e-4,
         "quality-width/adamw-w512-w2b8-powersgd48-fp16-hwu-lr7.5e-4-seed1", seed=1),
    _row("gpt-stdlib-w512", 512, "adamw", 32, 48, 0.86, 0.86, 15.08, 7.5e-4,
         "quality-width/adamw-w512-w2b16-powersgdauto0.995-fp16-hwu-lr7.5e-4"),
)

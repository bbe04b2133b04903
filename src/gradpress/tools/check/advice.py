"""Which method will train fastest: predicted step time per method from the model's arithmetic and the link.

The model is the floor of ``benchmarks/network/run.py``: no overlap of communication with the backward
pass is assumed, so a step costs

    predicted = compute step + the hook's own compute + Link.allreduce_seconds(bytes, collectives)

with a ring allreduce ``latency * 2 (n - 1)`` per collective plus ``bytes * 2 (n - 1) / n / busbw``.
Bytes per step come from the tools' byte model (:mod:`gradpress.tools.bytes`): allreduce sends every
gradient in fp32, the fp16 hook in fp16, PowerSGD what ``PowerSGDState.bytes_stats()`` counts
(:func:`~gradpress.tools.bytes.powersgd_bytes`: the plan's ``numel_sent`` at the wire's bytes per value;
two collectives per bucket, and on an fp16 wire one more tiny one per phase for the scale), local SGD
and DiLoCo one synchronization every ``H`` steps (:func:`~gradpress.tools.bytes.sync_bytes`, averaged
over the H steps). Local SGD and DiLoCo change the optimization (fewer synchronizations), so the
fastest step is not always the fastest to a given loss; the report says so.

PowerSGD's recommended configuration is one rank per model, passed in as ``recommended``: ``gradpress
check`` passes the quality map's (:func:`gradpress.tools.quality_map.advise` for the model's width,
optimizer and batch, with its options, e.g. AdamW's half-precision warm-up; see
:func:`gradpress.tools.check.report.powersgd_choice`). Without one, the rank comes from the model's width
by :func:`recipe_rule`, the rule the measured recipes of the demo's tasks follow (rank 16 on the
width-128 transformer, 22 on the wider models), on the recipes' fp16 wire. PowerSGD below that rank is
predicted too, for comparison, but never recommended: in the quality study it needed more steps to the
same loss (rank 4: never reached allreduce's mid-run perplexity on charlm), which a faster step does not
buy back.

>>> from gradpress.tools.check.link import Link
>>> link = Link(world_size=2, latency_s=1e-4, busbw=12.5e6)          # 100 Mbit/s
>>> rows = predict(candidate_methods([(512, 512), (512,)]), link, step_ms=20.0)
>>> rows[0].name != "allreduce"
True
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from fractions import Fraction
from typing import Any

import torch

from ...autorank import matrix_width
from ...averaging.outer_settings import OuterAdvice, advise_outer
from ...powersgd import make_plan
from .link import Link
from ..bytes import StepBytes, allreduce_bytes, powersgd_bytes, sync_bytes

__all__ = ["BUCKET_BYTES", "Method", "Prediction", "RankRule", "Recommended", "candidate_methods", "model_width",
           "outer_advice", "powersgd_configs", "predict", "recipe_rule", "recommend", "recommended_powersgd"]

#: DDP's default bucket size (``bucket_cap_mb=25``): one collective (per phase) per bucket.
BUCKET_BYTES = 25 * 1024 * 1024


def model_width(shapes: Sequence[Sequence[int]]) -> int:
    """The width of a model with gradients of ``shapes``: the median of ``min(n, m)`` over its matrices
    (their ``n x m`` views, as PowerSGD compresses them), each weighted by its elements; 0 without one.

    A transformer of width d gives d, an LSTM its hidden size: the small embeddings, heads and input
    matrices around them weigh little.

    >>> model_width([(512, 128), (128, 128), (97, 128), (128,)])
    128
    """
    plan = make_plan([tuple(int(d) for d in s) for s in shapes], 1, 0)
    return matrix_width(t.matrix for t in plan.tensors if len(t.shape) >= 2 and t.numel)


@dataclass(frozen=True)
class RankRule:
    """PowerSGD's rank for a model of width w: ``round(ratio * w)``, at least 1 and at most ``cap``, sent
    with ``bytes_per_weight`` bytes per value."""

    ratio: Fraction
    cap: int
    bytes_per_weight: int

    def rank(self, width: int) -> int:
        return max(1, min(self.cap, round(self.ratio * width)))


@functools.cache
def recipe_rule() -> RankRule:
    """The rule the measured recipes follow (:attr:`gradpress.tools.workloads.tasks.Task.recipe`, docs/tuning.md).

    ``cap``: the largest recipe rank (more was not measured); ``ratio``: the largest recipe rank per unit
    of its model's width (:func:`model_width`), i.e. that of a model whose width held its rank below the
    cap; ``bytes_per_weight``: the recipes' wire (the narrowest, should they differ). Every recipe's rank
    is this rule at its model's width (a test holds it to that).

    >>> rule = recipe_rule()
    >>> rule.ratio, rule.cap, rule.bytes_per_weight, rule.rank(128), rule.rank(256)
    (Fraction(1, 8), 22, 2, 16, 22)
    """
    from ..workloads.tasks import TASKS

    measured = []
    for task in TASKS.values():
        if task.recipe is not None:
            with torch.device("meta"):
                shapes = [p.shape for p in task.build().parameters() if p.requires_grad]
            measured.append((task.recipe, model_width(shapes)))
    return RankRule(ratio=max(Fraction(recipe.rank, width) for recipe, width in measured),
                    cap=max(recipe.rank for recipe, _ in measured),
                    bytes_per_weight=min(int(recipe.powersgd_options.get("bytes_per_weight", 4))
                                         for recipe, _ in measured))


def recommended_powersgd(shapes: Sequence[Sequence[int]]) -> tuple[int, int]:
    """``(rank, bytes_per_weight)`` by :func:`recipe_rule` at the width of a model with gradients of
    ``shapes``: the recommended configuration where the quality map is not read (``gradpress check``
    without ``--optimizer``; with it, check reads the map's rank, :func:`gradpress.tools.quality_map.advise`)."""
    rule = recipe_rule()
    return rule.rank(model_width(shapes)), rule.bytes_per_weight


#: ``(rank, options)`` of the recommended PowerSGD configuration: ``options`` are ``PowerSGDState``'s
#: keyword arguments besides the rank (``bytes_per_weight`` sets the wire; absent: fp32).
Recommended = tuple[int, Mapping[str, Any]]


def _recommended(shapes: Sequence[Sequence[int]], recommended: Recommended | None) -> Recommended:
    if recommended is not None:
        return int(recommended[0]), dict(recommended[1])
    rank, bytes_per_weight = recommended_powersgd(shapes)
    return rank, {"bytes_per_weight": bytes_per_weight}


def powersgd_configs(shapes: Sequence[Sequence[int]], powersgd_ranks: Sequence[int] = (4,),
                     recommended: Recommended | None = None) -> list[tuple[str, int, int, StepBytes]]:
    """The PowerSGD candidates for fp32 gradients of ``shapes``, as ``(name, rank, bytes_per_weight,
    bytes of one step)``: ``powersgd_ranks`` on an fp32 wire, then the recommended configuration
    (``recommended``, ``(rank, options)``: ``gradpress check`` passes the quality map's; by default
    :func:`recommended_powersgd`'s rule on its fp16 wire)."""
    shapes = [tuple(int(d) for d in s) for s in shapes]
    rank, options = _recommended(shapes, recommended)
    configs = [(int(r), 4) for r in powersgd_ranks] + [(rank, int(options.get("bytes_per_weight", 4)))]
    out = []
    for rank, bytes_per_weight in dict.fromkeys(configs):
        counts = powersgd_bytes(shapes, [torch.float32] * len(shapes), rank, 2, bytes_per_weight)
        out.append((f"powersgd-r{rank}-{counts.wire}", rank, bytes_per_weight, counts))
    return out


@dataclass(frozen=True)
class Method:
    """A candidate: ``bytes_per_step`` and ``collectives_per_step`` averaged over steps; ``config`` says how
    to use it; ``changes_optimization`` for methods that synchronize less often than every step; ``note``:
    why it trains differently from allreduce per step (empty when it does not), shown in the report."""

    name: str
    config: str
    bytes_per_step: float
    collectives_per_step: float
    changes_optimization: bool = False
    note: str = ""


@dataclass(frozen=True)
class Prediction:
    """One method's predicted step, in milliseconds, and its parts."""

    name: str
    config: str
    step_ms: float
    hook_ms: float
    comm_ms: float
    bytes_per_step: float
    changes_optimization: bool
    note: str = ""

    @property
    def predicted_ms(self) -> float:
        return self.step_ms + self.hook_ms + self.comm_ms

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "predicted_ms": self.predicted_ms}


def candidate_methods(shapes: Sequence[Sequence[int]], local_sgd_period: int = 8, diloco_period: int = 64,
                      powersgd_ranks: Sequence[int] = (4,), recommended: Recommended | None = None,
                      replicas: int | None = None, max_steps: int | None = None) -> list[Method]:
    """The candidates for a model whose gradients have ``shapes`` (fp32 gradients): allreduce, fp16,
    :func:`powersgd_configs` (``recommended``: PowerSGD's one recommended ``(rank, options)``, its config
    the ``PowerSGDState`` to build with all of ``options``; ranks below it carry a note), local SGD and
    DiLoCo, with the outer settings :func:`gradpress.averaging.outer_settings.advise_outer` gives for
    ``diloco_period``, ``replicas`` (``None`` or 1: its default count) and a run of ``max_steps``
    (``None``: its default length)."""
    if local_sgd_period < 1 or diloco_period < 1:
        raise ValueError(f"local_sgd_period={local_sgd_period} and diloco_period={diloco_period} must be >= 1")
    shapes = [tuple(int(d) for d in s) for s in shapes]
    numel = sum(math.prod(s) for s in shapes)
    if numel == 0:
        raise ValueError("shapes: the model has no parameters that take gradients")
    buckets = max(1, math.ceil(numel * 4 / BUCKET_BYTES))
    fp32 = [torch.float32] * len(shapes)
    methods = [
        Method("allreduce", "allreduce_hook (DDP's default)", allreduce_bytes(shapes, fp32).bytes_sent, buckets),
        Method("fp16", "fp16_compress_hook", allreduce_bytes(shapes, fp32, torch.float16).bytes_sent, buckets),
    ]
    recommended_rank, options = _recommended(shapes, recommended)
    for name, rank, bytes_per_weight, counts in powersgd_configs(shapes, powersgd_ranks, (recommended_rank, options)):
        phases = 2 * buckets * (2 if counts.wire == "fp16" else 1)  # an fp16 wire max-reduces its scales first
        note = f"rank below {recommended_rank}: more steps to the same loss" if rank < recommended_rank else ""
        chosen = rank == recommended_rank and bytes_per_weight == int(options.get("bytes_per_weight", 4))
        arguments = {**options, "bytes_per_weight": bytes_per_weight} if chosen else {
            "bytes_per_weight": bytes_per_weight}
        config = ", ".join([f"PowerSGDState(pg, matrix_approximation_rank={rank}"]
                           + [f"{k}={v!r}" for k, v in arguments.items()]) + ")"
        methods.append(Method(name, config, counts.bytes_sent, phases, note=note))
    periodic = "fewer syncs: check its loss"
    sync = sum(sync_bytes(shapes, fp32))  # every parameter, exactly
    methods.append(Method(f"local-sgd-h{local_sgd_period}", f"PeriodicModelAverager(period={local_sgd_period})",
                          sync / local_sgd_period, 1 / local_sgd_period, True, periodic))
    outer = outer_advice(diloco_period, replicas, max_steps)
    note = periodic + ("; plain averaging did as well at this period" if outer.plain_averaging else "")
    methods.append(Method(f"diloco-h{diloco_period}",
                          f"OuterOptimizerAverager(period={diloco_period}, {outer.arguments})",
                          sync / diloco_period, 1 / diloco_period, True, note))
    return methods


def outer_advice(diloco_period: int, replicas: int | None, max_steps: int | None = None) -> OuterAdvice:
    """The outer settings check gives DiLoCo's row: :func:`~gradpress.averaging.outer_settings.advise_outer`
    for ``diloco_period`` on ``replicas`` ranks (``None`` or one rank: its default count) in a run of
    ``max_steps`` optimizer steps (``None``: its default length)."""
    return advise_outer(diloco_period, replicas if replicas is not None and replicas >= 2 else None, max_steps)


def predict(methods: Sequence[Method], link: Link, step_ms: float,
            hook_ms: Mapping[str, float] | None = None) -> list[Prediction]:
    """Predicted step per method, fastest first. ``hook_ms``: measured hook compute by method name (0 if absent)."""
    if not step_ms >= 0:
        raise ValueError(f"step_ms={step_ms} must be >= 0")
    hook_ms = hook_ms or {}
    rows = [Prediction(m.name, m.config, step_ms, float(hook_ms.get(m.name, 0.0)),
                       1000 * link.allreduce_seconds(m.bytes_per_step, m.collectives_per_step), m.bytes_per_step,
                       m.changes_optimization, m.note) for m in methods]
    return sorted(rows, key=lambda row: row.predicted_ms)


def recommend(rows: Sequence[Prediction]) -> tuple[Prediction, str]:
    """The fastest method that trains like allreduce step for step (it synchronizes every step and carries
    no ``note``: allreduce, the cast hooks, PowerSGD at the recommended rank or above), and why, in one line.

    Local SGD / DiLoCo are recommended only when even the best per-step method spends most of its step on
    the link (they then say so: they change the optimization and need their own tuning).
    """
    by_name = {row.name: row for row in rows}
    baseline = by_name["allreduce"]
    every_step = [row for row in rows if not row.changes_optimization and not row.note]
    best = every_step[0]
    link_text = (f"the link carries {baseline.bytes_per_step / 1e6:.3g} MB in {baseline.comm_ms:.3g} ms "
                 f"against a {baseline.step_ms:.3g} ms step")
    if best.name == "allreduce" or best.predicted_ms > 0.95 * baseline.predicted_ms:
        return baseline, f"{link_text}: allreduce is enough (compression would save under 5%)"
    periodic = [row for row in rows if row.changes_optimization]
    if periodic and best.comm_ms > best.step_ms + best.hook_ms and periodic[0].predicted_ms < 0.5 * best.predicted_ms:
        choice = periodic[0]
        return choice, (f"{link_text}, and even {best.name} spends {best.comm_ms:.3g} ms on it: synchronize less "
                        f"often ({choice.name}, {baseline.predicted_ms / choice.predicted_ms:.2g}x faster steps; "
                        f"check its loss)")
    verb = "compress" if best.name.startswith("powersgd") else "halve the bytes"
    return best, (f"{link_text}: {verb} ({best.name}, {best.bytes_per_step / 1e6:.3g} MB, "
                  f"{baseline.predicted_ms / best.predicted_ms:.2g}x faster steps)")

"""The demo's communication methods: one registry (:data:`METHOD_REGISTRY`), each kind declared once.

A :class:`MethodKind` says what ``--methods`` accepts after its name (a PowerSGD rank, an averaging
period, or nothing), how the training loop builds its DDP hook and, for the methods that average
models, its averager, and what it sends at each step. Adding a method is adding one entry.

>>> [m.label for m in parse_methods("allreduce,powersgd,localsgd:16", [1, 2])]
['allreduce', 'powersgd r=1', 'powersgd r=2', 'localsgd H=16']
>>> METHOD_REGISTRY["multi"].argument, METHOD_REGISTRY["diloco"].argument, METHOD_REGISTRY["fp16"].argument
('rank', 'period', None)
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch

from ...averaging import ModelAverager, OuterOptimizerAverager, PeriodicModelAverager
from ...averaging.compress import QuantizeInt4, QuantizeInt8, TopK
from ...hooks import (PostLocalSGDState, PowerSGDState, allreduce_hook, bf16_compress_hook, fp16_compress_hook,
                     post_localSGD_hook, powerSGD_hook)
from ...powersgd import Plan
from ...streaming import StreamingDiLoCoAverager
from ...comm import link_bytes
from .. import bytes as model_bytes
from .config import DemoConfig
from .traffic import FragmentTraffic, allreduce_payload, at_anchor_step, gradients

__all__ = ["DEFAULT_PERIOD", "METHOD_KINDS", "METHOD_REGISTRY", "RECOMMENDED", "SPARSELOCO", "STREAMING_ALPHA",
           "STREAMING_DELAY", "STREAMING_FRAGMENTS", "Method", "MethodKind", "bytes_schedule", "link_schedule",
           "method_kind", "parse_methods", "warm_up_wire", "wire_bytes"]

#: Fragments, overlap (inner steps) and local share of ``streaming``: (F, tau, alpha), F and tau capped by H.
STREAMING_FRAGMENTS, STREAMING_DELAY, STREAMING_ALPHA = 4, 1, 0.5
#: ``sparseloco``'s outer step: top-k density, error-feedback decay (SparseLoCo's beta) and outer lr, with
#: no outer momentum. The best of a sweep on charlm (4 workers, 300 steps, H=8; BENCHMARKS.md): density
#: 1% -> 3% and beta 0.9/0.95 -> 1 each lowered the perplexity.
SPARSELOCO = {"density": 0.03, "error_decay": 1.0, "outer_lr": 1.0}
#: The demo's name for the quality map's advice (:mod:`gradpress.tools.quality_map`), resolved to one of
#: the methods here before they are parsed.
RECOMMENDED = "recommended"
#: Averaging period of ``localsgd`` and ``diloco`` when none is given.
DEFAULT_PERIOD = 8


@dataclass(frozen=True)
class Method:
    """A communication method: ``kind`` (a key of :data:`METHOD_KINDS`), PowerSGD's rank or local
    SGD's averaging period."""

    kind: str
    rank: int | None = None
    period: int | None = None

    @property
    def label(self) -> str:
        """``"allreduce"``, ``"powersgd r=2"``, ``"multi r=2"``, ``"localsgd H=8"``."""
        if self.period is not None:
            return f"{self.kind} H={self.period}"
        return self.kind if self.rank is None else f"{self.kind} r={self.rank}"

    @property
    def spec(self) -> str:
        """The ``--methods`` spelling that selects exactly this method (``"powersgd:2"``)."""
        number = self.rank if self.period is None else self.period
        return self.kind if number is None else f"{self.kind}:{number}"


#: ``(method, config) -> (state, hook)``: what the training loop registers on DDP.
HookBuilder = Callable[[Method, DemoConfig], tuple[Any, Any]]
#: ``(method, plan, config, world size) -> bytes``: payload bytes one worker hands to its collectives at
#: each step (the world size decides a compressed sync's schedule; ``None``: the all-gather's payload).
PayloadFn = Callable[[Method, Plan, DemoConfig, "int | None"], list[int]]
#: ``(method, plan, config, world size) -> bytes`` of one complete model synchronisation.
SyncBytesFn = Callable[[Method, Plan, DemoConfig, "int | None"], int]
#: ``(method, plan, config, world size) -> bytes`` one worker's link carries at each step (ring-equivalent).
LinkFn = Callable[[Method, Plan, DemoConfig, int], list[float]]
#: ``(method, plan, config, world size) -> bytes`` one worker's link carries for one complete synchronisation.
SyncLinkFn = Callable[[Method, Plan, DemoConfig, int], float]
#: ``(method, config, number of parameter tensors) -> averager`` wrapped around the optimizer.
AveragerBuilder = Callable[[Method, DemoConfig, int], ModelAverager]


@dataclass(frozen=True)
class MethodKind:
    """One kind of method, everything the demo needs to know about it.

    ``argument``: what ``kind:N`` sets: ``"rank"`` (PowerSGD's rank; without ``:N`` the kind runs once
    per given rank), ``"period"`` (the averaging period H; :data:`DEFAULT_PERIOD` without ``:N``) or
    ``None`` (nothing; ``kind:N`` is an error). ``hook``: builds ``(state, hook)`` for DDP. ``payload``:
    the bytes sent at each step (:func:`bytes_schedule`); ``link``: what one worker's link carries at
    each step (:func:`link_schedule`; by default the allreduce of the payload). ``averager``: builds the
    model averager that wraps the optimizer (``None``: gradients are averaged by the hook only). ``sync_bytes``: for the
    averaging kinds, the bytes of one complete model synchronisation after warm-up (the report's
    bytes/step is this over the period). ``alternating``: the compressed steps send different amounts
    (the report gives their mean, not the last step's). ``final_average``: always end on a plain average
    of the workers' models (not only when the last step did not synchronise). ``anchored``: the averager
    is DiLoCo's, whose anchor (the parameters where local steps start) is broadcast once, at the last
    warm-up step (:func:`anchor_bytes`).
    """

    name: str
    description: str
    argument: Literal["rank", "period"] | None
    hook: HookBuilder
    payload: PayloadFn
    averager: AveragerBuilder | None = None
    sync_bytes: SyncBytesFn | None = None
    link: LinkFn | None = None
    sync_link: SyncLinkFn | None = None
    alternating: bool = False
    final_average: bool = False
    anchored: bool = False

    @property
    def warms_up(self) -> bool:
        """Whether the method waits ``start_iter`` plain-allreduce steps before it starts (all kinds that
        take a rank or a period)."""
        return self.argument is not None

    def bytes_per_step(self, method: Method, plan: Plan, config: DemoConfig, wire: Sequence[float],
                       world_size: int, link: bool = False) -> float:
        """What one worker sends per step once the method runs, from ``wire`` (its bytes at each step:
        the payload, or zeros with one worker; with ``link``, what its link carries): the last step's; the
        mean after warm-up for an ``alternating`` kind; a synchronisation's bytes over the period for an
        averaging kind on several workers."""
        if self.sync_bytes is not None and world_size > 1:
            if link and self.sync_link is not None:
                return self.sync_link(method, plan, config, world_size) / (method.period or 1)
            if link:  # an averaging kind of one allreduce per synchronisation
                return link_bytes("allreduce", self.sync_bytes(method, plan, config, world_size), world_size) / (
                    method.period or 1)
            return self.sync_bytes(method, plan, config, world_size) / (method.period or 1)
        tail = wire[config.start_iter:]
        return sum(tail) / len(tail) if self.alternating and tail else wire[-1]


def wire_bytes(config: DemoConfig) -> int:
    """Bytes per element the PowerSGD methods put on the wire on compressed steps: the
    ``bytes_per_weight`` of ``config.powersgd_options`` (4, fp32, when not given)."""
    value = (config.powersgd_options or {}).get("bytes_per_weight")
    return 4 if value is None else int(value)  # None: the working precision, fp32 here


# --- hooks ----------------------------------------------------------------------------------------------

def _plain(hook: Any) -> HookBuilder:
    """A hook without state (the gradients of every step averaged)."""
    def build(method: Method, config: DemoConfig) -> tuple[Any, Any]:
        return None, hook
    return build


def _post_local(method: Method, config: DemoConfig) -> tuple[Any, Any]:
    """Gradients averaged until ``start_iter``, then none (the averager averages the models)."""
    return PostLocalSGDState(None, None, start_localSGD_iter=config.start_iter,
                             post_local_gradient_allreduce=False), post_localSGD_hook


def _powersgd(num_iters_per_step: int | None) -> HookBuilder:
    """``powerSGD_hook`` at the method's rank: classic (``None``) or ``num_iters_per_step`` one-sided
    iterations per step."""
    def build(method: Method, config: DemoConfig) -> tuple[Any, Any]:
        options: dict[str, Any] = {
            "matrix_approximation_rank": method.rank or 1, "start_powerSGD_iter": config.start_iter,
            "min_compression_rate": config.min_compression_rate, "random_seed": config.seed,
            "num_iters_per_step": num_iters_per_step, "warm_up_beta_factor": config.warm_up_beta,
            # Measured at (about) every evaluation, where the curve records both.
            "approximation_error_every_n_iters": max(1, config.steps // config.evals),
            "global_residual_every_n_iters": max(1, config.steps // config.evals),
            **(config.powersgd_options or {})}
        return PowerSGDState(None, **options), powerSGD_hook
    return build


# --- averagers ------------------------------------------------------------------------------------------

def _periodic_averager(method: Method, config: DemoConfig, num_tensors: int) -> ModelAverager:
    return PeriodicModelAverager(method.period or 1, warmup_steps=config.start_iter)


def _outer_averager(method: Method, config: DemoConfig, num_tensors: int) -> ModelAverager:
    return OuterOptimizerAverager(method.period or 1, warmup_steps=config.start_iter,
                                  outer_lr=config.outer_lr, outer_momentum=config.outer_momentum)


def _streaming_averager(method: Method, config: DemoConfig, num_tensors: int) -> StreamingDiLoCoAverager:
    period = method.period or 1
    return StreamingDiLoCoAverager(
        period, warmup_steps=config.start_iter, num_fragments=min(STREAMING_FRAGMENTS, period, num_tensors),
        fragment_sync_delay=min(STREAMING_DELAY, period - 1), fragment_update_alpha=STREAMING_ALPHA,
        outer_lr=config.outer_lr, outer_momentum=config.outer_momentum)


def _streaming_int4_averager(method: Method, config: DemoConfig, num_tensors: int) -> StreamingDiLoCoAverager:
    """``streaming``'s fragments, overlap and mixing, with int4 outer gradients (``config.schedule``)."""
    period = method.period or 1
    return StreamingDiLoCoAverager(
        period, warmup_steps=config.start_iter, num_fragments=min(STREAMING_FRAGMENTS, period, num_tensors),
        fragment_sync_delay=min(STREAMING_DELAY, period - 1), fragment_update_alpha=STREAMING_ALPHA,
        outer_lr=config.outer_lr, outer_momentum=config.outer_momentum, compression=QuantizeInt4(),
        schedule=config.schedule)


def _quantized_averager(compressor: Callable[[], Any]) -> AveragerBuilder:
    """DiLoCo (one fragment, no overlap) with the outer gradient compressed by ``compressor()``."""
    def build(method: Method, config: DemoConfig, num_tensors: int) -> StreamingDiLoCoAverager:
        return StreamingDiLoCoAverager(method.period or 1, warmup_steps=config.start_iter, outer_lr=config.outer_lr,
                                       outer_momentum=config.outer_momentum, compression=compressor(),
                                       schedule=config.schedule)
    return build


def _sparseloco_averager(method: Method, config: DemoConfig, num_tensors: int) -> StreamingDiLoCoAverager:
    # No outer momentum: the decayed error feedback stands in for it.
    return StreamingDiLoCoAverager(method.period or 1, warmup_steps=config.start_iter,
                                   outer_lr=SPARSELOCO["outer_lr"], outer_momentum=0.0,
                                   compression=TopK(density=SPARSELOCO["density"],
                                                    error_decay=SPARSELOCO["error_decay"]),
                                   schedule=config.schedule)


# --- payloads -------------------------------------------------------------------------------------------

_gradients, _allreduce = gradients, allreduce_payload


def _every_step(wire_dtype: torch.dtype | None) -> PayloadFn:
    """Every gradient element at every step: allreduce (fp32), fp16 and bf16 (the hooks' cast dtype)."""
    def payload(method: Method, plan: Plan, config: DemoConfig, world_size: int | None = None) -> list[int]:
        return [_allreduce(plan, wire_dtype)] * config.steps
    return payload


def _compressed(method: Method, plan: Plan, config: DemoConfig, num_iters_per_step: int | None,
                iteration: int) -> int:
    """Bytes of one compressed PowerSGD step as the state counts them
    (:func:`gradpress.tools.bytes.powersgd_bytes`, at :func:`wire_bytes`)."""
    return model_bytes.powersgd_bytes(*_gradients(plan), method.rank or 1, config.min_compression_rate,
                                      wire_bytes(config), num_iters_per_step, iteration).bytes_sent


def warm_up_wire(config: DemoConfig) -> torch.dtype | None:
    """What the PowerSGD methods' warm-up sends: fp16 with ``warm_up_bytes_per_weight=2`` in
    ``config.powersgd_options`` (the demo's gradients are fp32), else ``None``: the gradients as they are."""
    return torch.float16 if (config.powersgd_options or {}).get("warm_up_bytes_per_weight") == 2 else None


def _powersgd_payload(method: Method, plan: Plan, config: DemoConfig, world_size: int | None = None) -> list[int]:
    """The warm-up's exact average until ``start_iter`` (:func:`warm_up_wire`), then ``(n + m) r`` per
    compressed matrix and the rest as is."""
    warm, compressed = _allreduce(plan, warm_up_wire(config)), _compressed(method, plan, config, None, 0)
    return [warm if step < config.start_iter else compressed for step in range(config.steps)]


def _multi_payload(method: Method, plan: Plan, config: DemoConfig, world_size: int | None = None) -> list[int]:
    """The warm-up's exact average until ``start_iter`` (:func:`warm_up_wire`), then one factor per step
    (alternately ``n r`` and ``m r``)."""
    warm = _allreduce(plan, warm_up_wire(config))
    return [warm if step < config.start_iter else _compressed(method, plan, config, 1, step - config.start_iter)
            for step in range(config.steps)]


def _periodic_payload(method: Method, plan: Plan, config: DemoConfig, world_size: int | None = None) -> list[int]:
    """Every element on the synchronous steps and on each averaging step (every ``period`` steps from
    ``start_iter``), nothing on the others; DiLoCo's anchor at the last warm-up step."""
    return _with_anchor(_periodic_without_anchor(method, plan, config), method, plan, config)


def _periodic_without_anchor(method: Method, plan: Plan, config: DemoConfig) -> list[int]:
    period = method.period or 1
    warm, sync = _allreduce(plan), _whole_model(method, plan, config)
    return [warm if step < config.start_iter else sync if (step - config.start_iter) % period == 0 else 0
            for step in range(config.steps)]


def _periodic_link(method: Method, plan: Plan, config: DemoConfig, world_size: int) -> list[float]:
    """:func:`_periodic_payload`'s allreduces on one worker's link, and DiLoCo's anchor broadcast."""
    out = [link_bytes("allreduce", b, world_size) for b in _periodic_without_anchor(method, plan, config)]
    return _with_anchor_link(out, method, plan, config, world_size)


def anchor_bytes(method: Method, plan: Plan, config: DemoConfig) -> int:
    """Bytes of the anchor's broadcast (every parameter, fp32) for DiLoCo's averagers, else 0."""
    return model_bytes.anchor_bytes(*_gradients(plan)) if METHOD_REGISTRY[method.kind].anchored else 0


def _with_anchor(out: list[int], method: Method, plan: Plan, config: DemoConfig) -> list[int]:
    """``out`` with the anchor's broadcast added at the last warm-up step (step 0 without warm-up)."""
    return at_anchor_step(out, config, anchor_bytes(method, plan, config))


def _with_anchor_link(out: list[float], method: Method, plan: Plan, config: DemoConfig,
                      world_size: int) -> list[float]:
    """``out`` with the anchor's broadcast on one worker's link added where :func:`_with_anchor` adds it."""
    return at_anchor_step(out, config, link_bytes("broadcast", anchor_bytes(method, plan, config), world_size))


def _whole_model(method: Method, plan: Plan, config: DemoConfig, world_size: int | None = None) -> int:
    """One synchronization of local SGD or DiLoCo: every parameter, exactly."""
    return sum(model_bytes.sync_bytes(*_gradients(plan)))


def _streamed(name: str, description: str, averager: AveragerBuilder, final_average: bool = False) -> MethodKind:
    """An averaging kind whose averager is a :class:`StreamingDiLoCoAverager` (fragments, compression)."""
    traffic = FragmentTraffic(averager)
    return MethodKind(name, description, "period", hook=_post_local, payload=traffic.payload,
                      averager=averager, sync_bytes=traffic.sync_bytes, link=traffic.link,
                      sync_link=traffic.sync_link, final_average=final_average, anchored=True)


#: Every method kind, in the order ``--help`` lists them.
METHOD_REGISTRY: dict[str, MethodKind] = {kind.name: kind for kind in (
    MethodKind("allreduce", "plain allreduce of fp32 gradients (the baseline)", None,
               hook=_plain(allreduce_hook), payload=_every_step(None)),
    MethodKind("fp16", "gradients cast to fp16 for the allreduce (fp16_compress_hook)", None,
               hook=_plain(fp16_compress_hook), payload=_every_step(torch.float16)),
    MethodKind("bf16", "gradients cast to bf16 for the allreduce (bf16_compress_hook)", None,
               hook=_plain(bf16_compress_hook), payload=_every_step(torch.bfloat16)),
    MethodKind("powersgd", "PowerSGD DDP hook, rank r (classic: P and Q every step)", "rank",
               hook=_powersgd(None), payload=_powersgd_payload),
    MethodKind("multi", "multi-iteration PowerSGD, one one-sided iteration per step (half of powersgd's floats)",
               "rank", hook=_powersgd(1), payload=_multi_payload, alternating=True),
    MethodKind("localsgd", "post-local SGD: synchronous until --start-iter, then local steps and model averaging "
               "every H steps (localsgd:H, default 8)", "period",
               hook=_post_local, payload=_periodic_payload, averager=_periodic_averager, sync_bytes=_whole_model,
               link=_periodic_link),
    MethodKind("diloco", "like localsgd, but every H steps the averaged change goes through an outer Nesterov "
               "optimizer (DiLoCo; outer lr 0.7, momentum 0.5)", "period",
               hook=_post_local, payload=_periodic_payload, averager=_outer_averager, sync_bytes=_whole_model,
               link=_periodic_link, anchored=True),
    # Its fragments are never all in step at once: the run always ends on a plain average.
    _streamed("streaming", "streaming DiLoCo: diloco with the model in 4 fragments synchronised in turn (one every "
              "H/4 steps, a quarter of the bytes each time), each sync overlapped with the next inner step",
              _streaming_averager, final_average=True),
    _streamed("diloco-int8", "diloco with the outer gradient quantized to int8 (per-chunk scales, error feedback)",
              _quantized_averager(QuantizeInt8)),
    _streamed("diloco-int4", "diloco with the outer gradient quantized to int4 (per-chunk scales, error feedback)",
              _quantized_averager(QuantizeInt4)),
    _streamed("sparseloco", "diloco with a sparse outer gradient: top 3% of each chunk, 2-bit values, error "
              "feedback in place of the outer momentum (SparseLoCo)", _sparseloco_averager),
    _streamed("streaming-int4", "streaming with the outer gradient quantized to int4 (two-shot from 3 workers by "
              "default, --schedule)", _streaming_int4_averager, final_average=True),
)}

#: Method kinds: what each sends per step (``powersgd`` and ``multi`` take a rank).
METHOD_KINDS: dict[str, str] = {name: kind.description for name, kind in METHOD_REGISTRY.items()}


def _and(names: Sequence[str]) -> str:
    """``"a"``, ``"a and b"``, ``"a, b and c"``."""
    return names[0] if len(names) == 1 else f"{', '.join(names[:-1])} and {names[-1]}"


def method_kind(name: str) -> MethodKind:
    """The registered kind called ``name``; ``ValueError`` naming the valid ones otherwise."""
    try:
        return METHOD_REGISTRY[name]
    except KeyError:
        raise ValueError(f"unknown method {name!r}; valid methods: {', '.join(METHOD_REGISTRY)}") from None


def parse_methods(text: str | Sequence[str], ranks: Sequence[int]) -> list[Method]:
    """``"allreduce,powersgd,multi:4,localsgd:16"`` -> methods; a PowerSGD kind without ``:R`` runs once
    per rank; ``localsgd``/``diloco`` take an averaging period ``:H`` (default :data:`DEFAULT_PERIOD`).

    Raises ``ValueError`` (naming the valid methods) for an unknown name or a bad rank.
    """
    names = [t.strip() for t in (text.split(",") if isinstance(text, str) else text) if t.strip()]
    if not names:
        raise ValueError(f"--methods is empty; valid methods: {', '.join(METHOD_REGISTRY)}")
    ranked = [k.name for k in METHOD_REGISTRY.values() if k.argument == "rank"]
    periodic = [k.name for k in METHOD_REGISTRY.values() if k.argument == "period"]
    out: list[Method] = []
    for name in names:
        kind_name, _, number = name.partition(":")
        kind = METHOD_REGISTRY.get(kind_name)
        if kind is None:
            raise ValueError(f"unknown method {name!r}; valid methods: {', '.join(METHOD_REGISTRY)} "
                             f"({_and(ranked)} also as {ranked[0]}:R; {', '.join(periodic)} as {periodic[0]}:H)")
        if kind.argument == "period":
            if number and (not number.isdigit() or int(number) < 1):
                raise ValueError(f"method {name!r}: the period after ':' must be an integer >= 1")
            candidates = [Method(kind_name, period=int(number) if number else DEFAULT_PERIOD)]
        elif kind.argument is None:
            if number:
                raise ValueError(f"method {kind_name!r} takes no rank (got {name!r})")
            candidates = [Method(kind_name)]
        elif number:
            if not number.isdigit() or int(number) < 1:
                raise ValueError(f"method {name!r}: the rank after ':' must be an integer >= 1")
            candidates = [Method(kind_name, int(number))]
        else:
            candidates = [Method(kind_name, r) for r in ranks]
        out += [m for m in candidates if m not in out]
    return out


def bytes_schedule(method: Method, plan: Plan, config: DemoConfig, world_size: int | None = None) -> list[int]:
    """Payload bytes one worker hands to its collectives at each step (1-based index - 1), from the plan.
    (With one worker the collectives have no peer: nothing is sent, whatever the payload.) ``world_size``:
    the workers, which decide a compressed DiLoCo sync's schedule (``None``: the all-gather's payload,
    what this counted before the schedules existed).

    fp32 gradients: allreduce 4 bytes per element, fp16/bf16 2; PowerSGD sends every element (fp32)
    for ``start_iter`` steps, then ``(n + m) r`` per compressed matrix (classic), or one factor per step
    for ``multi`` (alternately ``n r`` and ``m r``), at :func:`wire_bytes` per element (4 unless
    ``config.powersgd_options`` sets ``bytes_per_weight``). ``localsgd``/``diloco`` send every element
    on the synchronous steps and on each averaging step (every ``period`` steps from ``start_iter``),
    nothing on the others; the streamed kinds each fragment's payload at its sync steps.
    """
    return method_kind(method.kind).payload(method, plan, config, world_size)


def link_schedule(method: Method, plan: Plan, config: DemoConfig, world_size: int) -> list[float]:
    """What one worker's link carries at each step over ``world_size`` workers, ring-equivalent
    (:func:`gradpress.comm.link_bytes`): the allreduce of :func:`bytes_schedule`'s payload for the
    gradient methods and PowerSGD; the model averagers' syncs by their collective (allreduce, an
    all-gathered or two-shot compressed outer gradient) and DiLoCo's anchor broadcast. Nothing with one
    worker."""
    kind = method_kind(method.kind)
    if kind.link is not None:
        return kind.link(method, plan, config, world_size)
    return [link_bytes("allreduce", b, world_size) for b in bytes_schedule(method, plan, config, world_size)]

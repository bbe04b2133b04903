"""``gradpress check``'s report: correctness, link, model and advice in one dict, and its text form.
:func:`collect` is a collective: call it on every rank of the default process group.

>>> report = collect("charlm", torch.device("cpu"))   # doctest: +SKIP
>>> print(format_report(report))                      # doctest: +SKIP
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist

from ... import comm
from ..cli.table import format_table
from ...comm import link_bytes
from ..bytes import allreduce_bytes, diloco_links, powersgd_bytes, reported_worlds
from ..quality_map import RULE, Advice, advise, recipe_options
from ..workloads.tasks import TASKS
from .advice import (Method, Prediction, candidate_methods, model_width, outer_advice, predict, recipe_rule,
                     recommend, recommended_powersgd)
from .compute import hook_compute_ms, step_ms
from .correctness import run_correctness
from .link import DEFAULT_SIZES, measure_link, node_groups
from .loader import load_model

__all__ = ["TOKENS_PER_STEP_HELP", "collect", "format_report", "powersgd_choice", "quality"]


#: What ``--tokens-per-step`` counts, and its default (``gradpress check --help``, docs/check.md).
TOKENS_PER_STEP_HELP = ("tokens (or samples) per optimizer step over all ranks, for the quality map: with gradient "
                        "accumulation, micro-batch tokens x accumulation steps x ranks (nanoGPT: batch_size x "
                        "block_size x gradient_accumulation_steps x ranks). Default: the model's example batch x "
                        "ranks, one micro-batch and no accumulation, when the model has an example batch; without "
                        "one, the quality map is not read")


def _slowest(value: float, device: torch.device) -> float:
    buffer = torch.tensor([value], dtype=torch.float64, device=device)
    return float(comm.all_reduce(buffer, issuer="gradpress check (slowest rank)", op="max"))


def collect(model: str, device: torch.device, given_step_ms: float | None = None,
            hooks: Mapping[str, Callable[..., Any]] | None = None, local_world_size: int | None = None,
            sizes: Sequence[int] = DEFAULT_SIZES, iters: int = 5, powersgd_ranks: Sequence[int] = (4,),
            local_sgd_period: int = 8, diloco_period: int = 64, optimizer: str | None = None,
            tokens_per_step: int | None = None, world_size: int | None = None,
            max_steps: int | None = None) -> dict[str, Any]:
    """Run every part of the check on every rank of the default group; the same report on every rank.

    ``model``: as ``--model`` (``ValueError`` naming it if invalid, raised before any collective).
    ``optimizer`` (``"sgd"``/``"adamw"``) and ``tokens_per_step`` (all ranks' tokens or samples per
    optimizer step, :data:`TOKENS_PER_STEP_HELP`; default: the example batch on every rank, one
    micro-batch) select the quality map's advice (``report["quality"]``), whose rank is the report's one
    PowerSGD rank (:func:`powersgd_choice`, ``report["model_info"]``): the candidate in the predictions,
    with the map's options; where PowerSGD was measured behind allreduce at that batch it is not
    recommended. Without an optimizer or a batch the rank is the measured recipes' rule, said so.
    ``given_step_ms``: the compute step when the model has no example batch (``--step-ms``); a measured
    step wins over it. ``hooks`` / ``local_world_size``: see :func:`~gradpress.tools.check.correctness.run_correctness`.
    ``world_size``: the world size of ``report["link_bytes"]`` (default: the launched group's), what one
    rank's link carries per step for each method (:func:`link_bytes_table`), also at W = 8, 64, 512.
    ``max_steps``: the run's length in optimizer steps, for DiLoCo's outer settings
    (:func:`~gradpress.averaging.outer_settings.advise_outer`; ``None``: its default length).
    """
    module, batch, loss = load_model(model, device)
    world = dist.get_world_size()
    report: dict[str, Any] = {"world_size": world, "backend": dist.get_backend(), "device": str(device),
                              "model": model}
    items = run_correctness(device, hooks, local_world_size)
    report["correctness"] = [{"name": i.name, "ok": i.ok, "reason": i.reason} for i in items]
    link = measure_link(device, None, sizes, iters)
    report["link"] = link.to_dict()
    if local_world_size is not None and 1 < local_world_size < world:
        intra, inter = node_groups(local_world_size)
        report["link_intra_node"] = measure_link(device, intra, sizes, iters, "inside a node").to_dict()
        report["link_inter_node"] = measure_link(device, inter, sizes, iters, "between nodes").to_dict()
    shapes = [tuple(p.shape) for p in module.parameters() if p.requires_grad]
    width = model_width(shapes)
    tokens_source: str | None
    if tokens_per_step is None and batch is not None:
        tokens_per_step, tokens_source = batch_tokens(batch) * world, "the example batch on every rank"
    else:
        tokens_source = "--tokens-per-step" if tokens_per_step is not None else None
    advice = _advice(width, optimizer, tokens_per_step, model if model in TASKS else None)
    report["quality"] = quality(width, optimizer, tokens_per_step, tokens_source,
                                model if model in TASKS else None, advice=advice)
    choice = powersgd_choice(shapes, advice)
    recommended = (choice["powersgd_rank"], choice["powersgd_options"])
    hook_ms = {name: _slowest(ms, device) for name, ms in
               hook_compute_ms(shapes, device, powersgd_ranks, recommended=recommended).items()}
    if batch is not None:
        measured, source = _slowest(step_ms(module, batch, loss, device), device), "measured (forward + backward)"
    elif given_step_ms is not None:
        measured, source = given_step_ms, "--step-ms"
    else:
        measured, source = 0.0, "unknown: the model has no example batch, give --step-ms"
    report["model_info"] = {"parameters": sum(p.numel() for p in module.parameters() if p.requires_grad),
                            "tensors": len(shapes), "step_ms": measured, "step_source": source,
                            "hook_compute_ms": hook_ms, "width": width, **choice}
    replicas = world if world_size is None else world_size
    methods = candidate_methods(shapes, local_sgd_period, diloco_period, powersgd_ranks, recommended, replicas,
                                max_steps)
    outer = outer_advice(diloco_period, replicas, max_steps)
    report["diloco_outer"] = {"period": diloco_period, "max_steps": max_steps, "outer_lr": outer.outer_lr,
                              "outer_momentum": outer.outer_momentum, "status": outer.status,
                              "plain_averaging": outer.plain_averaging, "reason": outer.reason}
    rows = predict(methods, link, measured, hook_ms)
    rows = _mark_measured_behind(rows, report["quality"])
    best, reason = recommend(rows)
    report["predictions"] = [row.to_dict() for row in rows]
    report["link_bytes"] = link_bytes_table(shapes, methods, world if world_size is None else world_size,
                                            diloco_period)
    report["recommendation"] = {"method": best.name, "config": best.config, "reason": reason}
    report["ok"] = all(item.ok for item in items)
    return report


def link_bytes_table(shapes: Sequence[Sequence[int]], methods: Sequence[Method], world_size: int,
                     diloco_period: int = 64) -> dict[str, Any]:
    """What one rank's link carries per step (ring-equivalent, :func:`gradpress.comm.link_bytes`) for each of
    ``methods`` (every one all-reduces its ``bytes_per_step``: ``2 (W - 1) / W`` of it) and for DiLoCo every
    ``diloco_period`` steps with int8/int4 outer gradients all-gathered or in two shots
    (:func:`gradpress.tools.bytes.diloco_links`), at ``world_size`` and W = 8, 64, 512: ``{"world_size",
    "world_sizes", "methods": {name: [bytes per W]}}``."""
    worlds = reported_worlds(world_size)
    table = {m.name: [link_bytes("allreduce", m.bytes_per_step, w) for w in worlds] for m in methods}
    fp32 = [torch.float32] * len(shapes)
    for name, values in diloco_links(shapes, fp32, worlds).items():
        if name != "exact":  # the exact DiLoCo is among the methods
            table[f"diloco-h{diloco_period} {name}"] = [v / diloco_period for v in values]
    return {"world_size": worlds[0], "world_sizes": worlds, "methods": table}


def batch_tokens(batch: Any) -> int:
    """Tokens (or samples) in one rank's example batch: the elements of its first tensor when it holds
    token ids (an integer tensor), else its first dimension."""
    first = batch[0] if isinstance(batch, (tuple, list)) else batch
    return int(first.numel()) if not first.is_floating_point() else int(first.shape[0])


def _advice(width: int, optimizer: str | None, tokens_per_step: int | None, task: str | None) -> Advice | None:
    """The map's advice, ``None`` without an optimizer or a batch size."""
    if optimizer is None or tokens_per_step is None:
        return None
    return advise(width, optimizer, tokens_per_step, task=task)


def quality(width: int, optimizer: str | None, tokens_per_step: int | None, source: str | None,
            task: str | None = None, advice: Advice | None = None) -> dict[str, Any]:
    """The quality map's advice (:func:`gradpress.tools.quality_map.advise`, or ``advice`` already read for
    these arguments) for the model's width, the optimizer and the global batch, as the report holds it
    (``"status_text"``: the status in words, naming the nearest measured width for ``"borrowed"`` advice);
    ``{"status": "not asked"...}`` without an optimizer or a batch size."""
    if optimizer is None or tokens_per_step is None:
        return {"status": "not asked", "status_text": "not asked",
                "reason": "give --optimizer and --tokens-per-step (all ranks' tokens or samples per optimizer "
                          "step) for the quality map's advice (docs/tuning.md)"}
    advice = advice or advise(width, optimizer, tokens_per_step, task=task)
    return {**advice.to_dict(), "optimizer": optimizer, "tokens_per_step": tokens_per_step,
            "tokens_source": source}


def powersgd_choice(shapes: Sequence[Sequence[int]], advice: Advice | None) -> dict[str, Any]:
    """The report's one PowerSGD configuration for a model with gradients of ``shapes``, what
    ``report["model_info"]`` holds and the predictions' PowerSGD candidate: ``powersgd_rank`` and
    ``powersgd_options`` (``PowerSGDState``'s other arguments), ``powersgd_source`` (where the rank comes
    from, in words), ``powersgd_advised`` (False where the map measured PowerSGD behind allreduce at this
    batch: the rank shown is then the lowest it measured behind, for comparison), and on this model's own
    shapes, fp32 gradients: ``powersgd_bytes_per_step`` (one worker, one compressed step, as
    ``PowerSGDState.bytes_stats()`` counts it), ``allreduce_bytes_per_step`` and ``powersgd_bytes_ratio``
    (their ratio, "x fewer bytes per step").

    From the quality map's ``advice`` where it was read (its rank and options, its status in words), else
    from the measured recipes' rule (:func:`~gradpress.tools.check.advice.recommended_powersgd`).
    """
    shapes = [tuple(int(d) for d in s) for s in shapes]
    advised = True
    if advice is None:
        rank, bytes_per_weight = recommended_powersgd(shapes)
        options: dict[str, Any] = {"bytes_per_weight": bytes_per_weight}
        rule = recipe_rule()
        source = (f"by the measured recipes' rule (width x {rule.ratio}, at most {rule.cap}; give --optimizer and "
                  "--tokens-per-step for the quality map's rank)")
    elif advice.method == "powersgd" and advice.rank is not None:
        rank, options = advice.rank, dict(advice.powersgd_options)
        source = (f"by the quality map's width rule, {advice.status_text}" if advice.status == RULE
                  else f"from the quality map, {advice.status_text}")
    else:  # the fp16 hook: every rank measured at the nearest batches fell behind
        rank = min(m.rank for m in advice.evidence)
        options = recipe_options(advice.evidence[0].optimizer)
        source = f"for comparison, not advised: the quality map, {advice.status_text}, advises the fp16 hook"
        advised = False
    fp32 = [torch.float32] * len(shapes)
    sent = powersgd_bytes(shapes, fp32, rank, 2, int(options.get("bytes_per_weight", 4))).bytes_sent
    exact = allreduce_bytes(shapes, fp32).bytes_sent
    return {"powersgd_rank": rank, "powersgd_options": options, "powersgd_source": source,
            "powersgd_advised": advised, "powersgd_bytes_per_step": sent, "allreduce_bytes_per_step": exact,
            "powersgd_bytes_ratio": exact / sent if sent else 0.0}


def _mark_measured_behind(rows: Sequence[Prediction], quality: Mapping[str, Any]) -> list[Prediction]:
    """The predictions, with PowerSGD's rows noted (so never recommended) where the quality map measured
    it behind allreduce at this global batch."""
    if quality.get("method") != "fp16":
        return list(rows)
    note = "measured behind allreduce at this batch (quality map)"
    return [dataclasses.replace(row, note=row.note or note) if row.name.startswith("powersgd") else row
            for row in rows]


def _size(nbytes: float) -> str:
    for unit, scale in (("MiB", 2 ** 20), ("KiB", 2 ** 10)):
        if nbytes >= scale:
            return f"{nbytes / scale:g} {unit}"
    return f"{nbytes:g} B"


def _link_lines(link: dict[str, Any]) -> list[str]:
    head = (f"link ({link['scope']}, {link['world_size']} ranks): bus bandwidth {link['busbw_gbps']:.3g} Gbit/s, "
            f"latency {link['latency_us']:.3g} us per hop")
    rows = [[_size(r["bytes"]), f"{1000 * r['seconds']:.3g}", f"{r['algbw'] * 8 / 1e9:.3g}",
             f"{r['busbw'] * 8 / 1e9:.3g}"] for r in link["sizes"]]
    return [head] + ["  " + line for line in format_table(["size", "ms", "algbw Gbit/s", "busbw Gbit/s"], rows, ">>>>")]


def _rank_line(info: dict[str, Any]) -> str:
    """The report's one PowerSGD rank for the model, where it comes from, and its bytes on the model."""
    return (f"  PowerSGD's rank for its width {info['width']}: {info['powersgd_rank']} {info['powersgd_source']}; "
            f"{info['powersgd_bytes_per_step'] / 1e6:.3g} MB per compressed step, "
            f"{info['powersgd_bytes_ratio']:.1f}x fewer bytes than allreduce's "
            f"{info['allreduce_bytes_per_step'] / 1e6:.3g} MB on this model")


def _link_table_lines(links: dict[str, Any], given: int | None) -> list[str]:
    worlds = links["world_sizes"]
    rows = [[name, *(f"{b / 1e6:.3g}" for b in values)] for name, values in links["methods"].items()]
    source = f"--world-size {given}" if given is not None else "the launched ranks"
    return ["  link MB per step by world size (what one rank's link carries, ring-equivalent: an allreduce "
            "2(W-1)/W of its payload, an all-gather W-1 payloads, two-shot 2(W-1)/W of its padded payload; "
            f"W = {links['world_size']} from {source})",
            *("  " + line for line in format_table(["method", *(f"W = {w}" for w in worlds)], rows,
                                                   "<" + ">" * len(worlds)))]


def format_report(report: dict[str, Any]) -> str:
    """The report as printed by ``gradpress check``."""
    lines = [f"gradpress check: {report['world_size']} ranks, {report['backend']}, {report['device']}", "",
             "correctness"]
    for item in report["correctness"]:
        lines.append(f"  {'PASS' if item['ok'] else 'FAIL'}  {item['name']}: {item['reason']}")
    lines.append("")
    if report["world_size"] == 1:
        lines.append("link: one rank, nothing to measure (run it under torchrun with the ranks you train with)")
    for key in ("link", "link_intra_node", "link_inter_node"):
        if key in report and report["world_size"] > 1:
            lines += _link_lines(report[key])
    info = report["model_info"]
    lines += ["", f"model {report['model']}: {info['parameters']:,} parameters in {info['tensors']} tensors; "
                  f"compute step {info['step_ms']:.3g} ms ({info['step_source']})",
              _rank_line(info)]
    links = report.get("link_bytes")
    given = links["world_size"] if links and links["world_size"] != report["world_size"] else None
    ring_factor = 2 * (report["world_size"] - 1) / report["world_size"]  # every candidate all-reduces
    rows = [[p["name"], f"{p['bytes_per_step'] / 1e6:.3g}", f"{ring_factor * p['bytes_per_step'] / 1e6:.3g}",
             f"{p['step_ms']:.3g}", f"{p['hook_ms']:.3g}",
             f"{p['comm_ms']:.3g}", f"{p['predicted_ms']:.3g}",
             p.get("note", "")] for p in report["predictions"]]
    lines += ["  " + line for line in format_table(
        ["method", "MB/step", "link MB/step", "step ms", "hook ms", "link ms", "predicted ms", "note"], rows,
        "<>>>>>><")]
    if links:
        lines += ["", *_link_table_lines(links, given)]
    q = report.get("quality", {})
    if q:
        head = "quality map" + (f" ({q['optimizer']}, {q['tokens_per_step']:,} tokens/step from {q['tokens_source']})"
                                if q["status"] != "not asked" else "")
        options = ", ".join(f"{k}={v!r}" for k, v in (q.get("powersgd_options") or {}).items())
        method = q.get("method", "")
        if options and method.startswith("powersgd"):  # the state to build: the rank and the wire options
            method += f" (PowerSGDState(..., matrix_approximation_rank={method.partition(':')[2]}, {options}))"
        lines += ["", f"{head}: {q.get('status_text', q['status'])}" + (f", {method}" if method else ""),
                  f"  {q['reason']}"]
        lines += [f"  {q['start']}"] if q.get("start") else []
    outer = report.get("diloco_outer")
    if outer:
        run = f" in a run of {outer['max_steps']:,} steps" if outer.get("max_steps") else ""
        lines += ["", f"DiLoCo every {outer['period']} steps{run}: outer_lr={outer['outer_lr']:g}, "
                      f"outer_momentum={outer['outer_momentum']:g} ({outer['status']})", f"  {outer['reason']}"]
    rec = report["recommendation"]
    lines += ["", f"recommended: {rec['method']} = {rec['config']}", f"  because {rec['reason']}",
              "", "all correctness checks passed" if report["ok"] else "SOME CORRECTNESS CHECKS FAILED"]
    return "\n".join(lines)

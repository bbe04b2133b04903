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
from ..quality_map import advise
from ..workloads.tasks import TASKS
from .advice import (Prediction, candidate_methods, model_width, predict, recipe_rule, recommend,
                     recommended_powersgd)
from .compute import hook_compute_ms, step_ms
from .correctness import run_correctness
from .link import DEFAULT_SIZES, measure_link, node_groups
from .loader import load_model

__all__ = ["collect", "format_report"]


def _slowest(value: float, device: torch.device) -> float:
    buffer = torch.tensor([value], dtype=torch.float64, device=device)
    return float(comm.all_reduce(buffer, issuer="gradpress check (slowest rank)", op="max"))


def collect(model: str, device: torch.device, given_step_ms: float | None = None,
            hooks: Mapping[str, Callable[..., Any]] | None = None, local_world_size: int | None = None,
            sizes: Sequence[int] = DEFAULT_SIZES, iters: int = 5, powersgd_ranks: Sequence[int] = (4,),
            local_sgd_period: int = 8, diloco_period: int = 64, optimizer: str | None = None,
            tokens_per_step: int | None = None) -> dict[str, Any]:
    """Run every part of the check on every rank of the default group; the same report on every rank.

    ``model``: as ``--model`` (``ValueError`` naming it if invalid, raised before any collective).
    ``optimizer`` (``"sgd"``/``"adamw"``) and ``tokens_per_step`` (all ranks' tokens or samples per
    optimizer step; default: the example batch on every rank) select the quality map's advice
    (``report["quality"]``); where PowerSGD was measured behind allreduce at that batch it is not recommended.
    ``given_step_ms``: the compute step when the model has no example batch (``--step-ms``); a measured
    step wins over it. ``hooks`` / ``local_world_size``: see :func:`~gradpress.tools.check.correctness.run_correctness`.
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
    hook_ms = {name: _slowest(ms, device) for name, ms in
               hook_compute_ms(shapes, device, powersgd_ranks).items()}
    if batch is not None:
        measured, source = _slowest(step_ms(module, batch, loss, device), device), "measured (forward + backward)"
    elif given_step_ms is not None:
        measured, source = given_step_ms, "--step-ms"
    else:
        measured, source = 0.0, "unknown: the model has no example batch, give --step-ms"
    report["model_info"] = {"parameters": sum(p.numel() for p in module.parameters() if p.requires_grad),
                            "tensors": len(shapes), "step_ms": measured, "step_source": source,
                            "hook_compute_ms": hook_ms, "width": model_width(shapes),
                            "powersgd_rank": recommended_powersgd(shapes)[0]}
    methods = candidate_methods(shapes, local_sgd_period, diloco_period, powersgd_ranks)
    rows = predict(methods, link, measured, hook_ms)
    tokens_source: str | None
    if tokens_per_step is None and batch is not None:
        tokens_per_step, tokens_source = batch_tokens(batch) * world, "the example batch on every rank"
    else:
        tokens_source = "--tokens-per-step" if tokens_per_step is not None else None
    report["quality"] = quality(report["model_info"]["width"], optimizer, tokens_per_step, tokens_source,
                                model if model in TASKS else None)
    rows = _mark_measured_behind(rows, report["quality"])
    best, reason = recommend(rows)
    report["predictions"] = [row.to_dict() for row in rows]
    report["recommendation"] = {"method": best.name, "config": best.config, "reason": reason}
    report["ok"] = all(item.ok for item in items)
    return report


def batch_tokens(batch: Any) -> int:
    """Tokens (or samples) in one rank's example batch: the elements of its first tensor when it holds
    token ids (an integer tensor), else its first dimension."""
    first = batch[0] if isinstance(batch, (tuple, list)) else batch
    return int(first.numel()) if not first.is_floating_point() else int(first.shape[0])


def quality(width: int, optimizer: str | None, tokens_per_step: int | None, source: str | None,
            task: str | None = None) -> dict[str, Any]:
    """The quality map's advice (:func:`gradpress.tools.quality_map.advise`) for the model's width, the
    optimizer and the global batch, as the report holds it; ``{"status": "not asked"...}`` without an
    optimizer or a batch size."""
    if optimizer is None or tokens_per_step is None:
        return {"status": "not asked", "reason": "give --optimizer and --tokens-per-step (all ranks' tokens or "
                "samples per optimizer step) for the quality map's advice (docs/tuning.md)"}
    advice = advise(width, optimizer, tokens_per_step, task=task)
    return {**advice.to_dict(), "optimizer": optimizer, "tokens_per_step": tokens_per_step,
            "tokens_source": source}


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


def _rule_text() -> str:
    rule = recipe_rule()
    return f"the measured recipes' rule: width x {rule.ratio}, at most {rule.cap}; docs/tuning.md"


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
              f"  PowerSGD's rank for its width {info['width']}: {info['powersgd_rank']} ({_rule_text()})"]
    rows = [[p["name"], f"{p['bytes_per_step'] / 1e6:.3g}", f"{p['step_ms']:.3g}", f"{p['hook_ms']:.3g}",
             f"{p['comm_ms']:.3g}", f"{p['predicted_ms']:.3g}",
             p.get("note", "")] for p in report["predictions"]]
    lines += ["  " + line for line in format_table(
        ["method", "MB/step", "step ms", "hook ms", "link ms", "predicted ms", "note"], rows, "<>>>>><")]
    q = report.get("quality", {})
    if q:
        head = "quality map" + (f" ({q['optimizer']}, {q['tokens_per_step']:,} tokens/step from {q['tokens_source']})"
                                if q["status"] != "not asked" else "")
        options = ", ".join(f"{k}={v!r}" for k, v in (q.get("powersgd_options") or {}).items())
        method = q.get("method", "")
        if options and method.startswith("powersgd"):  # the state to build: the rank and the wire options
            method += f" (PowerSGDState(..., matrix_approximation_rank={method.partition(':')[2]}, {options}))"
        lines += ["", f"{head}: {q['status']}" + (f", {method}" if method else ""), f"  {q['reason']}"]
        lines += [f"  {q['start']}"] if q.get("start") else []
    rec = report["recommendation"]
    lines += ["", f"recommended: {rec['method']} = {rec['config']}", f"  because {rec['reason']}",
              "", "all correctness checks passed" if report["ok"] else "SOME CORRECTNESS CHECKS FAILED"]
    return "\n".join(lines)

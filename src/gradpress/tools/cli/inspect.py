"""``gradpress inspect``: what PowerSGD compresses in a model, and how many bytes it sends.

``--model`` takes what ``gradpress check --model`` takes, through the same loader
(:func:`gradpress.tools.check.loader.load_model`): a built-in model of :mod:`gradpress.tools.zoo`, a model of
``gradpress demo``'s tasks (``--model gpt`` is the demo's ``--task gpt`` model) or ``module.path:function``
returning an ``nn.Module`` or ``(module, example_batch)`` (the batch is not used here).
The model is built on the meta device, so nothing is allocated, and
its gradient shapes (``model.parameters()`` that require grad, tied weights once, as DDP's hooks see
them) go through :func:`gradpress.powersgd.make_plan`, the plan the hooks and the aggregator use. Whether
a tensor is compressed does not depend on how DDP buckets it, so planning all parameters as one segment
gives the same floats as summing the plans of the buckets.

Traffic per epoch uses the PowerSGD paper's convention (Vogels et al. 2019, Table on ResNet-18/CIFAR-10):
what ONE worker puts into the allreduce per step, times ``steps = floor(dataset / (workers x batch))``
(``drop_last``), in MiB (2^20 bytes). Bytes come from the tools' one byte model (:mod:`gradpress.tools.bytes`):
allreduce sends the gradients in their dtype (:func:`~gradpress.tools.bytes.allreduce_bytes`), PowerSGD its
floats at the wire's precision, ``--bytes-per-weight`` (2: fp16, or bf16 for bf16 gradients), counted as
``PowerSGDState.bytes_stats()`` counts them (:func:`~gradpress.tools.bytes.powersgd_bytes`), so the
compression ratio is the state's.

Beside that payload, what one worker's **link** carries per step (ring-equivalent,
:func:`gradpress.comm.link_bytes`: an allreduce moves ``2 (W - 1) / W`` of its payload) at the world size
``--world-size`` (default: torchrun's ``WORLD_SIZE`` when launched by it, else ``--workers``) and at
W = 8, 64 and 512; and per synchronization of DiLoCo's outer gradient, exact and int8/int4 all-gathered or
in two shots (:func:`gradpress.tools.bytes.diloco_links`), where an all-gather's ``(W - 1)`` payloads show.

With ``--workers-per-node L`` it also shows the bytes that cross nodes per step, flat (every rank sends
its whole plan) vs :func:`gradpress.hierarchical_wrapper` (each local rank sends the plan of its share,
split by :func:`~gradpress.hooks.hierarchical.assign_shares`, the wrapper's own function).

>>> report = compression_report(build_named_model("resnet18-cifar"), "resnet18-cifar", rank=1)
>>> report["totals"]["floats_per_step"], round(report["totals"]["mib_per_epoch"]["allreduce"], 1)
({'allreduce': 11173962, 'powersgd': 45935}, 1023.0)
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

import os

from ...comm import link_bytes
from ..bytes import allreduce_bytes, diloco_links, powersgd_bytes, reported_worlds
from ..check.loader import load_model, valid_models
from ...hooks.hierarchical import assign_shares
from ...powersgd import make_plan
from ..workloads.tasks import TASKS
from .args import float_at_least, int_at_least
from .table import format_table

__all__ = ["DEMO_WORKERS", "GENERIC_SETTING", "SETTINGS", "Setting", "build_named_model", "compression_report",
           "format_report", "hierarchical_traffic", "register", "run", "task_setting"]

MIB = 1 << 20


@dataclass(frozen=True)
class Setting:
    """A training setup for the per-epoch figures: ``batch_size`` samples per worker per step."""

    workers: int
    batch_size: int
    dataset_size: int
    source: str


#: Default ``--workers/--batch-size/--dataset-size`` per built-in model.
SETTINGS: dict[str, Setting] = {
    "resnet18-cifar": Setting(16, 128, 50_000, "PowerSGD paper: CIFAR-10, 16 workers x 128 images"),
    "resnet50": Setting(8, 32, 1_281_167, "ImageNet-1k, 8 workers x 32 images (Goyal et al. 2017)"),
    "gpt2": Setting(8, 64, 8_789_062, "OpenWebText (~9e9 tokens) as 1024-token sequences, 8 workers x 64"),
    "lstm-wikitext2": Setting(16, 64, 69_620, "PowerSGD paper: WikiText-2 (2,088,628 tokens) as 30-token "
                                              "BPTT sequences, 16 workers x 64"),
}
#: Defaults for ``module:factory`` models.
GENERIC_SETTING = Setting(16, 128, 50_000, "generic default: 16 workers x 128 samples, 50,000 samples")
#: Workers of the per-epoch figures of a demo task's model: ``gradpress demo``'s default ``--workers``.
DEMO_WORKERS = 4


def build_named_model(name: str) -> nn.Module:
    """The model ``--model name`` means, on the meta device, by ``gradpress check``'s loader
    (:func:`gradpress.tools.check.loader.load_model`): ``ValueError`` naming ``--model`` and the valid values."""
    return load_model(name, torch.device("meta"), data=False)[0]


def task_setting(name: str) -> Setting:
    """The per-epoch setting of demo task ``name``: the demo's default workers, the task's batch size and
    its training set (loaded to count it: ``RuntimeError`` if the data's package is missing)."""
    task = TASKS[name]
    samples = len(task.load(0).y_train)
    unit = "images" if task.metric == "accuracy" else "windows"
    return Setting(DEMO_WORKERS, task.batch_size, samples,
                   f"gradpress demo --task {name}: {DEMO_WORKERS} workers x {task.batch_size} {unit}, "
                   f"{samples:,} training {unit}")


def _reason(numel: int, ndim: int, compressed: bool) -> str:
    if compressed:
        return "compressed"
    if ndim < 2:
        return "vector"
    return "empty" if numel == 0 else "below min rate"


def hierarchical_traffic(shapes: list[tuple[int, ...]], rank: int, min_compression_rate: float, workers: int,
                         workers_per_node: int, bytes_per_weight: int = 4,
                         dtypes: list[torch.dtype] | None = None) -> dict[str, Any]:
    """Inter-node bytes per step of the flat scheme vs :func:`gradpress.hierarchical_wrapper`, as a dict.

    Flat: every rank puts its whole plan into the allreduce that crosses nodes. Hierarchical: local rank
    ``j`` of each node puts in the plan of its share ``assign_shares(numels, L)[j]`` (the tensors are
    planned as one bucket; DDP's hook assigns shares per bucket, which moves tensors between local ranks
    but leaves each node's total unchanged: the sum of the shares' plans is the whole plan). Bytes from
    :mod:`gradpress.tools.bytes` for gradients of ``dtypes`` (default fp32). Raises
    ``ValueError`` unless ``workers_per_node`` divides ``workers`` into at least 2 nodes.

    >>> t = hierarchical_traffic([(512, 512), (512,)], rank=1, min_compression_rate=2, workers=4, workers_per_node=2)
    >>> [s["bytes_per_step"]["powersgd"] for s in t["shares"]]
    [4096, 2048]
    >>> t["per_node"]["hierarchical"]["powersgd"], t["per_node"]["flat"]["powersgd"]
    (6144, 12288)
    """
    if isinstance(workers_per_node, bool) or not isinstance(workers_per_node, int) or workers_per_node < 1:
        raise ValueError(f"--workers-per-node must be an integer >= 1, got {workers_per_node!r}")
    if workers % workers_per_node:
        raise ValueError(f"--workers-per-node {workers_per_node} does not divide --workers {workers}: "
                         "nodes must be of equal size")
    if workers_per_node == workers:
        raise ValueError(f"--workers-per-node {workers_per_node} puts all --workers {workers} on one node: "
                         "nothing crosses nodes; give more --workers")
    dtypes = [torch.float32] * len(shapes) if dtypes is None else dtypes
    plan = make_plan(shapes, rank, min_compression_rate)

    def sent(indices: list[int]) -> dict[str, int]:
        part = [shapes[i] for i in indices], [dtypes[i] for i in indices]
        return {"allreduce": allreduce_bytes(*part).bytes_sent,
                "powersgd": powersgd_bytes(*part, rank, min_compression_rate, bytes_per_weight).bytes_sent}

    shares = []
    share_bytes: list[dict[str, int]] = []  # each share's bytes_per_step
    for local_rank, share in enumerate(assign_shares([t.numel for t in plan.tensors], workers_per_node)):
        share_bytes.append(sent(share))
        shares.append({"local_rank": local_rank, "tensors": share,
                       "numel": sum(plan.tensors[i].numel for i in share), "bytes_per_step": share_bytes[-1]})
    flat = sent(list(range(len(shapes))))
    busiest = {k: max(b[k] for b in share_bytes) for k in flat}
    nodes = workers // workers_per_node
    return {
        "workers_per_node": workers_per_node, "nodes": nodes, "shares": shares,
        "per_rank": {"flat": flat, "hierarchical_busiest": busiest},
        # What each rank's link carries, ring-equivalent: flat, an allreduce over every worker; the
        # hierarchical wrapper's inter-node step, an allreduce over the nodes.
        "per_rank_link": {"flat": {k: link_bytes("allreduce", v, workers) for k, v in flat.items()},
                          "hierarchical_busiest": {k: link_bytes("allreduce", v, nodes) for k, v in busiest.items()}},
        "per_node": {"flat": {k: v * workers_per_node for k, v in flat.items()},
                     "hierarchical": {k: sum(b[k] for b in share_bytes) for k in flat}},
    }


def compression_report(model: nn.Module, name: str, rank: int, min_compression_rate: float = 2.0,
                       setting: Setting = GENERIC_SETTING, bytes_per_weight: int = 4,
                       workers_per_node: int | None = None, world_size: int | None = None) -> dict[str, Any]:
    """The plan of ``model``'s trainable parameters at ``rank``, as a JSON-ready dict.

    ``layers``: one entry per parameter (``name``, ``shape``, ``matrix`` ``[n, m]``, effective ``rank``
    ``min(n, m, rank)``, ``numel``, ``compressed``, ``reason``, ``numel_sent``). ``gradients`` and ``wire``:
    the dtypes' names (``wire``: what ``bytes_per_weight`` sends for these gradients, e.g. ``bf16`` for a
    bf16 model at 2). ``totals``: tensors, parameters, P/Q/uncompressed floats, ``floats_per_step``,
    ``bytes_per_step`` and ``mib_per_epoch`` for ``allreduce`` and ``powersgd``, ``compression_ratio`` (in
    bytes: ``PowerSGDState.bytes_stats()``'s rate) and ``floats_compression_ratio``
    (``compression_stats()``'s). ``epoch``: the setting and its
    ``steps``. ``workers_per_node``: also ``hierarchical``, the inter-node bytes of
    :func:`hierarchical_traffic` for ``setting.workers``. ``link``: what one worker's link carries, at
    ``world_size`` (default ``setting.workers``) and W = 8, 64, 512 (``world_sizes``): ``per_step``
    (``allreduce`` and ``powersgd``, ``2 (W - 1) / W`` of their bytes per step) and ``diloco_sync`` (one
    synchronization of the whole model: ``exact``, ``int8``/``int4`` ``all-gather`` and ``two-shot``).
    Raises ``ValueError`` if the model has no
    trainable parameter, the setting gives no full step per epoch or ``workers_per_node`` does not split
    the workers into at least 2 nodes.
    """
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    if not named:
        raise ValueError(f"model {name!r} has no trainable parameters")
    steps = setting.dataset_size // (setting.workers * setting.batch_size)
    if steps < 1:
        raise ValueError(f"--dataset-size {setting.dataset_size} is smaller than --workers x --batch-size "
                         f"= {setting.workers * setting.batch_size}: no full step per epoch")
    shapes = [tuple(p.shape) for _, p in named]
    dtypes = [p.dtype for _, p in named]
    counts = powersgd_bytes(shapes, dtypes, rank, min_compression_rate, bytes_per_weight)
    allreduce = allreduce_bytes(shapes, dtypes)
    hierarchical = None if workers_per_node is None else hierarchical_traffic(
        shapes, rank, min_compression_rate, setting.workers, workers_per_node, bytes_per_weight, dtypes)
    plan = make_plan(shapes, rank, min_compression_rate)
    layers = [{"name": named[t.index][0], "shape": list(t.shape), "matrix": list(t.matrix), "rank": t.rank,
               "numel": t.numel, "compressed": t.compressed, "reason": _reason(t.numel, len(t.shape), t.compressed),
               "numel_sent": t.numel_sent} for t in plan.tensors]
    floats = {"allreduce": plan.numel, "powersgd": plan.numel_sent}
    sent = {"allreduce": allreduce.bytes_sent, "powersgd": counts.bytes_sent}
    report: dict[str, Any] = {
        "model": name, "rank": rank, "min_compression_rate": min_compression_rate,
        "bytes_per_weight": bytes_per_weight, "gradients": counts.gradients, "wire": counts.wire,
        "epoch": {"workers": setting.workers, "batch_size": setting.batch_size,
                  "dataset_size": setting.dataset_size, "steps": steps, "source": setting.source},
        "layers": layers,
        "totals": {
            "tensors": len(layers), "parameters": plan.numel,
            "compressed_tensors": len(plan.compressed),
            "compressed_numel": sum(t.numel for t in plan.compressed),
            "p_numel": plan.p_numel, "q_numel": plan.q_numel, "uncompressed_numel": plan.uncompressed_numel,
            "floats_per_step": floats,
            "bytes_per_step": sent,
            "mib_per_epoch": {k: v * steps / MIB for k, v in sent.items()},
            "compression_ratio": counts.rate,
            "floats_compression_ratio": counts.numel_rate,
        },
    }
    worlds = reported_worlds(setting.workers if world_size is None else world_size)
    report["link"] = {
        "world_size": worlds[0], "world_sizes": worlds,
        "per_step": {"allreduce": [allreduce.link_bytes(w) for w in worlds],
                     "powersgd": [counts.link_bytes(w) for w in worlds]},
        "diloco_sync": diloco_links(shapes, dtypes, worlds)}
    if hierarchical is not None:
        report["hierarchical"] = hierarchical
    return report


def _dims(values: list[int]) -> str:
    return "x".join(map(str, values)) or "scalar"


def _precision(report: dict[str, Any]) -> str:
    """What the bytes row counts in: ``4 B/float`` when gradients and wire are both fp32, else both named."""
    if report["gradients"] == report["wire"] == "fp32":
        return "4 B/float"
    return f"{report['gradients']} gradients, {report['wire']} wire"


def format_report(report: dict[str, Any]) -> str:
    """The human-readable form of :func:`compression_report`: a row per parameter, then the totals."""
    rows = [[str(i), layer["name"], _dims(layer["shape"]),
             _dims(layer["matrix"]) if len(layer["shape"]) >= 2 else "-",
             str(layer["rank"]) if layer["compressed"] else "-", f"{layer['numel']:,}",
             f"{layer['numel_sent']:,}", f"{layer['numel'] / layer['numel_sent']:.1f}x" if layer["numel_sent"] else "-",
             "yes" if layer["compressed"] else f"no: {layer['reason']}"]
            for i, layer in enumerate(report["layers"])]
    lines = [f"gradpress inspect: {report['model']}, rank {report['rank']}, min compression rate "
             f"{report['min_compression_rate']:g}", ""]
    lines += format_table(["#", "parameter", "shape", "matrix", "r", "elements", "floats sent", "ratio",
                           "compressed"], rows, "><<<>>>><")
    t, e = report["totals"], report["epoch"]
    floats, nbytes, mib = t["floats_per_step"], t["bytes_per_step"], t["mib_per_epoch"]
    uncompressed = t["tensors"] - t["compressed_tensors"]
    lines += ["", f"{t['tensors']} tensors, {t['parameters']:,} parameters: {t['compressed_tensors']} matrices "
                  f"compressed ({t['compressed_numel']:,} elements -> P {t['p_numel']:,} + Q {t['q_numel']:,} "
                  f"floats), {uncompressed} tensors sent as they are ({t['uncompressed_numel']:,} elements)",
              f"epoch: {e['dataset_size']:,} samples / ({e['workers']} workers x {e['batch_size']} per worker) = "
              f"{e['steps']:,} steps (drop_last); {e['source']}", ""]
    lines += format_table(
        ["per worker", "allreduce", f"PowerSGD r={report['rank']}"],
        [["floats per step", f"{floats['allreduce']:,}", f"{floats['powersgd']:,}"],
         [f"bytes per step ({_precision(report)})", f"{nbytes['allreduce']:,}", f"{nbytes['powersgd']:,}"],
         [f"MB per epoch ({e['steps']:,} steps, MB = 2^20 B)", f"{mib['allreduce']:,.1f}", f"{mib['powersgd']:,.1f}"],
         ["compression ratio", "1x", f"{t['compression_ratio']:,.1f}x"]], "<>>")
    if "link" in report:
        lines += ["", *_format_link(report["link"], report["rank"])]
    if "hierarchical" in report:
        lines += ["", *_format_hierarchical(report["hierarchical"], report["rank"], e["workers"])]
    return "\n".join(lines)


def _format_link(link: dict[str, Any], rank: int) -> list[str]:
    worlds = link["world_sizes"]
    rows = [["per step: allreduce", *(f"{b:,.0f}" for b in link["per_step"]["allreduce"])],
            [f"per step: PowerSGD r={rank}", *(f"{b:,.0f}" for b in link["per_step"]["powersgd"])]]
    rows += [[f"per DiLoCo sync: {name}", *(f"{b:,.0f}" for b in values)]
             for name, values in link["diloco_sync"].items()]
    return [f"bytes on one worker's link (ring-equivalent: an allreduce 2(W-1)/W of its payload, an all-gather "
            f"W-1 payloads, two-shot 2(W-1)/W of its padded payload), W = {link['world_size']} (--world-size) "
            "and 8, 64, 512", "",
            *format_table(["on the link", *(f"W = {w}" for w in worlds)], rows, "<" + ">" * len(worlds))]


def _format_hierarchical(h: dict[str, Any], rank: int, workers: int) -> list[str]:
    size = h["workers_per_node"]
    flat, busiest = h["per_rank"]["flat"], h["per_rank"]["hierarchical_busiest"]

    def row(label: str, values: dict[str, float]) -> list[str]:
        return [label, f"{values['allreduce']:,}", f"{values['powersgd']:,}"]

    rows = [row("flat: each rank", flat), row(f"flat: each node ({size} ranks)", h["per_node"]["flat"])]
    rows += [row(f"hierarchical: local rank {s['local_rank']} ({len(s['tensors'])} tensors)", s["bytes_per_step"])
             for s in h["shares"]]
    rows += [row("hierarchical: each node", h["per_node"]["hierarchical"]),
             ["hierarchical / flat, busiest rank", *(f"{busiest[k] / flat[k]:.2f}x" for k in flat)]]
    links = h.get("per_rank_link")
    if links is not None:
        rows += [[f"on the link: flat, each rank (allreduce over {workers} workers)",
                  *(f"{v:,.0f}" for v in links["flat"].values())],
                 [f"on the link: hierarchical, busiest rank (its inter-node allreduce over {h['nodes']} nodes)",
                  *(f"{v:,.0f}" for v in links["hierarchical_busiest"].values())]]
    return [f"inter-node traffic, {workers} workers = {h['nodes']} nodes x {size}: flat = every rank sends its "
            "whole plan across nodes; hierarchical = gradpress.hierarchical_wrapper, local rank j sends its share's",
            "", *format_table(["inter-node bytes per step", "allreduce", f"PowerSGD r={rank}"], rows, "<>>"),
            "shares: whole tensors balanced by size, the model planned as one bucket (the hook splits each DDP "
            "bucket: tensors may move between local ranks, each node's total stays the same)"]


def register(subparsers: Any) -> argparse.ArgumentParser:
    """Add the ``inspect`` subcommand to ``subparsers`` (an ``add_subparsers()`` result)."""
    defaults = "; ".join(f"{name}: {s.workers}/{s.batch_size}/{s.dataset_size:,}" for name, s in SETTINGS.items())
    parser: argparse.ArgumentParser = subparsers.add_parser(
        "inspect", help="show what PowerSGD compresses in a model and the bytes it sends per step and epoch",
        description="Plan PowerSGD for a model's gradient shapes (the same plan the DDP hooks use) and print, per "
                    "parameter, its matrix view, whether it is compressed and the floats it sends per step; "
                    "then totals: floats, bytes per step and MB (2^20 bytes) per epoch, allreduce vs PowerSGD. "
                    "Nothing is allocated: the model is built on the meta device.",
        epilog=f"--workers/--batch-size/--dataset-size defaults per model ({defaults}); for the demo's "
               f"tasks: {DEMO_WORKERS} workers (the demo's default), the task's batch size and training set; "
               f"for module:factory: {GENERIC_SETTING.workers}/{GENERIC_SETTING.batch_size}/"
               f"{GENERIC_SETTING.dataset_size:,}.")
    parser.add_argument("--model", required=True, metavar="NAME",
                        help=f"as for gradpress check: {valid_models()}; a function takes no arguments, the "
                             "current folder is importable")
    parser.add_argument("--rank", type=int_at_least(1), required=True, metavar="R",
                        help="PowerSGD matrix approximation rank (integer >= 1)")
    parser.add_argument("--min-compression-rate", type=float_at_least(0), default=2.0, metavar="X",
                        help="compress an n x m matrix only if n*m > X*(n+m)*r, like the hooks' "
                             "min_compression_rate (number >= 0; default: %(default)g)")
    parser.add_argument("--workers", type=int_at_least(1), default=None, metavar="N",
                        help="data-parallel workers (integer >= 1; default: per model, see below)")
    parser.add_argument("--batch-size", type=int_at_least(1), default=None, metavar="B",
                        help="samples per worker per step (integer >= 1; default: per model)")
    parser.add_argument("--dataset-size", type=int_at_least(1), default=None, metavar="D",
                        help="training samples per epoch (integer >= 1; default: per model)")
    parser.add_argument("--bytes-per-weight", type=int, choices=(2, 4, 8), default=4,
                        help="PowerSGDState's bytes_per_weight, bytes per float on the wire: 2 (fp16; bf16 for bf16 "
                             "gradients), 4 (fp32), 8 (fp64); allreduce sends the gradients' dtype "
                             "(default: %(default)s)")
    parser.add_argument("--workers-per-node", type=int_at_least(1), default=None, metavar="L",
                        help="also show the bytes that cross nodes per step with --workers split into nodes of L, "
                             "flat vs gradpress.hierarchical_wrapper (integer >= 1 dividing --workers into at "
                             "least 2 nodes)")
    parser.add_argument("--world-size", type=int_at_least(1), default=None, metavar="W",
                        help="the world size of the link bytes (what one worker's link carries, ring-equivalent; "
                             "W = 8, 64 and 512 are printed too; default: WORLD_SIZE when launched by torchrun, "
                             "else --workers)")
    parser.add_argument("--json", action="store_true", help="print a JSON document instead of the tables")
    parser.set_defaults(func=run)
    return parser


def _fail(message: str, code: int = 2) -> int:
    print(f"gradpress inspect: error: {message}", file=sys.stderr)
    return code


def run(args: argparse.Namespace) -> int:
    """``gradpress inspect``: 0 on success, 2 for a bad model or setting (one line on stderr)."""
    try:
        model = build_named_model(args.model)
    except ValueError as exc:
        return _fail(str(exc))
    default = SETTINGS.get(args.model, GENERIC_SETTING)
    if args.model in TASKS and args.model not in SETTINGS:
        if args.dataset_size is None:
            try:
                default = task_setting(args.model)
            except RuntimeError as exc:
                return _fail(f"--model {args.model}: {exc}; or give --dataset-size")
        else:  # the training set is not needed: no need to load it
            task = TASKS[args.model]
            default = Setting(DEMO_WORKERS, task.batch_size, args.dataset_size, f"gradpress demo --task {args.model}")
    given = (args.workers, args.batch_size, args.dataset_size)
    setting = Setting(default.workers if args.workers is None else args.workers,
                      default.batch_size if args.batch_size is None else args.batch_size,
                      default.dataset_size if args.dataset_size is None else args.dataset_size,
                      default.source if given == (None, None, None) else f"command line; defaults: {default.source}")
    try:
        launched = os.environ.get("WORLD_SIZE")
        world = args.world_size if args.world_size is not None else int(launched) if launched else None
        report = compression_report(model, args.model, args.rank, args.min_compression_rate, setting,
                                    args.bytes_per_weight, args.workers_per_node, world)
    except ValueError as exc:
        return _fail(str(exc))
    print(json.dumps(report, indent=2) if args.json else format_report(report))
    return 0

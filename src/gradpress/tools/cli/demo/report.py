"""The demo's report: the summary of every method's results (:func:`summarize`), the unsettled-loss
check (:func:`settled`), and the text and markdown tables with their notes."""

from __future__ import annotations

from typing import Any

from ...workloads.config import DemoConfig
from ...workloads.tasks import get_task


# --- report -------------------------------------------------------------------------------------------

def format_rate(bytes_per_s: float) -> str:
    bits = bytes_per_s * 8
    for prefix, scale in (("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if bits >= scale:
            return f"{bits / scale:g} {prefix}bit/s"
    return f"{bits:g} bit/s"


def plural(count: int, noun: str) -> str:
    """``"1 rank"``, ``"2 ranks"``, ``"2 worker processes"``."""
    if count == 1:
        return f"1 {noun}"
    return f"{count} {noun}{'es' if noun.endswith('s') else 's'}"


def _format_bytes(n: float) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:.3g} {unit}"
    return f"{n:.0f} B"


def summarize(results: dict[str, list[dict[str, Any]]], config: DemoConfig, workers: int, wall_time: float,
              bandwidth: float | None = None, command: str = "gradpress demo",
              recipe: str | None = None) -> dict[str, Any]:
    """The JSON document: settings, per-method figures (rank 0's, plus every rank's checksum) and checks.
    ``recipe``: what of the task's measured recipe the demo applied, in words (``None``: nothing); the
    header repeats it.

    With ``bandwidth`` (bytes/s), each method gets ``modelled_time_s``: its measured training time plus
    ``link_bytes_total / bandwidth``, the time its collectives take on a link of that rate (what one
    worker's link carries, ring-equivalent: ``2 (n - 1) / n`` of an allreduced payload, ``n - 1`` times an
    all-gathered one; no latency, no overlap with computation).
    """
    task = get_task(config.task)
    ring = 2 * (workers - 1) / workers
    methods: dict[str, Any] = {}
    for spec, per_rank in results.items():
        entry = {k: v for k, v in per_rank[0].items() if k not in ("rank", "checksum", "digest")}
        entry["checksums"] = [r["checksum"] for r in per_rank]
        entry["ranks_agree"] = len({r["digest"] for r in per_rank}) == 1
        if bandwidth is not None:
            carried = entry.get("link_bytes_total")  # results of earlier versions: an allreduce of the payload
            entry["modelled_time_s"] = entry["wall_time_s"] + (ring * entry["bytes_total"] if carried is None
                                                               else carried) / bandwidth
        entry["settled"] = settled(entry["curve"], task.metric)
        methods[spec] = entry
    first = next(iter(results.values()))[0]
    return {
        "command": command,
        "task": config.task,
        "task_description": task.description,
        "metric_name": task.metric,
        "workers": workers,
        "backend": first.get("backend", "gloo"),
        "config": config.to_dict(),
        "batch_size": config.resolved_batch_size(),
        "lr": config.resolved_lr(),
        "recipe": recipe,
        "parameters": first["numel"],
        "methods": methods,
        "ranks_agree": all(m["ranks_agree"] for m in methods.values()),
        "bytes_check_ok": all(m["counted"]["ok"] for m in methods.values() if "counted" in m),
        "bandwidth_bytes_per_s": bandwidth,
        "wall_time_s": wall_time,
    }


#: A run whose final test loss exceeds its lowest by this factor is reported as unsettled.
UNSETTLED_FACTOR = 1.5
#: ... and so is a classifier whose test accuracy spans more than this over the last quarter of its steps.
UNSETTLED_ACCURACY_SPREAD = 0.03


def settled(curve: list[dict[str, Any]], metric_name: str = "accuracy") -> bool:
    """Whether a run ended near its best and stopped moving: its final test loss is at most
    :data:`UNSETTLED_FACTOR` times the lowest of its evaluations, and (for accuracy) its test accuracy
    spans at most :data:`UNSETTLED_ACCURACY_SPREAD` over the evaluations of the last quarter of the steps
    (when there are at least 3). A run whose loss still swings from one evaluation to the next (a method
    too aggressive for the task) ends wherever the last swing left it, and that depends on rounding: the
    CPU's vector instructions select other kernels in ATen, oneDNN and BLAS, so the same command gives
    other figures on another machine. The report marks such runs instead of presenting their figures as
    the method's (README: multi r=1 ended at 64.0% here and at 82.7% with oneDNN and MKL limited to SSE4,
    while every other row moved by at most 0.3 point)."""
    losses = [point["test_loss"] for point in curve]
    if losses[-1] > UNSETTLED_FACTOR * min(losses):
        return False
    if metric_name == "accuracy":
        tail = _last_quarter(curve)
        if len(tail) >= 3 and max(tail) - min(tail) > UNSETTLED_ACCURACY_SPREAD:
            return False
    return True


def _last_quarter(curve: list[dict[str, Any]]) -> list[float]:
    """The test metric at the evaluations of the last quarter of the steps."""
    last = curve[-1]["step"]
    return [point["metric"] for point in curve if "metric" in point and point["step"] >= 0.75 * last]


def _ratio(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.1f}x"


def table(summary: dict[str, Any], markdown: bool = False) -> list[str]:
    metric = summary["metric_name"]
    bandwidth = summary["bandwidth_bytes_per_s"]
    header = ["method", "test acc" if metric == "accuracy" else "test ppl", "test loss", "train loss",
              "bytes/step", "compression", "link B/step", "link fewer", "total MB", "total ratio", "syncs",
              "approx err", "global res", "time (s)", "ms/step"]
    if bandwidth is not None:
        header.append(f"@{format_rate(bandwidth)} (s)*")
    rows = [header]
    for m in summary["methods"].values():
        score = f"{100 * m['metric']:.1f}%" if metric == "accuracy" else f"{m['metric']:.2f}"
        score += "" if m.get("settled", True) else " !"
        error = m.get("approximation_error")
        residual = m.get("global_residual")
        row = [m["label"], score, f"{m['test_loss']:.4f}", f"{m['train_loss']:.4f}",
               _format_bytes(m["bytes_per_step"]), _ratio(m["compression_ratio"]),
               "-" if m.get("link_bytes_per_step") is None else _format_bytes(m["link_bytes_per_step"]),
               _ratio(m.get("link_compression_ratio")), f"{m['bytes_total'] / 1e6:.3g}",
               _ratio(m["total_ratio"]), str(m["synchronizations"]), "-" if error is None else f"{error:.2f}",
               "-" if residual is None else f"{residual:.2f}",
               f"{m['wall_time_s']:.1f}", f"{1000 * m['time_per_step_s']:.1f}"]
        if bandwidth is not None:
            row.append(f"{m['modelled_time_s']:.1f}")
        rows.append(row)
    if markdown:
        return ["| " + " | ".join(r) + " |" for r in rows[:1]] + ["|" + "---|" * len(header)] + \
               ["| " + " | ".join(r) + " |" for r in rows[1:]]
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    lines = ["  ".join(c.ljust(widths[i]) if i == 0 else c.rjust(widths[i]) for i, c in enumerate(row))
             for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return lines


def notes(summary: dict[str, Any]) -> list[str]:
    config = summary["config"]
    metric = summary["metric_name"]
    n = summary["workers"]
    start = config["start_iter"]
    lines = [
        ("test acc: accuracy on the held-out test set after the last step (higher is better)"
         if metric == "accuracy" else
         "test ppl: held-out perplexity per character after the last step (lower is better)"),
        "test loss: mean cross-entropy on the test set; train loss: mean over the last logged interval",
        f"bytes/step: the payload each worker hands to its collectives per step once the method runs, after the "
        f"first {start} steps (PowerSGD: plain allreduce until then; local SGD and DiLoCo: synchronous until then, "
        "then one model average every H steps, shown per step); compression: allreduce's bytes/step / this "
        "method's",
        f"link B/step: what each worker's link carries per step for those collectives at {n} workers "
        "(ring-equivalent: an allreduce 2(n-1)/n of its payload, an all-gathered compressed outer gradient n-1 "
        "payloads, a two-shot one 2(n-1)/n of its padded payload); link fewer: allreduce's link B/step / this "
        "method's, the ratio to compare methods by",
        f"total MB: what each worker sent over the whole run (MB = 10^6 bytes), the first {start} steps "
        "included, and for local SGD and DiLoCo a final average; total ratio: allreduce's total / this "
        "method's, what the run saved; syncs: steps with communication",
        f"time: training loop of the slowest worker, here ({summary['backend']}, {plural(n, 'local process')}"
        "), evaluation excluded",
    ]
    if any(m.get("approximation_error") is not None for m in summary["methods"].values()):
        lines.append("approx err: PowerSGD's ||M - P Q^T|| / ||M|| over all compressed matrices (M: a worker's "
                     "gradient plus error memory), worker 0, mean of the measurements at the evaluations; near 1: "
                     "the error memory dwarfs what each step sends (see docs/tuning.md)")
    if any(m.get("global_residual") is not None for m in summary["methods"].values()):
        lines.append("global res: PowerSGD's ||mean M - P Q^T|| / ||mean M|| over all compressed matrices (mean M: the "
                     "workers' average, what P Q^T stands in for; 1 - its square is the captured energy), the same "
                     "on every worker, mean of the measurements at the evaluations; estimated from a 16-column "
                     "random sketch (exact for matrices of at most 16 columns)")
    unsettled = [m for m in summary["methods"].values() if not m.get("settled", True)]
    if unsettled:
        swings = "; ".join(f"{m['label']}: {_swing(m)}" for m in unsettled)
        accuracy = summary["metric_name"] == "accuracy"
        lines.append(f"! unsettled ({swings}): the method is too aggressive here and its result still swings "
                     "from one evaluation to the next, so where it ends depends on rounding (the CPU's vector "
                     "instructions select other kernels) and differs between machines; read these figures as "
                     f"unstable, not as the method's {'accuracy' if accuracy else 'quality'}")
    if n == 1:
        lines.append("1 worker: a collective with no peer sends nothing, so every byte figure is 0 and the "
                     "ratios are n/a; run --workers 2 or more to compare the methods' traffic")
    bandwidth = summary["bandwidth_bytes_per_s"]
    if bandwidth is not None:
        lines.append(f"* MODELLED, not measured: time here + each worker's link bytes / rate, for n={n} workers "
                     f"on a {format_rate(bandwidth)} link (ring-equivalent, no latency, no overlap)")
    methods = summary["methods"]
    counted = [m for m in methods.values() if "counted" in m]
    if counted:
        status = "OK" if summary["bytes_check_ok"] else "MISMATCH"
        lines.append(f"bytes check: the bytes counted by PowerSGDState.bytes_stats() and the model averagers "
                     f"equal the plan's for {', '.join(m['label'] for m in counted)}: {status}")
    if n == 1:
        lines.append("ranks agree: one worker, nothing to compare")
    elif summary["ranks_agree"]:
        lines.append(f"ranks agree: parameters identical on all {n} workers for every method")
    else:
        lines += [f"RANKS DISAGREE for {m['label']}: parameter sums per rank {m['checksums']}"
                  for m in methods.values() if not m["ranks_agree"]]
    stopped = summary.get("stopped")
    if stopped:
        lines.append(stopped_note(stopped, [m["label"] for m in methods.values()]))
    return lines


def stopped_note(stopped: dict[str, Any], finished: list[str]) -> str:
    """The note of a run stopped early (``summary["stopped"]``: ``kind``, ``reason``, the ``method`` it
    stopped in and every method asked for): ``"STALLED: 1 of 3 methods finished; stopped during powersgd
    r=1; not run: fp16 (no worker reported progress for 60 s)"``."""
    asked: list[str] = stopped["methods"]
    line = f"{stopped['kind'].upper()}: {len(finished)} of {len(asked)} methods finished"
    if stopped.get("method"):
        line += f"; stopped during {stopped['method']}"
    not_run = [label for label in asked if label not in finished and label != stopped.get("method")]
    if not_run:
        line += f"; not run: {', '.join(not_run)}"
    return line + (f" ({stopped['reason']})" if stopped.get("reason") else "")


def _swing(method: dict[str, Any]) -> str:
    """How an unsettled run still moves: its accuracy over the last quarter if it swings, else its test loss."""
    tail = _last_quarter(method["curve"])
    if len(tail) >= 3 and max(tail) - min(tail) > UNSETTLED_ACCURACY_SPREAD:
        first = next(p["step"] for p in method["curve"] if p["step"] >= 0.75 * method["curve"][-1]["step"])
        return f"test accuracy {100 * min(tail):.1f}-{100 * max(tail):.1f}% from step {first} on"
    best = min(method["curve"], key=lambda point: point["test_loss"])
    final = method["curve"][-1]["test_loss"]
    return f"test loss {best['test_loss']:.2f} at step {best['step']}, {final:.2f} at the end"


def _header(summary: dict[str, Any]) -> str:
    config = summary["config"]
    return (f"{summary['task']}: {summary['task_description']}; {summary['parameters']:,} parameters; "
            f"{plural(summary['workers'], 'worker')} ({summary['backend']}), {config['steps']} steps x batch "
            f"{summary['batch_size']} per worker, SGD lr {summary['lr']:g} momentum {config['momentum']:g}, "
            f"seed {config['seed']}" + (f"; {summary['recipe']}" if summary.get("recipe") else ""))


def format_report(summary: dict[str, Any]) -> str:
    """The side-by-side table and its notes, as printed by ``gradpress demo``."""
    return "\n".join([_header(summary), ""] + table(summary) + [""] + notes(summary))


def format_markdown(summary: dict[str, Any], plot: str | None) -> str:
    """``demo.md``: the same table and notes, in Markdown, with the plot."""
    lines = ["# gradpress demo", "", f"`{summary['command']}`", "", _header(summary) + ".", ""]
    lines += table(summary, markdown=True) + [""] + [f"- {note}" for note in notes(summary)]
    lines += ["", f"Total wall time {summary['wall_time_s']:.1f} s, including starting the workers.", ""]
    if plot:
        lines += [f"![test metric and loss vs step and vs bytes sent]({plot})", ""]
    return "\n".join(lines)


#: Line styles cycled with the colours, so that methods with equal curves (allreduce and fp16) stay visible.

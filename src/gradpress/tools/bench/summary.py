"""The overhead benchmark's numbers, from raw timings to verdicts and tables: quartiles, per-(model,
rank) medians, overheads and ratios (:func:`summarize`), the reasons a run cannot be trusted
(:func:`trust_warnings`), and the markdown tables (:func:`markdown_rows`, :func:`memory_rows`).

Functions of the measurements alone (no torch, no clock; the load average is read by the one
function that says so); :mod:`gradpress.tools.bench.overhead` measures.
"""

from __future__ import annotations

import os
import statistics
from collections.abc import Sequence
from typing import Any

__all__ = ["COMPARED", "MB", "MEMORY_HEADER", "MIN_ROUNDS_FOR_SPREAD", "TABLE_HEADER", "iqr", "load_average",
           "markdown_rows", "memory_rows", "summarize", "trust_warnings"]

MB = 1 << 20
#: The PowerSGD hooks measured against plain allreduce: gradpress's, and PyTorch's batched and unbatched.
COMPARED = ("ours", "torch_batched", "torch")


def iqr(values: Sequence[float]) -> list[float] | None:
    """``[first quartile, third quartile]`` of ``values`` (inclusive method); one value: ``[v, v]``;
    none: ``None``."""
    if not values:
        return None
    if len(values) == 1:
        return [values[0], values[0]]
    q1, _, q3 = statistics.quantiles(values, n=4, method="inclusive")
    return [q1, q3]


def _stats(values: list[float]) -> dict[str, Any]:
    return {"values": values, "median": statistics.median(values) if values else None, "iqr": iqr(values)}


def summarize(parts: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Pool the measurements of one (model, rank) from all workers into medians, overheads, ratios, and
    the same per round.

    ``parts`` are :func:`measure` results (their ``round_offset`` numbers the rounds of an isolated run:
    worker ``i`` of round ``k`` has offset ``k``). ``median_ms``, ``overhead_ms`` and ``ratio_*`` pool
    every timed step (BENCHMARKS.md's tables). ``by_round`` holds, per round, each variant's median step
    (``step_ms``), each hook's overhead: its median step minus the allreduce median step *of the same
    part and round* (``overhead_ms``), and ours' overhead over a torch hook's of the same round number
    (``ratio_ours_vs``; same process with ``--no-isolate``, adjacent processes with ``--isolate``); each
    as ``values``, their ``median`` and ``iqr`` (first and third quartile); ``count``: rounds.
    """
    first = parts[0]
    times: dict[str, list[float]] = {name: [] for name in ("allreduce", *COMPARED)}
    step_rounds: dict[str, list[float]] = {name: [] for name in times}  # per-round median steps
    overhead_rounds: dict[str, dict[int, float]] = {name: {} for name in COMPARED}  # round -> ms
    state_bytes: dict[str, Any] = {}
    plan: dict[str, int] = {}
    for part in parts:
        for name, ts in part["times_ms"].items():
            times[name].extend(ts)
        blocks = part.get("rounds_ms", {})
        offset = part.get("round_offset", 0)
        for index, baseline in enumerate(blocks.get("allreduce", [])):
            base = statistics.median(baseline)
            step_rounds["allreduce"].append(base)
            for name in COMPARED:
                if name in blocks and blocks[name][index]:
                    step = statistics.median(blocks[name][index])
                    step_rounds[name].append(step)
                    overhead_rounds[name][offset + index] = step - base
        state_bytes.update(part["state_bytes"])
        plan = part.get("plan", plan)
    missing = [name for name, ts in times.items() if not ts]
    if missing:
        raise AssertionError(f"no measurements for {missing}")
    med = {name: statistics.median(ts) for name, ts in times.items()}
    overhead = {name: med[name] - med["allreduce"] for name in COMPARED}
    ratio_rounds = {
        name: [ours / theirs for key, ours in sorted(overhead_rounds["ours"].items())
               if (theirs := overhead_rounds[name].get(key, 0.0)) > 0]
        for name in COMPARED[1:]
    }
    by_round = {
        "count": min(len(rounds) for rounds in overhead_rounds.values()),
        "step_ms": {name: _stats(values) for name, values in step_rounds.items()},
        "overhead_ms": {name: _stats([ms for _, ms in sorted(rounds.items())])
                        for name, rounds in overhead_rounds.items()},
        "ratio_ours_vs": {name: _stats(ratios) for name, ratios in ratio_rounds.items()},
    }
    grad_bytes = first["params"] * 4
    p_bytes, q_bytes = plan["p"] * 4, plan["q"] * 4
    max_bucket_bytes = max(first["buckets"]) * 4
    return {
        "model": first["model"],
        "rank": first["rank"],
        "params": first["params"],
        "buckets": first["buckets"],
        "compression_rate": first["params"] / plan["sent"] if plan["sent"] else 0.0,
        "steps": {name: len(ts) for name, ts in times.items()},
        "median_ms": med,
        "min_ms": {name: min(ts) for name, ts in times.items()},
        "all_ms": times,
        "overhead_ms": overhead,
        "ratio_ours_vs_torch_batched": _ratio(overhead["ours"], overhead["torch_batched"]),
        "ratio_ours_vs_torch": _ratio(overhead["ours"], overhead["torch"]),
        "by_round": by_round,
        "memory": {
            "grad_bytes": grad_bytes,
            "max_bucket_bytes": max_bucket_bytes,
            "p_bytes": p_bytes,
            "q_bytes": q_bytes,
            "target_bytes": grad_bytes + p_bytes + q_bytes + max_bucket_bytes,
            **state_bytes,
        },
    }


#: Fewer rounds than this give no usable spread: the result is reported as untrustworthy.
MIN_ROUNDS_FOR_SPREAD = 3
_TORCH_LABELS = {"torch_batched": "torch batched", "torch": "torch"}


def load_average() -> float | None:
    """The machine's 1-minute load average; ``None`` where the OS has none (Windows)."""
    try:
        return os.getloadavg()[0]
    except (AttributeError, OSError):  # not on every platform (Windows)
        return None


def trust_warnings(results: Sequence[dict[str, Any]], load_avg_1min: float | None, cores: int,
                   threads: int) -> list[str]:
    """Reasons why these :func:`summarize` results cannot be trusted; empty if there are none.

    * the 1-minute load average exceeds ``cores``: other processes took CPU time from the measurement;
    * ``threads`` (intra-op threads of the workers) exceed ``cores``: OpenMP's fork/joins wait for
      threads that are not running, so a hook's time tracks how many ops it forks, not its work;
    * for a (model, rank), fewer than :data:`MIN_ROUNDS_FOR_SPREAD` rounds (no spread), or the wider
      interquartile range over rounds of ours' and a torch hook's overhead is at least the difference of
      their medians over rounds (``by_round`` of :func:`summarize`): the run cannot tell them apart.

    Pure: no clock, no machine state (``run_benchmark`` passes the load and the cores it read).
    """
    warnings = []
    if load_avg_1min is not None and load_avg_1min > cores:
        warnings.append(f"the 1-minute load average ({load_avg_1min:.1f}) is above the {cores} usable cores: "
                        "other processes took CPU time from the measurement")
    if threads > cores:
        warnings.append(f"{threads} intra-op threads on {cores} usable cores: OpenMP fork/joins wait for threads "
                        "that are not running (use --threads 1)")
    for r in results:
        where = f"{r['model']} r={r['rank']}"
        rounds = r["by_round"]["count"]
        if rounds < MIN_ROUNDS_FOR_SPREAD:
            warnings.append(f"{where}: {rounds} round(s), too few for a spread "
                            f"(use --rounds {MIN_ROUNDS_FOR_SPREAD} or more)")
            continue
        overheads = r["by_round"]["overhead_ms"]
        ours = overheads["ours"]
        for name, label in _TORCH_LABELS.items():
            difference = abs(overheads[name]["median"] - ours["median"])
            spread = max(ours["iqr"][1] - ours["iqr"][0], overheads[name]["iqr"][1] - overheads[name]["iqr"][0])
            if spread >= difference:
                warnings.append(f"{where}: the spread of the overheads over rounds ({spread:.1f} ms, the wider "
                                f"interquartile range) is not below the difference between ours and {label} "
                                f"({difference:.1f} ms)")
    return warnings


def _ratio(a: float, b: float) -> float | None:
    return a / b if b > 0 else None


# --------------------------------------------------------------------------------------------------
# Reporting
# --------------------------------------------------------------------------------------------------
TABLE_HEADER = (
    "| model | r | allreduce ms | ours ms | torch (batched) ms | torch (unbatched) ms "
    "| ours overhead ms | torch overhead ms (batched / unbatched) | ours / torch overhead (batched / unbatched) "
    "| state MiB: ours / torch | grads MiB |\n"
    "|---|---|---|---|---|---|---|---|---|---|---|"
)


def _fmt_ratio(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.2f}x"


def markdown_rows(results: list[dict[str, Any]]) -> str:
    rows = [TABLE_HEADER]
    for r in results:
        m, o, mem = r["median_ms"], r["overhead_ms"], r["memory"]
        rows.append(
            f"| {r['model']} | {r['rank']} | {m['allreduce']:.1f} | {m['ours']:.1f} | {m['torch_batched']:.1f} "
            f"| {m['torch']:.1f} | {o['ours']:.1f} | {o['torch_batched']:.1f} / {o['torch']:.1f} "
            f"| {_fmt_ratio(r['ratio_ours_vs_torch_batched'])} / {_fmt_ratio(r['ratio_ours_vs_torch'])} "
            f"| {mem['ours']['total'] / MB:.1f} / {mem['torch_batched']['total'] / MB:.1f} "
            f"| {mem['grad_bytes'] / MB:.1f} |")
    return "\n".join(rows)


MEMORY_HEADER = (
    "| model | r | grads MiB | ours: error memory + M buffer + P,uncompressed + Q + saved Q + workspace = total MiB "
    "| torch: error + P + Q = total MiB | target MiB (grads + P + Q + largest bucket) | ours <= target |\n"
    "|---|---|---|---|---|---|---|"
)


def memory_rows(results: list[dict[str, Any]]) -> str:
    rows = [MEMORY_HEADER]
    for r in results:
        mem = r["memory"]
        o, t = mem["ours"], mem["torch_batched"]
        rows.append(
            f"| {r['model']} | {r['rank']} | {mem['grad_bytes'] / MB:.1f} "
            # Results written before the memory report had its own names call them "work" and "phase1".
            f"| {o.get('error_memory', o.get('work', 0)) / MB:.1f} + {o.get('m_buffer', 0) / MB:.1f} "
            f"+ {o.get('p', o.get('phase1', 0)) / MB:.2f} "
            f"+ {o['q'] / MB:.2f} + {o.get('saved_factors', 0) / MB:.2f} "
            f"+ {o.get('workspace', 0) / MB:.1f} = {o['total'] / MB:.1f} "
            f"| {t['error'] / MB:.1f} + {t['p'] / MB:.2f} + {t['q'] / MB:.2f} = {t['total'] / MB:.1f} "
            f"| {mem['target_bytes'] / MB:.1f} | {'yes' if o['total'] <= mem['target_bytes'] else 'NO'} |")
    return "\n".join(rows)

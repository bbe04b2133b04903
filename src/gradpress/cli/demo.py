"""``gradpress demo``: train one model on real data with several gradient-communication methods.

The parent process spawns ``--workers`` local processes (gloo on CPU with one thread each; NCCL when
there is one GPU per worker). Every worker runs :func:`gradpress.workloads.training.train` once per
method, with the same seed, weights and data order, and sends progress, results or its traceback back
through a queue. The parent shows progress bars, then prints a table (test metric, loss, bytes per
step, compression, time) and writes ``demo.json``, ``demo.md`` and ``demo.png`` to ``--out``. It checks
that every worker ended with identical parameters and that PowerSGD's counted bytes match the plan.

If a worker fails, the parent stops the others, prints the failing worker's traceback and exits 1;
it never waits longer than ``--timeout`` seconds.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import queue
import re
import shlex
import signal
import sys
import threading
import time
import traceback
from collections.abc import Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any

from ..launch import free_port, usable_cores
from ..workloads.tasks import TASKS, get_task
from ..workloads.training import METHOD_KINDS, DemoConfig, Method, ProgressFn, default_start_iter, parse_methods
from .args import int_at_least, int_list, positive_float

__all__ = ["Interrupted", "WorkerFailure", "format_report", "free_port", "parse_bandwidth", "register", "run",
           "run_workers", "summarize"]

_DEFAULTS = DemoConfig()
DEFAULT_TIMEOUT = 600.0
#: Seconds a worker's collective waits for its peers before raising (a dead or stuck peer).
DEFAULT_COLLECTIVE_TIMEOUT = 60.0
DEFAULT_METHODS = "allreduce,fp16,powersgd,multi,localsgd,diloco"
DEFAULT_RANKS = (1, 2)


class WorkerFailure(RuntimeError):
    """A worker crashed, exited early or timed out; ``str(exc)`` is the report to print."""


class Interrupted(KeyboardInterrupt):
    """Ctrl-C during :func:`run_workers` (the workers are stopped); ``completed`` holds the results of
    the methods that every worker had finished, in the order they were asked for."""

    def __init__(self, completed: dict[str, list[dict[str, Any]]]) -> None:
        super().__init__()
        self.completed = completed


# --- argument parsing ---------------------------------------------------------------------------------

def _beta(text: str) -> float:
    value = positive_float(text)
    if value > 1:
        raise argparse.ArgumentTypeError(f"must be a number in (0, 1], got {text!r}")
    return value


_PREFIX = {"": 1.0, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12}
_BANDWIDTH = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*([kKmMgGtT]?)(bit|bits|bps|bit/s|B/s|Bps|byte/s|bytes/s)\s*$")


def parse_bandwidth(text: str) -> float:
    """Link rate in **bytes** per second from ``"1gbit"``, ``"100mbit"``, ``"10Gbit/s"``, ``"125MB/s"``.

    Decimal prefixes (k = 1000). ``bit``/``bps``/``bit/s`` are bits, ``B/s``/``Bps``/``byte/s`` bytes.

    >>> parse_bandwidth("1gbit")
    125000000.0
    """
    match = _BANDWIDTH.match(text)
    if not match or not float(match.group(1)) > 0:
        raise argparse.ArgumentTypeError(f"must be a positive rate such as 1gbit, 100mbit, 10Gbit/s or "
                                         f"125MB/s, got {text!r}")
    value = float(match.group(1)) * _PREFIX[match.group(2).lower()]
    unit = match.group(3)
    return value if unit.startswith(("B", "byte")) else value / 8


def _format_rate(bytes_per_s: float) -> str:
    bits = bytes_per_s * 8
    for prefix, scale in (("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if bits >= scale:
            return f"{bits / scale:g} {prefix}bit/s"
    return f"{bits:g} bit/s"


def register(subparsers: Any) -> argparse.ArgumentParser:
    """Add the ``demo`` subcommand to ``subparsers`` (an ``add_subparsers()`` result)."""
    # argparse %-formats help strings: a literal "%" in a description must be doubled.
    methods_help = "; ".join(f"{k}: {v}" for k, v in METHOD_KINDS.items()).replace("%", "%%")
    tasks_help = "; ".join(f"{t.name}: {t.description}" for t in TASKS.values()).replace("%", "%%")
    parser: argparse.ArgumentParser = subparsers.add_parser(
        "demo", help="train a model on real data with several methods and compare accuracy, bytes and time",
        description="Train one model on real data that ships with scikit-learn or Python (nothing is "
                    "downloaded) with DDP on local worker processes, once per communication method, same "
                    "seed and data order; print accuracy, loss, bytes sent per step and time side by side, "
                    "and write demo.json, demo.md and demo.png to --out.")
    parser.add_argument("--workers", type=int_at_least(1), default=4, metavar="N",
                        help="number of local worker processes (integer >= 1; default: %(default)s)")
    parser.add_argument("--task", default=_DEFAULTS.task, metavar="NAME",
                        help=f"what to train ({tasks_help}; default: %(default)s)")
    parser.add_argument("--methods", default=DEFAULT_METHODS, metavar="LIST",
                        help=f"comma-separated methods to compare ({methods_help}). powersgd and multi run "
                             "once per --rank, or at one rank as powersgd:R (default: %(default)s)")
    parser.add_argument("--rank", type=int_list(1), default=None, metavar="R[,R...]",
                        help=f"PowerSGD approximation rank(s) for the methods given without one (powersgd, "
                             f"multi) (integers >= 1; default: {','.join(map(str, DEFAULT_RANKS))})")
    parser.add_argument("--steps", type=int_at_least(1), default=_DEFAULTS.steps, metavar="N",
                        help="training steps per method (integer >= 1; default: %(default)s)")
    parser.add_argument("--start-iter", type=int_at_least(2), default=None, metavar="N",
                        help="plain-allreduce steps before PowerSGD, local SGD and DiLoCo start (integer >= 2, "
                             "less than --steps; default: a tenth of --steps, at least 2: "
                             f"{_DEFAULTS.start_iter} for {_DEFAULTS.steps} steps)")
    parser.add_argument("--seed", type=int_at_least(0), default=_DEFAULTS.seed, metavar="S",
                        help="seed for the split, initialisation and batch order (integer >= 0; "
                             "default: %(default)s)")
    parser.add_argument("--out", type=Path, default=Path("gradpress-demo"), metavar="DIR",
                        help="folder for demo.json, demo.md and demo.png (created; default: %(default)s)")
    parser.add_argument("--bandwidth", type=parse_bandwidth, default=None, metavar="RATE",
                        help="also report each method's MODELLED time on a link of this rate, e.g. 1gbit, "
                             "100mbit, 10Gbit/s, 125MB/s: measured time + 2(n-1)/n x bytes sent / rate")
    parser.add_argument("--warm-up-beta", type=_beta, default=None, metavar="BETA",
                        help="PowerSGDState(warm_up_beta_factor=BETA) for the PowerSGD methods (in (0, 1])")
    parser.add_argument("--timeout", type=positive_float, default=DEFAULT_TIMEOUT, metavar="SECONDS",
                        help="give up (and stop the workers) after this long (default: %(default)s)")
    parser.add_argument("--collective-timeout", type=positive_float, default=DEFAULT_COLLECTIVE_TIMEOUT,
                        metavar="SECONDS", help="a worker's collective waits this long for a dead or stuck peer, "
                        "then fails naming the collective (default: %(default)s; at most --timeout)")
    parser.set_defaults(func=run)
    return parser


# --- workers ------------------------------------------------------------------------------------------

def _worker(rank: int, world_size: int, port: int, config: dict[str, Any], methods: Sequence[Method],
            messages: Any, timeout: float) -> None:
    """Worker process: join the group, train every method, report through ``messages``.

    Messages: ``("progress", rank, label, step, steps, loss)``, ``("result", rank, spec, dict)``,
    ``("error", rank, label or None, traceback text)``. Exits 1 after an error. NCCL with GPU ``rank``
    when there are at least ``world_size`` GPUs, gloo on CPU otherwise.
    """
    label: str | None = None
    try:
        import torch
        import torch.distributed as dist

        from ..workloads.training import DemoConfig, train

        torch.set_num_threads(1)
        use_cuda = torch.cuda.is_available() and torch.cuda.device_count() >= world_size
        device = torch.device("cuda", rank) if use_cuda else torch.device("cpu")
        if use_cuda:
            torch.cuda.set_device(device)
        dist.init_process_group("nccl" if use_cuda else "gloo", init_method=f"tcp://127.0.0.1:{port}",
                                rank=rank, world_size=world_size, timeout=timedelta(seconds=timeout))
        cfg = DemoConfig(**config)

        def progress(name: str, step: int, steps: int, loss: float) -> None:
            messages.put(("progress", rank, name, step, steps, loss))

        for method in methods:
            label = method.label
            result = train(rank, world_size, method, cfg, on_progress=progress, device=device)
            result["backend"] = dist.get_backend()
            messages.put(("result", rank, method.spec, result))
        label = None
        dist.destroy_process_group()
    except BaseException:  # noqa: BLE001 - everything goes to the parent, which decides
        messages.put(("error", rank, label, traceback.format_exc()))
        sys.exit(1)


def _stuck_line(rank: int) -> str:
    return (f"worker rank {rank} was still running and reported no error: it is probably stuck (the others' "
            "collectives timed out waiting for it)")


def _stop(procs: Sequence[Any]) -> None:
    """Terminate (then kill) every started process that is still alive, and reap all of them."""
    for proc in procs:
        if proc.pid is not None and proc.is_alive():
            proc.terminate()
    for proc in procs:
        if proc.pid is None:
            continue
        proc.join(timeout=3)
        if proc.is_alive():
            proc.kill()
            proc.join(timeout=3)


def _drain(messages: Any, errors: dict[int, tuple[str | None, str]], grace: float) -> None:
    """Collect error messages that arrive within ``grace`` seconds (other messages are dropped)."""
    end = time.monotonic() + grace
    while True:
        try:
            msg = messages.get(timeout=max(0.0, end - time.monotonic()))
        except (queue.Empty, OSError, EOFError, ValueError):
            return
        if msg[0] == "error":
            errors.setdefault(msg[1], (msg[2], msg[3]))


_EXCEPTION_LINE = re.compile(r"^[A-Za-z_][\w.]*(Error|Exception|Interrupt|Exit|Warning)\b")


def _exception_line(tb: str, limit: int = 240) -> str:
    """The last ``SomeError: message`` line of a traceback (shortened), or its last line."""
    lines = [line for line in tb.strip().splitlines() if line.strip()]
    fallback = lines[-1] if lines else "?"
    found = next((line for line in reversed(lines) if _EXCEPTION_LINE.match(line)), fallback)
    return found if len(found) <= limit else found[: limit - 3] + "..."


def _describe_exit(code: int | None) -> str:
    if code is None:
        return "was still running"
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"


def _failure_report(errors: dict[int, tuple[str | None, str]], first: int | None,
                    exit_codes: Sequence[int | None], reason: str | None = None) -> str:
    """What to print when the workers failed.

    ``exit_codes`` are taken before the parent stopped the survivors. A rank that died without a
    traceback (killed, or failed before it could report) is the likely root cause; otherwise the first
    traceback received is, and the other ranks' errors (typically "Connection closed by peer") are
    listed on one line each.
    """
    lines: list[str] = []
    silent = [r for r, code in enumerate(exit_codes) if code not in (None, 0) and r not in errors]
    stuck = [r for r, code in enumerate(exit_codes) if code is None and r not in errors] if errors else []
    lines += [_stuck_line(r) for r in stuck]
    for rank in silent:
        lines.append(f"worker rank {rank} {_describe_exit(exit_codes[rank])} without a traceback "
                     "(any output it printed is above)")
    if first is not None and not silent and not stuck:
        method, tb = errors[first]
        lines.append(f"worker rank {first} failed{f' during {method}' if method else ''}:")
        lines.append(tb.rstrip())
    consequences = sorted(r for r in errors if silent or stuck or r != first)
    for rank in consequences:
        method = errors[rank][0]
        lines.append(f"worker rank {rank} also failed{f' during {method}' if method else ''}, probably as a "
                     f"consequence: {_exception_line(errors[rank][1])}")
    if reason:
        lines.append(reason)
    lines.append("stopped all workers")
    return "\n".join(lines)


def _raise_on_sigterm() -> Any:
    """Make SIGTERM raise ``SystemExit(143)`` (so the workers get stopped); the previous handler, or
    ``None`` if it could not be installed (not the main thread) or was already customised."""
    if threading.current_thread() is not threading.main_thread():
        return None
    previous = signal.getsignal(signal.SIGTERM)
    if previous is not signal.SIG_DFL:
        return None

    def handler(signum: int, frame: Any) -> None:
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, handler)
    return previous


def run_workers(config: DemoConfig, workers: int, *, timeout: float = DEFAULT_TIMEOUT,
                methods: Sequence[Method], on_progress: ProgressFn | None = None,
                collective_timeout: float = DEFAULT_COLLECTIVE_TIMEOUT) -> dict[str, list[dict[str, Any]]]:
    """Run every method on ``workers`` spawned processes; ``{method.spec: [result of rank 0, 1, ...]}``.

    Raises :class:`WorkerFailure` (after stopping every worker) if a worker raises, dies or the run
    takes longer than ``timeout`` seconds, and :class:`Interrupted` (with the finished methods' results)
    on Ctrl-C. No worker process outlives this call. A collective waits ``collective_timeout`` seconds
    (at most ``timeout``) for a dead or stuck peer; the report then names the worker that was stuck.
    """
    ctx = mp.get_context("spawn")
    messages = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_worker, name=f"gradpress-demo-rank{rank}",
                         args=(rank, workers, port, config.to_dict(), tuple(methods), messages,
                               min(timeout, collective_timeout)),
                         daemon=True) for rank in range(workers)]
    results: dict[str, dict[int, dict[str, Any]]] = {method.spec: {} for method in methods}
    errors: dict[int, tuple[str | None, str]] = {}
    expected = workers * len(methods)
    received = 0
    first_error: int | None = None
    reason: str | None = None
    deadline = time.monotonic() + timeout
    saved_omp = os.environ.get("OMP_NUM_THREADS")
    saved_sigterm = _raise_on_sigterm()
    try:
        os.environ["OMP_NUM_THREADS"] = "1"  # inherited by the spawned interpreters (before torch loads)
        try:
            for proc in procs:
                proc.start()
        finally:
            if saved_omp is None:
                os.environ.pop("OMP_NUM_THREADS", None)
            else:
                os.environ["OMP_NUM_THREADS"] = saved_omp
        while received < expected:
            try:
                msg = messages.get(timeout=0.2)
            except queue.Empty:
                msg = None
            if msg is not None:
                kind = msg[0]
                if kind == "progress":
                    if on_progress is not None:
                        on_progress(*msg[2:])
                elif kind == "result":
                    results[msg[2]][msg[1]] = msg[3]
                    received += 1
                elif kind == "error":
                    errors[msg[1]] = (msg[2], msg[3])
                    first_error = msg[1]
                    break
            codes = [proc.exitcode for proc in procs]
            if any(code not in (None, 0) for code in codes):
                break  # died without a traceback so far; _drain below collects one if it was sent
            if msg is None and all(code == 0 for code in codes):  # exited, and nothing left to read
                reason = f"workers exited after sending {received} of {expected} results"
                break
            if time.monotonic() > deadline:
                reason = f"timed out after {timeout:g} s (raise --timeout if the machine is just slow)"
                break
        if received < expected:
            _drain(messages, errors, grace=1.0)  # let the other ranks' errors (if any) arrive
            if first_error is None and errors:
                first_error = next(iter(errors))  # the first to arrive
            codes = [proc.exitcode for proc in procs]
            _stop(procs)
            raise WorkerFailure(_failure_report(errors, first_error, codes, reason))
        for proc in procs:
            proc.join(timeout=30)
        codes = [proc.exitcode for proc in procs]
        if any(code != 0 for code in codes):
            _drain(messages, errors, grace=0.5)
            _stop(procs)
            raise WorkerFailure(_failure_report(errors, min(errors) if errors else None, codes,
                                                "a worker failed while shutting down"))
    except KeyboardInterrupt:
        raise Interrupted({spec: [per_rank[rank] for rank in range(workers)]
                           for spec, per_rank in results.items() if len(per_rank) == workers}) from None
    finally:
        _stop(procs)
        messages.close()
        messages.join_thread()
        if saved_sigterm is not None:
            signal.signal(signal.SIGTERM, saved_sigterm)
    return {m.spec: [results[m.spec][rank] for rank in range(workers)] for m in methods}


# --- report -------------------------------------------------------------------------------------------

def _plural(count: int, noun: str) -> str:
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
              bandwidth: float | None = None, command: str = "gradpress demo") -> dict[str, Any]:
    """The JSON document: settings, per-method figures (rank 0's, plus every rank's checksum) and checks.

    With ``bandwidth`` (bytes/s), each method gets ``modelled_time_s``: its measured training time plus
    ``2 (n - 1) / n * bytes_total / bandwidth``, the time a ring allreduce of its payload takes on a link
    of that rate (no latency, no overlap with computation).
    """
    task = get_task(config.task)
    ring = 2 * (workers - 1) / workers
    methods: dict[str, Any] = {}
    for spec, per_rank in results.items():
        entry = {k: v for k, v in per_rank[0].items() if k not in ("rank", "checksum", "digest")}
        entry["checksums"] = [r["checksum"] for r in per_rank]
        entry["ranks_agree"] = len({r["digest"] for r in per_rank}) == 1
        if bandwidth is not None:
            entry["modelled_time_s"] = entry["wall_time_s"] + ring * entry["bytes_total"] / bandwidth
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


def _table(summary: dict[str, Any], markdown: bool = False) -> list[str]:
    metric = summary["metric_name"]
    bandwidth = summary["bandwidth_bytes_per_s"]
    header = ["method", "test acc" if metric == "accuracy" else "test ppl", "test loss", "train loss",
              "bytes/step", "compression", "total MB", "total ratio", "syncs", "approx err", "time (s)",
              "ms/step"]
    if bandwidth is not None:
        header.append(f"@{_format_rate(bandwidth)} (s)*")
    rows = [header]
    for m in summary["methods"].values():
        score = f"{100 * m['metric']:.1f}%" if metric == "accuracy" else f"{m['metric']:.2f}"
        score += "" if m.get("settled", True) else " !"
        error = m.get("approximation_error")
        row = [m["label"], score, f"{m['test_loss']:.4f}", f"{m['train_loss']:.4f}",
               _format_bytes(m["bytes_per_step"]), _ratio(m["compression_ratio"]), f"{m['bytes_total'] / 1e6:.3g}",
               _ratio(m["total_ratio"]), str(m["synchronizations"]), "-" if error is None else f"{error:.2f}",
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


def _notes(summary: dict[str, Any]) -> list[str]:
    config = summary["config"]
    metric = summary["metric_name"]
    n = summary["workers"]
    start = config["start_iter"]
    lines = [
        ("test acc: accuracy on the held-out test set after the last step (higher is better)"
         if metric == "accuracy" else
         "test ppl: held-out perplexity per character after the last step (lower is better)"),
        "test loss: mean cross-entropy on the test set; train loss: mean over the last logged interval",
        f"bytes/step: what each worker sends per step once the method runs, after the first {start} steps "
        "(PowerSGD: plain allreduce until then; local SGD and DiLoCo: synchronous until then, then one model "
        "average every H steps, shown per step); compression: allreduce's bytes/step / this method's",
        f"total MB: what each worker sent over the whole run (MB = 10^6 bytes), the first {start} steps "
        "included, and for local SGD and DiLoCo a final average; total ratio: allreduce's total / this "
        "method's, what the run saved; syncs: steps with communication",
        f"time: training loop of the slowest worker, here ({summary['backend']}, {_plural(n, 'local process')}"
        "), evaluation excluded",
    ]
    if any(m.get("approximation_error") is not None for m in summary["methods"].values()):
        lines.append("approx err: PowerSGD's ||M - P Q^T|| / ||M|| over all compressed matrices (M: a worker's "
                     "gradient plus error memory), worker 0, mean of the measurements at the evaluations; near 1: "
                     "the error memory dwarfs what each step sends (see docs/tuning.md)")
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
        lines.append(f"* MODELLED, not measured: time here + 2(n-1)/n x bytes sent / rate, for n={n} workers "
                     f"on a {_format_rate(bandwidth)} link (ring allreduce, no latency, no overlap)")
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
    interrupted = summary.get("interrupted")
    if interrupted:
        finished = {m["label"] for m in methods.values()}
        lines.append(f"INTERRUPTED: {len(finished)} of {len(interrupted)} methods finished; not run: "
                     f"{', '.join(label for label in interrupted if label not in finished)}")
    return lines


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
            f"{_plural(summary['workers'], 'worker')} ({summary['backend']}), {config['steps']} steps x batch "
            f"{summary['batch_size']} per worker, SGD lr {summary['lr']:g} momentum {config['momentum']:g}, "
            f"seed {config['seed']}")


def format_report(summary: dict[str, Any]) -> str:
    """The side-by-side table and its notes, as printed by ``gradpress demo``."""
    return "\n".join([_header(summary), ""] + _table(summary) + [""] + _notes(summary))


def format_markdown(summary: dict[str, Any], plot: str | None) -> str:
    """``demo.md``: the same table and notes, in Markdown, with the plot."""
    lines = ["# gradpress demo", "", f"`{summary['command']}`", "", _header(summary) + ".", ""]
    lines += _table(summary, markdown=True) + [""] + [f"- {note}" for note in _notes(summary)]
    lines += ["", f"Total wall time {summary['wall_time_s']:.1f} s, including starting the workers.", ""]
    if plot:
        lines += [f"![test metric and loss vs step and vs bytes sent]({plot})", ""]
    return "\n".join(lines)


#: Line styles cycled with the colours, so that methods with equal curves (allreduce and fp16) stay visible.
_STYLES = (("-", "o", 2.6), ("--", "s", 1.6), ("-.", "^", 1.6), (":", "D", 1.9), ("-", "v", 1.2), ("--", "x", 1.2))


def _plain_log_ticks(axis: Any) -> None:
    """Label a log axis at 1, 2, 5 x 10^k with plain numbers and no minor labels (they overlap)."""
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    axis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
    axis.set_major_formatter(FuncFormatter(lambda value, _: f"{value:g}"))
    axis.set_minor_formatter(NullFormatter())


def plot(summary: dict[str, Any], path: Path) -> bool:
    """Write :func:`make_figure`'s figure to ``path``; ``False`` without matplotlib."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig = make_figure(summary)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def make_figure(summary: dict[str, Any]) -> Any:
    """The demo's 2x2 matplotlib figure (needs matplotlib).

    Left: test metric and train loss vs step, with the end of the plain-allreduce warm-up marked.
    Right: the same vs MB each worker sent *after* the warm-up (log axis): during the warm-up every
    method sends what allreduce sends, which would squeeze the compressed methods into one smear.
    """
    import matplotlib.pyplot as plt

    accuracy = summary["metric_name"] == "accuracy"
    start = summary["config"]["start_iter"]
    metric = "test accuracy" if accuracy else "test perplexity per character (log)"
    fig, axes = plt.subplots(2, 2, figsize=(12, 8.5), constrained_layout=True)
    sent_anything = False
    for i, m in enumerate(summary["methods"].values()):
        linestyle, marker, width = _STYLES[i % len(_STYLES)]
        style = {"label": m["label"], "color": f"C{i % 10}", "linestyle": linestyle, "marker": marker,
                 "markersize": 3.5, "linewidth": width}
        curve = m["curve"]
        steps = [c["step"] for c in curve]
        axes[0][0].plot(steps, [c["metric"] for c in curve], **style)
        axes[1][0].plot(steps[1:], [c["train_loss"] for c in curve[1:]], **style)  # step 0 has no train loss
        after = [c for c in curve if c["step"] > start and c["bytes"] > m["bytes_warm_up"]]
        if after:
            sent_anything = True
            mb = [(c["bytes"] - m["bytes_warm_up"]) / 1e6 for c in after]
            axes[0][1].plot(mb, [c["metric"] for c in after], **style)
            axes[1][1].plot(mb, [c["train_loss"] for c in after], **style)
    for row, ylabel in ((0, metric), (1, "train loss (log)")):
        for col in (0, 1):
            ax = axes[row][col]
            ax.set_ylabel(ylabel)
            ax.grid(True, alpha=0.3)
            if row == 1 or not accuracy:
                ax.set_yscale("log")
                _plain_log_ticks(ax.yaxis)
        axes[row][0].set_xlabel("step")
        axes[row][0].axvline(start, color="grey", linestyle=":", linewidth=1.2,
                             label=f"step {start}: warm-up ends, compression / local steps start")
        axes[row][1].set_xlabel(f"MB sent per worker after the {start} warm-up steps (log)")
        if sent_anything:
            axes[row][1].set_xscale("log")
            _plain_log_ticks(axes[row][1].xaxis)
        else:
            axes[row][1].text(0.5, 0.5, "nothing was sent (1 worker)", ha="center", va="center",
                              transform=axes[row][1].transAxes)
    axes[0][0].set_title("vs training step")
    axes[0][1].set_title("vs bytes sent once the methods differ")
    axes[0][0].legend(fontsize=8)
    fig.suptitle(f"gradpress demo: {summary['task']}, {_plural(summary['workers'], 'worker')}, "
                 f"{summary['config']['steps']} steps (dotted line: end of the {start}-step warm-up, where "
                 "every method communicates every step)")
    return fig


class Progress:
    """Progress bars on stderr: one line redrawn in place on a terminal, a line per milestone otherwise."""

    def __init__(self, stream: Any = None, width: int = 24) -> None:
        self.stream = stream if stream is not None else sys.stderr
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.width = width
        self.started = time.perf_counter()
        self.method_started: dict[str, float] = {}
        self.milestones: dict[str, int] = {}

    def __call__(self, label: str, step: int, steps: int, loss: float) -> None:
        now = time.perf_counter()
        began = self.method_started.setdefault(label, now)
        filled = round(self.width * step / steps)
        line = (f"  {label:<14} [{'#' * filled}{'.' * (self.width - filled)}] {step:>{len(str(steps))}}/{steps}"
                f"  loss {loss:.4f}  {now - began:5.1f} s")
        if self.tty:
            self.stream.write("\r" + line + ("\n" if step == steps else ""))
        else:
            milestone = 2 * step // steps  # halfway and done
            if milestone > self.milestones.get(label, 0):
                self.milestones[label] = milestone
                self.stream.write(line + "\n")
        self.stream.flush()


# --- the command --------------------------------------------------------------------------------------

def _fail(message: str, code: int = 2) -> int:
    """Print ``gradpress demo: error: message`` on stderr; return ``code``."""
    print(f"gradpress demo: error: {message}", file=sys.stderr)
    return code


def write_outputs(summary: dict[str, Any], out: Path) -> list[Path]:
    """Write ``demo.json``, ``demo.png`` (if matplotlib is installed) and ``demo.md`` into ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    written = [out / "demo.json"]
    written[0].write_text(json.dumps(summary, indent=2) + "\n")
    has_plot = plot(summary, out / "demo.png")
    if has_plot:
        written.append(out / "demo.png")
    (out / "demo.md").write_text(format_markdown(summary, "demo.png" if has_plot else None))
    written.append(out / "demo.md")
    return written


def _warn(message: str) -> None:
    print(f"gradpress demo: warning: {message}", file=sys.stderr)


def _start_iter(args: argparse.Namespace, methods: Sequence[Method]) -> int | str:
    """The warm-up length, or an error message when the user's own --start-iter contradicts --steps."""
    uses_warm_up = any(m.kind not in ("allreduce", "fp16", "bf16") for m in methods)
    if args.start_iter is None:
        start_iter = default_start_iter(args.steps)
        if start_iter >= args.steps and uses_warm_up:
            _warn(f"--steps {args.steps} is all warm-up ({start_iter} plain-allreduce steps come first): "
                  "PowerSGD, local SGD and DiLoCo will not start; use --steps 3 or more to see them")
        return start_iter
    if args.start_iter >= args.steps and uses_warm_up:
        return (f"--start-iter {args.start_iter} leaves no step for PowerSGD, local SGD or DiLoCo in "
                f"--steps {args.steps}: use --start-iter {args.steps - 1} or less (>= 2), or --steps "
                f"{args.start_iter + 1} or more, or leave --start-iter out (default: a tenth of --steps)")
    return int(args.start_iter)


def run(args: argparse.Namespace) -> int:
    """``gradpress demo``: 0 on success, 1 if a worker or a check failed, 2 for bad arguments, 130 when
    interrupted (the methods that finished are still reported and written)."""
    try:
        task = get_task(args.task)
        methods = parse_methods(args.methods, args.rank if args.rank is not None else DEFAULT_RANKS)
    except ValueError as exc:
        return _fail(str(exc))
    start_iter = _start_iter(args, methods)
    if isinstance(start_iter, str):
        return _fail(start_iter)
    out: Path = args.out
    if out.exists() and not out.is_dir():
        return _fail(f"--out: {str(out)!r} exists and is not a folder")
    if args.rank is not None and parse_methods(args.methods, []) == methods:
        _warn(f"--rank {','.join(map(str, args.rank))} is not used: no method in --methods takes it (only "
              "powersgd and multi without ':R' run once per --rank)")
    cores = usable_cores()
    if args.workers > 2 * cores:
        _warn(f"{args.workers} workers on {_plural(cores, 'core')}: each worker gets a small share of a core, so "
              f"the run is slow and its times mostly measure waiting; --workers {cores} to {2 * cores} fits "
              "this machine")
    config = DemoConfig(task=task.name, steps=args.steps, start_iter=start_iter, seed=args.seed,
                        evals=min(15, args.steps), warm_up_beta=args.warm_up_beta)
    argv = getattr(args, "argv", None)
    command = " ".join(["gradpress", "demo", *map(shlex.quote, argv or [])])
    print(f"gradpress demo: {task.name} ({task.description}), {_plural(args.workers, 'worker')}, "
          f"{_plural(len(methods), 'method')} x {config.steps} steps: {', '.join(m.label for m in methods)}",
          file=sys.stderr, flush=True)
    start = time.perf_counter()
    interrupted = False
    try:
        results = run_workers(config, args.workers, timeout=args.timeout, methods=methods, on_progress=Progress(),
                              collective_timeout=args.collective_timeout)
    except WorkerFailure as exc:
        return _fail(str(exc), code=1)
    except Interrupted as exc:
        if not exc.completed:
            print("\ngradpress demo: interrupted before any method finished; nothing written", file=sys.stderr)
            return 130
        results, interrupted = exc.completed, True
        print(f"\ngradpress demo: interrupted; reporting the {_plural(len(results), 'method')} that finished",
              file=sys.stderr)
    wall_time = time.perf_counter() - start

    summary = summarize(results, config, args.workers, wall_time, args.bandwidth, command)
    if interrupted:
        summary["interrupted"] = [m.label for m in methods]
    print(format_report(summary))
    print(f"total wall time: {wall_time:.1f} s (including starting {_plural(args.workers, 'worker process')})")
    try:
        written = write_outputs(summary, out)
    except OSError as exc:
        return _fail(f"--out: could not write to {str(out)!r}: {exc}", code=1)
    if not any(p.name == "demo.png" for p in written):
        print("no demo.png: matplotlib is not installed (pip install 'gradpress[demo]')", file=sys.stderr)
    print(f"wrote {', '.join(p.name for p in written)} to {out}/")
    if interrupted:
        return 130
    if not summary["ranks_agree"]:
        return _fail("workers ended with different parameters", code=1)
    if not summary["bytes_check_ok"]:
        return _fail("PowerSGD's counted bytes do not match the plan", code=1)
    return 0

"""``gradpress demo``: train the same small model with plain allreduce and with PowerSGD, side by side.

The parent process spawns ``--workers`` local processes (gloo on CPU, one thread each). Every worker
runs :func:`gradpress.workloads.digits.train` once per method, with the same seed and data order, and
sends progress, results or its traceback back through a queue. The parent prints a table comparing
accuracy, loss, floats sent per step and wall time, checks that every rank ended with identical
parameters and that PowerSGD's counted traffic matches :func:`gradpress.make_plan`.

If a worker fails, the parent stops the others, prints the failing worker's traceback and exits 1;
it never waits longer than ``--timeout`` seconds.
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing as mp
import os
import queue
import re
import signal
import socket
import sys
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any

from ..workloads.digits import METHODS, DemoConfig, ProgressFn, make_model

__all__ = ["WorkerFailure", "format_report", "free_port", "register", "run", "run_workers"]

_DEFAULTS = DemoConfig()
DEFAULT_TIMEOUT = 300.0


class WorkerFailure(RuntimeError):
    """A worker crashed, exited early or timed out; ``str(exc)`` is the report to print."""


# --- argument parsing ---------------------------------------------------------------------------------

def _int_at_least(minimum: int) -> Callable[[str], int]:
    """An argparse ``type`` accepting integers ``>= minimum``, with a message naming the allowed values."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be an integer >= {minimum}, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be an integer >= {minimum}, got {value}")
        return value

    parse.__name__ = f"integer >= {minimum}"
    return parse


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number > 0, got {text!r}") from None
    if not value > 0 or not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"must be a number > 0, got {text!r}")
    return value


def register(subparsers: Any) -> argparse.ArgumentParser:
    """Add the ``demo`` subcommand to ``subparsers`` (an ``add_subparsers()`` result)."""
    parser: argparse.ArgumentParser = subparsers.add_parser(
        "demo", help="train a small model with allreduce and with PowerSGD and compare",
        description="Train a small MLP on generated 8x8 data with DDP on local CPU workers (gloo), once "
                    "with plain allreduce and once with PowerSGD (same seed, same data order), and print "
                    "accuracy, loss, floats sent per step and wall time side by side. Nothing is "
                    "downloaded.")
    parser.add_argument("--workers", type=_int_at_least(1), default=2, metavar="N",
                        help="number of local worker processes (integer >= 1; default: %(default)s)")
    parser.add_argument("--steps", type=_int_at_least(1), default=_DEFAULTS.steps, metavar="N",
                        help="training steps per method (integer >= 1; default: %(default)s)")
    parser.add_argument("--rank", type=_int_at_least(1), default=_DEFAULTS.rank, metavar="R",
                        help="PowerSGD approximation rank (integer >= 1; default: %(default)s)")
    parser.add_argument("--start-iter", type=_int_at_least(2), default=_DEFAULTS.start_iter, metavar="N",
                        help="plain-allreduce steps before PowerSGD starts (integer >= 2, less than "
                             "--steps; default: %(default)s)")
    parser.add_argument("--seed", type=_int_at_least(0), default=_DEFAULTS.seed, metavar="S",
                        help="seed for data, initialisation and batch order (integer >= 0; "
                             "default: %(default)s)")
    parser.add_argument("--json", type=Path, default=None, metavar="PATH",
                        help="also write the results as JSON to PATH")
    parser.add_argument("--timeout", type=_positive_float, default=DEFAULT_TIMEOUT, metavar="SECONDS",
                        help="give up (and stop the workers) after this long (default: %(default)s)")
    parser.set_defaults(func=run)
    return parser


# --- workers ------------------------------------------------------------------------------------------

def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _worker(rank: int, world_size: int, port: int, config: dict[str, Any], methods: Sequence[str],
            messages: Any, timeout: float) -> None:
    """Worker process: join the gloo group, train every method, report through ``messages``.

    Messages: ``("progress", rank, method, step, steps, loss)``, ``("result", rank, method, dict)``,
    ``("error", rank, method or None, traceback text)``. Exits 1 after an error.
    """
    method: str | None = None
    try:
        import torch
        import torch.distributed as dist

        from ..workloads.digits import DemoConfig, train

        torch.set_num_threads(1)
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=world_size, timeout=timedelta(seconds=timeout))
        cfg = DemoConfig(**config)

        def progress(name: str, step: int, steps: int, loss: float) -> None:
            messages.put(("progress", rank, name, step, steps, loss))

        for method in methods:
            messages.put(("result", rank, method, train(rank, world_size, method, cfg, on_progress=progress)))
        method = None
        dist.destroy_process_group()
    except BaseException:  # noqa: BLE001 - everything goes to the parent, which decides
        messages.put(("error", rank, method, traceback.format_exc()))
        sys.exit(1)


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
    for rank in silent:
        lines.append(f"worker rank {rank} {_describe_exit(exit_codes[rank])} without a traceback "
                     "(any output it printed is above)")
    if first is not None and not silent:
        method, tb = errors[first]
        lines.append(f"worker rank {first} failed{f' during {method}' if method else ''}:")
        lines.append(tb.rstrip())
    consequences = sorted(r for r in errors if silent or r != first)
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
                methods: Sequence[str] = METHODS,
                on_progress: ProgressFn | None = None) -> dict[str, list[dict[str, Any]]]:
    """Run every method on ``workers`` spawned gloo processes; ``{method: [result of rank 0, 1, ...]}``.

    Raises :class:`WorkerFailure` (after stopping every worker) if a worker raises, dies or the run
    takes longer than ``timeout`` seconds. No worker process outlives this call.
    """
    ctx = mp.get_context("spawn")
    messages = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_worker, name=f"gradpress-demo-rank{rank}",
                         args=(rank, workers, port, config.to_dict(), tuple(methods), messages, timeout),
                         daemon=True) for rank in range(workers)]
    results: dict[str, dict[int, dict[str, Any]]] = {method: {} for method in methods}
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
    finally:
        _stop(procs)
        messages.close()
        messages.join_thread()
        if saved_sigterm is not None:
            signal.signal(signal.SIGTERM, saved_sigterm)
    return {method: [results[method][rank] for rank in range(workers)] for method in methods}


# --- report -------------------------------------------------------------------------------------------

def _plural(count: int, noun: str) -> str:
    """``"1 rank"``, ``"2 ranks"``, ``"2 worker processes"``."""
    if count == 1:
        return f"1 {noun}"
    return f"{count} {noun}{'es' if noun.endswith('s') else 's'}"


def _label(method: str, config: DemoConfig) -> str:
    return f"powersgd (r={config.rank})" if method == "powersgd" else method


def summarize(results: dict[str, list[dict[str, Any]]], config: DemoConfig, workers: int,
              wall_time: float) -> dict[str, Any]:
    """The JSON document: config, per-method metrics (from rank 0) and the agreement checks."""
    methods: dict[str, Any] = {}
    for method, per_rank in results.items():
        entry = {k: v for k, v in per_rank[0].items() if k not in ("rank", "checksum", "digest")}
        entry["checksums"] = [r["checksum"] for r in per_rank]
        entry["ranks_agree"] = len({r["digest"] for r in per_rank}) == 1 \
            and len({r["checksum"] for r in per_rank}) == 1
        methods[method] = entry
    cross_check: dict[str, Any] | None = None
    if "powersgd" in methods:
        ps = methods["powersgd"]
        stats = ps["stats"] or {}
        steps = ps["compressed_steps"]
        cross_check = {
            "plan_floats_per_step": ps["floats_per_step"],
            "stats_floats_per_step": stats.get("floats_per_step"),
            "compressed_steps": steps,
            "ok": steps > 0 and stats.get("numel_after") == ps["floats_per_step"] * steps
            and stats.get("numel_before") == ps["numel"] * steps,
        }
    return {
        "command": "gradpress demo",
        "workers": workers,
        "config": config.to_dict(),
        "methods": methods,
        "ranks_agree": all(m["ranks_agree"] for m in methods.values()),
        "cross_check": cross_check,
        "wall_time_s": wall_time,
    }


def format_report(summary: dict[str, Any]) -> str:
    """The side-by-side table and the check lines, as printed by ``gradpress demo``."""
    config = DemoConfig(**summary["config"])
    methods = summary["methods"]
    header = ("method", "test acc", "train loss", "floats/step", "compression", "steps", "time (s)")
    rows = [header]
    for method, m in methods.items():
        rows.append((_label(method, config), f"{100 * m['test_accuracy']:.1f}%", f"{m['train_loss']:.4f}",
                     f"{m['floats_per_step']:,}", f"{m['compression_rate']:.1f}x", str(m["steps"]),
                     f"{m['wall_time_s']:.2f}"))
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    lines = ["  ".join(cell.ljust(widths[i]) if i == 0 else cell.rjust(widths[i])
                       for i, cell in enumerate(row)) for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    any_method = next(iter(methods.values()))
    lines.append("")
    lines.append(f"floats/step: floats each worker sends per step ({any_method['numel']:,} parameters; "
                 f"PowerSGD after its first {config.start_iter} allreduce steps); time: training loop, "
                 "slowest rank")
    check = summary["cross_check"]
    if check is not None:
        status = "OK" if check["ok"] else "MISMATCH"
        counted = check["stats_floats_per_step"]
        counted_text = f"{counted:,.0f}" if counted is not None else "nothing"
        lines.append(f"cross-check: make_plan says {check['plan_floats_per_step']:,} floats/step, "
                     f"PowerSGDState.compression_stats() counted {counted_text} per step over "
                     f"{check['compressed_steps']} compressed steps: {status}")
    if summary["ranks_agree"]:
        sums = ", ".join(f"{method} {m['checksums'][0]:.6f}" for method, m in methods.items())
        lines.append(f"ranks agree: parameters identical on {_plural(summary['workers'], 'rank')} for every "
                     f"method (parameter sums: {sums})")
    else:
        for method, m in methods.items():
            if not m["ranks_agree"]:
                lines.append(f"RANKS DISAGREE for {method}: parameter sums per rank {m['checksums']}")
    return "\n".join(lines)


# --- the command --------------------------------------------------------------------------------------

def _fail(message: str, code: int = 2) -> int:
    """Print ``gradpress demo: error: message`` on stderr; return ``code``."""
    print(f"gradpress demo: error: {message}", file=sys.stderr)
    return code


def run(args: argparse.Namespace) -> int:
    """``gradpress demo``: returns 0 on success, 1 if a worker or a check failed, 2 for bad arguments."""
    if args.start_iter >= args.steps:
        return _fail(f"--start-iter must be smaller than --steps so that PowerSGD runs "
                     f"(got --start-iter {args.start_iter}, --steps {args.steps})")
    json_path: Path | None = args.json
    if json_path is not None and not json_path.parent.is_dir():
        return _fail(f"--json: directory {str(json_path.parent)!r} does not exist")
    config = DemoConfig(steps=args.steps, rank=args.rank, start_iter=args.start_iter, seed=args.seed,
                        log_every=max(1, args.steps // 6))
    model = make_model(config)
    n_params = sum(p.numel() for p in model.parameters())
    sizes = [model.fc1.in_features] + [layer.out_features for layer in (model.fc1, model.fc2, model.fc3)]
    print(f"gradpress demo: {_plural(args.workers, 'worker')} (gloo, CPU), "
          f"{config.steps} steps x batch {config.batch_size} per worker, MLP {'-'.join(map(str, sizes))} "
          f"({n_params:,} parameters), generated 8x8 data ({config.n_train} train / {config.n_test} test)",
          file=sys.stderr, flush=True)

    start = time.perf_counter()

    def progress(method: str, step: int, steps: int, loss: float) -> None:
        print(f"  [{_label(method, config)}] step {step:>{len(str(steps))}}/{steps}  loss {loss:.4f}  "
              f"({time.perf_counter() - start:.1f} s)", file=sys.stderr, flush=True)

    try:
        results = run_workers(config, args.workers, timeout=args.timeout, on_progress=progress)
    except WorkerFailure as exc:
        return _fail(str(exc), code=1)
    wall_time = time.perf_counter() - start

    summary = summarize(results, config, args.workers, wall_time)
    print(format_report(summary))
    print(f"total wall time: {wall_time:.1f} s "
          f"(including starting {_plural(args.workers, 'worker process')})")
    if json_path is not None:
        try:
            json_path.write_text(json.dumps(summary, indent=2) + "\n")
        except OSError as exc:
            return _fail(f"--json: could not write {str(json_path)!r}: {exc}", code=1)
        print(f"wrote {json_path}", file=sys.stderr)
    if not summary["ranks_agree"]:
        return _fail("ranks ended with different parameters", code=1)
    if summary["cross_check"] is not None and not summary["cross_check"]["ok"]:
        return _fail("PowerSGD's counted traffic does not match make_plan", code=1)
    return 0

"""The demo's supervisor: spawns the worker processes, relays their progress and results, and stops
all of them (naming the failing worker, its traceback and the collective it was in) when one fails or
the run times out."""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import re
import signal
import sys
import threading
import time
import traceback
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

from ...launch import free_port
from ...workloads.training import DemoConfig, Method, ProgressFn

DEFAULT_TIMEOUT = 600.0
#: Seconds a worker's collective waits for its peers before raising (a dead or stuck peer).
DEFAULT_COLLECTIVE_TIMEOUT = 60.0


class WorkerFailure(RuntimeError):
    """A worker crashed, exited early or timed out; ``str(exc)`` is the report to print."""


class Interrupted(KeyboardInterrupt):
    """Ctrl-C during :func:`run_workers` (the workers are stopped); ``completed`` holds the results of
    the methods that every worker had finished, in the order they were asked for."""

    def __init__(self, completed: dict[str, list[dict[str, Any]]]) -> None:
        super().__init__()
        self.completed = completed


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

        from ...workloads.training import DemoConfig, train

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

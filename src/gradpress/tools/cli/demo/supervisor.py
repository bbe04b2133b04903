"""The demo's supervisor: starts the worker processes (:func:`context`), relays their progress and
results, and stops all of them when one fails, when none has made progress for ``timeout`` seconds (a
stall), or on Ctrl-C.
The methods every worker had finished are kept in each case; a failure's report names the worker that
caused it, its traceback and the collective the others were in, whatever order their messages arrive in.

Each worker has its own pipe to the supervisor and writes to it from its main thread only, so a worker
killed in the middle of a message (SIGKILL, the OOM killer) can only cut its own pipe (read as its
exit), never block or garble another worker's messages.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from datetime import timedelta
from multiprocessing.connection import Connection, wait
from typing import Any, Protocol, cast

from ...processes import join_group, serve_rendezvous
from ...workloads.config import DemoConfig
from ...workloads.methods import Method
from ...workloads.training import ProgressFn
from .failures import WorkerError, failure_report, is_peer_loss, root_cause_line

#: Seconds without a report from any worker (a step, an evaluation, a result) after which the run is stopped.
DEFAULT_TIMEOUT = 600.0
#: Seconds a worker's collective waits for its peers before raising (a dead or stuck peer).
DEFAULT_COLLECTIVE_TIMEOUT = 60.0
#: A worker reports its optimizer steps at most this often (seconds): liveness, not a log.
STEP_REPORT_INTERVAL = 1.0
#: Seconds the supervisor keeps listening, once a worker failed, for the others' errors or exits: the
#: worker that caused a failure may be heard from after the ones that failed because of it.
SETTLE_TIME = 10.0


class StoppedEarly:
    """What a run stopped before its end keeps (mixed into :class:`WorkerFailure` and :class:`Interrupted`).

    ``completed``: ``{method.spec: [result of rank 0, 1, ...]}`` for the methods that every worker had
    finished, in the order they were asked for; ``stopped``: the label of the method that was running (or
    about to run), ``None`` if none; ``kind``: ``"failed"``, ``"stalled"`` or ``"interrupted"``;
    ``reason``: one line saying why.
    """

    completed: dict[str, list[dict[str, Any]]]
    stopped: str | None
    kind: str
    reason: str

    def _keep(self, completed: dict[str, list[dict[str, Any]]] | None, stopped: str | None, kind: str,
              reason: str) -> None:
        self.completed = dict(completed or {})
        self.stopped = stopped
        self.kind = kind
        self.reason = reason


class WorkerFailure(StoppedEarly, RuntimeError):
    """A worker crashed or exited early (``kind="failed"``), or no worker made progress for the run's
    timeout (``kind="stalled"``); ``str(exc)`` is the report to print."""

    def __init__(self, report: str, completed: dict[str, list[dict[str, Any]]] | None = None,
                 stopped: str | None = None, kind: str = "failed", reason: str | None = None) -> None:
        RuntimeError.__init__(self, report)
        self._keep(completed, stopped, kind, reason if reason is not None else report.splitlines()[0])


class Interrupted(StoppedEarly, KeyboardInterrupt):
    """Ctrl-C during :func:`run_workers` (the workers are stopped)."""

    def __init__(self, completed: dict[str, list[dict[str, Any]]], stopped: str | None = None) -> None:
        KeyboardInterrupt.__init__(self)
        self._keep(completed, stopped, "interrupted", "Ctrl-C")


# --- workers ------------------------------------------------------------------------------------------

class StepReporter:
    """A global optimizer step post-hook (``torch.optim.optimizer.register_optimizer_step_post_hook``):
    after an optimizer step, ``send(("step", rank, label))`` if nothing was sent for ``interval``
    seconds. The supervisor's stall timeout counts from these reports, so a run is judged by its
    steps, however far apart its evaluations are."""

    def __init__(self, send: Callable[[tuple[Any, ...]], None], rank: int, interval: float = STEP_REPORT_INTERVAL,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.send, self.rank, self.interval, self.clock = send, rank, interval, clock
        self.label: str | None = None
        self._last = -float("inf")

    def __call__(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        now = self.clock()
        if now - self._last >= self.interval:
            self._last = now
            self.send(("step", self.rank, self.label))


#: What the forkserver imports once, before it forks any worker (``context``).
PRELOAD = ["torch", "torch.distributed", "gradpress", "gradpress.tools.workloads.training"]


def context() -> Any:
    """Where the workers come from: forked from a server that imported :data:`PRELOAD` once (started by
    the first call in a process; each later call's workers start in a fraction of a second instead of an
    interpreter start and an ``import torch`` each, 5-15 s on a busy 2-core machine), or spawned where
    there is no forkserver. Either way each worker is a new process with none of the caller's state, and
    it runs in the caller's environment at the call (see ``_worker``)."""
    if "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    return ctx


def _worker(rank: int, world_size: int, port: int, config: dict[str, Any], methods: Sequence[Method],
            channel: Connection, timeout: float, environ: dict[str, str]) -> None:
    """Worker process: join the group (its rendezvous is the supervisor's store at ``port``), train every
    method, report through ``channel`` (this worker's own).

    Messages: ``("started", rank, label)`` as a method starts, ``("step", rank, label)`` at most every
    :data:`STEP_REPORT_INTERVAL` seconds while its optimizer steps, ``("progress", rank, label, step,
    steps, loss)`` at rank 0's evaluations, ``("result", rank, spec, dict)``, and ``("error", rank, label
    or None, traceback text, is_peer_loss)``. Exits 1 after an error. NCCL with GPU ``rank`` when there
    are at least ``world_size`` GPUs, gloo on CPU otherwise.
    """
    label: str | None = None
    # A forked worker inherits the server's environment, from when the server started: take the caller's,
    # as a spawned interpreter would (NCCL_*, GLOO_SOCKET_IFNAME, ... set since then).
    os.environ.clear()
    os.environ.update(environ)
    try:
        import torch
        import torch.distributed as dist
        from torch.optim.optimizer import register_optimizer_step_post_hook

        from ...workloads.training import train

        torch.set_num_threads(1)
        use_cuda = torch.cuda.is_available() and torch.cuda.device_count() >= world_size
        device = torch.device("cuda", rank) if use_cuda else torch.device("cpu")
        if use_cuda:
            torch.cuda.set_device(device)
        join_group("nccl" if use_cuda else "gloo", port, rank, world_size, timeout=timedelta(seconds=timeout))
        cfg = DemoConfig(**config)
        steps = StepReporter(channel.send, rank)
        register_optimizer_step_post_hook(steps)

        def progress(name: str, step: int, total: int, loss: float) -> None:
            channel.send(("progress", rank, name, step, total, loss))

        for method in methods:
            label = steps.label = method.label
            channel.send(("started", rank, label))
            result = train(rank, world_size, method, cfg, on_progress=progress, device=device)
            result["backend"] = dist.get_backend()
            channel.send(("result", rank, method.spec, result))
        label = None
        dist.destroy_process_group()
    except BaseException as exc:  # noqa: BLE001 - everything goes to the parent, which decides
        try:
            channel.send(("error", rank, label, traceback.format_exc(), is_peer_loss(exc)))
        except OSError:
            pass  # the supervisor is gone: nobody to tell
        sys.exit(1)


# --- what the supervisor heard ------------------------------------------------------------------------

class Ledger:
    """What the supervisor has heard from the workers: their results, their errors, and when any of
    them last made progress. Pure bookkeeping, fed one message at a time (:meth:`receive`)."""

    def __init__(self, methods: Sequence[Method], workers: int, clock: Callable[[], float] = time.monotonic) -> None:
        self.methods = list(methods)
        self.workers = workers
        self.clock = clock
        self.results: dict[str, dict[int, dict[str, Any]]] = {m.spec: {} for m in self.methods}
        self.errors: dict[int, WorkerError] = {}
        self.last_report = clock()
        #: Whether any worker has sent anything yet (the workers have started).
        self.heard = False
        #: Rank 0's last evaluation: ``(label, step, steps)``.
        self.last_evaluation: tuple[str, int, int] | None = None

    def receive(self, msg: tuple[Any, ...], on_progress: ProgressFn | None = None) -> None:
        """Record one worker message (any kind is a sign of life); evaluations go on to ``on_progress``."""
        self.last_report = self.clock()
        self.heard = True
        kind, rank = msg[0], msg[1]
        if kind == "progress":
            self.last_evaluation = (msg[2], msg[3], msg[4])
            if on_progress is not None:
                on_progress(*msg[2:])
        elif kind == "result":
            self.results[msg[2]][rank] = msg[3]
        elif kind == "error":
            self.errors.setdefault(rank, WorkerError(msg[2], msg[3], bool(msg[4])))

    @property
    def received(self) -> int:
        return sum(len(per_rank) for per_rank in self.results.values())

    @property
    def expected(self) -> int:
        return self.workers * len(self.methods)

    @property
    def complete(self) -> bool:
        return self.received == self.expected

    def idle(self) -> float:
        """Seconds since the last message from any worker."""
        return self.clock() - self.last_report

    def completed(self) -> dict[str, list[dict[str, Any]]]:
        """The results of the methods that every worker finished, in the order they were asked for."""
        return {m.spec: [self.results[m.spec][rank] for rank in range(self.workers)]
                for m in self.methods if len(self.results[m.spec]) == self.workers}

    def stopped(self) -> str | None:
        """The label of the first method that not every worker finished (the one running), if any."""
        return next((m.label for m in self.methods if len(self.results[m.spec]) < self.workers), None)


# --- supervising --------------------------------------------------------------------------------------

class _Process(Protocol):
    """What the supervision loop needs of a worker process (a ``multiprocessing.Process``)."""

    @property
    def exitcode(self) -> int | None: ...

    def join(self, timeout: float | None = None) -> None: ...


def _read(channels: dict[Connection, int], ledger: Ledger, wait_s: float,
          on_progress: ProgressFn | None = None) -> None:
    """Record the messages that arrive within ``wait_s`` seconds; a channel at its end (its worker exited,
    or died mid-message) is dropped from ``channels``."""
    if not channels:
        time.sleep(wait_s)
        return
    # wait() returns the objects it was given (typeshed types them as any waitable).
    for conn in cast("list[Connection]", wait(list(channels), timeout=wait_s)):
        try:
            msg = conn.recv()
        except (EOFError, OSError):
            del channels[conn]
            continue
        ledger.receive(msg, on_progress)


def _settle(channels: dict[Connection, int], ledger: Ledger, grace: float) -> None:
    """After a failure: keep listening until every worker has sent an error or closed its channel
    (exited), or ``grace`` seconds passed."""
    end = time.monotonic() + grace
    while True:
        left = end - time.monotonic()
        if left <= 0 or all(rank in ledger.errors for rank in channels.values()):
            return
        _read(channels, ledger, min(0.2, left))


def supervise(ledger: Ledger, channels: dict[Connection, int], procs: Sequence[_Process], *, timeout: float,
              startup: float = 0.0, on_progress: ProgressFn | None = None, settle: float = SETTLE_TIME) -> None:
    """Relay the workers' messages into ``ledger`` until every result has arrived.

    ``channels``: each worker's pipe (read end) and its rank. Raises :class:`WorkerFailure` (with the
    methods every worker finished) when a worker reports an error or dies, when the workers exit before
    sending every result, or when no message has come for ``timeout`` seconds (``kind="stalled"``);
    before the first message, ``timeout + startup`` seconds. The caller stops the processes.
    """
    reason: str | None = None
    kind, stall = "failed", ""
    while not ledger.complete:
        _read(channels, ledger, 0.2, on_progress)
        if ledger.errors or any(proc.exitcode not in (None, 0) for proc in procs):
            break
        if not channels:  # every worker closed its channel before sending every result
            for proc in procs:
                proc.join(timeout=1)
            if all(proc.exitcode == 0 for proc in procs):
                reason = f"workers exited after sending {ledger.received} of {ledger.expected} results"
            break
        if ledger.heard and ledger.idle() > timeout:
            kind = "stalled"
            running = ledger.stopped()
            stall = f"no worker reported progress for {timeout:g} s"
            last = ledger.last_evaluation
            if last is not None and last[0] == running:
                stall += f" (the last evaluation was at step {last[1]} of {last[2]})"
            where = f" during {running}" if running else ""
            reason = (f"the run stalled{where}: {stall}; --timeout {timeout:g} stops a run after that "
                      "long without progress (raise it if a step or an evaluation can take longer on this machine)")
            break
        if not ledger.heard and ledger.idle() > timeout + startup:
            kind = "stalled"
            stall = f"no worker started within {timeout + startup:g} s"
            reason = (f"the run stalled while starting: {stall} (--timeout {timeout:g}, plus {startup:g} s for "
                      "joining the process group)")
            break
    if ledger.complete:
        return
    _settle(channels, ledger, settle if kind == "failed" else min(settle, 1.0))
    for rank, proc in enumerate(procs):
        if rank not in channels.values():  # its channel closed: it has exited, or is about to
            proc.join(timeout=1)
    codes = [proc.exitcode for proc in procs]
    report = failure_report(ledger.errors, codes, reason)
    if kind == "stalled":
        summary = stall
    else:
        summary = root_cause_line(ledger.errors, codes) or reason or report.splitlines()[0]
    raise WorkerFailure(report, ledger.completed(), ledger.stopped(), kind, summary)


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
    """Run every method on ``workers`` new processes (:func:`context`); ``{method.spec: [result of rank 0,
    1, ...]}``.

    ``timeout`` is a stall timeout: the run is stopped when no worker has reported anything (an
    optimizer step, an evaluation, a result) for that many seconds, however long the whole run takes;
    starting the workers, until the first report, may take the collective timeout more. Raises
    :class:`WorkerFailure` (after stopping every worker) if a worker raises or dies, or the run stalls, and
    :class:`Interrupted` on Ctrl-C; both carry the results of the methods every worker had finished
    (:class:`StoppedEarly`). No worker process outlives this call. A collective waits
    ``collective_timeout`` seconds (at most ``timeout``) for a dead or stuck peer; the report then names
    the worker that was stuck.
    """
    ctx = context()
    joining = min(timeout, collective_timeout)
    pipes = [ctx.Pipe(duplex=False) for _ in range(workers)]
    # The group's rendezvous, served from this process on a port it holds until the run ends.
    store = serve_rendezvous(workers, timeout=timedelta(seconds=joining))
    port = store.port
    environ = {**os.environ, "OMP_NUM_THREADS": "1"}
    procs = [ctx.Process(target=_worker, name=f"gradpress-demo-rank{rank}",
                         args=(rank, workers, port, config.to_dict(), tuple(methods), pipes[rank][1], joining,
                               environ),
                         daemon=True) for rank in range(workers)]
    channels = {reader: rank for rank, (reader, _) in enumerate(pipes)}
    ledger = Ledger(methods, workers)
    saved_omp = os.environ.get("OMP_NUM_THREADS")
    saved_sigterm = _raise_on_sigterm()
    try:
        # One thread per worker: inherited by a spawned interpreter, or by the forkserver this call may
        # start, before either loads torch.
        os.environ["OMP_NUM_THREADS"] = "1"
        try:
            for proc, (_, writer) in zip(procs, pipes):
                proc.start()
                writer.close()  # the worker holds its own copy: its exit is then the channel's end
        finally:
            if saved_omp is None:
                os.environ.pop("OMP_NUM_THREADS", None)
            else:
                os.environ["OMP_NUM_THREADS"] = saved_omp
        ledger.last_report = ledger.clock()  # the stall clock starts with the workers
        # Starting (importing torch, joining the group) reports nothing until it is done, and joining
        # waits up to the collective timeout for the others: it gets that long on top of the timeout.
        supervise(ledger, channels, procs, timeout=timeout, startup=joining, on_progress=on_progress)
        for proc in procs:
            proc.join(timeout=30)
        codes = [proc.exitcode for proc in procs]
        if any(code != 0 for code in codes):
            _settle(channels, ledger, grace=0.5)
            _stop(procs)
            raise WorkerFailure(failure_report(ledger.errors, codes, "a worker failed while shutting down"),
                                ledger.completed(), None)
    except KeyboardInterrupt:
        raise Interrupted(ledger.completed(), ledger.stopped()) from None
    finally:
        _stop(procs)
        for reader, writer in pipes:
            reader.close()
            writer.close()
        if saved_sigterm is not None:
            signal.signal(signal.SIGTERM, saved_sigterm)
        del store  # the port goes now, not with a traceback that may keep this frame alive
    return ledger.completed()

"""The one helper for multi-process tests: gloo on CPU, a store held by the test process, timeout, rank
tracebacks re-raised.

``run(fn, world_size, *args)`` calls ``fn(rank, world_size, *args)`` on every rank of a persistent worker
group (process start-up and ``import torch`` are paid once per world size per session) and returns the
per-rank results. ``run_fresh`` does the same in newly started processes (for checkpoint tests). Workers
are forked from a server that imported torch once.
``fn`` must be a module-level function of an importable module.
"""

from __future__ import annotations

import io
import os
import queue
import traceback
from typing import Any, Callable

from gradpress.tools.cli.demo.supervisor import context
from gradpress.tools.processes import join_group, serve_rendezvous

# The demo's start method: forked from a server that imported torch once (about 0.1 s a group instead of
# an interpreter start and ``import torch`` each, 5-15 s on a busy 2-core machine), each still a new
# process with none of the test process's state; spawned where there is no forkserver. One server, one
# preload list, for these groups and the demo runs of the same session.
_CTX = context()
DEFAULT_TIMEOUT = 180.0


def _worker(rank: int, world_size: int, port: int, tasks: Any, results: Any, once: bool) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    try:
        join_group("gloo", port, rank, world_size)
    except Exception:
        results.put((rank, False, traceback.format_exc()))
        return
    try:
        while True:
            item = tasks.get()
            if item is None:
                break
            fn, args = item
            try:
                # Serialized here: tensors sent as-is are shared through file descriptors that die with
                # this process.
                payload = io.BytesIO()
                torch.save(fn(rank, world_size, *args), payload)
                results.put((rank, True, payload.getvalue()))
            except BaseException:
                results.put((rank, False, traceback.format_exc()))
            if once:
                break
    finally:
        dist.destroy_process_group()


class WorkerGroup:
    """``world_size`` processes in one gloo group, running submitted functions on every rank."""

    def __init__(self, world_size: int, once: bool = False) -> None:
        self.world_size = world_size
        # The group's rendezvous, served from this process on a port it holds until the group is closed.
        self.store: Any = serve_rendezvous(world_size)
        port = self.store.port
        self.results = _CTX.Queue()
        self.tasks = [_CTX.Queue() for _ in range(world_size)]
        self.procs = [_CTX.Process(target=_worker, args=(r, world_size, port, self.tasks[r], self.results, once),
                                   daemon=True) for r in range(world_size)]
        for proc in self.procs:
            proc.start()
        self.broken = False

    def run(self, fn: Callable[..., Any], *args: Any, timeout: float = DEFAULT_TIMEOUT) -> list[Any]:
        for q in self.tasks:
            q.put((fn, args))
        out: dict[int, Any] = {}
        errors: dict[int, str] = {}
        while len(out) + len(errors) < self.world_size:
            try:
                rank, ok, value = self.results.get(timeout=timeout)
            except queue.Empty:
                self.close(kill=True)
                dead = [r for r, p in enumerate(self.procs) if not p.is_alive()]
                raise AssertionError(
                    f"{fn.__name__} timed out after {timeout}s on {self.world_size} ranks "
                    f"(answered: {sorted(out) + sorted(errors)}, dead: {dead})" +
                    "".join(f"\n--- rank {r} ---\n{tb}" for r, tb in errors.items()))
            if ok:
                import torch

                out[rank] = torch.load(io.BytesIO(value), weights_only=False)
            else:
                errors[rank] = value
            if errors and len(out) + len(errors) < self.world_size:
                # Other ranks may now wait forever in a collective: give them a short grace, then stop.
                timeout = min(timeout, 20.0)
        if errors:
            self.close(kill=True)
            raise AssertionError(f"{fn.__name__} failed on rank(s) {sorted(errors)}:" +
                                 "".join(f"\n--- rank {r} ---\n{tb}" for r, tb in sorted(errors.items())))
        return [out[r] for r in range(self.world_size)]

    def close(self, kill: bool = False) -> None:
        self.broken = True
        if not kill:
            for q in self.tasks:
                q.put(None)
        for proc in self.procs:
            proc.join(timeout=0 if kill else 10)
            if proc.is_alive():
                proc.kill()
                proc.join()
        self.store = None  # the rendezvous and its port go with the group


_GROUPS: dict[int, WorkerGroup] = {}


def run(fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = DEFAULT_TIMEOUT) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on a shared group of ``world_size`` gloo workers."""
    group = _GROUPS.get(world_size)
    if group is None or group.broken:
        group = _GROUPS[world_size] = WorkerGroup(world_size)
    return group.run(fn, *args, timeout=timeout)


def run_fresh(fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = DEFAULT_TIMEOUT) -> list[Any]:
    """Like :func:`run`, in processes started for this call alone."""
    group = WorkerGroup(world_size, once=True)
    try:
        return group.run(fn, *args, timeout=timeout)
    finally:
        group.close(kill=False) if not group.broken else None
        for proc in group.procs:
            proc.join(timeout=10)


def close_all() -> None:
    for group in _GROUPS.values():
        if not group.broken:
            group.close()
    _GROUPS.clear()

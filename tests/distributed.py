"""The one helper for multi-process tests: gloo on CPU, a store held by the test process, timeout, rank
tracebacks re-raised.

``run(fn, world_size, *args)`` calls ``fn(rank, world_size, *args)`` on every rank of a persistent worker
group (process start-up and ``import torch`` are paid once per world size per session) and returns the
per-rank results. ``run_fresh`` does the same in newly started processes (for checkpoint tests).
``run_script(path, args, nproc)`` runs a script as ``torchrun --standalone --nproc-per-node NPROC path
args`` would, in new processes that join no group of ours: the script makes its own from the environment
torchrun would give it. Workers are forked from a server that imported torch once.
``fn`` must be a module-level function of an importable module.
"""

from __future__ import annotations

import io
import os
import queue
import sys
import traceback
from typing import Any, Callable

from gradpress.tools.cli.demo import supervisor
from gradpress.tools.cli.demo.supervisor import context
from gradpress.tools.processes import join_group, serve_rendezvous

# The demo's start method: forked from a server that imported torch once (about 0.1 s a group instead of
# an interpreter start and ``import torch`` each, 5-15 s on a busy 2-core machine), each still a new
# process with none of the test process's state; spawned where there is no forkserver. One server, one
# preload list, for these groups and the demo runs of the same session: the demo's (``PRELOAD``), and
# for the tests also what nearly every new worker imported next, each on its own: ``torch._dynamo``,
# which DDP's constructor imports, and scikit-learn, the digits task's data (with SciPy): 3-5 s of a
# demo worker's 5-6 s from its start to its first step, measured on the busy 2-core machine; 0.2 s
# with them preloaded. Only what the server imports changes (a module it cannot import is skipped, and
# the worker imports it as before); the demo's own runs outside the tests keep ``PRELOAD``.
for _module in ("torch._dynamo", "sklearn.datasets"):
    if _module not in supervisor.PRELOAD:
        supervisor.PRELOAD.append(_module)
_CTX = context()
DEFAULT_TIMEOUT = 180.0


def _worker(rank: int, world_size: int, port: int, tasks: Any, results: Any, once: bool, join: bool) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    try:
        if join:
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
        if dist.is_initialized():  # a script run by ``run_script`` destroys the group it made itself
            dist.destroy_process_group()


class WorkerGroup:
    """``world_size`` processes in one gloo group, running submitted functions on every rank (with ``join``
    false, in no group: the store is there for what they run to make one)."""

    def __init__(self, world_size: int, once: bool = False, join: bool = True) -> None:
        self.world_size = world_size
        # The group's rendezvous, served from this process on a port it holds until the group is closed.
        self.store: Any = serve_rendezvous(world_size)
        port = self.store.port
        self.results = _CTX.Queue()
        self.tasks = [_CTX.Queue() for _ in range(world_size)]
        self.procs = [_CTX.Process(target=_worker, daemon=True,
                                   args=(r, world_size, port, self.tasks[r], self.results, once, join))
                      for r in range(world_size)]
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


#: The process groups a script run by :func:`run_script` destroyed, kept until its process ends.
_KEPT: list[Any] = []


def _script(rank: int, world_size: int, path: str, args: list[str], env: dict[str, str],
            cwd: str | None) -> tuple[int, str]:
    """Rank ``rank`` of :func:`run_script`: ``python path args`` as torchrun's worker ``rank`` would run it.

    One difference, outside what the script does: the groups it destroys are deregistered as usual but
    their C++ objects are kept (``_KEPT``) until this process ends, without running their destructors
    (``os._exit``). Otherwise the last reference to a gloo group is the one a DDP reducer drops when the
    script's objects are freed after ``destroy_process_group``, holding the GIL, and
    ``~ProcessGroupGloo`` joins a gloo thread which, now and then, is waiting for the GIL to free the
    thread-local state of the last collective (pytorch/pytorch#56297): the process hangs for good (seen
    once in about six runs of ``examples/own_script.py --compile`` here, with both threads' stacks in
    gdb; probably also the Accelerate example's rare teardown hang under torchrun, which its test runs
    again, tests/torchrun.py). Each example's own torchrun test still runs it without this."""
    import contextlib
    import runpy

    import torch.distributed as dist
    from torch.distributed import distributed_c10d

    destroy = dist.destroy_process_group

    def destroy_keeping_the_objects(group: Any = None) -> None:
        _KEPT.extend(distributed_c10d._world.pg_map)
        destroy(group)

    # This process runs this one script only: nothing else sees the change.
    dist.destroy_process_group = distributed_c10d.destroy_process_group = destroy_keeping_the_objects
    os.environ.clear()
    os.environ.update(env, RANK=str(rank), LOCAL_RANK=str(rank), ROLE_RANK=str(rank))
    if cwd is not None:
        os.chdir(cwd)
    sys.argv = [path, *args]
    sys.path.insert(0, os.path.dirname(os.path.abspath(path)))  # as ``python path`` puts the script's folder
    out = io.StringIO()
    code: Any = 0
    with contextlib.redirect_stdout(out):
        try:
            runpy.run_path(path, run_name="__main__")
        except SystemExit as exc:
            code = exc.code
    return (0 if code is None else code if isinstance(code, int) else 1), out.getvalue()


def run_script(path: str | os.PathLike[str], args: list[str], nproc: int, *, env: dict[str, str] | None = None,
               cwd: str | os.PathLike[str] | None = None, timeout: float = DEFAULT_TIMEOUT) -> list[tuple[int, str]]:
    """Run the script at ``path`` with ``args`` as ``torchrun --standalone --nproc-per-node NPROC path args``
    would, on ``nproc`` processes started for this call (forked from the server, no group joined, one
    thread each): each runs it as ``__main__`` in ``cwd`` with the environment torchrun gives its workers
    (``env``, default this process's, plus ``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ... and, as torchrun's
    agent does, ``MASTER_ADDR``/``MASTER_PORT`` of a store this process serves with
    ``TORCHELASTIC_USE_AGENT_STORE``), so that ``init_process_group`` from the environment makes the group.
    Returns each rank's ``(exit code, what it printed)``; a rank that raises fails the call with its
    traceback. For a test whose subject is the script's code path, not the launch: each example keeps one
    test that starts it under a real ``torchrun`` (``tests/torchrun.py``)."""
    group = WorkerGroup(nproc, once=True, join=False)
    base = dict(os.environ if env is None else env)
    base.update(OMP_NUM_THREADS="1", WORLD_SIZE=str(nproc), LOCAL_WORLD_SIZE=str(nproc), ROLE_WORLD_SIZE=str(nproc),
                GROUP_RANK="0", GROUP_WORLD_SIZE="1", ROLE_NAME="default", MASTER_ADDR="127.0.0.1",
                MASTER_PORT=str(group.store.port), TORCHELASTIC_USE_AGENT_STORE="True",
                TORCHELASTIC_RESTART_COUNT="0", TORCHELASTIC_MAX_RESTARTS="0",
                TORCHELASTIC_RUN_ID=f"run_script-{os.getpid()}-{group.store.port}")
    try:
        return group.run(_script, os.fspath(path), list(args), base, None if cwd is None else os.fspath(cwd),
                         timeout=timeout)
    finally:
        group.close(kill=False) if not group.broken else None
        for proc in group.procs:
            proc.join(timeout=10)


def modules_imported_by(rank: int, world_size: int, statement: str, names: list[str]) -> list[str]:
    """Those of ``names`` in ``sys.modules`` after ``exec(statement)``: run with :func:`run_fresh`, in a
    process forked from the server, which has imported its preload list (torch, gradpress) and this module
    only, what an interpreter started for ``python -c statement`` would hold (the test process's
    imports, Lightning's included, are not there)."""
    exec(statement, {})
    return sorted(name for name in names if name in sys.modules)


def close_all() -> None:
    for group in _GROUPS.values():
        if not group.broken:
            group.close()
    _GROUPS.clear()

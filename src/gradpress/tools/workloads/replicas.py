"""W data-parallel replicas of :func:`~gradpress.tools.workloads.training.train` in one process, one thread each.

Local SGD, DiLoCo and their streamed and compressed variants end on a result that depends on the number of
replicas, not only on the global batch (PowerSGD's averaged update does: there, one worker with a W times
larger batch stands in for W workers). Studying 8, 16 or 32 replicas on a machine with 2 cores is what this
module is for: :func:`train_replicas` runs ``train(rank, W, method, config)`` for every rank at once, each
rank a thread and a member of an in-memory process group (PyTorch's threaded group from its own test suite,
``torch.testing._internal.distributed.multi_threaded_pg``), so every line of the training loop, DDP, the
hooks, the averagers, the outer step and the compressors runs as it does on W real workers: nothing of
their arithmetic is re-derived here.

What equals real workers (``tests/tools/test_replicas.py`` checks against W gloo processes): each replica's data
shard and order, the initial weights (rank 0's, broadcast by DDP), the warm-up, the optimizer and its
learning-rate schedule, every collective in the same order, and so the curve, the bytes and the final
parameters. A sum over ranks is taken in rank order (``((x0 + x1) + x2) + ...``) where gloo's ring adds in
another order: with 2 replicas the results are bitwise those of gloo (a + b == b + a), with more they agree
to float rounding. What does not: the times (``wall_time_s``, ``time_s``), which are those of W threads
sharing this machine's cores.

>>> results = train_replicas(parse_methods("diloco:8", [1])[0], DemoConfig(steps=300), 16)   # doctest: +SKIP
>>> results[0]["curve"][-1]["metric"], results[0]["bytes_per_step"]                          # doctest: +SKIP
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

from .config import DemoConfig
from .methods import Method
from .training import ProgressFn, train

__all__ = ["DEFAULT_TIMEOUT_S", "train_replicas"]

#: How long :func:`train_replicas` waits for the replicas before it stops them and raises.
DEFAULT_TIMEOUT_S = 24 * 3600.0

# One simulation at a time in a process: the threaded group replaces torch.distributed's (process-wide) world.
_RUNNING = threading.Lock()


def _threaded_group_module() -> Any:
    """PyTorch's in-memory threaded process group (a module of its test suite, imported here only, so a torch
    that moves it breaks this one place). Importing it registers the ``"threaded"`` backend."""
    try:
        from torch.testing._internal.distributed import multi_threaded_pg
    except ImportError as exc:  # pragma: no cover - depends on the torch build
        raise RuntimeError(f"simulating replicas needs torch's threaded process group "
                           f"(torch.testing._internal.distributed.multi_threaded_pg), missing in torch "
                           f"{torch.__version__}: {exc}") from exc
    return multi_threaded_pg


@contextlib.contextmanager
def _threaded_world() -> Iterator[Any]:
    """Install the threaded world (each thread sees its own default group) and remove it after, as PyTorch's
    ``MultiThreadedTestCase`` does; yields the group class (for its termination event)."""
    threaded = _threaded_group_module()
    isolation = torch._C._distributed_c10d._set_thread_isolation_mode  # type: ignore[attr-defined]  # not in the stubs
    isolation(True)
    threaded._install_threaded_pg()
    try:
        yield threaded.ProcessLocalGroup
    finally:
        threaded.ProcessLocalGroup.reset()
        threaded._uninstall_threaded_pg()
        isolation(False)


def _check(method: Method, config: DemoConfig, replicas: int) -> None:
    if isinstance(replicas, bool) or not isinstance(replicas, int) or replicas < 1:
        raise ValueError(f"replicas must be an integer >= 1, got {replicas!r}")
    if config.fail_at_step is not None and config.fail_kind != "raise":
        # sigkill would end this process, every replica with it; hang would never return.
        raise ValueError(f"DemoConfig.fail_kind={config.fail_kind!r} cannot be simulated in one process; "
                         "use fail_kind='raise' or real workers")


def train_replicas(method: Method, config: DemoConfig, replicas: int, *, on_progress: ProgressFn | None = None,
                   device: torch.device | str = "cpu", checkpoint_dir: str | os.PathLike[str] | None = None,
                   checkpoint_every: int | None = None, timeout_s: float = DEFAULT_TIMEOUT_S) -> list[dict[str, Any]]:
    """Run ``train(rank, replicas, method, config, ...)`` for every rank, each in a thread of this process in
    one threaded process group, and return the results in rank order (each what :func:`train` returns on
    that rank: curve, bytes per step, checksum, ...). Any method of the registry runs; the point is the
    model-averaging ones, whose result depends on ``replicas``.

    The caller's thread must not be in a process group (``ValueError``), and one simulation runs at a time
    per process (the others wait). Threads share the process's torch settings: set
    ``torch.set_num_threads(1)`` to give each replica one core's worth. A replica that raises stops the
    others (they leave their collectives) and its exception is raised here; ``timeout_s`` bounds the
    whole run (``TimeoutError``). ``checkpoint_dir`` and ``checkpoint_every`` are :func:`train`'s: every
    replica saves its rank's files there, as real workers would. ``fail_kind`` other than ``"raise"`` is
    refused (``ValueError``): it would kill or hang this process.
    """
    _check(method, config, replicas)
    if dist.is_available() and dist.is_initialized():
        raise ValueError("train_replicas runs its own process group: call it outside torch.distributed "
                         "(this thread already has a default process group)")
    with _RUNNING, _threaded_world() as group_class:
        store = dist.HashStore()
        results: list[dict[str, Any] | None] = [None] * replicas
        errors: dict[int, BaseException] = {}

        def replica(rank: int) -> None:
            try:
                dist.init_process_group(backend="threaded", rank=rank, world_size=replicas, store=store)
                try:
                    results[rank] = train(rank, replicas, method, config, on_progress, device,
                                          checkpoint_dir=checkpoint_dir, checkpoint_every=checkpoint_every)
                finally:
                    dist.destroy_process_group()
            except SystemExit:  # left a collective because another replica failed (the group's termination)
                pass
            except BaseException as exc:  # raised in the caller; wake the others blocked in a collective
                errors[rank] = exc
                group_class.exception_handle(exc)

        threads = [threading.Thread(target=replica, args=(rank,), name=f"gradpress-replica-{rank}", daemon=True)
                   for rank in range(replicas)]
        for thread in threads:
            thread.start()
        deadline = threading.Event()
        timer = threading.Timer(timeout_s, deadline.set)
        timer.start()
        try:
            for thread in threads:
                while thread.is_alive() and not deadline.is_set():
                    thread.join(timeout=1.0)
        finally:
            timer.cancel()
        if deadline.is_set() and any(thread.is_alive() for thread in threads):
            stuck = [rank for rank, thread in enumerate(threads) if thread.is_alive()]
            group_class.exception_handle(TimeoutError())
            for thread in threads:
                thread.join(timeout=10.0)
            raise TimeoutError(f"train_replicas: {method.spec} on {replicas} replicas did not finish within "
                               f"{timeout_s:g} s (replicas still running: {stuck})")
        if errors:
            rank = min(errors)
            raise RuntimeError(f"replica {rank} of {replicas} failed ({method.spec}): {errors[rank]!r}") \
                from errors[rank]
        missing = [rank for rank, result in enumerate(results) if result is None]
        if missing:  # pragma: no cover - every replica either returns or records its error
            raise RuntimeError(f"replicas {missing} of {replicas} returned no result")
        return [result for result in results if result is not None]

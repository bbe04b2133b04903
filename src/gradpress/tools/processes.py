"""Local processes for the tools (the demo, ``check``, ``bench``) and the tests: a local group's rendezvous
(a store this process serves, or a free port), and the cores this process may use."""

from __future__ import annotations

import os
import socket
from datetime import timedelta
from typing import Any

__all__ = ["free_port", "join_group", "serve_rendezvous", "usable_cores"]


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (for a local group's ``MASTER_PORT`` or
    ``tcp://`` init method; another process may take it before it is bound again)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


#: A store's own wait for its peers, torch's default.
STORE_TIMEOUT = timedelta(seconds=300)


def serve_rendezvous(world_size: int, timeout: timedelta = STORE_TIMEOUT) -> Any:
    """A ``TCPStore`` served from this process on 127.0.0.1, at a port the OS picked (``store.port``), for
    ``world_size`` worker processes that :func:`join_group` it. The port is held from the start until the
    store is dropped, so no other process can take it between choosing it and the workers joining (as it
    can with :func:`free_port`)::

        store = serve_rendezvous(2)      # then start 2 workers, each: join_group("gloo", port, rank, 2)
        port = store.port
    """
    import torch.distributed as dist

    return dist.TCPStore("127.0.0.1", 0, world_size, is_master=True, wait_for_workers=False, timeout=timeout)


def join_group(backend: str, port: int, rank: int, world_size: int, timeout: timedelta | None = None) -> None:
    """Join the default process group (``backend``, ``rank`` of ``world_size``) at the store that
    :func:`serve_rendezvous` serves at ``port`` on 127.0.0.1; ``timeout`` for the store and the group
    (torch's defaults when None)."""
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", port, world_size, is_master=False, timeout=timeout or STORE_TIMEOUT)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=timeout)


def usable_cores() -> int:
    """CPUs this process may run on (its affinity mask where the OS has one, else ``os.cpu_count()``)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1

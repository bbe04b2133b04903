"""Local processes for the tools (the demo, ``check``, ``bench``) and the tests: a free port for a local
group's rendezvous, and the cores this process may use."""

from __future__ import annotations

import os
import socket

__all__ = ["free_port", "usable_cores"]


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (for a local group's ``MASTER_PORT`` or
    ``tcp://`` init method; another process may take it before it is bound again)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def usable_cores() -> int:
    """CPUs this process may run on (its affinity mask where the OS has one, else ``os.cpu_count()``)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1

"""Rate-limited links between local ranks: network namespaces on a bridge, shaped with ``tc tbf``.

One namespace per rank (``gpnet-r0``, ``gpnet-r1``, ...) with a veth ``eth0`` at ``10.77.0.<rank + 1>/24``,
its peer plugged into a bridge that lives in a namespace of its own (``gpnet-br``), so nothing touches
the host's network. Every link is shaped in both directions (the rank's egress on ``eth0``, the
bridge's egress towards the rank) with ``tbf rate RATE burst 1mb latency 50ms``: a switch with RATE
ports. Needs root and iproute2 (``ip``, ``tc``); netem (added delay) is not used.

    with Network(world_size=2, rate="1gbit") as net:
        net.set_rate("100mbit")                      # reshape all links in place
        subprocess.run(net.exec_prefix(0) + ["python3", "worker.py"], env={**env, **net.env(0)})

Everything is deleted on exit, also after an error, Ctrl-C or ``kill`` (SIGTERM); :func:`cleanup` removes leftovers of a
killed run (namespaces whose names start with ``gpnet-``).
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import threading
from types import TracebackType

__all__ = ["Network", "NetworkError", "cleanup", "parse_rate"]

PREFIX = "gpnet-"
SUBNET = "10.77.0"
BRIDGE_NS = f"{PREFIX}br"


class NetworkError(RuntimeError):
    """The network could not be built (not root, no iproute2, a command failed)."""


def parse_rate(text: str) -> float:
    """``"1gbit"`` -> 1e9 bits per second (tc's spelling: kbit, mbit, gbit)."""
    match = re.fullmatch(r"(\d+(?:\.\d+)?)(kbit|mbit|gbit)", text.strip().lower())
    if not match:
        raise ValueError(f"rate must look like 100mbit, 1gbit or 10gbit, got {text!r}")
    return float(match.group(1)) * {"kbit": 1e3, "mbit": 1e6, "gbit": 1e9}[match.group(2)]


def _run(*args: str) -> None:
    proc = subprocess.run(args, capture_output=True, text=True)
    if proc.returncode != 0:
        raise NetworkError(f"{' '.join(args)} failed: {proc.stderr.strip()}")


def _namespaces() -> list[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def cleanup() -> list[str]:
    """Delete every namespace this module made (name starts with ``gpnet-``); the names deleted."""
    gone = [ns for ns in _namespaces() if ns.startswith(PREFIX)]
    for ns in gone:
        subprocess.run(["ip", "netns", "delete", ns], capture_output=True)
    return gone


def check_can_build() -> None:
    """Raise :class:`NetworkError` saying what is missing (root, ip, tc)."""
    if os.geteuid() != 0:
        raise NetworkError("the network benchmark needs root (it creates network namespaces, veth pairs and "
                           "tc shapers); run it with sudo, or as root in a VM or container with CAP_NET_ADMIN")
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    if missing:
        raise NetworkError(f"the network benchmark needs iproute2 ({', '.join(missing)} not found): "
                           "apt-get install iproute2")


def _exit_on_sigterm(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)


class Network:
    """``world_size`` ranks on one bridge, every link shaped to ``rate`` (see the module doc); with
    ``ranks_per_node=L``, ranks ``L k .. L k + L - 1`` share node ``k``'s namespace (a multi-GPU machine:
    fast inside, the shaped link between nodes)."""

    def __init__(self, world_size: int, rate: str, ranks_per_node: int = 1) -> None:
        if world_size < 1 or world_size > 200:
            raise ValueError(f"world_size must be in 1..200, got {world_size}")
        if ranks_per_node < 1 or world_size % ranks_per_node:
            raise ValueError(f"ranks_per_node must be a positive divisor of world_size={world_size}, "
                             f"got {ranks_per_node}")
        parse_rate(rate)
        self.world_size = world_size
        self.ranks_per_node = ranks_per_node
        self.nodes = world_size // ranks_per_node
        self.rate = rate
        self.built = False
        self._previous_sigterm: object = None

    def namespace(self, rank: int) -> str:
        """Rank ``rank``'s namespace: one per node (``ranks_per_node`` consecutive ranks share it)."""
        return f"{PREFIX}r{rank // self.ranks_per_node}"

    def address(self, rank: int) -> str:
        """The address of rank ``rank``'s node. Ranks of one node reach each other over its loopback
        (traffic to a local address never leaves the namespace), so only traffic between nodes is shaped."""
        return f"{SUBNET}.{rank // self.ranks_per_node + 1}"

    def exec_prefix(self, rank: int) -> list[str]:
        """Command prefix that runs a program inside rank ``rank``'s namespace."""
        return ["ip", "netns", "exec", self.namespace(rank)]

    def env(self, rank: int) -> dict[str, str]:
        """Environment for rank ``rank``: gloo binds to the shaped interface, not to loopback."""
        return {"GLOO_SOCKET_IFNAME": "eth0", "MASTER_ADDR": self.address(0)}

    def __enter__(self) -> Network:
        check_can_build()
        leftovers = [ns for ns in _namespaces() if ns.startswith(PREFIX)]
        if leftovers:
            raise NetworkError(f"namespaces {leftovers} exist already (another run, or a killed one): "
                               "delete them with `python3 benchmarks/network/run.py --cleanup`")
        if threading.current_thread() is threading.main_thread():  # SIGTERM unwinds through __exit__ too
            self._previous_sigterm = signal.signal(signal.SIGTERM, _exit_on_sigterm)
        try:
            self._build()
        except BaseException:
            self._restore_sigterm()
            cleanup()
            raise
        self.built = True
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        cleanup()
        self.built = False
        self._restore_sigterm()

    def _restore_sigterm(self) -> None:
        if self._previous_sigterm is not None:
            signal.signal(signal.SIGTERM, self._previous_sigterm)  # type: ignore[arg-type]
            self._previous_sigterm = None

    def _build(self) -> None:
        _run("ip", "netns", "add", BRIDGE_NS)
        _run("ip", "-n", BRIDGE_NS, "link", "add", "br0", "type", "bridge")
        _run("ip", "-n", BRIDGE_NS, "link", "set", "br0", "up")
        _run("ip", "-n", BRIDGE_NS, "link", "set", "lo", "up")
        for node in range(self.nodes):
            rank = node * self.ranks_per_node
            ns, port = self.namespace(rank), f"p{node}"
            _run("ip", "netns", "add", ns)
            _run("ip", "link", "add", "eth0", "netns", ns, "type", "veth", "peer", "name", port, "netns", BRIDGE_NS)
            _run("ip", "-n", BRIDGE_NS, "link", "set", port, "master", "br0")
            _run("ip", "-n", BRIDGE_NS, "link", "set", port, "up")
            _run("ip", "-n", ns, "addr", "add", f"{self.address(rank)}/24", "dev", "eth0")
            _run("ip", "-n", ns, "link", "set", "eth0", "up")
            _run("ip", "-n", ns, "link", "set", "lo", "up")
        self.set_rate(self.rate, replace=False)

    def _shapers(self) -> list[tuple[str, str]]:
        """(namespace, device) of every shaped egress: each node's eth0 and each bridge port."""
        return [(self.namespace(n * self.ranks_per_node), "eth0") for n in range(self.nodes)] + \
               [(BRIDGE_NS, f"p{n}") for n in range(self.nodes)]

    def set_rate(self, rate: str, replace: bool = True) -> None:
        """Shape every link to ``rate`` in both directions (``tbf ... burst 1mb latency 50ms``)."""
        parse_rate(rate)
        for ns, dev in self._shapers():
            _run("ip", "netns", "exec", ns, "tc", "qdisc", "replace" if replace else "add", "dev", dev, "root",
                 "tbf", "rate", rate, "burst", "1mb", "latency", "50ms")
        self.rate = rate

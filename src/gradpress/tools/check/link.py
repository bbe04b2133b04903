"""The link between ranks: allreduce time per size, bus bandwidth and latency (nccl-tests' definitions).

For an allreduce of ``S`` bytes taking ``t`` seconds on ``n`` ranks: ``algbw = S / t`` and
``busbw = algbw * 2 (n - 1) / n`` (what each rank's link carries in a ring). The ring model used by the
advice is ``t(S) = latency * 2 (n - 1) + S * 2 (n - 1) / n / busbw``: ``latency`` is the per-hop time,
measured as the smallest size's time over ``2 (n - 1)``, and ``busbw`` is the largest size's.

Timings are the median over iterations of the slowest rank (a max-allreduce of each rank's time). On
CUDA the device is synchronized around each timed call (this is a measurement, not a training step).

>>> link = measure_link(torch.device("cpu"))   # doctest: +SKIP
>>> link.busbw_gbps, link.latency_us           # doctest: +SKIP
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from ... import comm

__all__ = ["DEFAULT_SIZES", "Link", "measure_link", "node_groups"]

#: Message sizes in bytes (fp32 elements x 4): a latency-bound one, then up to 16 MiB.
DEFAULT_SIZES = (4, 64 * 1024, 1024 * 1024, 16 * 1024 * 1024)


@dataclass
class Link:
    """A measured (or assumed) link: ``world_size`` ranks, ``latency_s`` per ring hop, ``busbw`` in bytes/s.

    ``sizes``: per message size, the median time and the bandwidths (for the report).
    """

    world_size: int
    latency_s: float
    busbw: float
    scope: str = "all ranks"
    sizes: list[dict[str, float]] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.world_size < 1:
            raise ValueError(f"world_size={self.world_size} must be >= 1")
        if not self.latency_s >= 0 or not self.busbw > 0:
            raise ValueError(f"latency_s={self.latency_s} must be >= 0 and busbw={self.busbw} > 0 (bytes/s)")

    def allreduce_seconds(self, nbytes: float, collectives: float = 1) -> float:
        """Ring allreduce time of ``nbytes`` in ``collectives`` calls (a mean over steps may be fractional):
        ``latency 2(n-1)`` each + the bytes."""
        n = self.world_size
        if n == 1:
            return 0.0
        return collectives * self.latency_s * 2 * (n - 1) + nbytes * 2 * (n - 1) / n / self.busbw

    @property
    def busbw_gbps(self) -> float:
        """Bus bandwidth in Gbit/s."""
        return self.busbw * 8 / 1e9

    @property
    def latency_us(self) -> float:
        return self.latency_s * 1e6

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "busbw_gbps": self.busbw_gbps, "latency_us": self.latency_us}


def _time_allreduce(buffer: torch.Tensor, group: Any, iters: int) -> float:
    times = []
    for _ in range(iters + 2):  # two warm-up calls (connection set-up, allocator)
        if buffer.is_cuda:
            torch.cuda.synchronize(buffer.device)
        start = time.perf_counter()
        comm.all_reduce(buffer, group, issuer="gradpress check (link)")
        if buffer.is_cuda:
            torch.cuda.synchronize(buffer.device)
        times.append(time.perf_counter() - start)
    slowest = torch.tensor(times[2:], dtype=torch.float64, device=buffer.device)
    comm.all_reduce(slowest, group, issuer="gradpress check (link timings)", op="max")
    return statistics.median(slowest.tolist())


def measure_link(device: torch.device, group: Any = None, sizes: Sequence[int] = DEFAULT_SIZES, iters: int = 5,
                 scope: str = "all ranks") -> Link:
    """Time allreduces of each size over ``group`` (default: all ranks); a collective on its members.

    ``sizes``: bytes, at least two, increasing, multiples of 4. Returns the :class:`Link` model.
    """
    if len(sizes) < 2 or any(s <= 0 or s % 4 for s in sizes) or list(sizes) != sorted(sizes):
        raise ValueError(f"sizes={list(sizes)}: give at least two increasing positive multiples of 4 bytes")
    if iters < 1:
        raise ValueError(f"iters={iters} must be >= 1")
    n = dist.get_world_size(group)
    rows = []
    for size in sizes:
        seconds = _time_allreduce(torch.zeros(size // 4, device=device), group, iters)
        algbw = size / seconds
        rows.append({"bytes": float(size), "seconds": seconds, "algbw": algbw, "busbw": algbw * 2 * (n - 1) / n})
    hops = 2 * (n - 1) if n > 1 else 1
    return Link(n, rows[0]["seconds"] / hops, max(rows[-1]["busbw"], 1.0), scope, rows)


def node_groups(local_world_size: int) -> tuple[Any, Any]:
    """``(this rank's node, the ranks with its local index on every node)`` for nodes of ``local_world_size``
    consecutive ranks. A collective: every rank creates every group, in the same order."""
    rank, world = dist.get_rank(), dist.get_world_size()
    intra = inter = None
    for node in range(world // local_world_size):
        group = dist.new_group(list(range(node * local_world_size, (node + 1) * local_world_size)))
        if rank // local_world_size == node:
            intra = group
    for local in range(local_world_size):
        group = dist.new_group(list(range(local, world, local_world_size)))
        if rank % local_world_size == local:
            inter = group
    return intra, inter

"""The two collectives of compressed payloads (:mod:`gradpress.averaging.transport`): an all-gather and
an all-to-all of ``uint8`` buffers, behind one small interface so that the transports do not care who
carries them.

:class:`GroupExchange` runs them on a ``torch.distributed`` process group (gloo, NCCL, a threaded group);
another communicator (a fault-tolerant one that decides per step who takes part) provides the same three
members: ``rank`` and ``world`` (this rank's place among those taking part) and the two collectives,
each returning a handle whose ``wait()`` returns the filled output. Nothing else of the transports'
arithmetic depends on the process group.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import torch.distributed as dist
from torch import Tensor

from .collectives import Work, all_gather_async, all_to_all_async, is_distributed

__all__ = ["GroupExchange", "PayloadExchange"]


class Handle(Protocol):
    def wait(self) -> Any: ...


class PayloadExchange(Protocol):
    """What a transport needs to exchange payloads: ``rank``, ``world`` and two collectives over equal
    pieces (``what`` describes the collective if it fails; a string or a function making it)."""

    rank: int
    world: int

    def all_gather(self, out: Tensor, tensor: Tensor, what: str | Callable[[], str]) -> Handle:
        """Start gathering every rank's ``tensor`` into ``out`` (``world`` pieces in rank order)."""

    def all_to_all(self, out: Tensor, tensor: Tensor, what: str | Callable[[], str]) -> Handle:
        """Start sending piece ``r`` of ``tensor`` to rank ``r``; piece ``r`` of ``out`` is rank ``r``'s
        piece for this rank."""


class GroupExchange:
    """:class:`PayloadExchange` over ``process_group`` (``None``: the default group; without
    ``torch.distributed``, one rank alone).

    ``rank`` and ``world``: this rank's place among those taking part, where the group cannot say it
    itself (torchft's process group reports rank 0 on every replica; its ``Manager`` knows the rank);
    ``None`` asks ``torch.distributed``. ``gather_as_list``: all-gather through the list form (see
    :func:`gradpress.comm.all_gather_async`)."""

    __slots__ = ("process_group", "issuer", "rank", "world", "gather_as_list")

    def __init__(self, process_group: dist.ProcessGroup | None = None, issuer: str = "gradpress", *,
                 rank: int | None = None, world: int | None = None, gather_as_list: bool = False) -> None:
        self.process_group = process_group
        self.issuer = issuer
        distributed = is_distributed()
        self.rank = rank if rank is not None else dist.get_rank(process_group) if distributed else 0
        self.world = world if world is not None else dist.get_world_size(process_group) if distributed else 1
        self.gather_as_list = gather_as_list

    def all_gather(self, out: Tensor, tensor: Tensor, what: str | Callable[[], str]) -> Work:
        return all_gather_async(out, tensor, self.process_group, self.issuer, what=what, as_list=self.gather_as_list)

    def all_to_all(self, out: Tensor, tensor: Tensor, what: str | Callable[[], str]) -> Work:
        return all_to_all_async(out, tensor, self.process_group, self.issuer, what=what)

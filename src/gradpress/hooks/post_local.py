"""Post-local SGD as a DDP communication hook (drop-in for PyTorch's ``post_localSGD_hook``).

No ``from __future__ import annotations`` here: DDP checks the hook's ``bucket`` annotation at runtime.

>>> state = PostLocalSGDState(process_group=None, subgroup=None, start_localSGD_iter=100)  # doctest: +SKIP
>>> ddp_model.register_comm_hook(state, post_localSGD_hook)                                # doctest: +SKIP

Before ``start_localSGD_iter`` iterations: global gradient allreduce (synchronous SGD). Afterwards,
gradients are averaged within ``subgroup`` only (``post_local_gradient_allreduce=True``, e.g. over the
fast links inside one machine) or not at all; combine it with a model averager
(:class:`gradpress.PeriodicModelAverager` through :class:`gradpress.PostLocalSGDOptimizer`).
"""


import logging
import os
import socket
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from ..comm import all_gather_ints
from .default import allreduce_mean_future

__all__ = ["PostLocalSGDState", "node_subgroup", "post_localSGD_hook", "post_localsgd_hook"]

logger = logging.getLogger(__name__)


def node_subgroup(process_group: dist.ProcessGroup | None = None) -> dist.ProcessGroup | None:
    """The group of this process's machine (ranks of ``process_group`` with the same host name).

    A collective: every rank of the default group must call it. Machines must hold consecutive ranks
    or not, any layout works; each machine's group is created with ``dist.new_group``.
    """
    host = os.environ.get("GRADPRESS_NODE_NAME") or socket.gethostname()
    world = dist.get_world_size(process_group)
    # The names as their UTF-8 bytes: an integer gather needs no numpy (object collectives do).
    names = [bytes(name).decode() for name in all_gather_ints(list(host.encode()), process_group,
                                                                  issuer="node_subgroup")]
    ranks = dist.get_process_group_ranks(process_group) if process_group is not None else list(range(world))
    mine = None
    for name in dict.fromkeys(names):
        members = [r for r, n in zip(ranks, names) if n == name]
        group = dist.new_group(members)
        if name == host:
            mine = group
    return mine


class PostLocalSGDState:
    """State of :func:`post_localSGD_hook` (PyTorch's arguments and defaults).

    Args:
        process_group: the group of the global allreduce before ``start_localSGD_iter`` (``None``: the
            default group).
        subgroup: the group of the gradient allreduce afterwards. ``None``: the ranks on this machine
            (found by host name; set ``GRADPRESS_NODE_NAME`` to override), created lazily at the first
            local step. Every rank must reach that step (as with any DDP iteration).
        start_localSGD_iter: number of synchronous iterations first (>= 1).
        post_local_gradient_allreduce: after the switch, average gradients within ``subgroup``
            (``True``) or not at all (``False``).
    """

    __slots__ = ("process_group", "subgroup", "start_localSGD_iter", "post_local_gradient_allreduce", "iter",
                 "_subgroup_created")

    def __init__(self, process_group: dist.ProcessGroup | None, subgroup: dist.ProcessGroup | None,
                 start_localSGD_iter: int, post_local_gradient_allreduce: bool = True) -> None:
        if isinstance(start_localSGD_iter, bool) or not isinstance(start_localSGD_iter, int) \
                or start_localSGD_iter < 1:
            raise ValueError(f"start_localSGD_iter must be an integer >= 1, got {start_localSGD_iter!r}")
        if not isinstance(post_local_gradient_allreduce, bool):
            raise TypeError(f"post_local_gradient_allreduce must be a bool, got {post_local_gradient_allreduce!r}")
        self.process_group = process_group
        self.subgroup = subgroup
        self.start_localSGD_iter = start_localSGD_iter
        self.post_local_gradient_allreduce = post_local_gradient_allreduce
        self.iter = 0
        self._subgroup_created = False

    def maybe_increase_iter(self, bucket: Any) -> None:
        """Count an iteration when the last bucket has been processed (PyTorch's contract)."""
        if bucket.is_last():
            self.iter += 1
            if self.iter == self.start_localSGD_iter:
                logger.info("Start to apply local SGD after %s iterations.", self.iter)

    def state_dict(self) -> dict[str, Any]:
        """The iteration counter and options (no process groups)."""
        return {"iter": self.iter, "start_localSGD_iter": self.start_localSGD_iter,
                "post_local_gradient_allreduce": self.post_local_gradient_allreduce}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.iter = int(state["iter"])

    def _local_group(self) -> dist.ProcessGroup | None:
        if self.subgroup is None and not self._subgroup_created:
            self.subgroup = node_subgroup(self.process_group)
            self._subgroup_created = True
        return self.subgroup


def post_localSGD_hook(state: PostLocalSGDState, bucket: dist.GradBucket) -> torch.futures.Future[Tensor]:
    """Global allreduce for the first ``state.start_localSGD_iter`` iterations, then allreduce within
    ``state.subgroup`` (or nothing, with ``post_local_gradient_allreduce=False``)."""
    if not isinstance(state, PostLocalSGDState):
        raise TypeError(f"post_localSGD_hook expects a gradpress.PostLocalSGDState, got {type(state).__name__}")
    buffer = bucket.buffer()
    if state.iter < state.start_localSGD_iter:
        state.maybe_increase_iter(bucket)
        return allreduce_mean_future(buffer, state.process_group,
                                     issuer=f"post_localSGD_hook, bucket {bucket.index()}")
    state.maybe_increase_iter(bucket)
    if not state.post_local_gradient_allreduce:
        fut: torch.futures.Future = torch.futures.Future()
        fut.set_result(buffer)
        return fut
    return allreduce_mean_future(buffer, state._local_group(),
                                 issuer=f"post_localSGD_hook (within the node), bucket {bucket.index()}")


post_localsgd_hook = post_localSGD_hook

"""Model averagers: the step counter, periodic averaging, and hierarchical averaging in subgroups."""

from __future__ import annotations

import warnings
from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Mapping
from typing import Any

import torch.distributed as dist
from torch import Tensor, nn

from ..checkpoint import reject_gathered
from ..validation import check_int
from ..comm import all_gather_objects, average_tensors_, is_member
from .tensors import Params, tensors_to_average

__all__ = ["HierarchicalModelAverager", "ModelAverager", "PeriodicModelAverager"]


class ModelAverager(ABC):
    """Base of the averagers: a step counter and ``average_parameters(params)`` called once per step."""

    def __init__(self, process_group: dist.ProcessGroup | None = None, average_buffers: bool = False) -> None:
        self.process_group = process_group
        self.average_buffers = bool(average_buffers)
        self.step = 0
        self.bytes_sent = 0
        self.num_averages = 0

    def anchor_parameters(self, params: Params) -> None:
        """Where local training starts (called by :class:`PostLocalSGDOptimizer` when it is built):
        averagers with an anchor (DiLoCo's) take ``params`` as it; the others ignore it."""

    @abstractmethod
    def average_parameters(self, params: Params) -> None:
        """Average ``params`` if this step is an averaging step; advance the step counter."""

    def _issuer(self) -> str:
        """Names this averager's collectives in a :class:`gradpress.comm.CollectiveError`."""
        return f"{type(self).__name__}.average_parameters, step {self.step}"

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step, "bytes_sent": self.bytes_sent, "num_averages": self.num_averages}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict`'s output (``ValueError`` for anything else: a gathered state, a
        dict without ``"step"``). :class:`PostLocalSGDOptimizer` loads a state without a step counter as
        PyTorch does (warning, step 0)."""
        reject_gathered(state, f"{type(self).__name__}.load_state_dict")
        if "step" not in state:
            raise ValueError(f"{type(self).__name__}.load_state_dict: the state has no 'step': it is not what "
                             f"state_dict() returned (keys: {sorted(state)})")
        self.step = int(state["step"])
        self.bytes_sent = int(state.get("bytes_sent", 0))
        self.num_averages = int(state.get("num_averages", 0))


class PeriodicModelAverager(ModelAverager):
    """Average every ``period`` steps after ``warmup_steps`` steps (PyTorch's name and semantics).

    Step ``s`` (counting calls from 0) averages iff ``s >= warmup_steps`` and
    ``(s - warmup_steps) % period == 0``.

    >>> averager = PeriodicModelAverager(period=4, warmup_steps=100)      # doctest: +SKIP
    >>> averager.average_parameters(model.parameters())   # after optimizer.step(), every step
    """

    def __init__(self, period: int, warmup_steps: int = 0, process_group: dist.ProcessGroup | None = None,
                 *, average_buffers: bool = False) -> None:
        super().__init__(process_group, average_buffers)
        self.period = check_int("period", period, 1)
        self.warmup_steps = check_int("warmup_steps", warmup_steps, 0)

    def is_averaging_step(self, step: int) -> bool:
        return step >= self.warmup_steps and (step - self.warmup_steps) % self.period == 0

    def average_parameters(self, params: Params) -> None:
        if self.is_averaging_step(self.step) and is_member(self.process_group):
            self._average(tensors_to_average(params, self.average_buffers or isinstance(params, nn.Module)))
        self.step += 1

    def _average(self, tensors: list[Tensor]) -> None:
        self.bytes_sent += average_tensors_(tensors, self.process_group, issuer=self._issuer())
        self.num_averages += 1


class HierarchicalModelAverager(ModelAverager):
    """Average within groups of different sizes at different periods (PyTorch's name, arguments, schedule
    and ``period_process_group_dict``).

    ``period_group_size_dict`` maps periods (strictly increasing) to group sizes (each dividing the size
    of ``process_group``, the last equal to it): at step ``s >= warmup_steps``, the largest period ``p``
    with ``s % p == 0`` wins and parameters are averaged within groups of consecutive ranks of its size;
    no period dividing ``s``, no averaging. E.g. ``{2: 2, 8: 4}`` on 4 ranks: ranks {0,1} and {2,3} every
    2nd step, all 4 every 8th. Periods count from step 0, as PyTorch's do; ``count_from_warmup=True``
    counts them from the end of warm-up instead (``(s - warmup_steps) % p``, the schedule of
    :class:`PeriodicModelAverager`, so the first step after warm-up averages over the largest group).
    The subgroups are created here with ``dist.new_group``, which is collective over every rank of the
    default group: **every rank must construct the averager**, those outside ``process_group`` included,
    and every rank makes the same ``new_group`` calls in the same order (house rule: same order on every
    rank). When ``process_group`` leaves some ranks out, construction first all-gathers its member ranks
    over the default group (the outside ranks cannot read them from their handle), so that every rank
    checks the same sizes (an invalid dict raises the same ``ValueError`` on every rank, before any
    ``new_group``) and creates the same subgroups. Then the members' averagers are ready, and on a rank
    outside ``process_group``, which has nothing to average, construction raises a ``ValueError`` saying so
    (after the ``new_group`` calls, so that the members do not wait for it): catch it there and go on
    without an averager.

    >>> HierarchicalModelAverager(OrderedDict([(2, 2), (8, 4)]), warmup_steps=100)   # doctest: +SKIP
    """

    def __init__(self, period_group_size_dict: Mapping[int, int] | None = None, warmup_steps: int = 0,
                 process_group: dist.ProcessGroup | None = None, *, average_buffers: bool = False,
                 count_from_warmup: bool = False) -> None:
        super().__init__(process_group, average_buffers)
        if not period_group_size_dict:
            raise ValueError("period_group_size_dict must map at least one period to a group size")
        self.warmup_steps = check_int("warmup_steps", warmup_steps, 0)
        self.count_from_warmup = bool(count_from_warmup)
        items = list(period_group_size_dict.items())
        for period, size in items:
            check_int("period_group_size_dict: every period", period, 1)
            check_int("period_group_size_dict: every group size", size, 1)
        if [p for p, _ in items] != sorted({p for p, _ in items}):
            raise ValueError(f"period_group_size_dict: periods must be strictly increasing, got "
                             f"{[p for p, _ in items]}")
        if items[-1][0] == 1:
            warnings.warn("HierarchicalModelAverager: the largest period is 1, so parameters are averaged every step, "
                          "which sends no fewer bytes than averaging gradients in DDP's backward pass: use DDP "
                          "alone", stacklevel=2)
        ranks = _group_ranks(process_group)
        world = len(ranks)
        if items[-1][1] != world:
            raise ValueError(f"period_group_size_dict: the last group size must be the size of the process group "
                             f"({world}), got {items[-1][1]}")
        for _, size in items:
            if world % size:
                raise ValueError(f"period_group_size_dict: every group size must divide the size of the process "
                                 f"group ({world}); {size} does not")
        self.period_group_size_dict = OrderedDict(items)
        me = dist.get_rank()
        by_size: dict[int, dist.ProcessGroup | None] = {world: process_group}
        for _, size in items:
            if size in by_size:
                continue
            for start in range(0, world, size):
                members = ranks[start: start + size]
                group = dist.new_group(members)  # every rank of the default group must call new_group
                if me in members:
                    by_size[size] = group
        if me not in ranks:  # only now: the members' new_group calls needed this rank's
            raise ValueError(
                f"HierarchicalModelAverager: this rank (global rank {me}) is not in process_group (global ranks "
                f"{ranks}), so it has nothing to average. It has made the subgroups' new_group calls with the "
                "other ranks, as every rank must, and the members' averagers are ready: catch this ValueError on "
                "this rank and go on without an averager")
        #: PyTorch's attribute: each period's group containing this rank.
        self.period_process_group_dict: OrderedDict[int, dist.ProcessGroup | None] = OrderedDict(
            (period, by_size[size]) for period, size in items)

    def group_for_step(self, step: int) -> tuple[int, dist.ProcessGroup | None] | None:
        """``(period, group)`` that averages at ``step``, or ``None``."""
        if step < self.warmup_steps:
            return None
        counted = step - self.warmup_steps if self.count_from_warmup else step
        for period in reversed(self.period_process_group_dict):
            if counted % period == 0:
                return period, self.period_process_group_dict[period]
        return None

    def average_parameters(self, params: Params) -> None:
        found = self.group_for_step(self.step)
        if found is not None and is_member(found[1]):
            tensors = tensors_to_average(params, self.average_buffers or isinstance(params, nn.Module))
            self.bytes_sent += average_tensors_(tensors, found[1], issuer=self._issuer())
            self.num_averages += 1
        self.step += 1


def _group_ranks(process_group: dist.ProcessGroup | None) -> list[int]:
    """The global ranks of ``process_group`` (``None``: the default group), on every rank of the default
    group, members or not. A collective over the default group when some rank is outside
    ``process_group`` (the decision is the same on every rank: a member sees a group smaller than the
    world exactly when some rank is outside it); otherwise no communication."""
    world = dist.get_world_size()
    if process_group is None:
        return list(range(world))
    member = is_member(process_group)
    if member and dist.get_world_size(process_group) == world:
        return dist.get_process_group_ranks(process_group)
    # A rank outside the group holds only torch's NON_GROUP_MEMBER sentinel: ask the members.
    mine = dist.get_process_group_ranks(process_group) if member else None
    seen = {tuple(r) for r in all_gather_objects(mine, issuer="HierarchicalModelAverager's construction")
            if r is not None}
    if len(seen) != 1:  # the same gathered list on every rank: every rank raises this
        raise ValueError(f"HierarchicalModelAverager: every rank of process_group must pass the same group, "
                         f"got groups of global ranks {sorted(map(list, seen))}")
    return list(seen.pop())

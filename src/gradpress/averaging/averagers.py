"""Model averagers: the step counter, periodic averaging, and hierarchical averaging in subgroups."""

from __future__ import annotations

import warnings
from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from ..checkpoint import dcp_saved_keys, per_rank_state, placement, read_per_rank, reject_gathered
from ..validation import check_int
from ..comm import all_gather_ints, average_tensors_, check_process_group, is_member, is_torchft_object, link_bytes
from .islands import check_islands
from .saved import Kind, check_kind, kind_from_keys, kind_from_state
from .shards import Spec, as_sharded, check_same_layout, from_saved, layout_key, local_views
from .tensors import Params, named_tensors_to_average

__all__ = ["HierarchicalModelAverager", "ModelAverager", "PeriodicModelAverager"]


class ModelAverager(ABC):
    """Base of the averagers: a step counter and ``average_parameters(params)`` called once per step.

    Parameters of ``fully_shard`` (FSDP2/HSDP DTensors) are averaged shard by shard: each rank its
    local shard with the ranks of ``process_group`` that hold the same shard in the other islands
    (:mod:`gradpress.averaging.shards`).

    Two byte counters, this rank's: ``bytes_sent``, the payload it handed to its collectives (what it
    always counted), and ``link_bytes``, what its link carried for them at the world size each was sent
    at, ring-equivalent (:func:`gradpress.comm.link_bytes`: an allreduce of ``S`` bytes ``2 (W - 1) / W ·
    S``, an all-gather of ``P`` ``(W - 1) · P``, an all-to-all of ``S`` ``(W - 1) / W · S``, the anchor's
    broadcast ``S``). Compare methods by ``link_bytes``: an all-gathered payload reads small in
    ``bytes_sent`` at every ``W``.

    ``state_dict()`` is laid out for ``torch.distributed.checkpoint`` (and ``torch.save``): values
    identical on every rank (counters) and sharded ones (DiLoCo's anchor and outer momentum, as
    DTensors where the parameters are) at the top, this rank's own values (its bytes, residuals,
    PowerSGD memory, and between synchronizations its parameters, which differ from island to island)
    in one per-rank entry (:func:`gradpress.checkpoint.per_rank_state`). :meth:`local_state_dict` is
    the same state as one rank's plain dict.
    """

    def __init__(self, process_group: dist.ProcessGroup | None = None, average_buffers: bool = False) -> None:
        if is_torchft_object(process_group):  # others pass through: a rank outside a subgroup holds a marker int
            check_process_group(process_group, f"{type(self).__name__}'s process_group")
        self.process_group = process_group
        self.average_buffers = bool(average_buffers)
        self.step = 0
        self.bytes_sent = 0
        self.link_bytes = 0.0
        self.num_averages = 0
        self._params: list[Tensor] = []       # what was averaged last (parameters, DTensors or not)
        self._names: list[str | None] = []    # their names, where what was given names them
        self._pending: list[Tensor] | None = None  # a checkpoint's parameters of this rank, not yet written
        self._checked_layout: tuple[Any, ...] | None = None
        self._checked_setup = False  # the set-ups of averaging/islands.py, checked once

    #: Whether this averager takes DiLoCo's outer step (native HSDP across its group is then an error).
    _outer_step = False
    #: Whether ``process_group`` is the only group it averages over (not subgroups by design).
    _one_group = True

    def anchor_parameters(self, params: Params) -> None:
        """Where local training starts (called by :class:`PostLocalSGDOptimizer` when it is built):
        averagers with an anchor (DiLoCo's) take ``params`` as it; the others remember which tensors
        they average (a checkpoint restores a rank's own parameters into them). ``params`` is read once
        (a generator such as ``model.parameters()`` works), in any form :meth:`average_parameters` takes."""
        self._anchor(self._remember(params))

    def _anchor(self, tensors: list[Tensor]) -> None:
        """:meth:`anchor_parameters` on the tensors it read: writes a loaded checkpoint's parameters of
        this rank into them; DiLoCo's averagers also take their anchor here."""
        self._write_pending()

    @abstractmethod
    def average_parameters(self, params: Params) -> None:
        """Average ``params`` if this step is an averaging step; advance the step counter. ``params``: a
        module, tensors, ``named_parameters()`` pairs or parameter groups, read once (a generator works)."""

    def _issuer(self) -> str:
        """Names this averager's collectives in a :class:`gradpress.comm.CollectiveError`."""
        return f"{type(self).__name__}.average_parameters, step {self.step}"

    def _remember(self, params: Params) -> list[Tensor]:
        """The tensors ``params`` holds (read once: call it once per entry point and pass its result on),
        remembered with their names."""
        self._params, self._names = named_tensors_to_average(params, self.average_buffers or
                                                             isinstance(params, nn.Module))
        return self._params

    def _describe(self, index: int) -> str:
        """Averaged tensor ``index`` in words: its name where known, and its shape."""
        tensor = self._params[index]
        name = self._names[index] if index < len(self._names) else None
        return f"averaged tensor {index}{f' {name!r}' if name else ''} (shape {tuple(tensor.shape)})"

    def _local(self, tensors: list[Tensor], group: dist.ProcessGroup | None = None
               ) -> tuple[list[Tensor], list[Spec | None]]:
        """Local shards of ``tensors`` (views) and their specs; a layout of DTensors not seen yet
        is checked over ``group`` (default ``process_group``; a collective there)."""
        views, specs = local_views(tensors)
        if not self._checked_setup:
            self._checked_setup = True
            check_islands(views, specs, self.process_group if group is None else group, type(self).__name__,
                          self._outer_step, self._one_group)
        if any(s is not None for s in specs):
            key = layout_key(views, specs)
            if key != self._checked_layout:
                check_same_layout(views, specs, self.process_group if group is None else group,
                                  type(self).__name__)
                self._checked_layout = key
        return views, specs

    def in_sync(self) -> bool:
        """Whether every rank of ``process_group`` holds the same parameters now (right after a
        synchronization, or during a synchronous warm-up): a checkpoint then leaves the parameters to
        the model's state dict; otherwise each rank's own are saved in its per-rank entry."""
        return False

    # -- state ------------------------------------------------------------------------------------

    def local_state_dict(self) -> dict[str, Any]:
        """This rank's whole state as one plain dict (the layout of earlier versions)."""
        return {"step": self.step, "bytes_sent": self.bytes_sent, "link_bytes": self.link_bytes,
                "num_averages": self.num_averages}

    def _shared_state(self) -> dict[str, Any]:
        """What is identical on every rank, or sharded: saved once by ``torch.distributed.checkpoint``."""
        return {"step": self.step, "num_averages": self.num_averages}

    def _own_state(self) -> dict[str, Any]:
        """This rank's own values (the per-rank entry)."""
        own: dict[str, Any] = {"bytes_sent": self.bytes_sent, "link_bytes": self.link_bytes,
                               "placement": placement(self.process_group)}
        views, specs = local_views(self._params)
        if any(s is not None for s in specs):
            own["sharded"] = True  # what this rank saved is its own shards: no other rank's
        if not self.in_sync() and self._params:
            own["parameters"] = [v.detach().clone() for v in views]
        return own

    def _per_rank_contents(self, own: Mapping[str, Any]) -> list[str]:
        """What in the per-rank entry ``own`` belongs to the rank that saved it alone, in words (empty:
        nothing, and another rank may load it: its counters, and its parameters saved between
        synchronizations, which replace that rank's as loading the same rank's model state does)."""
        return ["its parameters and outer state are that rank's FSDP2 shards"] if own.get("sharded") else []

    def _portable(self, own: Any) -> str | None:
        """``read_per_rank``'s question for an entry saved on another rank: ``None`` where it can serve
        this rank, else what it holds per rank."""
        if not isinstance(own, Mapping):
            return None
        return "; ".join(self._per_rank_contents(own)) or None

    def state_dict(self) -> dict[str, Any]:
        """The state for ``torch.distributed.checkpoint`` and ``torch.save`` (see the class docstring);
        a fresh averager's is a complete template for DCP's in-place load once it knows its parameters
        (:class:`PostLocalSGDOptimizer` built, or :meth:`anchor_parameters` called). Asked for it by
        ``dcp.load``, it first checks what the checkpoint holds under its key (:meth:`check_dcp_keys`)."""
        found = dcp_saved_keys()
        if found is not None:
            self.check_dcp_keys(found[1], found[0])
        return per_rank_state(self._own_state(), self._shared_state())

    def _kind(self) -> Kind:
        """This averager's state in outline (what :meth:`check_state_dict` compares)."""
        return Kind("plain")

    def check_state_dict(self, state: Mapping[str, Any]) -> None:
        """Refuse (``ValueError``) a state saved by another kind of averager (another class, fragment count
        or number of averaged tensors), saying what it holds and what this averager is; called by
        :meth:`load_state_dict` before it loads anything."""
        name = type(self).__name__
        check_kind(name, self._kind(), kind_from_state(state), f"{name}.load_state_dict")

    def check_dcp_keys(self, keys: set[str], prefix: str) -> None:
        """:meth:`check_state_dict` for a ``torch.distributed.checkpoint`` checkpoint whose keys are
        ``keys``, this averager's state saved under ``prefix``: raised where DCP would raise its "Missing
        key" (or load a part of another averager's state without a word)."""
        name = type(self).__name__
        check_kind(name, self._kind(), kind_from_keys(keys, prefix),
                   f"{name}: torch.distributed.checkpoint.load of {prefix!r}")

    def load_state_dict(self, state: Mapping[str, Any], *, allow_other_rank: bool = False,
                        on_world_size_change: str = "raise") -> None:
        """Restore :meth:`state_dict`'s (or :meth:`local_state_dict`'s) output (``ValueError`` for anything
        else: a gathered state, a dict without ``"step"``). Per-rank values saved by another world size:
        ``on_world_size_change="raise"`` refuses, ``"fresh"`` starts them fresh (see
        :func:`gradpress.checkpoint.read_per_rank`). A rank's own parameters saved between
        synchronizations are written into the parameters this averager knows (load after the model).
        :class:`PostLocalSGDOptimizer` loads a state without a step counter as PyTorch does (warning,
        step 0)."""
        reject_gathered(state, f"{type(self).__name__}.load_state_dict")
        if "step" not in state:
            raise ValueError(f"{type(self).__name__}.load_state_dict: the state has no 'step': it is not what "
                             f"state_dict() returned (keys: {sorted(state)})")
        self.check_state_dict(state)
        own, found = read_per_rank(state, type(self).__name__, on_world_size_change=on_world_size_change,
                                   allow_other_rank=allow_other_rank, portable=self._portable)
        self._load(state, own if found else None, allow_other_rank)
        if found and own.get("parameters") is not None:
            self._restore_parameters(own["parameters"])

    def _load(self, state: Mapping[str, Any], own: Mapping[str, Any] | None, allow_other_rank: bool) -> None:
        """Restore the shared values from ``state`` and this rank's from ``own`` (``None``: fresh; the
        same dict as ``state`` for the earlier layout)."""
        self.step = int(state["step"])
        self.num_averages = int(state.get("num_averages", 0))
        self.bytes_sent = 0 if own is None else int(own.get("bytes_sent", 0))
        self.link_bytes = 0.0 if own is None else float(own.get("link_bytes", 0.0))

    def _restore_parameters(self, saved: list[Tensor]) -> None:
        """Write a checkpoint's parameters of this rank into the parameters, now if this averager knows
        them, else at :meth:`anchor_parameters` (:class:`PostLocalSGDOptimizer` built after the load)."""
        self._pending = list(saved)
        if self._params:
            self._write_pending()

    def _count_exact(self, sent: int, process_group: dist.ProcessGroup | None) -> None:
        """Count an exact average (one allreduce) of ``sent`` payload bytes over ``process_group``."""
        self.bytes_sent += sent
        self.link_bytes += link_bytes("allreduce", sent, dist.get_world_size(process_group)) if sent else 0.0

    def _write_pending(self) -> None:
        saved, self._pending = self._pending, None
        if saved is None:
            return
        views = local_views(self._params)[0]
        if len(saved) != len(views):
            raise ValueError(f"{type(self).__name__}.load_state_dict: the checkpoint holds {len(saved)} parameters "
                             f"of this rank, this averager averages {len(views)}")
        with torch.no_grad():
            for view, value in zip(views, saved):
                view.copy_(from_saved(value, view))


def sharded_copies(tensors: list[Tensor], specs: list[Spec | None]) -> list[Tensor]:
    """Copies of local tensors as DTensors laid out like their parameters (plain where not sharded)."""
    return [as_sharded(t.detach().clone(), s) for t, s in zip(tensors, specs)]


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
        self._average_step(self._remember(params))  # known between averages too: a checkpoint saves them

    def _average_step(self, tensors: list[Tensor]) -> None:
        """Average ``tensors`` (what :meth:`average_parameters` read) if this step is an averaging step."""
        if self.is_averaging_step(self.step) and is_member(self.process_group):
            self._average(self._local(tensors)[0])
        self.step += 1

    def in_sync(self) -> bool:
        return self.step <= self.warmup_steps or self.is_averaging_step(self.step - 1)

    def _average(self, tensors: list[Tensor]) -> None:
        self._count_exact(average_tensors_(tensors, self.process_group, issuer=self._issuer()), self.process_group)
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

    _one_group = False  # its subgroups leave ranks out by design

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
        remembered = self._remember(params)
        if found is not None and is_member(found[1]):
            tensors = self._local(remembered, found[1])[0]
            self._count_exact(average_tensors_(tensors, found[1], issuer=self._issuer()), found[1])
            self.num_averages += 1
        self.step += 1

    def in_sync(self) -> bool:
        if self.step <= self.warmup_steps:
            return True
        found = self.group_for_step(self.step - 1)
        return found is not None and found[0] == next(reversed(self.period_process_group_dict))


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
    # A rank outside the group holds only torch's NON_GROUP_MEMBER sentinel: ask the members (integers, no
    # numpy; an outside rank sends none).
    mine = dist.get_process_group_ranks(process_group) if member else []
    seen = {tuple(r) for r in all_gather_ints(mine, issuer="HierarchicalModelAverager's construction") if r}
    if len(seen) != 1:  # the same gathered list on every rank: every rank raises this
        raise ValueError(f"HierarchicalModelAverager: every rank of process_group must pass the same group, "
                         f"got groups of global ranks {sorted(map(list, seen))}")
    return list(seen.pop())

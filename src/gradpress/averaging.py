"""Local SGD: model averaging every few steps instead of gradient averaging every step.

Drop-in for ``torch.distributed.algorithms.model_averaging`` (same names, arguments and defaults), with
PyTorch's defects fixed, plus an outer optimizer (DiLoCo)::

    from gradpress import PostLocalSGDState, post_localSGD_hook, PeriodicModelAverager, PostLocalSGDOptimizer
    state = PostLocalSGDState(process_group=None, subgroup=None, start_localSGD_iter=100)
    model.register_comm_hook(state, post_localSGD_hook)          # synchronous SGD for 100 steps, then local
    optimizer = PostLocalSGDOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                      PeriodicModelAverager(period=4, warmup_steps=100))
    for x, y in loader:
        optimizer.zero_grad(); loss_fn(model(x), y).backward(); optimizer.step()   # averages every 4th step

What differs from PyTorch (each has a test):

* averaging is **in place** (``param.copy_``): optimizers, EMA copies and anything else holding the
  parameter tensors see the averaged values (PyTorch rebinds ``param.data``);
* ``average_buffers=True`` (or passing a module) also averages floating-point buffers such as BatchNorm
  running statistics; integer buffers (``num_batches_tracked``) are left alone;
* parameters with ``requires_grad=False`` are skipped; the rest are averaged whether or not they have a
  ``.grad`` this step (PyTorch skips those with ``grad is None`` and lets them drift apart);
* one collective per (device, dtype), each in its own dtype: no silent upcast of fp16/bf16 parameters;
  the sum is taken of ``value / world_size`` so fp16 cannot overflow;
* no ``torch.cuda.synchronize()``;
* :class:`HierarchicalModelAverager` counts its periods from the end of warm-up, like
  :class:`PeriodicModelAverager` (PyTorch's counts from step 0).
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Iterable, Iterator, Mapping
from typing import Any, Union

import torch
import torch.distributed as dist
from torch import Tensor, nn

from .checkpoint import check_placement, placement
from .comm import all_reduce, average_tensors_, broadcast_parameters, flat_groups

__all__ = ["HierarchicalModelAverager", "ModelAverager", "OuterOptimizerAverager", "PeriodicModelAverager",
           "PostLocalSGDOptimizer", "average_parameters", "broadcast_parameters"]

logger = logging.getLogger(__name__)

Params = Union[nn.Module, Iterable[Tensor], Iterable[Mapping[str, Any]], Iterable[tuple[str, Tensor]]]


def _check_int(name: str, value: Any, minimum: int, maximum: int | None = None) -> int:
    """``value`` if it is an int in ``[minimum, maximum]``, else a ``ValueError`` naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum \
            or (maximum is not None and value > maximum):
        bound = f"in [{minimum}, {maximum}]" if maximum is not None else f">= {minimum}"
        raise ValueError(f"{name} must be an integer {bound}, got {value!r}")
    return value


def tensors_to_average(params: Params, average_buffers: bool = False) -> list[Tensor]:
    """The tensors :func:`average_parameters` averages: trainable parameters (of a module, of parameter
    groups, of ``named_parameters()``, or a plain list), and with ``average_buffers`` (or a module) its
    floating-point buffers. Each tensor once."""
    out: list[Tensor] = []
    if isinstance(params, nn.Module):
        out = [p for p in params.parameters() if p.requires_grad]
        if average_buffers:
            out += [b for b in params.buffers() if b.is_floating_point()]
    else:
        for item in params:
            if isinstance(item, Mapping):
                out += [p for p in item["params"] if p.requires_grad]
            elif isinstance(item, tuple):
                if item[1].requires_grad:
                    out.append(item[1])
            elif isinstance(item, Tensor):
                if item.requires_grad or not isinstance(item, nn.Parameter):
                    out.append(item)
            else:
                raise TypeError(f"params must hold tensors, parameter groups or (name, tensor) pairs, got "
                                f"{type(item).__name__}")
    seen: set[int] = set()
    return [t for t in out if not (id(t) in seen or seen.add(id(t)))]  # type: ignore[func-returns-value]


def average_parameters(params: Params, process_group: dist.ProcessGroup | None = None) -> None:
    """Average ``params`` over ``process_group`` (``None``: the default group), in place.

    >>> average_parameters(model.parameters(), None)     # doctest: +SKIP
    >>> average_parameters(model, None)                   # a module: its float buffers too
    """
    average_tensors_(tensors_to_average(params, average_buffers=isinstance(params, nn.Module)), process_group)


class ModelAverager(ABC):
    """Base of the averagers: a step counter and ``average_parameters(params)`` called once per step."""

    def __init__(self, process_group: dist.ProcessGroup | None = None, average_buffers: bool = False) -> None:
        self.process_group = process_group
        self.average_buffers = bool(average_buffers)
        self.step = 0
        self.bytes_sent = 0
        self.num_averages = 0

    @abstractmethod
    def average_parameters(self, params: Params) -> None:
        """Average ``params`` if this step is an averaging step; advance the step counter."""

    def _issuer(self) -> str:
        """Names this averager's collectives in a :class:`gradpress.comm.CollectiveError`."""
        return f"{type(self).__name__}.average_parameters, step {self.step}"

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step, "bytes_sent": self.bytes_sent, "num_averages": self.num_averages}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
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
        self.period = _check_int("period", period, 1)
        self.warmup_steps = _check_int("warmup_steps", warmup_steps, 0)

    def is_averaging_step(self, step: int) -> bool:
        return step >= self.warmup_steps and (step - self.warmup_steps) % self.period == 0

    def average_parameters(self, params: Params) -> None:
        if self.is_averaging_step(self.step):
            self._average(tensors_to_average(params, self.average_buffers or isinstance(params, nn.Module)))
        self.step += 1

    def _average(self, tensors: list[Tensor]) -> None:
        self.bytes_sent += average_tensors_(tensors, self.process_group, issuer=self._issuer())
        self.num_averages += 1


class HierarchicalModelAverager(ModelAverager):
    """Average within groups of different sizes at different periods (PyTorch's name and arguments).

    ``period_group_size_dict`` maps periods (increasing) to group sizes (increasing, each dividing the
    next, the last equal to the size of ``process_group``): at step ``s`` past warm-up, the largest
    period ``p`` with ``(s - warmup_steps) % p == 0`` wins and parameters are averaged within groups of
    consecutive ranks of its size. E.g. ``{2: 2, 8: 4}`` on 4 ranks: ranks {0,1} and {2,3} every 2nd
    step, all 4 every 8th. The subgroups are created here: every rank must construct the averager.

    >>> HierarchicalModelAverager(OrderedDict([(2, 2), (8, 4)]), warmup_steps=100)   # doctest: +SKIP
    """

    def __init__(self, period_group_size_dict: Mapping[int, int] | None = None, warmup_steps: int = 0,
                 process_group: dist.ProcessGroup | None = None, *, average_buffers: bool = False) -> None:
        super().__init__(process_group, average_buffers)
        if not period_group_size_dict:
            raise ValueError("period_group_size_dict must map at least one period to a group size")
        self.warmup_steps = _check_int("warmup_steps", warmup_steps, 0)
        items = list(period_group_size_dict.items())
        for period, size in items:
            _check_int("period_group_size_dict: every period", period, 1)
            _check_int("period_group_size_dict: every group size", size, 1)
        if [p for p, _ in items] != sorted({p for p, _ in items}):
            raise ValueError(f"period_group_size_dict: periods must be strictly increasing, got {[p for p, _ in items]}")
        world = dist.get_world_size(process_group)
        if items[-1][1] != world:
            raise ValueError(f"period_group_size_dict: the last group size must be the size of the process group "
                             f"({world}), got {items[-1][1]}")
        for (_, small), (_, large) in zip(items, items[1:]):
            if large % small or large <= small:
                raise ValueError(f"period_group_size_dict: group sizes must increase and each divide the next "
                                 f"and the world size {world}; {small} then {large} does not")
        self.period_group_size_dict = OrderedDict(items)
        ranks = dist.get_process_group_ranks(process_group) if process_group is not None \
            else list(range(world))
        me = dist.get_rank()
        self._groups: dict[int, dist.ProcessGroup | None] = {}
        for period, size in items:
            if size == world:
                self._groups[period] = process_group
                continue
            for start in range(0, world, size):
                members = ranks[start: start + size]
                group = dist.new_group(members)  # every rank of the default group must call new_group
                if me in members:
                    self._groups[period] = group

    def group_for_step(self, step: int) -> tuple[int, dist.ProcessGroup | None] | None:
        """``(period, group)`` that averages at ``step``, or ``None``."""
        if step < self.warmup_steps:
            return None
        for period in reversed(self.period_group_size_dict):
            if (step - self.warmup_steps) % period == 0:
                return period, self._groups[period]
        return None

    def average_parameters(self, params: Params) -> None:
        found = self.group_for_step(self.step)
        if found is not None:
            tensors = tensors_to_average(params, self.average_buffers or isinstance(params, nn.Module))
            self.bytes_sent += average_tensors_(tensors, found[1], issuer=self._issuer())
            self.num_averages += 1
        self.step += 1


class OuterOptimizerAverager(PeriodicModelAverager):
    """DiLoCo-style outer optimization: every ``period`` steps, average the change since the last
    synchronization and apply it with an outer SGD (Nesterov momentum by default).

    With ``x`` the parameters at the last synchronization (identical on every rank) and ``x_i`` rank
    i's parameters now, the outer gradient is ``Δ = mean_i(x - x_i)``; the outer optimizer takes a step
    on ``x`` with gradient ``Δ`` and every rank continues from the new ``x``. The first averaging step
    (at ``warmup_steps``) is plain averaging and sets ``x``. ``outer_lr=1, outer_momentum=0`` is plain
    periodic averaging. ``compression``: ``None``, ``"fp16"``, ``"bf16"`` (cast Δ for the allreduce), or
    a :class:`gradpress.Config` to send Δ through PowerSGD (with its own error feedback).

    A non-finite averaged Δ (a rank's parameters overflowed to inf/NaN since the last synchronization;
    the mean carries it to every rank) is never applied: the outer step is skipped, ``x`` and the outer
    momentum stay as they were, the PowerSGD memory too (compressed variant), and every rank goes back
    to ``x``, so all ranks stay identical and finite. ``num_skipped`` counts such synchronizations (a
    warning is logged); they do not count in ``num_averages``. Deciding reads one flag on the host per
    synchronization. The first synchronization sets ``x`` by plain averaging: it has nothing to go back to.

    >>> averager = OuterOptimizerAverager(period=50, outer_lr=0.7, outer_momentum=0.9)     # doctest: +SKIP
    >>> optimizer = PostLocalSGDOptimizer(torch.optim.AdamW(model.parameters()), averager)  # doctest: +SKIP
    """

    def __init__(self, period: int, warmup_steps: int = 0, process_group: dist.ProcessGroup | None = None, *,
                 outer_lr: float = 0.7, outer_momentum: float = 0.9, nesterov: bool = True,
                 compression: Any = None, average_buffers: bool = False) -> None:
        super().__init__(period, warmup_steps, process_group, average_buffers=average_buffers)
        if isinstance(outer_lr, bool) or not isinstance(outer_lr, (int, float)) or not outer_lr > 0:
            raise ValueError(f"outer_lr must be a number > 0, got {outer_lr!r}")
        if isinstance(outer_momentum, bool) or not isinstance(outer_momentum, (int, float)) \
                or not 0 <= outer_momentum < 1:
            raise ValueError(f"outer_momentum must be a number in [0, 1), got {outer_momentum!r}")
        from .aggregator import Config
        if not (compression is None or compression in ("fp16", "bf16") or isinstance(compression, Config)):
            raise ValueError(f"compression must be None, 'fp16', 'bf16' or a gradpress.Config, got {compression!r}")
        self.outer_lr = float(outer_lr)
        self.outer_momentum = float(outer_momentum)
        self.nesterov = bool(nesterov) and outer_momentum > 0
        self.compression = compression
        self._anchor: list[Tensor] | None = None
        self._outer: torch.optim.SGD | None = None
        self._powersgd: Any = None
        self._pending_state: dict[str, Any] | None = None
        self.num_skipped = 0

    def _average(self, tensors: list[Tensor]) -> None:
        with torch.no_grad():
            if self._anchor is None:
                super()._average(tensors)
                self._anchor = [t.detach().clone() for t in tensors]
                self._make_outer(tensors)
                return
            if len(self._anchor) != len(tensors) or any(a.shape != t.shape for a, t in zip(self._anchor, tensors)):
                raise ValueError("OuterOptimizerAverager: the parameters changed since the last synchronization")
            deltas = [a - t.detach() for a, t in zip(self._anchor, tensors)]
            if isinstance(self.compression, str):
                wire = torch.float16 if self.compression == "fp16" else torch.bfloat16
                self.bytes_sent += average_tensors_(deltas, self.process_group, wire_dtype=wire, issuer=self._issuer())
            elif self.compression is not None:
                self._powersgd.aggregate_(deltas)
                self.bytes_sent = self._powersgd.total_bytes_sent
            else:
                self.bytes_sent += average_tensors_(deltas, self.process_group, issuer=self._issuer())
            assert self._outer is not None
            # The averaged deltas are the same on every rank, so every rank takes the same branch.
            finite = _all_finite(deltas)
            if self._powersgd is not None and self._powersgd.finite is not None:
                finite = finite and bool(self._powersgd.finite)  # then its memory is as before, too
            if not finite:
                for anchor, t in zip(self._anchor, tensors):
                    t.detach().copy_(anchor)
                self.num_skipped += 1
                logger.warning("OuterOptimizerAverager: the averaged change at step %s is not finite; the outer "
                               "step is skipped and every rank goes back to the last synchronized parameters",
                               self.step)
                return
            for anchor, delta in zip(self._anchor, deltas):
                anchor.grad = delta.to(anchor.dtype)
        self._outer.step()
        with torch.no_grad():
            for anchor, t in zip(self._anchor, tensors):
                anchor.grad = None
                t.detach().copy_(anchor)
        self.num_averages += 1

    def _make_outer(self, tensors: list[Tensor]) -> None:
        assert self._anchor is not None
        self._outer = torch.optim.SGD(self._anchor, lr=self.outer_lr, momentum=self.outer_momentum,
                                      nesterov=self.nesterov)
        if self.compression is not None and not isinstance(self.compression, str):
            from .aggregator import PowerSGD
            self._powersgd = PowerSGD(self._anchor, self.compression, process_group=self.process_group)
        if self._pending_state is not None:
            self._load_outer(self._pending_state)
            self._pending_state = None

    def state_dict(self) -> dict[str, Any]:
        state = super().state_dict()
        state["num_skipped"] = self.num_skipped
        if self._anchor is not None:
            assert self._outer is not None
            state["anchor"] = [a.detach().clone() for a in self._anchor]
            state["outer"] = self._outer.state_dict()
            if self._powersgd is not None:
                state["powersgd"] = self._powersgd.state_dict()
        return state

    def load_state_dict(self, state: Mapping[str, Any], *, allow_other_rank: bool = False) -> None:
        """Restore :meth:`state_dict`'s output. The compressed variant's error memory is per rank: a
        checkpoint saved on another rank or world size raises ``ValueError`` here (unless
        ``allow_other_rank=True``); older checkpoints without that record are accepted."""
        if isinstance(state.get("powersgd"), Mapping):
            check_placement(state["powersgd"].get("placement"), placement(self.process_group),
                            "OuterOptimizerAverager", allow_other_rank)
        super().load_state_dict(state)
        self.num_skipped = int(state.get("num_skipped", 0))
        if "anchor" not in state:
            self._anchor = None
            return
        self._anchor = [a.detach().clone() for a in state["anchor"]]
        self._pending_state = dict(state)
        self._make_outer(self._anchor)

    def _load_outer(self, state: Mapping[str, Any]) -> None:
        assert self._outer is not None
        self._outer.load_state_dict(state["outer"])
        if self._powersgd is not None and "powersgd" in state:
            self._powersgd.load_state_dict(state["powersgd"], allow_other_rank=True)  # checked on load


def _all_finite(tensors: list[Tensor]) -> bool:
    """Whether every value of ``tensors`` is finite: one host read per device."""
    flags: dict[torch.device, list[Tensor]] = {}
    for t in tensors:
        flags.setdefault(t.device, []).append(torch.isfinite(t).all())
    return all(bool(torch.stack(group).all()) for group in flags.values())


class PostLocalSGDOptimizer(torch.optim.Optimizer):
    """Wrap an optimizer so that each ``step()`` is followed by ``averager.average_parameters``.

    ``state_dict()`` holds the wrapped optimizer's state and the averager's (its step counter, and an
    outer optimizer's state), so a resumed run averages on the same steps as an uninterrupted one.

    >>> opt = PostLocalSGDOptimizer(torch.optim.SGD(params, lr=0.1), PeriodicModelAverager(4, 100))  # doctest: +SKIP
    """

    def __init__(self, optim: torch.optim.Optimizer, averager: ModelAverager) -> None:
        if not isinstance(optim, torch.optim.Optimizer):
            raise TypeError(f"optim must be a torch.optim.Optimizer, got {type(optim).__name__}")
        if not isinstance(averager, ModelAverager):
            raise TypeError(f"averager must be a gradpress ModelAverager, got {type(averager).__name__}")
        self.optim = optim
        self.averager = averager
        self.param_groups = optim.param_groups
        self.defaults = optim.defaults

    @property
    def state(self) -> Any:  # type: ignore[override]
        return self.optim.state

    def __repr__(self) -> str:
        return f"PostLocalSGDOptimizer({self.optim!r}, {type(self.averager).__name__})"

    def step(self, closure: Any = None) -> Any:  # type: ignore[override]
        loss = self.optim.step(closure) if closure is not None else self.optim.step()
        self.averager.average_parameters(self.param_groups)
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optim.zero_grad(set_to_none=set_to_none)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        self.optim.add_param_group(param_group)

    def state_dict(self) -> dict[str, Any]:  # type: ignore[override]
        state = self.optim.state_dict()
        state["averager"] = self.averager.state_dict()
        state["step"] = self.averager.step  # PyTorch's key
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:  # type: ignore[override]
        state = dict(state_dict)
        averager = state.pop("averager", None)
        step = state.pop("step", None)
        self.optim.load_state_dict(state)
        if averager is not None:
            self.averager.load_state_dict(averager)
        elif step is not None:
            self.averager.step = int(step)
        else:
            raise ValueError("state_dict has no averager state ('averager' or 'step'): it was not saved by "
                             "PostLocalSGDOptimizer, and resuming would average on the wrong steps")

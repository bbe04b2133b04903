"""The optimizer wrapper that averages after every ``step()``."""

from __future__ import annotations

import sys
import warnings
from typing import Any

import torch

from ..checkpoint import PER_RANK_FORMAT, dcp_saved_keys, per_rank_state, read_per_rank
from .averagers import ModelAverager
from .shards import is_sharded

__all__ = ["PostLocalSGDOptimizer"]


class PostLocalSGDOptimizer(torch.optim.Optimizer):
    """Wrap an optimizer so that each ``step()`` is followed by ``averager.average_parameters``.

    ``state_dict()`` holds the wrapped optimizer's state and the averager's (its step counter, and an
    outer optimizer's state), so a resumed run averages on the same steps as an uninterrupted one. As in
    PyTorch, the step counter is the state's ``"step"`` key: a state without it loads with PyTorch's
    warning and the counter at 0.

    ``torch.distributed.checkpoint``: the wrapper is a Stateful (``dcp.save({"model": model.state_dict(),
    "optim": optimizer})``). Put it after the model: its load writes each rank's own parameters saved
    between synchronizations. Islands differ there, and DCP keeps each shard of a sharded model's state
    dict once, from whichever island it picks: between synchronizations the model part of the checkpoint
    is a per-shard mix of the islands' parameters, no island's model (a resume through this wrapper gives
    every rank its own back; evaluating or exporting the model part alone does not). For a consistent
    model at any step save DiLoCo's ``averager.anchor_state_dict(model)``, the model the islands agreed
    on at the last synchronization, or checkpoint right after one (``averager.in_sync()``); a periodic
    averager has no common model between synchronizations.
    ``get_state_dict(model, optimizer)`` reads the inner optimizer's state only (and DCP keeps each of its
    shards from one island or another: a mix too): save the averager beside it (``"averager":
    optimizer.averager``) and load it in a ``dcp.load`` of its own after ``set_state_dict``; the
    zero-learning-rate step ``get_state_dict`` takes on an optimizer without state is not an averaging
    step, and ``set_state_dict`` leaves the averager alone.

    >>> opt = PostLocalSGDOptimizer(torch.optim.SGD(params, lr=0.1), PeriodicModelAverager(4, 100))  # doctest: +SKIP
    """

    def __init__(self, optim: torch.optim.Optimizer, averager: ModelAverager) -> None:
        if not isinstance(optim, torch.optim.Optimizer):
            raise TypeError(f"optim must be a torch.optim.Optimizer, got {type(optim).__name__}")
        if not isinstance(averager, ModelAverager):
            raise TypeError(f"averager must be a gradpress ModelAverager, got {type(averager).__name__}")
        self.optim = optim
        self.averager = averager
        averager.anchor_parameters(self.param_groups)  # DiLoCo's anchor: where local training starts

    # The inner optimizer's own objects, read through: its load_state_dict replaces its param_groups list,
    # and an LR scheduler built on this wrapper (torchtitan attaches them to the optimizer it is handed)
    # must keep writing the learning rate the inner optimizer steps with. PyTorch's wrapper copies the
    # list once, so after a resume its schedulers write into groups nothing reads.
    @property  # type: ignore[override]
    def param_groups(self) -> list[dict[str, Any]]:
        """The inner optimizer's ``param_groups`` (the same list, also after :meth:`load_state_dict`)."""
        return self.optim.param_groups

    @param_groups.setter
    def param_groups(self, groups: list[dict[str, Any]]) -> None:
        self.optim.param_groups = groups

    @property  # type: ignore[override]
    def defaults(self) -> dict[str, Any]:
        """The inner optimizer's ``defaults``."""
        return self.optim.defaults

    @defaults.setter
    def defaults(self, defaults: dict[str, Any]) -> None:
        self.optim.defaults = defaults

    @property
    def state(self) -> Any:  # type: ignore[override]
        return self.optim.state

    def __repr__(self) -> str:
        return f"PostLocalSGDOptimizer({self.optim!r}, {type(self.averager).__name__})"

    def step(self, closure: Any = None) -> Any:  # type: ignore[override]
        loss = self.optim.step(closure) if closure is not None else self.optim.step()
        if not _called_by_torch("_init_optim_state"):
            self.averager.average_parameters(self.param_groups)
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optim.zero_grad(set_to_none=set_to_none)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        self.optim.add_param_group(param_group)

    def state_dict(self) -> dict[str, Any]:  # type: ignore[override]
        """The inner optimizer's ``param_groups``, the averager's state and PyTorch's ``"step"``; the inner
        optimizer's ``state`` (its momentum, Adam moments) is this rank's own, as each island trains on
        its own: kept per rank (:func:`gradpress.checkpoint.per_rank_state`), so a DCP checkpoint does not
        hand every island a per-shard mix of the islands' states, and a fresh optimizer needs no initialized
        state to load into. Called by ``get_state_dict``, the inner optimizer's plain state dict (the layout
        it reads)."""
        inner = self.optim.state_dict()
        if _called_by_torch("_get_optim_state_dict"):
            return inner
        found = dcp_saved_keys()  # asked by dcp.load: what the checkpoint holds of the averager, checked first
        if found is not None:
            self.averager.check_dcp_keys(found[1], f"{found[0]}.averager")
        return per_rank_state({"state": inner["state"]},
                              {"param_groups": inner["param_groups"], "averager": self.averager.state_dict(),
                               "step": self.averager.step})

    def load_state_dict(self, state_dict: dict[str, Any], *,  # type: ignore[override]
                        on_world_size_change: str = "raise", allow_other_rank: bool = False) -> None:
        """Restore :meth:`state_dict`'s output (or a plain optimizer state dict, as PyTorch's does);
        ``on_world_size_change`` as in the averager's ``load_state_dict`` (``"fresh"``: the inner
        optimizer's state starts empty too).

        Another rank's state (rank 0's ``torch.save`` loaded on every rank, as PyTorch's own test of its
        wrapper does) loads wherever nothing in it belongs to rank 0 alone: the step counter, the outer
        state, the inner optimizer's state (which PyTorch hands every rank too) and rank 0's parameters
        saved between synchronizations (what loading rank 0's model does anyway). Error feedback (a
        compressor's residual, PowerSGD's error memory) and FSDP2 shards would be lost or misapplied:
        that is refused with a ``ValueError`` naming it (``allow_other_rank=True`` loads it anyway)."""
        state = dict(state_dict)
        averager = state.pop("averager", None)
        step = state.pop("step", None)
        if averager is not None:  # another kind of averager's state: refused before anything loads
            self.averager.check_state_dict({**averager, "step": 0})
        own, found = read_per_rank(state, "PostLocalSGDOptimizer", on_world_size_change=on_world_size_change,
                                   allow_other_rank=allow_other_rank, portable=_inner_state_portable)
        if state.get("format") == PER_RANK_FORMAT:
            state = {"state": own["state"] if found else {}, "param_groups": state["param_groups"]}
        self.optim.load_state_dict(state)
        if averager is None and step is None and _called_by_torch("_load_optim_state_dict"):
            return  # set_state_dict passes the inner optimizer's part only: the averager is loaded on its own
        if averager is not None:  # its other fields; the step is PyTorch's key alone
            self.averager.load_state_dict({**averager, "step": 0}, on_world_size_change=on_world_size_change,
                                          allow_other_rank=allow_other_rank)
        if step is None:
            # PyTorch's warning, in its words.
            warnings.warn("Loaded state dict does not contain a step counter for an averager. Setting step "
                          "counter to 0.", stacklevel=2)
            self.averager.step = 0
        else:
            self.averager.step = int(step)


def _inner_state_portable(own: Any) -> str | None:
    """Whether the inner optimizer's state saved on another rank can serve this one (``None``: it can, as
    in PyTorch), unless it holds FSDP2 shards (DTensors: that rank's part of the model)."""
    values = [v for per_param in (own.get("state") or {}).values() if isinstance(per_param, dict)
              for v in per_param.values()] if isinstance(own, dict) else []
    if any(is_sharded(v) for v in values):
        return "the inner optimizer's state of that rank's FSDP2 shards"
    return None


def _called_by_torch(name: str) -> bool:
    """Whether the calling method was called by ``torch.distributed.checkpoint.state_dict``'s function
    ``name``: its state initialization (``_init_optim_state``, a step at learning rate 0 on zero
    gradients, not a training step, so not an averaging step) or ``set_state_dict``'s optimizer load
    (``_load_optim_state_dict``, which hands over the inner optimizer's state only)."""
    caller = sys._getframe(2)
    return caller.f_code.co_name == name and "torch/distributed/checkpoint" in \
        caller.f_code.co_filename.replace("\\", "/")

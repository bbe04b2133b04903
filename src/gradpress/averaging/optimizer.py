"""The optimizer wrapper that averages after every ``step()``."""

from __future__ import annotations

import warnings
from typing import Any

import torch

from .averagers import ModelAverager

__all__ = ["PostLocalSGDOptimizer"]


class PostLocalSGDOptimizer(torch.optim.Optimizer):
    """Wrap an optimizer so that each ``step()`` is followed by ``averager.average_parameters``.

    ``state_dict()`` holds the wrapped optimizer's state and the averager's (its step counter, and an
    outer optimizer's state), so a resumed run averages on the same steps as an uninterrupted one. As in
    PyTorch, the step counter is the state's ``"step"`` key: a state without it loads with PyTorch's
    warning and the counter at 0.

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
        averager.anchor_parameters(self.param_groups)  # DiLoCo's anchor: where local training starts

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
        if averager is not None:  # its other fields; the step is PyTorch's key alone
            self.averager.load_state_dict({**averager, "step": 0})
        if step is None:
            # PyTorch's warning, in its words.
            warnings.warn("Loaded state dict does not contain a step counter for an averager. Setting step "
                          "counter to 0.", stacklevel=2)
            self.averager.step = 0
        else:
            self.averager.step = int(step)

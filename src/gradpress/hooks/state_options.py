""":class:`~gradpress.PowerSGDState`'s own arguments, checked (house rule: errors speak), beside what the
engine's :class:`~gradpress.powersgd.EngineConfig` checks of its fields. Each function raises a ``ValueError``
or ``TypeError`` naming the argument, its value and what is allowed.

>>> checked_device("cpu")
device(type='cpu')
"""

from __future__ import annotations

from typing import Any

import torch

from ..diagnostics import check_measure_every
from ..powersgd.config import EngineConfig
from .iteration import OVERLAPS

__all__ = ["check_lr_scheduler", "check_schedule", "check_warm_up", "checked_device", "checked_overlap",
           "merged_error_feedback"]


def merged_error_feedback(use_error_feedback: bool, error_feedback: bool | None) -> bool:
    """``use_error_feedback`` and its alias ``error_feedback`` as one value: the alias wins when given.
    ``use_error_feedback``'s default is PyTorch's plain ``True`` (tools read defaults from the signature), so
    only a non-default ``use_error_feedback=False`` can be seen to disagree."""
    if error_feedback is None:
        return use_error_feedback
    if not isinstance(error_feedback, bool):
        raise TypeError(f"error_feedback must be a bool, got {error_feedback!r}")
    if use_error_feedback is False and error_feedback:
        raise ValueError(f"error_feedback={error_feedback!r} and use_error_feedback={use_error_feedback!r} "
                         "disagree; they are the same option, give one of them")
    return error_feedback


def check_lr_scheduler(lr_scheduler: Any) -> None:
    """``None``, or anything with ``get_last_lr()``."""
    if lr_scheduler is not None and not callable(getattr(lr_scheduler, "get_last_lr", None)):
        raise TypeError(f"lr_scheduler must be None or have a get_last_lr() method (a "
                        f"torch.optim.lr_scheduler.LRScheduler), got {type(lr_scheduler).__name__}")


def check_schedule(start_powerSGD_iter: Any, compression_stats_logging_frequency: Any,
                   approximation_error_every_n_iters: Any, global_residual_every_n_iters: Any) -> None:
    """The iteration counts: checked before the engine's config, whose messages name its own fields."""
    if isinstance(start_powerSGD_iter, bool) or not isinstance(start_powerSGD_iter, int) or start_powerSGD_iter < 0:
        raise ValueError(f"start_powerSGD_iter must be an integer >= 0, got {start_powerSGD_iter!r}")
    frequency = compression_stats_logging_frequency
    if isinstance(frequency, bool) or not isinstance(frequency, int):
        raise ValueError("compression_stats_logging_frequency must be an integer, got "
                         f"{compression_stats_logging_frequency!r}")
    check_measure_every(approximation_error_every_n_iters)
    check_measure_every(global_residual_every_n_iters, "global_residual_every_n_iters")


def check_warm_up(config: EngineConfig) -> None:
    """PyTorch's rule: error feedback and warm start need ``start_powerSGD_iter > 1`` (DDP rebuilds its
    buckets after the first iteration)."""
    if (config.use_error_feedback or config.warm_start) and config.warm_up_steps <= 1:
        raise ValueError(
            "Expect `start_powerSGD_iter` > 1 if `use_error_feedback` or `warm_start` is enabled, "
            "because PowerSGD can only be applied after the first two iterations in DDP "
            f"(got start_powerSGD_iter={config.warm_up_steps!r}).")


def checked_device(comm_device: Any) -> torch.device | None:
    """``comm_device`` as a ``torch.device`` (``None`` stays ``None``)."""
    if comm_device is None:
        return None
    try:
        return torch.device(comm_device)
    except (RuntimeError, TypeError) as exc:
        raise ValueError(f"comm_device must be None or a torch device such as 'cpu' or 'cuda:0', "
                         f"got {comm_device!r}") from exc


def checked_overlap(overlap: Any, num_iters_per_step: int | None) -> str:
    """``overlap``, one of :data:`~gradpress.hooks.iteration.OVERLAPS`; ``"p-phase"`` splits classic PowerSGD's
    step, so it needs ``num_iters_per_step=None``."""
    if overlap not in OVERLAPS:
        raise ValueError(f"overlap must be one of {', '.join(map(repr, OVERLAPS))}, got {overlap!r}")
    if overlap == "p-phase" and num_iters_per_step is not None:
        raise ValueError(f"overlap='p-phase' issues classic PowerSGD's P phase per bucket; with "
                         f"num_iters_per_step={num_iters_per_step!r} use overlap='none' or 'auto'")
    return str(overlap)

"""What defines a demo training run (:class:`DemoConfig`, identical on every worker) and its default warm-up."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

from .tasks import get_task

__all__ = ["ADAMW_BETAS", "ADAMW_LR", "ADAMW_MIN_LR_FRACTION", "FAIL_KINDS", "OPTIMIZERS", "DemoConfig",
           "default_start_iter"]

#: How an injected failure (``DemoConfig.fail_at_step``) fails.
FAIL_KINDS = ("raise", "sigkill", "hang")

#: The inner optimizers a run can use (``DemoConfig.optimizer``).
OPTIMIZERS = ("sgd", "adamw")
#: AdamW as nanoGPT trains transformers: betas, the final learning rate of the cosine decay as a fraction
#: of the peak, and the peak when the user gives none (not tuned per task).
ADAMW_BETAS = (0.9, 0.95)
ADAMW_MIN_LR_FRACTION = 0.1
ADAMW_LR = 1e-3


def default_start_iter(steps: int) -> int:
    """Plain-allreduce steps before compression or local steps start, when the user gives none: a tenth
    of the run (30 of the default 300 steps), at least 2 (DDP rebuilds its buckets after the first step,
    and ``PowerSGDState`` needs ``start_powerSGD_iter >= 2``).

    >>> default_start_iter(300), default_start_iter(10)
    (30, 2)
    """
    return max(2, round(steps / 10))


@dataclass(frozen=True)
class DemoConfig:
    """Everything that defines a run (identical on every worker).

    ``batch_size`` (per worker) and ``lr`` default to the task's. ``start_iter``: plain-allreduce steps
    before PowerSGD starts. ``evals``: how many times the test metric is measured along the run.
    ``warm_up_beta``: ``PowerSGDState(warm_up_beta_factor=...)`` for the PowerSGD methods.
    ``powersgd_options``: further ``PowerSGDState`` keyword arguments for the PowerSGD methods (e.g.
    ``{"num_iters_per_step": 2}``), over the ones the method and this configuration set; its
    ``bytes_per_weight`` (the wire's precision) also sets the bytes of their compressed steps.
    ``outer_lr``, ``outer_momentum``: ``diloco``'s outer Nesterov SGD (momentum 0.5, not DiLoCo's 0.9,
    which is tuned for periods of hundreds of AdamW steps and diverges on this short-period demo).
    ``fail_at_step``/``fail_rank``/``fail_kind``: make that rank fail at that step, to exercise failure
    handling: ``"raise"`` an exception, ``"sigkill"`` itself (a lost worker), or ``"hang"`` (sleep inside
    the step until killed: a stuck worker); only in a run that did not resume from a checkpoint, so a
    restarted run gets past it. Checkpoints ignore these three fields.
    ``clip_grad_norm``: clip the gradient to this norm (over all parameters) at every step: by default the
    averaged gradient, after the hook (``torch.nn.utils.clip_grad_norm_`` between backward and the
    optimizer, what a DDP training loop does; for PowerSGD this is after error feedback); with
    ``clip_before_averaging`` each worker's own gradient, before the hook (before PowerSGD's error
    feedback, as in the PowerSGD paper's LSTM runs; DDP then puts the whole gradient in one bucket, so the
    norm is the model's).
    ``optimizer``: ``"sgd"`` (momentum ``momentum``, constant ``lr``) or ``"adamw"`` as nanoGPT trains
    transformers: betas ``ADAMW_BETAS``, weight decay ``weight_decay`` on matrices only (biases, norms and
    other vectors none), the learning rate rising linearly over the first tenth of the run to ``lr``
    (default ``ADAMW_LR``), then a cosine decay to ``ADAMW_MIN_LR_FRACTION`` of it (:meth:`lr_at`).
    ``schedule``: how the compressed DiLoCo methods' payloads travel (the averagers' ``schedule=``:
    ``"auto"``, two-shot for int8/int4 from 3 workers; ``"all-gather"``; ``"two-shot"``, top-k too).
    """

    task: str = "digits"
    steps: int = 300
    start_iter: int = 30
    seed: int = 0
    batch_size: int | None = None
    lr: float | None = None
    momentum: float = 0.9
    min_compression_rate: float = 2.0
    evals: int = 15
    warm_up_beta: float | None = None
    powersgd_options: dict[str, Any] | None = None
    outer_lr: float = 0.7
    outer_momentum: float = 0.5
    fail_at_step: int | None = None
    fail_rank: int = 1
    fail_kind: str = "raise"
    clip_grad_norm: float | None = None
    clip_before_averaging: bool = False
    optimizer: str = "sgd"
    weight_decay: float = 0.1
    schedule: str = "auto"

    def __post_init__(self) -> None:
        if self.schedule not in ("auto", "all-gather", "two-shot"):
            raise ValueError(f"schedule must be one of ('auto', 'all-gather', 'two-shot'), got {self.schedule!r}")
        if self.optimizer not in OPTIMIZERS:
            raise ValueError(f"optimizer must be one of {', '.join(OPTIMIZERS)}, got {self.optimizer!r}")
        if isinstance(self.weight_decay, bool) or not isinstance(self.weight_decay, (int, float)) \
                or self.weight_decay < 0:
            raise ValueError(f"weight_decay must be a number >= 0, got {self.weight_decay!r}")
        if self.batch_size is not None and (isinstance(self.batch_size, bool) or not isinstance(self.batch_size, int)
                                            or self.batch_size < 1):
            raise ValueError(f"batch_size must be an integer >= 1 (sequences per worker per step) or None, "
                             f"got {self.batch_size!r}")
        if self.fail_kind not in FAIL_KINDS:
            raise ValueError(f"fail_kind must be one of {', '.join(FAIL_KINDS)}, got {self.fail_kind!r}")
        if self.clip_grad_norm is not None and not (isinstance(self.clip_grad_norm, (int, float))
                                                    and not isinstance(self.clip_grad_norm, bool)
                                                    and self.clip_grad_norm > 0):
            raise ValueError(f"clip_grad_norm must be a number > 0 or None, got {self.clip_grad_norm!r}")
        if self.clip_before_averaging and self.clip_grad_norm is None:
            raise ValueError("clip_before_averaging=True needs clip_grad_norm (the norm to clip to)")

    def to_dict(self) -> dict[str, Any]:
        """Plain-dict form (JSON-serialisable, picklable)."""
        return asdict(self)

    def resolved_batch_size(self) -> int:
        return self.batch_size if self.batch_size is not None else get_task(self.task).batch_size

    def resolved_lr(self) -> float:
        """The (peak) learning rate: ``lr``, else the task's for SGD or ``ADAMW_LR`` for AdamW."""
        if self.lr is not None:
            return self.lr
        return get_task(self.task).lr if self.optimizer == "sgd" else ADAMW_LR

    def lr_warmup_steps(self) -> int:
        """AdamW's linear warm-up: the first tenth of the run (at least one step)."""
        return max(1, round(self.steps / 10))

    def lr_at(self, step: int) -> float:
        """The learning rate of step ``step`` (1-based, as the training loop counts): constant for SGD;
        for AdamW, ``peak * step / warmup`` up to the warm-up's end, then a cosine from the peak down to
        ``ADAMW_MIN_LR_FRACTION`` of it at the last step. A pure function of the step, so a resumed run
        follows the same schedule with nothing to save.

        >>> config = DemoConfig(task="gpt", steps=100, optimizer="adamw", lr=1e-3)
        >>> [round(config.lr_at(s), 6) for s in (1, 10, 55, 100)]
        [0.0001, 0.001, 0.00055, 0.0001]
        """
        peak = self.resolved_lr()
        if self.optimizer == "sgd":
            return peak
        warmup = self.lr_warmup_steps()
        if step <= warmup:
            return peak * step / warmup
        progress = (step - warmup) / max(1, self.steps - warmup)
        low = peak * ADAMW_MIN_LR_FRACTION
        return low + 0.5 * (1 + math.cos(math.pi * min(1.0, progress))) * (peak - low)

"""gradpress in the Hugging Face ``transformers`` ``Trainer``: :func:`register_comm_hook` / :class:`GradpressCallback`.

The ``Trainer`` wraps the model in DDP inside ``train()`` (through Accelerate) and has no argument for a
communication hook. A ``TrainerCallback`` is the route that composes with any ``Trainer`` subclass, but
callbacks are given neither the DDP model nor the checkpoint being resumed; so the callback keeps a
reference to the trainer (``trainer.model_wrapped`` is the DDP model by ``on_train_begin``) and finds the
checkpoint folder from the restored ``global_step``::

    from transformers import Trainer, TrainingArguments
    import gradpress
    from gradpress.integrations.transformers import register_comm_hook

    trainer = Trainer(model=model, args=TrainingArguments(output_dir="out", save_steps=500), train_dataset=data)
    state = gradpress.PowerSGDState(process_group=None, matrix_approximation_rank=2, start_powerSGD_iter=100)
    register_comm_hook(trainer, state, gradpress.powerSGD_hook)
    trainer.train()                                  # or trainer.train(resume_from_checkpoint=True)
"""

from __future__ import annotations

import os
import warnings
from typing import Any, Callable

import torch
from torch.nn.parallel import DistributedDataParallel
from transformers import Trainer, TrainerCallback
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

from . import _common

__all__ = ["GradpressCallback", "register_comm_hook", "state_file"]


def state_file(checkpoint_dir: str | os.PathLike[str], rank: int) -> str:
    """The file in a Trainer checkpoint folder holding rank ``rank``'s hook state."""
    return os.path.join(os.fspath(checkpoint_dir), f"gradpress_comm_state_rank{rank}.pt")


class GradpressCallback(TrainerCallback):
    """Registers ``hook`` with ``state`` on the Trainer's DDP model and keeps ``state`` in its checkpoints.

    * ``on_train_begin`` (every ``train()`` call): registers the hook on ``trainer.model_wrapped`` (the
      DDP model by then); when the run resumes (``global_step > 0``), loads this rank's state from the
      checkpoint folder: ``resume_from_checkpoint`` if given, else ``args.resume_from_checkpoint`` if it
      is a folder, else ``<output_dir>/checkpoint-<global_step>`` (where the Trainer writes checkpoints,
      and what ``train(resume_from_checkpoint=True)`` picks). A resumed run whose folder has no file for
      this rank raises ``FileNotFoundError`` rather than silently starting the error memory afresh.
    * ``on_save``: every rank writes ``gradpress_comm_state_rank<R>.pt`` into
      ``<output_dir>/checkpoint-<global_step>``, next to the Trainer's own per-rank ``rng_state_<R>.pth``;
      ``save_total_limit`` rotation deletes it with its folder.

    Resuming needs the same number of processes (``ValueError``). Hyperparameter-search runs (whose
    checkpoints go to per-trial folders) are not supported.

    Example::

        callback = GradpressCallback(trainer, gradpress.PowerSGDState(None, start_powerSGD_iter=10),
                                     gradpress.powerSGD_hook)
        trainer.add_callback(callback)
        trainer.train(resume_from_checkpoint="elsewhere/checkpoint-500")  # then pass it here too:
        # GradpressCallback(..., resume_from_checkpoint="elsewhere/checkpoint-500")
    """

    def __init__(self, trainer: Trainer, state: Any, hook: Callable[..., Any], *,
                 resume_from_checkpoint: str | os.PathLike[str] | None = None) -> None:
        if not isinstance(trainer, Trainer):
            raise TypeError(f"trainer must be a transformers.Trainer, got {type(trainer).__name__}")
        self.trainer = trainer
        self.state = state
        self.hook = _common.check_hook(hook)
        self.resume_from_checkpoint = None if resume_from_checkpoint is None else os.fspath(resume_from_checkpoint)
        self._registered: list[Any] = []  # the DDP module the hook is on (one per train() call at most)

    # --- registration ----------------------------------------------------------------------------------
    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        model = self.trainer.model_wrapped
        ddp = model if isinstance(model, DistributedDataParallel) else getattr(model, "_orig_mod", None)
        if not isinstance(ddp, DistributedDataParallel):
            _, world = _common.rank_and_world()
            if world == 1:
                warnings.warn("GradpressCallback: a single process, the model is not DDP-wrapped and nothing is "
                              "communicated; the hook is not registered", UserWarning, stacklevel=2)
                return
            raise TypeError(f"GradpressCallback: the Trainer's model is {type(model).__name__}, not "
                            "DistributedDataParallel: the hook works with DDP only (not FSDP or DeepSpeed)")
        if not any(registered is ddp for registered in self._registered):
            ddp.register_comm_hook(self.state, self.hook)
            self._registered = [ddp]
        if state.global_step > 0 and _common.is_stateful(self.state):
            self._load(args, state.global_step)

    # --- checkpoints -----------------------------------------------------------------------------------
    def _candidates(self, args: Any, global_step: int) -> list[str]:
        out = [self.resume_from_checkpoint]
        if isinstance(getattr(args, "resume_from_checkpoint", None), str):
            out.append(args.resume_from_checkpoint)
        out.append(os.path.join(args.output_dir, f"{PREFIX_CHECKPOINT_DIR}-{global_step}"))
        return [c for c in out if c]

    def _load(self, args: Any, global_step: int) -> None:
        rank, world = _common.rank_and_world()
        candidates = self._candidates(args, global_step)
        for folder in candidates:
            path = state_file(folder, rank)
            if os.path.exists(path):
                entry = torch.load(path, map_location="cpu", weights_only=True)
                if entry.get("global_step") != global_step:
                    continue
                _common.check_saved_world(entry, world, path)
                _common.restore_rank_entry(entry, self.state, None, path)
                return
        raise FileNotFoundError(
            f"the Trainer resumes at step {global_step}, but no gradpress hook state of rank {rank} for that step "
            f"was found (looked for {[state_file(c, rank) for c in candidates]}); pass the checkpoint folder as "
            "GradpressCallback(..., resume_from_checkpoint=folder)")

    def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if not _common.is_stateful(self.state):
            return
        rank, world = _common.rank_and_world()
        folder = os.path.join(args.output_dir, f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}")
        os.makedirs(folder, exist_ok=True)
        entry = {"version": _common.FORMAT_VERSION, "world_size": world, "rank": rank,
                 "global_step": state.global_step, **_common.rank_entry(self.state, None)}
        torch.save(entry, state_file(folder, rank))


def register_comm_hook(trainer: Trainer, state: Any, hook: Callable[..., Any], *,
                       resume_from_checkpoint: str | os.PathLike[str] | None = None) -> GradpressCallback:
    """Add a :class:`GradpressCallback` to ``trainer`` (before ``trainer.train()``) and return it.

    ``state``/``hook``: what ``DistributedDataParallel.register_comm_hook`` takes, e.g.
    ``gradpress.PowerSGDState(None, ...)`` and ``gradpress.powerSGD_hook``. Call it on every process.

    Example::

        register_comm_hook(trainer, gradpress.PowerSGDState(None, start_powerSGD_iter=10), gradpress.powerSGD_hook)
        trainer.train()
    """
    callback = GradpressCallback(trainer, state, hook, resume_from_checkpoint=resume_from_checkpoint)
    trainer.add_callback(callback)
    return callback

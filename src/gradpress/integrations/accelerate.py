"""gradpress in Hugging Face Accelerate: :func:`register_comm_hook`, one call after ``accelerator.prepare``.

Accelerate's own ``DistributedDataParallelKwargs(comm_hook=...)`` only names PyTorch's built-in hooks, and
``accelerator.register_for_checkpointing(obj)`` writes ``obj.state_dict()`` **of the main process only**
and loads that one file into every process: per-rank state such as PowerSGD's error memory would be
silently replaced by rank 0's on resume. :func:`register_comm_hook` registers any hook on the prepared
DDP model and saves each process's hook state to its own file in the ``save_state`` folder, next to
Accelerate's own per-process ``random_states_<i>.pkl``::

    from accelerate import Accelerator
    import gradpress
    from gradpress.integrations.accelerate import register_comm_hook

    accelerator = Accelerator(gradient_accumulation_steps=2)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    state = gradpress.PowerSGDState(process_group=None, matrix_approximation_rank=2, start_powerSGD_iter=100)
    register_comm_hook(accelerator, model, state, gradpress.powerSGD_hook)
    for x, y in loader:
        with accelerator.accumulate(model):        # no_sync on accumulation steps: the hook runs on sync steps
            accelerator.backward(loss_fn(model(x), y))
            optimizer.step()
            optimizer.zero_grad()
    accelerator.save_state("ckpt")                 # + ckpt/gradpress_comm_state_0_rank<R>.pt on every rank
    accelerator.load_state("ckpt")                 # each rank loads its own
"""

from __future__ import annotations

import os
import weakref
from typing import Any, Callable

import torch
from accelerate import Accelerator
from torch.nn.parallel import DistributedDataParallel

from . import _common

__all__ = ["register_comm_hook", "state_file"]

# How many hook states each accelerator has registered (file names must not collide).
_REGISTERED: weakref.WeakKeyDictionary[Any, int] = weakref.WeakKeyDictionary()


def state_file(directory: str | os.PathLike[str], rank: int, index: int = 0) -> str:
    """The file in a ``save_state`` folder holding rank ``rank``'s state of the ``index``-th registered hook."""
    return os.path.join(os.fspath(directory), f"gradpress_comm_state_{index}_rank{rank}.pt")


def _ddp_of(model: Any) -> DistributedDataParallel | None:
    """The DDP module in ``model`` (itself, or under ``torch.compile``'s wrapper), else ``None``."""
    for candidate in (model, getattr(model, "_orig_mod", None)):
        if isinstance(candidate, DistributedDataParallel):
            return candidate
    return None


def register_comm_hook(accelerator: Accelerator, model: torch.nn.Module, state: Any,
                       hook: Callable[..., Any]) -> None:
    """Register ``hook`` with ``state`` on the DDP model that ``accelerator.prepare`` returned, and keep
    each process's ``state`` in ``accelerator.save_state`` / ``load_state``.

    Call it on every process, after ``prepare`` and before the first backward pass. ``state`` and
    ``hook`` are what ``DistributedDataParallel.register_comm_hook`` takes (e.g. a
    :class:`gradpress.PowerSGDState` and :func:`gradpress.powerSGD_hook`, or ``None`` and
    :func:`gradpress.fp16_compress_hook`).

    Checkpoints: if ``state`` has ``state_dict()``/``load_state_dict()``, ``save_state(dir)`` writes
    ``dir/gradpress_comm_state_<i>_rank<R>.pt`` on every rank R (``i`` counts the states registered with
    this accelerator) and ``load_state(dir)`` loads each rank's own file (``FileNotFoundError`` if it is
    missing, ``ValueError`` if it was written by a different number of processes). Each rank must see its
    own file: a shared filesystem, or the same rank on the same machine (as for Accelerate's own
    ``random_states_<R>.pkl``). Do not also pass ``state`` to ``register_for_checkpointing``: that would
    load rank 0's state on every rank.

    Gradient accumulation: inside ``accelerator.accumulate(model)`` the accumulation steps run under
    ``no_sync``, so the hook runs, and PowerSGD's ``iter`` / ``start_powerSGD_iter`` count, on
    synchronizing steps only (one per optimizer step).

    With a single process Accelerate does not wrap the model in DDP: there is nothing to communicate,
    the call warns and does nothing.

    Raises:
        TypeError: ``accelerator`` is not an ``accelerate.Accelerator``, ``hook`` is not callable, or
            ``model`` is not DDP-wrapped while several processes run (pass the model ``prepare``
            returned, not the original).

    Example::

        model, optimizer = accelerator.prepare(model, optimizer)
        register_comm_hook(accelerator, model, gradpress.PowerSGDState(None, start_powerSGD_iter=10),
                           gradpress.powerSGD_hook)
    """
    if not isinstance(accelerator, Accelerator):
        raise TypeError(f"accelerator must be an accelerate.Accelerator, got {type(accelerator).__name__}")
    _common.check_hook(hook)
    ddp = _ddp_of(model)
    if ddp is None:
        if accelerator.num_processes == 1:
            import warnings

            warnings.warn("register_comm_hook: a single process, the model is not DDP-wrapped and nothing is "
                          "communicated; the hook is not registered", UserWarning, stacklevel=2)
            return
        raise TypeError(f"model must be the DistributedDataParallel model returned by accelerator.prepare, got "
                        f"{type(model).__name__}: pass the prepared model, not the original one")
    ddp.register_comm_hook(state, hook)
    if not _common.is_stateful(state):
        return
    index = _REGISTERED.get(accelerator, 0)
    _REGISTERED[accelerator] = index + 1

    def save(models: Any, weights: Any, output_dir: str) -> None:
        rank, world = _common.rank_and_world()
        entry = {"version": _common.FORMAT_VERSION, "world_size": world, "rank": rank,
                 **_common.rank_entry(state, None)}
        torch.save(entry, state_file(output_dir, rank, index))

    def load(models: Any, input_dir: str) -> None:
        rank, world = _common.rank_and_world()
        path = state_file(input_dir, rank, index)
        if not os.path.exists(path):
            raise FileNotFoundError(f"{path} is missing: load_state({input_dir!r}) needs the gradpress hook state "
                                    f"of rank {rank}, written by save_state on that rank")
        entry = torch.load(path, map_location="cpu", weights_only=True)
        _common.check_saved_world(entry, world, path)
        _common.restore_rank_entry(entry, state, None, path)

    accelerator.register_save_state_pre_hook(save)
    accelerator.register_load_state_pre_hook(load)

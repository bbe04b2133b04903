"""The body of ``GradpressDDPStrategy``, shared by ``lightning.pytorch`` and ``pytorch_lightning``.

It imports neither package: :mod:`gradpress.integrations.lightning` and
:mod:`gradpress.integrations.pytorch_lightning` mix it into their ``DDPStrategy``. What it changes in
Lightning's ``DDPStrategy`` (2.6):

1. ``_register_ddp_hooks``: registers ``ddp_comm_hook`` (wrapped by ``ddp_comm_wrapper``) whatever the
   device; Lightning registers it on CUDA only and silently drops it on CPU.
2. ``setup``: builds the model averager (``model_averager=``, or a ``PeriodicModelAverager`` for a
   ``PostLocalSGDState`` with ``model_averaging_period``, gradpress's state or PyTorch's), then restores
   the hook/averager state that ``load_checkpoint`` read.
3. ``optimizer_step``: runs the averager on the stepped optimizer's parameters after every step, and
   logs a ``PowerSGDState``'s approximation errors and global residuals (``powersgd/approximation_error/*``,
   ``powersgd/global_residual/*`` with ``captured_energy``) through the trainer's loggers after each step
   that measured them (``approximation_error_every_n_iters``, ``global_residual_every_n_iters``; names from
   the LightningModule).
4. ``save_checkpoint`` / ``load_checkpoint`` / ``remove_checkpoint``: keep each rank's hook and averager
   state with the checkpoint (``comm_state_storage``); with local SGD (a model averager or a
   ``PostLocalSGDState``), also each rank's parameters and optimizer state, which differ between averages
   (Lightning's checkpoint holds rank 0's only).
"""

from __future__ import annotations

import os
from typing import Any, Callable

from ..comm import gather_objects
from ..diagnostics import approximation_error_metrics
from . import _common

#: Key of gradpress's entry in a Lightning checkpoint.
CHECKPOINT_KEY = "gradpress"
STORAGES = ("checkpoint", "per_rank_files")


def rank_file(checkpoint_path: Any, rank: int) -> str:
    """Where ``comm_state_storage="per_rank_files"`` keeps rank ``rank``'s state for ``checkpoint_path``."""
    return f"{os.fspath(checkpoint_path)}.gradpress-rank{rank}"


def _is_post_local_state(state: Any) -> bool:
    from ..hooks.post_local import PostLocalSGDState

    if isinstance(state, PostLocalSGDState):
        return True
    try:
        from torch.distributed.algorithms.ddp_comm_hooks.post_localSGD_hook import PostLocalSGDState as Torch
    except ImportError:  # pragma: no cover - torch without distributed algorithms
        return False
    return isinstance(state, Torch)


def _is_factory(averager: Any) -> bool:
    from ..averaging import ModelAverager

    return averager is not None and not isinstance(averager, ModelAverager)


class GradpressStrategyMixin:
    """Mixed into Lightning's ``DDPStrategy``; see :class:`gradpress.integrations.lightning.GradpressDDPStrategy`."""

    # Set by Lightning's DDPStrategy.__init__ / ParallelStrategy:
    _ddp_comm_state: Any
    _ddp_comm_hook: Callable[..., Any] | None
    _ddp_comm_wrapper: Callable[..., Any] | None
    _model_averaging_period: int | None
    _model_averager: Any
    model: Any
    lightning_module: Any
    optimizers: list[Any]
    checkpoint_io: Any

    def __init__(self, *args: Any, model_averager: Any = None, comm_state_storage: str = "checkpoint",
                 **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[call-arg]
        _common.check_hook(self._ddp_comm_hook, "ddp_comm_hook", allow_none=True)
        if self._ddp_comm_wrapper is not None:
            if not callable(self._ddp_comm_wrapper):
                raise TypeError("ddp_comm_wrapper must be a callable that wraps a hook, such as "
                                f"gradpress.fp16_compress_wrapper, got {type(self._ddp_comm_wrapper).__name__}")
            if self._ddp_comm_hook is None:
                raise ValueError("ddp_comm_wrapper was given without ddp_comm_hook: a wrapper needs a hook to wrap")
        if self._ddp_comm_state is not None and self._ddp_comm_hook is None:
            raise ValueError(f"ddp_comm_state ({type(self._ddp_comm_state).__name__}) was given without "
                             "ddp_comm_hook: pass the hook that uses it")
        _common.check_averager(model_averager)
        period = self._model_averaging_period
        if period is not None:
            if isinstance(period, bool) or not isinstance(period, int) or period < 1:
                raise ValueError(f"model_averaging_period must be an integer >= 1, got {period!r}")
            if not _is_post_local_state(self._ddp_comm_state):
                raise ValueError("model_averaging_period applies to post-local SGD only: pass a PostLocalSGDState "
                                 "as ddp_comm_state (with post_localSGD_hook), or a model_averager= instead "
                                 f"(got ddp_comm_state={type(self._ddp_comm_state).__name__})")
            if model_averager is not None:
                raise ValueError("give model_averaging_period or model_averager, not both (model_averaging_period "
                                 "builds a PeriodicModelAverager)")
        if comm_state_storage not in STORAGES:
            raise ValueError(f"comm_state_storage must be one of {STORAGES}, got {comm_state_storage!r}")
        self._gradpress_averager_spec = model_averager
        self._gradpress_storage = comm_state_storage
        self._gradpress_pending: dict[str, Any] | None = None
        self._gradpress_module_state: dict[str, Any] | None = None
        self._gradpress_logged_iter: int | None = None  # the last measurement sent to the loggers
        #: The averager that runs after each optimizer step (a factory's product once ``setup`` ran).
        self.model_averager: Any = None if _is_factory(model_averager) else model_averager

    # --- hook registration ---------------------------------------------------------------------------
    def _register_ddp_hooks(self) -> None:
        from torch.nn.parallel import DistributedDataParallel

        if self._ddp_comm_hook is None:
            return
        if not isinstance(self.model, DistributedDataParallel):  # pragma: no cover - Lightning wraps it first
            raise TypeError(f"expected the model wrapped in DistributedDataParallel, got {type(self.model).__name__}")
        hook = self._ddp_comm_hook
        if self._ddp_comm_wrapper is not None:
            hook = self._ddp_comm_wrapper(hook)
        from ..hooks.powersgd import PowerSGDState

        if isinstance(self._ddp_comm_state, PowerSGDState):  # the names its approximation errors are logged by
            self._ddp_comm_state.name_parameters(self.model)
        self.model.register_comm_hook(state=self._ddp_comm_state, hook=hook)

    # --- model averaging -----------------------------------------------------------------------------
    def _enable_model_averaging(self) -> None:
        """Lightning calls this for PyTorch's ``PostLocalSGDState`` only; :meth:`setup` handles every case."""

    def setup(self, trainer: Any) -> None:
        super().setup(trainer)  # type: ignore[misc]
        if trainer.state.fn != "fit":
            self._gradpress_pending = self._gradpress_module_state = None
            return
        self._model_averager = None  # Lightning's own (PyTorch's averager) never runs next to ours
        self.model_averager = self._build_averager()
        pending, self._gradpress_pending = self._gradpress_pending, None
        if pending is not None:
            _common.restore_rank_entry(pending, self._ddp_comm_state, self.model_averager, "the Lightning checkpoint")
        module_state, self._gradpress_module_state = self._gradpress_module_state, None
        if module_state is not None:  # after DDP's construction, which broadcast rank 0's parameters
            self.lightning_module.load_state_dict(module_state)

    def _ranks_may_differ(self) -> bool:
        """Local SGD: between two averages each rank holds its own parameters and optimizer state."""
        return self.model_averager is not None or _is_post_local_state(self._ddp_comm_state)

    def _build_averager(self) -> Any:
        from ..averaging import PeriodicModelAverager

        spec = self._gradpress_averager_spec
        if spec is None and self._model_averaging_period is not None:
            averager = PeriodicModelAverager(self._model_averaging_period,
                                             warmup_steps=self._ddp_comm_state.start_localSGD_iter)
        elif spec is None and _is_post_local_state(self._ddp_comm_state):
            raise ValueError("Post-local SGD is used (a PostLocalSGDState as ddp_comm_state) but neither "
                             "model_averaging_period nor model_averager was given: ranks would never average")
        else:
            averager = _common.build_averager(spec)
        if averager is None:
            return None
        if len(self.optimizers) != 1:
            raise ValueError(f"model averaging needs exactly one optimizer, the LightningModule configured "
                             f"{len(self.optimizers)}")
        from torch.distributed.optim import PostLocalSGDOptimizer as TorchPostLocalSGDOptimizer
        from torch.distributed.optim import ZeroRedundancyOptimizer

        from ..averaging import PostLocalSGDOptimizer

        optimizer = getattr(self.optimizers[0], "_optimizer", self.optimizers[0])
        if isinstance(optimizer, (ZeroRedundancyOptimizer, PostLocalSGDOptimizer, TorchPostLocalSGDOptimizer)):
            raise ValueError(f"model averaging cannot run with an optimizer of type {type(optimizer).__name__} "
                             "(it shards or averages by itself)")
        averager.anchor_parameters(optimizer.param_groups)  # DiLoCo's anchor: where local training starts
        return averager

    def optimizer_step(self, optimizer: Any, closure: Callable[[], Any], model: Any = None, **kwargs: Any) -> Any:
        output = super().optimizer_step(optimizer, closure, model, **kwargs)  # type: ignore[misc]
        if self.model_averager is not None:
            self.model_averager.average_parameters(optimizer.param_groups)
        self._log_approximation_error()
        return output

    def _log_approximation_error(self) -> None:
        """Send a new measurement of the hook state's approximation errors and global residuals to the
        trainer's loggers (:func:`~gradpress.diagnostics.approximation_error_metrics`; each logger writes
        on rank 0 only, as Lightning's do; the per-worker errors are rank 0's, the global residuals every
        rank's)."""
        from ..hooks.powersgd import PowerSGDState

        state = self._ddp_comm_state
        if not isinstance(state, PowerSGDState) or state.last_measured_iter in (None, self._gradpress_logged_iter):
            return
        self._gradpress_logged_iter = state.last_measured_iter
        trainer = self.lightning_module.trainer
        metrics = approximation_error_metrics(state)
        for logger in trainer.loggers:
            logger.log_metrics(metrics, step=trainer.global_step)

    # --- checkpoints ---------------------------------------------------------------------------------
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any = None) -> None:
        if "optimizer_states" in checkpoint:  # not a weights-only checkpoint
            self._add_rank_state(checkpoint, filepath, storage_options)
        super().save_checkpoint(checkpoint, filepath, storage_options=storage_options)  # type: ignore[misc]

    def _add_rank_state(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any) -> None:
        entry = _common.rank_entry(self._ddp_comm_state, self.model_averager)
        if not entry:
            return
        rank, world = _common.rank_and_world()
        if rank != 0 and self._ranks_may_differ():  # rank 0's are the checkpoint's own
            entry["state_dict"] = _common.to_cpu(checkpoint["state_dict"])
            entry["optimizer_states"] = _common.to_cpu(checkpoint["optimizer_states"])
        header = {"version": _common.FORMAT_VERSION, "world_size": world, "storage": self._gradpress_storage}
        if self._gradpress_storage == "per_rank_files":
            self.checkpoint_io.save_checkpoint(entry, rank_file(filepath, rank), storage_options=storage_options)
        else:
            gathered: list[Any] | None = [None] * world if rank == 0 else None
            if world > 1:
                gathered = gather_objects(entry, dst=0)  # a collective: every rank saves (Lightning's rule)
            else:
                gathered = [entry]
            header["ranks"] = gathered
        if rank == 0:
            checkpoint[CHECKPOINT_KEY] = header

    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        checkpoint = super().load_checkpoint(checkpoint_path, weights_only=weights_only)  # type: ignore[misc]
        saved = checkpoint.pop(CHECKPOINT_KEY, None)
        self._gradpress_pending = self._gradpress_module_state = None
        if saved is None:
            if _common.is_stateful(self._ddp_comm_state) or self._gradpress_averager_spec is not None \
                    or self._model_averaging_period is not None:
                self._gradpress_pending = {}  # warns in setup: nothing to restore
            return checkpoint
        rank, world = _common.rank_and_world()
        _common.check_saved_world(saved, world, f"checkpoint {checkpoint_path}")
        if saved["storage"] == "per_rank_files":
            path = rank_file(checkpoint_path, rank)
            if not os.path.exists(path) and os.path.islink(os.fspath(checkpoint_path)):  # a "last" link
                path = rank_file(os.path.realpath(checkpoint_path), rank)
            try:
                self._gradpress_pending = self.checkpoint_io.load_checkpoint(path, weights_only=weights_only)
            except FileNotFoundError as exc:
                raise FileNotFoundError(f"checkpoint {checkpoint_path} keeps rank {rank}'s gradpress hook state in "
                                        f"{path}, which is missing ({exc})") from exc
        else:
            self._gradpress_pending = dict(saved["ranks"][rank])
        # Local SGD: this rank's own parameters (loaded in setup, after DDP's broadcast) and optimizer state
        # (loaded by Lightning from the checkpoint dict, after setup).
        self._gradpress_module_state = self._gradpress_pending.pop("state_dict", None)
        if "optimizer_states" in self._gradpress_pending:
            checkpoint["optimizer_states"] = self._gradpress_pending.pop("optimizer_states")
        return checkpoint

    def remove_checkpoint(self, filepath: Any) -> None:
        super().remove_checkpoint(filepath)  # type: ignore[misc]
        if self._gradpress_storage == "per_rank_files":
            rank, _ = _common.rank_and_world()
            self.checkpoint_io.remove_checkpoint(rank_file(filepath, rank))

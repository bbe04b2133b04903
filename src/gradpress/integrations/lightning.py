"""gradpress in Lightning (``lightning.pytorch``): :class:`GradpressDDPStrategy`.

Lightning's ``DDPStrategy`` takes ``ddp_comm_state`` / ``ddp_comm_hook`` / ``ddp_comm_wrapper`` /
``model_averaging_period``, but (Lightning 2.6) registers the hook only when the device is CUDA (on
CPU/gloo it is dropped without a word), averages models only for PyTorch's own ``PostLocalSGDState``, and
keeps neither the hook state nor the averager in checkpoints, so a resumed PowerSGD run loses its error
memory and warm start. ``GradpressDDPStrategy`` takes the same arguments and fixes the three::

    import lightning.pytorch as pl
    import gradpress
    from gradpress.integrations.lightning import GradpressDDPStrategy

    state = gradpress.PowerSGDState(process_group=None, matrix_approximation_rank=2, start_powerSGD_iter=100)
    strategy = GradpressDDPStrategy(ddp_comm_state=state, ddp_comm_hook=gradpress.powerSGD_hook)
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy=strategy, max_epochs=3)
    trainer.fit(model, train_loader)                         # later: trainer.fit(..., ckpt_path=path)

For ``pytorch_lightning`` (the older package name) use :mod:`gradpress.integrations.pytorch_lightning`.
"""

from __future__ import annotations

from typing import Any

from lightning.pytorch.strategies import DDPStrategy as LightningDDPStrategy

from ._lightning_strategy import CHECKPOINT_KEY, GradpressStrategyMixin, rank_file

__all__ = ["CHECKPOINT_KEY", "DDPStrategy", "GradpressDDPStrategy", "rank_file"]


class GradpressDDPStrategy(GradpressStrategyMixin, LightningDDPStrategy):
    """Lightning's ``DDPStrategy`` with gradpress's hooks on every device, model averaging and resumable state.

    Takes every argument of ``lightning.pytorch.strategies.DDPStrategy`` (``ddp_comm_state``,
    ``ddp_comm_hook``, ``ddp_comm_wrapper``, ``model_averaging_period``, ``find_unused_parameters``, ...,
    with the same meaning) plus:

    Args:
        model_averager: a gradpress averager run after every optimizer step on that optimizer's
            parameters: ``PeriodicModelAverager``, ``HierarchicalModelAverager``,
            ``OuterOptimizerAverager`` (DiLoCo), or a function with no arguments returning one (called
            in ``setup``, once the process group exists: ``HierarchicalModelAverager`` creates subgroups
            when it is built). Its step counter counts optimizer steps, so with
            ``accumulate_grad_batches=k`` a period is in optimizer steps, not batches. Needs exactly one
            optimizer. For post-local SGD, ``model_averaging_period=H`` with a ``PostLocalSGDState``
            (gradpress's or PyTorch's) is short for ``PeriodicModelAverager(H, warmup_steps=
            state.start_localSGD_iter)``.
        comm_state_storage: where each rank's hook state (e.g. PowerSGD error memory, warm-start
            factors, iteration) and averager state go when Lightning saves a checkpoint. With local SGD
            (a ``model_averager`` or a ``PostLocalSGDState``) the ranks' parameters and optimizer states
            (momentum) also differ between averages, while Lightning's checkpoint holds rank 0's: every
            other rank's go there too, and each rank resumes from its own.

            * ``"checkpoint"`` (default): gathered to rank 0 into the checkpoint file, under
              ``checkpoint["gradpress"]["ranks"][rank]``. One self-contained file that any
              ``CheckpointIO`` (local or remote) can store and ``ckpt_path=`` alone restores. Costs:
              rank 0 holds (and the file stores) every rank's state, about
              ``world_size x (compressed parameters) x 4 bytes`` of PowerSGD error memory (with local
              SGD, ``world_size`` copies of the model and optimizer state), and every rank reads the
              whole file when resuming; saving is a collective (``gather_object``), so
              every rank must save together, as Lightning already requires.
            * ``"per_rank_files"``: each rank writes its own ``<checkpoint>.gradpress-rank<R>`` next to
              the checkpoint (through the strategy's ``CheckpointIO``) and reads only its own; the
              checkpoint records the world size. Scales to large models and many ranks with no
              collective, but the files must be kept (copied, deleted) together with the checkpoint, and
              each rank must see its own file when resuming (a shared filesystem, or the same rank on the
              same machine). ``ModelCheckpoint`` deletions remove them too.

    Resuming needs the same number of processes (a clear ``ValueError`` otherwise). The hook is
    registered on CPU (gloo) as on CUDA (NCCL). Bad arguments fail at construction: a hook or wrapper
    that is not callable (``TypeError``), a state without a hook, ``model_averaging_period`` without a
    ``PostLocalSGDState`` or together with ``model_averager`` (``ValueError``).

    Example::

        from gradpress import OuterOptimizerAverager, PostLocalSGDState, post_localSGD_hook

        # DiLoCo: local steps with no gradient communication, an outer Nesterov step every 50
        strategy = GradpressDDPStrategy(
            ddp_comm_state=PostLocalSGDState(None, None, start_localSGD_iter=1,
                                             post_local_gradient_allreduce=False),
            ddp_comm_hook=post_localSGD_hook,
            model_averager=OuterOptimizerAverager(period=50, warmup_steps=1))
        trainer = pl.Trainer(accelerator="cpu", devices=2, strategy=strategy, max_steps=1000)
    """

    def __init__(self, *args: Any, model_averager: Any = None, comm_state_storage: str = "checkpoint",
                 **kwargs: Any) -> None:
        super().__init__(*args, model_averager=model_averager, comm_state_storage=comm_state_storage, **kwargs)


#: The name users of Lightning reach for: ``from gradpress.integrations.lightning import DDPStrategy`` gives
#: gradpress's strategy (Lightning's own drops communication hooks on CPU ranks), never Lightning's.
DDPStrategy = GradpressDDPStrategy

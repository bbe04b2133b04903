"""PowerSGD (or local SGD / DiLoCo) in a Lightning ``Trainer`` on 2 CPU processes: ``GradpressDDPStrategy``.

Lightning starts the second process itself (no torchrun needed)::

    python examples/lightning_powersgd.py                        # PowerSGD rank 2, 3 epochs
    python examples/lightning_powersgd.py --method diloco        # local steps + an outer Nesterov step every 8
    python examples/lightning_powersgd.py --epochs 2 --save ckpt/a.ckpt
    python examples/lightning_powersgd.py --epochs 4 --resume ckpt/a.ckpt   # same digest as --epochs 4 alone

Rank 0 prints the loss of the first and last epoch of the run, PowerSGD's compression counters, whether
the two processes ended with identical parameters, and a digest of the parameters. (Lightning's own
``DDPStrategy`` with the same ``ddp_comm_hook`` would silently not register it on CPU.)
"""

from __future__ import annotations

import argparse
import hashlib

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import gradpress
from gradpress.integrations.lightning import GradpressDDPStrategy


class Regression(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 8))
        self.epoch_losses: list[float] = []

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x), y)
        self.log("loss", loss, on_epoch=True, on_step=False, sync_dist=True)
        return loss

    def on_train_epoch_end(self) -> None:
        self.epoch_losses.append(float(self.trainer.callback_metrics["loss"]))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)


def make_strategy(method: str) -> tuple[GradpressDDPStrategy, object]:
    if method in ("powersgd", "fp16-powersgd"):
        state = gradpress.PowerSGDState(process_group=None, matrix_approximation_rank=2, start_powerSGD_iter=10)
        wrapper = gradpress.fp16_compress_wrapper if method == "fp16-powersgd" else None
        return GradpressDDPStrategy(ddp_comm_state=state, ddp_comm_hook=gradpress.powerSGD_hook,
                                    ddp_comm_wrapper=wrapper), state
    # Synchronous for 15 steps, then no gradient communication: the ranks average every 8th step from step 15
    # (counting from 0), so the last step of every 32-step epoch averages.
    state = gradpress.PostLocalSGDState(None, None, start_localSGD_iter=15, post_local_gradient_allreduce=False)
    if method == "localsgd":
        return GradpressDDPStrategy(ddp_comm_state=state, ddp_comm_hook=gradpress.post_localSGD_hook,
                                    model_averaging_period=8), state
    # outer settings for a short period: advise_outer(8) (momentum 0; the paper's 0.7 / 0.9 are for H ~ 500)
    averager = gradpress.OuterOptimizerAverager(period=8, warmup_steps=15, outer_lr=0.5, outer_momentum=0.0)
    return GradpressDDPStrategy(ddp_comm_state=state, ddp_comm_hook=gradpress.post_localSGD_hook,
                                model_averager=averager), state


def main() -> None:
    parser = argparse.ArgumentParser(description="gradpress in a Lightning Trainer on 2 CPU processes.")
    parser.add_argument("--method", choices=["powersgd", "fp16-powersgd", "localsgd", "diloco"], default="powersgd")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--save", help="save a checkpoint here at the end")
    parser.add_argument("--resume", help="resume from this checkpoint (trainer.fit(ckpt_path=...))")
    args = parser.parse_args()

    generator = torch.Generator().manual_seed(0)
    x = torch.randn(1024, 32, generator=generator)
    y = x @ torch.randn(32, 8, generator=generator) / 32 ** 0.5
    loader = DataLoader(TensorDataset(x, y), batch_size=16)  # 32 steps per epoch and rank
    torch.manual_seed(0)
    model = Regression()

    strategy, state = make_strategy(args.method)
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy=strategy, max_epochs=args.epochs, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(model, loader, ckpt_path=args.resume)
    if args.save:
        trainer.save_checkpoint(args.save)  # every rank calls it: each rank's hook state goes in

    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    copies = [torch.empty_like(flat) for _ in range(dist.get_world_size())]
    dist.all_gather(copies, flat)
    if trainer.is_global_zero:
        print(f"{args.method}: loss {model.epoch_losses[0]:.4f} (first epoch of this run) -> "
              f"{model.epoch_losses[-1]:.4f} (epoch {trainer.current_epoch}), {trainer.global_step} steps")
        if isinstance(state, gradpress.PowerSGDState):
            rate, before, after = state.compression_stats()
            print(f"PowerSGD: {state.iter} iterations, {before:,} floats compressed to {after:,} ({rate:.1f}x)")
        else:
            print(f"averaged {strategy.model_averager.num_averages} times")
        print("ranks identical:", all(torch.equal(copies[0], c) for c in copies[1:]))
        print("parameters digest:", hashlib.sha256(flat.numpy().tobytes()).hexdigest()[:16])
    # Tear the group down while Python is still fully running: a gloo thread that still holds the last
    # collective's tensors when the interpreter shuts down can abort the process ("terminate called ...").
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

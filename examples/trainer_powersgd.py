"""PowerSGD in a Hugging Face ``transformers`` ``Trainer`` on 2 CPU processes (a callback, resumable).

    torchrun --standalone --nproc-per-node 2 examples/trainer_powersgd.py --output-dir out --steps 40
    torchrun --standalone --nproc-per-node 2 examples/trainer_powersgd.py --output-dir out --steps 80 --resume

The Trainer saves a checkpoint every 20 steps in ``--output-dir``; each rank's PowerSGD state goes into the
same ``checkpoint-<step>`` folder. ``--resume`` continues from the latest one
(``trainer.train(resume_from_checkpoint=True)``). Rank 0 prints the training loss, PowerSGD's counters and
whether the processes ended with identical parameters.
"""

from __future__ import annotations

import argparse
import hashlib

import torch
import torch.distributed as dist
from torch import nn
from transformers import Trainer, TrainingArguments

import gradpress
from gradpress.integrations.transformers import register_comm_hook


class Regression(nn.Module):
    """Any ``nn.Module`` whose forward returns a dict with ``loss`` works with the Trainer."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 8))

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        out = self.net(x)
        return {"loss": nn.functional.mse_loss(out, labels), "logits": out}


def main() -> None:
    parser = argparse.ArgumentParser(description="PowerSGD in a transformers Trainer.")
    parser.add_argument("--output-dir", default="trainer-powersgd")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--resume", action="store_true", help="resume from the latest checkpoint in --output-dir")
    args = parser.parse_args()

    generator = torch.Generator().manual_seed(0)
    x = torch.randn(1024, 32, generator=generator)
    y = x @ torch.randn(32, 8, generator=generator) / 32 ** 0.5
    dataset = [{"x": x[i], "labels": y[i]} for i in range(len(x))]
    torch.manual_seed(0)
    model = Regression()

    training_args = TrainingArguments(
        output_dir=args.output_dir, max_steps=args.steps, per_device_train_batch_size=16, learning_rate=0.05,
        optim="sgd", lr_scheduler_type="constant", weight_decay=0.0, use_cpu=True, save_steps=20,
        report_to="none", logging_steps=10, disable_tqdm=True, remove_unused_columns=False)
    trainer = Trainer(model=model, args=training_args, train_dataset=dataset)
    state = gradpress.PowerSGDState(process_group=None, matrix_approximation_rank=2, start_powerSGD_iter=10)
    register_comm_hook(trainer, state, gradpress.powerSGD_hook)
    result = trainer.train(resume_from_checkpoint=True if args.resume else None)

    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    copies = [torch.empty_like(flat) for _ in range(dist.get_world_size())]
    dist.all_gather(copies, flat)
    if trainer.is_world_process_zero():
        rate, before, after = state.compression_stats()
        print(f"training loss {result.training_loss:.4f} after {trainer.state.global_step} steps")
        print(f"PowerSGD: {state.iter} iterations, {before:,} floats compressed to {after:,} ({rate:.1f}x)")
        print("ranks identical:", all(torch.equal(copies[0], c) for c in copies[1:]))
        print("parameters digest:", hashlib.sha256(flat.numpy().tobytes()).hexdigest()[:16])
    # Tear the group down while Python is still fully running: a gloo thread that still holds the last
    # collective's tensors when the interpreter shuts down can abort the process ("terminate called ...").
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

"""PowerSGD with Hugging Face Accelerate on 2 CPU processes, with gradient accumulation and resumable state.

Either launcher works (MULTI_CPU, gloo)::

    torchrun --standalone --nproc-per-node 2 examples/accelerate_powersgd.py --epochs 2 --save ckpt
    accelerate launch --multi_gpu --num_processes 2 examples/accelerate_powersgd.py --epochs 2 --resume ckpt
    torchrun --standalone --nproc-per-node 2 examples/accelerate_powersgd.py --epochs 4   # the same digest

(``accelerate launch --cpu --num_processes 2`` starts a single process in Accelerate 1.15: its CPU path
is MPI only; ``--multi_gpu`` starts the processes with torchrun, and ``Accelerator(cpu=True)`` keeps
them on the CPU, also on a machine without a GPU.)

``--resume`` loads the model, optimizer and each rank's PowerSGD state (error memory, warm start, iteration)
with ``accelerator.load_state`` and trains ``--epochs`` more epochs. Rank 0 prints the loss, PowerSGD's
counters (iterations count synchronizing steps only: one per ``--accumulation`` micro-batches) and
whether the processes ended with identical parameters.
"""

from __future__ import annotations

import argparse
import hashlib

import torch
import torch.distributed as dist
from accelerate import Accelerator
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import gradpress
from gradpress.integrations.accelerate import register_comm_hook


def main() -> None:
    parser = argparse.ArgumentParser(description="PowerSGD with Accelerate on CPU processes.")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--accumulation", type=int, default=2, help="gradient accumulation steps")
    parser.add_argument("--save", help="accelerator.save_state(SAVE) at the end")
    parser.add_argument("--resume", help="accelerator.load_state(RESUME) before training")
    args = parser.parse_args()

    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=args.accumulation)
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(1024, 32, generator=generator)
    y = x @ torch.randn(32, 8, generator=generator) / 32 ** 0.5
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 8))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    loader = DataLoader(TensorDataset(x, y), batch_size=16)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)

    state = gradpress.PowerSGDState(process_group=None, matrix_approximation_rank=2, start_powerSGD_iter=10)
    register_comm_hook(accelerator, model, state, gradpress.powerSGD_hook)
    if args.resume:
        accelerator.load_state(args.resume)  # each rank loads its own PowerSGD state

    for epoch in range(args.epochs):
        total = 0.0
        for inputs, targets in loader:
            with accelerator.accumulate(model):  # no_sync on accumulation steps: the hook runs on sync steps
                loss = nn.functional.mse_loss(model(inputs), targets)
                accelerator.backward(loss)
                optimizer.step()
                optimizer.zero_grad()
            total += loss.item()
        accelerator.print(f"epoch {epoch + 1}: loss {total / len(loader):.4f}")
    if args.save:
        accelerator.save_state(args.save)  # + gradpress_comm_state_0_rank<R>.pt on every rank

    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    copies = [torch.empty_like(flat) for _ in range(accelerator.num_processes)]
    dist.all_gather(copies, flat) if accelerator.num_processes > 1 else copies[0].copy_(flat)
    rate, before, after = state.compression_stats()
    accelerator.print(f"PowerSGD: {state.iter} synchronizing steps, {before:,} floats compressed to {after:,} "
                      f"({rate:.1f}x)")
    accelerator.print("ranks identical:", all(torch.equal(copies[0], c) for c in copies[1:]))
    accelerator.print("parameters digest:", hashlib.sha256(flat.numpy().tobytes()).hexdigest()[:16])
    # Tear the process group down here, every rank past its last collective first: left to the
    # interpreter's exit, a gloo worker thread that still holds the last collective's tensors (whose
    # Python objects die with this function) releases them after finalization has begun, cannot take
    # the GIL, and the process aborts with "terminate called without an active exception".
    accelerator.wait_for_everyone()
    accelerator.end_training()  # destroy_process_group()


if __name__ == "__main__":
    main()

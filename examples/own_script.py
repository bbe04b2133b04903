"""gradpress in a hand-written training script, shaped like nanoGPT's ``train.py``.

A small GPT (tied embeddings) on Python's documentation text, AdamW, gradient accumulation through
``require_backward_grad_sync``, a validation loss every ``--eval-interval`` iterations, and a checkpoint
written **by rank 0 only, when the validation loss improves**. PowerSGD's state is per rank (each rank's
error memory), so every rank hands its state to rank 0 with ``gradpress.gather_state`` at the same
iteration, and a resume hands each rank its own entry back with ``gradpress.scatter_state``. Run::

    torchrun --standalone --nproc-per-node 2 examples/own_script.py --max-iters 40 --out-dir out
    torchrun --standalone --nproc-per-node 2 examples/own_script.py --max-iters 80 --out-dir out --init-from resume

The lines that concern gradpress are marked ``# gradpress``.
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import json
import math
import os
import time
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

import gradpress  # gradpress


class Block(nn.Module):
    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln_1, self.ln_2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.qkv, self.proj = nn.Linear(width, 3 * width), nn.Linear(width, width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(self.ln_1(x)).split(c, dim=2)
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, c)
        x = x + self.proj(y)
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, vocab: int, block_size: int, layers: int = 2, width: int = 64, heads: int = 4) -> None:
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, width), nn.Embedding(block_size, width)
        self.blocks = nn.ModuleList(Block(width, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(width)
        self.lm_head = nn.Linear(width, vocab, bias=False)
        self.lm_head.weight = self.wte.weight  # tied: one parameter, counted once by DDP and gradpress
        self.apply(self._init_weights)  # nanoGPT's (GPT-2's) initialisation: a near-uniform start

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        return F.cross_entropy(logits.view(-1, logits.shape[-1]), targets.view(-1))


def text_codes() -> tuple[torch.Tensor, torch.Tensor, int]:
    from pydoc_data.topics import topics

    text = "\n\n".join(topics[key] for key in sorted(topics))
    chars = sorted(set(text))
    codes = torch.tensor([chars.index(c) for c in text[:200_000]], dtype=torch.long)
    split = int(0.9 * len(codes))
    return codes[:split], codes[split:], len(chars)


def get_batch(data: torch.Tensor, batch: int, block: int,
              generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    starts = torch.randint(len(data) - block - 1, (batch,), generator=generator)
    x = torch.stack([data[i:i + block] for i in starts])
    return x, torch.stack([data[i + 1:i + block + 1] for i in starts])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--max-iters", type=int, default=40)
    parser.add_argument("--eval-interval", type=int, default=10)
    parser.add_argument("--grad-accum", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--block-size", type=int, default=32)
    parser.add_argument("--rank", type=int, default=4,
                        help="PowerSGD's matrix_approximation_rank (the recommended configuration, docs/tuning.md: "
                             "width / 8, at most 22, so 8 for this 64-wide model)")
    parser.add_argument("--bytes-per-weight", type=int, choices=(2, 4), default=None,
                        help="precision on the wire: 2 sends P and Q in fp16 (the recommended configuration), "
                             "4 or unset in fp32")
    parser.add_argument("--start-iter", type=int, default=10, help="plain allreduce before this iteration")
    parser.add_argument("--out-dir", default="out")
    parser.add_argument("--init-from", choices=("scratch", "resume"), default="scratch")
    parser.add_argument("--compile", nargs="?", const="model", choices=("model", "ddp"), default=None,
                        help="torch.compile the model and then wrap it in DDP (model, nanoGPT's order; the "
                             "default of a bare --compile), or compile the DDP model (ddp)")
    parser.add_argument("--json", default=None, help="rank 0 writes the run's figures here")
    args = parser.parse_args()

    # nanoGPT: nccl on GPUs. A collective timeout of minutes, not torch's default of 30 (10 with NCCL): a
    # rank left waiting in a collective its peers never join then fails in minutes.
    dist.init_process_group("gloo", timeout=timedelta(minutes=10))
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)
    train_data, val_data, vocab = text_codes()
    torch.manual_seed(1337)
    model = GPT(vocab, args.block_size)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, betas=(0.9, 0.95), weight_decay=0.1)
    iter_num, best_val_loss, checkpoint = 0, math.inf, None
    path = os.path.join(args.out_dir, "ckpt.pt")
    if args.init_from == "resume":
        checkpoint = torch.load(path, map_location="cpu", weights_only=True)  # on every rank, as nanoGPT does
        model.load_state_dict(checkpoint["model"])
        optimizer.load_state_dict(checkpoint["optimizer"])
        iter_num, best_val_loss = checkpoint["iter_num"], checkpoint["best_val_loss"]
    raw_model = model  # what the checkpoint holds: no "_orig_mod." prefix from torch.compile in its keys
    if args.compile == "model":
        model = torch.compile(model)  # compile, then wrap in DDP (nanoGPT): the hook sees DDP's buckets as usual
    model = DDP(model)
    if args.compile == "ddp":
        model = torch.compile(model)  # or compile the DDP model: DDP's attributes stay reachable through it
    state = gradpress.PowerSGDState(None, matrix_approximation_rank=args.rank,  # gradpress
                                    start_powerSGD_iter=args.start_iter,       # gradpress
                                    bytes_per_weight=args.bytes_per_weight)    # gradpress
    model.register_comm_hook(state, gradpress.powerSGD_hook)                   # gradpress
    if args.init_from == "resume":  # before or after register_comm_hook, before the first backward
        gradpress.scatter_state(state, checkpoint["powersgd"] if rank == 0 else None)  # gradpress: collective

    saved_at, val_losses, started = [], [], time.perf_counter()
    while iter_num < args.max_iters:
        if iter_num % args.eval_interval == 0 and iter_num > 0:
            model.eval()
            val_gen = torch.Generator().manual_seed(7 + rank)
            with torch.no_grad():
                val_loss = sum(float(model(*get_batch(val_data, args.batch_size, args.block_size, val_gen)))
                               for _ in range(4)) / 4
            model.train()
            val_losses.append(val_loss)
            # nanoGPT's rank 0 saves when *its* validation loss improves; gather_state is a collective,
            # so every rank must take the same decision: rank 0's, broadcast.
            improved = torch.tensor([1 if val_loss < best_val_loss else 0])                  # gradpress
            dist.broadcast(improved, 0)                                                      # gradpress
            best_val_loss = min(best_val_loss, val_loss) if rank == 0 else best_val_loss
            if improved.item():
                hooks = gradpress.gather_state(state)  # gradpress: every rank, same iteration
                if rank == 0:
                    os.makedirs(args.out_dir, exist_ok=True)
                    gradpress.checkpoint.save({"model": raw_model.state_dict(), "optimizer": optimizer.state_dict(),
                                               "iter_num": iter_num, "best_val_loss": best_val_loss,
                                               "powersgd": hooks}, path)  # gradpress: an atomic save
                    saved_at.append(iter_num)
                    print(f"iter {iter_num}: val loss {val_loss:.4f}, saved {path} (hook state "
                          f"{gradpress.state_nbytes(hooks) / 2**10:.0f} KiB for {world} ranks)", flush=True)
        # Batches depend on the iteration only (not on how many were drawn before): a resumed run draws the
        # same ones as an uninterrupted run, which a generator seeded once at start-up would not.
        data_gen = torch.Generator().manual_seed(1000 * iter_num + rank)
        for micro_step in range(args.grad_accum):
            # The hook runs only on the last micro-step, where DDP synchronizes: state.iter counts
            # optimizer steps, like iter_num.
            model.require_backward_grad_sync = micro_step == args.grad_accum - 1
            x, y = get_batch(train_data, args.batch_size, args.block_size, data_gen)
            (model(x, y) / args.grad_accum).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        iter_num += 1
    if rank == 0 and args.json:
        with open(args.json, "w") as f:
            json.dump({"iter_num": iter_num, "hook_iter": state.iter, "saved_at": saved_at, "val_losses": val_losses,
                       "compression": state.compression_stats()[0], "seconds": time.perf_counter() - started,
                       "digest": hashlib.sha256(b"".join(p.detach().numpy().tobytes()
                                                         for p in raw_model.parameters())).hexdigest()}, f)
    # The model goes before the process group: gloo's group, when its last reference goes, waits for its
    # threads while holding the GIL (pytorch/pytorch#56297), and a DDP/FSDP model holds that group and its
    # hooks' futures: freed by the model's destructor after this call, a gloo thread that needs the GIL to
    # finish deadlocks the exit.
    del model, raw_model, optimizer
    gc.collect()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

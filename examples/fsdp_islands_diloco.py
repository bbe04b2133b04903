"""FSDP2 inside each island, streaming DiLoCo with int4 outer gradients between islands, checkpointed
with ``torch.distributed.checkpoint`` (DCP) and resumed.

    torchrun --standalone --nproc-per-node 4 examples/fsdp_islands_diloco.py --steps 48 --checkpoint-dir ckpt
    torchrun --standalone --nproc-per-node 4 examples/fsdp_islands_diloco.py --steps 96 --checkpoint-dir ckpt
    torchrun --standalone --nproc-per-node 4 examples/fsdp_islands_diloco.py --verify-resume

Two islands of two ranks: each ``fully_shard`` unit is sharded over ``mesh["shard"]`` (the fast links of
one island), and :class:`gradpress.StreamingDiLoCoAverager` averages each rank's shard with the same shard
of the other island over ``mesh["island"]`` (the slow link), one fragment (a ``fully_shard`` unit) at a
time, its int4 outer gradient in flight for ``--delay`` inner steps. Every ``--checkpoint-every`` steps,
and at the end, ``dcp.save`` writes the model (DTensors, one copy per shard), the optimizer (the inner
optimizer's state and the averager's per-rank values, one entry per rank: islands differ between syncs)
and the step; a start that finds ``--checkpoint-dir`` resumes from it. ``--verify-resume`` trains
``--steps`` steps straight, then again with a save, fresh objects and a load at half-way, and prints
whether both runs end with the same parameters, bit for bit. NCCL with one GPU per process when CUDA is
available, gloo on CPU otherwise.
"""

from __future__ import annotations

import argparse
import json
import os

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import gradpress


def make_model(device: str) -> nn.Sequential:
    torch.manual_seed(0)  # the same initial weights on every rank
    blocks = [nn.Sequential(nn.Linear(32, 96), nn.GELU(), nn.Linear(96, 32)) for _ in range(2)]
    return nn.Sequential(*blocks, nn.Linear(32, 1)).to(device)


def batch(step: int, rank: int, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s batch at ``step``: a function of both only, so a resumed run sees the same data."""
    g = torch.Generator().manual_seed(10_000 * step + rank)
    x = torch.randn(32, 32, generator=g)
    return x.to(device), torch.sin(x[:, :4].sum(1, keepdim=True)).to(device)


class Run:
    """The model, its FSDP2 units and the optimizer with the averager: what a checkpoint restores."""

    def __init__(self, mesh, device: str, args: argparse.Namespace) -> None:
        self.model = make_model(device)
        for block in self.model[:2]:
            fully_shard(block, mesh=mesh["shard"])
        fully_shard(self.model, mesh=mesh["shard"])
        averager = gradpress.StreamingDiLoCoAverager(
            sync_every=args.sync_every, process_group=mesh["island"].get_group(),
            fragments=[self.model[0], self.model[1], [*self.model[2].parameters()]],
            fragment_sync_delay=args.delay, compression=gradpress.QuantizeInt4())
        self.optimizer = gradpress.PostLocalSGDOptimizer(torch.optim.AdamW(self.model.parameters(), lr=3e-3),
                                                         averager)
        self.step = 0

    def state(self) -> dict:
        # Model first: the optimizer's load writes each rank's own parameters saved between syncs.
        return {"model": self.model.state_dict(), "optim": self.optimizer, "progress": {"step": self.step}}

    def save(self, path: str) -> None:
        state = self.state()
        dcp.save(state, checkpoint_id=path)

    def load(self, path: str) -> None:
        state = self.state()
        dcp.load(state, checkpoint_id=path)
        self.step = int(state["progress"]["step"])

    def train(self, until: int, rank: int, device: str, log_every: int = 0) -> float:
        loss = torch.zeros(())
        while self.step < until:
            x, y = batch(self.step, rank, device)
            loss = nn.functional.mse_loss(self.model(x), y)
            self.optimizer.zero_grad()
            loss.backward()
            self.optimizer.step()
            self.step += 1
            if log_every and self.step % log_every == 0 and rank == 0:
                print(f"step {self.step} loss {loss.item():.4f}", flush=True)
        return float(loss.item())


def local_shards(run: Run) -> list[torch.Tensor]:
    return [p.to_local().detach().clone() for p in run.model.parameters()]


def main() -> int:
    parser = argparse.ArgumentParser(description="FSDP2 islands + streaming DiLoCo (int4) + DCP, under torchrun.")
    parser.add_argument("--shards", type=int, default=2, help="ranks per island (the FSDP shard group)")
    parser.add_argument("--steps", type=int, default=48)
    parser.add_argument("--sync-every", type=int, default=12, help="inner steps between two syncs of a fragment")
    parser.add_argument("--delay", type=int, default=2, help="inner steps an outer gradient is in flight")
    parser.add_argument("--checkpoint-dir", default=None, help="DCP checkpoint directory (resumed from if present)")
    parser.add_argument("--checkpoint-every", type=int, default=0, help="save every N steps (0: at the end only)")
    parser.add_argument("--verify-resume", action="store_true",
                        help="train straight, then with a save and load half-way, and compare the parameters")
    parser.add_argument("--json", default=None, help="rank 0 writes a summary here")
    args = parser.parse_args()
    if "RANK" not in os.environ:
        parser.error("run me under torchrun, e.g. torchrun --standalone --nproc-per-node 4 "
                     "examples/fsdp_islands_diloco.py")
    if torch.cuda.is_available():
        device = "cuda"
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        dist.init_process_group("nccl")
    else:
        device = "cpu"
        dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if world % args.shards or world // args.shards < 2:
        parser.error(f"--shards {args.shards} must divide the number of processes ({world}) into 2 or more islands")
    mesh = init_device_mesh(device, (world // args.shards, args.shards), mesh_dim_names=("island", "shard"))

    summary: dict = {"islands": world // args.shards, "shards": args.shards}
    if args.verify_resume:
        straight = Run(mesh, device, args)
        straight.train(args.steps, rank, device)
        path = args.checkpoint_dir or os.path.join(os.environ.get("TMPDIR", "/tmp"),
                                                   f"gradpress-verify-{os.environ.get('TORCHELASTIC_RUN_ID', 'run')}")
        first = Run(mesh, device, args)
        first.train(args.steps // 2, rank, device)
        first.save(path)
        resumed = Run(mesh, device, args)  # fresh objects, as in a new process
        resumed.load(path)
        resumed.train(args.steps, rank, device)
        same = all(torch.equal(a, b) for a, b in zip(local_shards(straight), local_shards(resumed)))
        flags = [None] * world
        dist.all_gather_object(flags, same)
        summary["resume_bitwise"] = all(flags)
        if rank == 0:
            print(f"resumed at step {args.steps // 2} of {args.steps}: parameters equal to never stopping, "
                  f"bit for bit, on every rank: {all(flags)}", flush=True)
    else:
        run = Run(mesh, device, args)
        if args.checkpoint_dir and os.path.exists(os.path.join(args.checkpoint_dir, ".metadata")):
            run.load(args.checkpoint_dir)
            if rank == 0:
                print(f"resumed from {args.checkpoint_dir} at step {run.step}", flush=True)
        while run.step < args.steps:
            until = args.steps if not args.checkpoint_every else min(args.steps, run.step + args.checkpoint_every)
            summary["loss"] = run.train(until, rank, device, log_every=args.sync_every)
            if args.checkpoint_dir:
                run.save(args.checkpoint_dir)
        averager = run.optimizer.averager
        shard_bytes = sum(p.to_local().numel() for p in run.model.parameters())
        summary.update(step=run.step, bytes_sent_rank0=averager.bytes_sent, fragment_syncs=averager.num_averages,
                       shard_values_rank0=shard_bytes)
        if rank == 0:
            print(f"{summary['islands']} islands x {args.shards} shards: {averager.num_averages} fragment syncs, "
                  f"rank 0 sent {averager.bytes_sent:,} bytes (its shard: {shard_bytes:,} values, int4 outer "
                  f"gradients)", flush=True)
    if rank == 0 and args.json:
        with open(args.json, "w") as f:
            json.dump(summary, f)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""FSDP2 inside each replica, PowerSGD across replicas (hybrid sharding with compressed all-reduce).

    torchrun --standalone --nproc-per-node 4 examples/fsdp_powersgd.py            # 2 replicas x 2 shards
    torchrun --standalone --nproc-per-node 4 examples/fsdp_powersgd.py --shards 4 # 1 replica (no hook needed)

Each ``fully_shard`` unit is sharded over ``mesh["shard"]`` (fast links, e.g. the GPUs of one node) and
its reduce-scattered gradient is averaged over ``mesh["replicate"]`` (slow links, e.g. across nodes) by
``gradpress.powerSGD_hook``. NCCL with one GPU per process when CUDA is available, gloo on CPU otherwise.
Rank 0 prints the loss and what PowerSGD sent; ``--checkpoint DIR`` saves each rank's hook state.
"""

from __future__ import annotations

import argparse
import gc
import os

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import gradpress


def make_model() -> nn.Sequential:
    torch.manual_seed(0)  # the same initial weights on every rank
    blocks = [nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 64), nn.ReLU()) for _ in range(2)]
    return nn.Sequential(*blocks, nn.Linear(64, 10))


def main() -> int:
    parser = argparse.ArgumentParser(description="FSDP2 + PowerSGD across replicas, under torchrun.")
    parser.add_argument("--shards", type=int, default=2, help="ranks per replica (the FSDP shard group)")
    parser.add_argument("--rank", type=int, default=4, help="PowerSGD matrix_approximation_rank")
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--start-iter", type=int, default=10, help="plain all-reduce steps first")
    parser.add_argument("--checkpoint", default=None, help="directory for each rank's PowerSGD state")
    args = parser.parse_args()
    if "RANK" not in os.environ:
        parser.error("run me under torchrun, e.g. torchrun --standalone --nproc-per-node 4 examples/fsdp_powersgd.py")

    if torch.cuda.is_available():
        device_type = "cuda"
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        dist.init_process_group("nccl")
    else:
        device_type = "cpu"
        dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if world % args.shards:
        parser.error(f"--shards {args.shards} must divide the number of processes ({world})")
    mesh = init_device_mesh(device_type, (world // args.shards, args.shards), mesh_dim_names=("replicate", "shard"))

    model = make_model().to(device_type)
    for block in model[:2]:
        fully_shard(block, mesh=mesh["shard"])
    fully_shard(model, mesh=mesh["shard"])
    # The lines that make it hybrid: PowerSGD averages each unit's shards over the replicas.
    state = gradpress.PowerSGDState(mesh["replicate"].get_group(), matrix_approximation_rank=args.rank,
                                    start_powerSGD_iter=args.start_iter)
    gradpress.register_fsdp_comm_hook(model, state, gradpress.powerSGD_hook)

    optimizer = torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.9)
    generator = torch.Generator().manual_seed(rank)  # each rank its own data
    teacher = torch.randn(64, 10, generator=torch.Generator().manual_seed(0)) / 8
    for step in range(args.steps):
        x = torch.randn(32, 64, generator=generator).to(device_type)
        loss = nn.functional.mse_loss(model(x), x @ teacher.to(device_type))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if rank == 0 and (step % 20 == 0 or step == args.steps - 1):
            print(f"step {step:3d}  loss {loss.item():.4f}", flush=True)

    rate, before, after = state.bytes_stats()
    if rank == 0:
        print(f"PowerSGD across {world // args.shards} replicas: {state.iter} iterations, sent {after} bytes "
              f"instead of {before} (x{rate:.1f} less) since step {args.start_iter}")
    if args.checkpoint is not None:
        os.makedirs(args.checkpoint, exist_ok=True)
        # Per rank: each rank's error memory belongs to its own shards.
        torch.save({"model": model.state_dict(), "powersgd": state.state_dict()},
                   os.path.join(args.checkpoint, f"rank{rank}.pt"))
    # The model goes before the process group: gloo's group, when its last reference goes, waits for its
    # threads while holding the GIL (pytorch/pytorch#56297), and a DDP/FSDP model holds that group and its
    # hooks' futures: freed by the model's destructor after this call, a gloo thread that needs the GIL to
    # finish deadlocks the exit.
    del model
    gc.collect()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""PowerSGD across nodes, exact allreduce inside them: ``gradpress.hierarchical_wrapper`` under torchrun.

On one machine, 4 processes simulate 2 nodes x 2 ranks (gloo on CPU)::

    torchrun --standalone --nproc-per-node 4 examples/hierarchical_powersgd.py

On real nodes, the same script with torchrun's ``--nnodes``/``--rdzv-endpoint``: the nodes are then
torchrun's (``LOCAL_WORLD_SIZE`` ranks each). Each bucket is reduced exactly inside the node; each local
rank then runs ``powerSGD_hook`` on its share of the bucket with the ranks of the same local index on the
other nodes, so the inter-node link carries 1/L of the flat scheme's bytes per rank. Rank 0 prints the
loss and the inter-node bytes per step, measured by each rank's ``PowerSGDState``, next to the flat
scheme's (``gradpress inspect --workers-per-node`` gives the same arithmetic for any model).
"""

from __future__ import annotations

import argparse
import gc
import os
import sys

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.nn.parallel import DistributedDataParallel as DDP

import gradpress


def main() -> int:
    parser = argparse.ArgumentParser(description="Hierarchical PowerSGD under torchrun.")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--rank", type=int, default=2, help="PowerSGD matrix approximation rank")
    parser.add_argument("--workers-per-node", type=int, default=None,
                        help="ranks per node (default: torchrun's LOCAL_WORLD_SIZE on several nodes, else 2)")
    args = parser.parse_args()
    if "RANK" not in os.environ:
        parser.error("run me under torchrun, e.g. torchrun --standalone --nproc-per-node 4 "
                     "examples/hierarchical_powersgd.py")
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    per_node = args.workers_per_node
    if per_node is None:
        several_nodes = int(os.environ.get("GROUP_WORLD_SIZE", "1")) > 1
        per_node = int(os.environ["LOCAL_WORLD_SIZE"]) if several_nodes else 2
    if per_node < 1 or world % per_node or world == per_node:
        parser.error(f"--workers-per-node {per_node} must divide the {world} ranks into at least 2 nodes")

    # Rows are nodes of consecutive ranks: mesh["local"] is this rank's node, mesh["node"] the ranks with
    # its local index on every node (the group PowerSGD communicates in).
    mesh = init_device_mesh("cpu", (world // per_node, per_node), mesh_dim_names=("node", "local"))
    torch.manual_seed(0)
    model = DDP(nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 8)))
    state = gradpress.PowerSGDState(mesh["node"].get_group(), matrix_approximation_rank=args.rank,
                                    start_powerSGD_iter=5)
    model.register_comm_hook(state, gradpress.hierarchical_wrapper(gradpress.powerSGD_hook,
                                                                   mesh["local"].get_group()))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)

    teacher = torch.randn(32, 8, generator=torch.Generator().manual_seed(1)) / 32 ** 0.5  # targets of variance 1
    data = torch.Generator().manual_seed(100 + rank)  # each rank its own samples
    for step in range(args.steps):
        x = torch.randn(64, 32, generator=data)
        loss = nn.functional.mse_loss(model(x), x @ teacher)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        mean_loss = loss.detach().clone()
        dist.all_reduce(mean_loss)
        if rank == 0 and (step % 10 == 0 or step == args.steps - 1):
            print(f"step {step:3d}  loss {mean_loss.item() / world:.4f}", flush=True)

    compressed_steps = state.iter - state.start_powerSGD_iter
    device = next(model.parameters()).device  # NCCL collectives need tensors on the GPU
    mine = torch.tensor([state.bytes_stats()[2] / max(1, compressed_steps)], device=device)
    sent = [torch.zeros(1, device=device) for _ in range(world)]
    dist.all_gather(sent, mine)
    if rank == 0:
        shapes = [p.shape for p in model.parameters()]
        flat = gradpress.make_plan(shapes, args.rank, state.min_compression_rate).numel_sent * 4
        per_rank = ", ".join(f"{int(b.item()):,}" for b in sent[:per_node])
        node = int(sum(b.item() for b in sent[:per_node]))
        print(f"inter-node bytes per step ({world // per_node} nodes x {per_node}, PowerSGD rank {args.rank}):")
        print(f"  flat:         {flat:,} per rank, {flat * per_node:,} per node")
        print(f"  hierarchical: {per_rank} (local ranks 0..{per_node - 1}), {node:,} per node "
              f"({node / (flat * per_node):.2f}x of flat)")
    # The model goes before the process group: gloo's group, when its last reference goes, waits for its
    # threads while holding the GIL (pytorch/pytorch#56297), and a DDP/FSDP model holds that group and its
    # hooks' futures: freed by the model's destructor after this call, a gloo thread that needs the GIL to
    # finish deadlocks the exit.
    del model
    gc.collect()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())

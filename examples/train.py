"""Train one of ``gradpress demo``'s tasks with any gradpress method, under ``torchrun``.

The same code path as the demo (:func:`gradpress.workloads.train`), launched the way real jobs are::

    torchrun --standalone --nproc-per-node 4 examples/train.py --method powersgd:2 --steps 300
    torchrun --standalone --nproc-per-node 2 examples/train.py --task charlm --method multi:2,allreduce

On several machines, use torchrun's usual ``--nnodes``/``--rdzv-endpoint`` options. NCCL with one GPU
per process when CUDA is available, gloo on CPU otherwise. Rank 0 prints one line per method and, with
``--json PATH``, writes the full results (curves included).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import torch.distributed as dist

from gradpress.workloads import METHOD_KINDS, DemoConfig, default_start_iter, parse_methods, task_names, train


def main() -> int:
    parser = argparse.ArgumentParser(description="Train a gradpress demo task under torchrun.")
    parser.add_argument("--task", default="digits", choices=task_names())
    parser.add_argument("--method", default="powersgd:2",
                        help=f"comma-separated methods ({', '.join(METHOD_KINDS)}; powersgd:R, multi:R)")
    parser.add_argument("--rank", type=int, default=2, help="PowerSGD rank for methods given without :R")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--start-iter", type=int, default=None,
                        help="plain-allreduce steps first (default: a tenth of --steps, at least 2)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default=None, help="rank 0 writes the results here")
    args = parser.parse_args()
    try:
        methods = parse_methods(args.method, [args.rank])
    except ValueError as exc:
        parser.error(str(exc))
    if "RANK" not in os.environ:
        parser.error("run me under torchrun, e.g. torchrun --standalone --nproc-per-node 2 examples/train.py")

    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    if torch.cuda.is_available():
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        dist.init_process_group("nccl")
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    start_iter = default_start_iter(args.steps) if args.start_iter is None else args.start_iter
    config = DemoConfig(task=args.task, steps=args.steps, start_iter=start_iter, seed=args.seed)
    results = []
    for method in methods:
        result = train(rank, world, method, config, device=device)
        results.append(result)
        if rank == 0:
            ratio = "n/a" if result["compression_ratio"] is None else f"{result['compression_ratio']:.1f}x"
            print(f"{method.label}: test {result['metric_name']} {result['metric']:.4f}, test loss "
                  f"{result['test_loss']:.4f}, {result['bytes_per_step']:,.0f} bytes/step ({ratio}), "
                  f"{result['bytes_total'] / 1e6:.3g} MB in all, {result['wall_time_s']:.1f} s", flush=True)
    if rank == 0 and args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())

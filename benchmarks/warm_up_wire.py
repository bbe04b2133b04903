"""The half-precision warm-up's cost: a DDP backward on the recipe's fp16 warm-up wire beside the same
backward on the full-precision wire, before PowerSGD starts.

One rank (a one-process gloo group) by default, where the full-precision warm-up sends nothing and the
half-precision one still finds each gradient's scale, casts and copies back: the ratio is then the wire's
whole compute cost. ``--world-size 2`` runs two gloo processes (OMP_NUM_THREADS=1 each), where both wires
send. The model has the gradient shapes of ``--model`` (GPT-2 small's 148 by default) and computes
``sum(p * p) / 2``, so the backward is the hook plus one cheap pass; the two wires alternate iteration by
iteration in one process and the medians of ``--iterations`` backwards are compared::

    python3 benchmarks/warm_up_wire.py [--model gpt2] [--iterations 7] [--world-size 1] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.nn.parallel import DistributedDataParallel as DDP

import gradpress
from gradpress.tools.bench.buckets import model_parameters
from gradpress.tools.bench.kernels import _Shapes  # noqa: PLC2701 (the kernel counter's model)
from gradpress.tools.processes import free_port


def _worker(rank: int, world_size: int, port: int, model: str, iterations: int, out: Any) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    shapes = [tuple(p.shape) for p in model_parameters(model)]
    models = {}
    for wire, extra in (("fp32", {}), ("fp16", {"bytes_per_weight": 2, "warm_up_bytes_per_weight": 2})):
        ddp = DDP(_Shapes(shapes, torch.Generator().manual_seed(0)))
        state = gradpress.PowerSGDState(None, matrix_approximation_rank=32, start_powerSGD_iter=10**6,
                                        min_compression_rate=2, **extra)
        ddp.register_comm_hook(state, gradpress.powerSGD_hook)
        models[wire] = ddp
    times: dict[str, list[float]] = {wire: [] for wire in models}
    for iteration in range(iterations + 2):  # two first: DDP rebuilds its buckets after the first
        for wire, ddp in models.items():
            loss = ddp()
            dist.barrier()
            start = time.perf_counter()
            loss.backward()
            elapsed = time.perf_counter() - start
            ddp.zero_grad(set_to_none=False)
            if iteration >= 2:
                times[wire].append(elapsed)
    if rank == 0:
        medians = {wire: statistics.median(t) for wire, t in times.items()}
        out.put({"model": model, "world_size": world_size, "iterations": iterations,
                 "median_backward_s": medians, "ratio": medians["fp16"] / medians["fp32"],
                 "torch": torch.__version__, "command": "python3 " + " ".join(sys.argv)})
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="gpt2")
    parser.add_argument("--iterations", type=int, default=7)
    parser.add_argument("--world-size", type=int, default=1)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    context = mp.get_context("spawn")
    queue = context.SimpleQueue()
    mp.start_processes(_worker, args=(args.world_size, free_port(), args.model, args.iterations, queue),
                       nprocs=args.world_size, start_method="spawn")
    result = queue.get()
    medians = result["median_backward_s"]
    print(f"{args.model}, world size {args.world_size}: backward on the full-precision warm-up wire "
          f"{medians['fp32']:.3f} s, half-precision {medians['fp16']:.3f} s: {result['ratio']:.2f}x")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()

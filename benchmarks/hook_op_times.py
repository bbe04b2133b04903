"""Where a PowerSGD hook's CPU time goes: the time of each ATen op it dispatches, summed by op, for
gradpress's hook and PyTorch's (batched or not) on a model's gradients in DDP's default buckets.

One process, one gloo rank, one intra-op thread (as ``gradpress bench --threads 1``); gradients refilled
from fixed random values before each step, the hook's warm-up and a few compressed steps run untimed
first, then ``--steps`` compressed steps under a ``TorchDispatchMode`` that times each op. The mode adds
its own Python cost per op (a few microseconds), so the per-op sums, not the wall time, are the figures:
they say which ops the time goes to, and what no hook computing the same products can go below (the
products themselves).

    python3 benchmarks/hook_op_times.py --model resnet50 --rank 4
    python3 benchmarks/hook_op_times.py --model resnet18 --rank 1 --hooks ours,torch_batched
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import sys
import time
from typing import Any

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

from gradpress.tools.bench.buckets import make_buckets, model_parameters
from gradpress.tools.bench.harness import START_POWERSGD_ITER, make_group, make_variants, run_step
from gradpress.tools.processes import free_port

#: The ops that compute the three products (P = M Q, Q = M^T P, the outer product P Q^T and its fused forms).
PRODUCTS = ("bmm", "mm", "matmul", "addmm", "baddbmm", "addmm_", "baddbmm_", "addcmul_", "addcmul", "mv", "addmv_")


class OpTimer(TorchDispatchMode):
    """Sums the wall time and counts the calls of each ATen op dispatched inside it."""

    def __init__(self) -> None:
        super().__init__()
        self.seconds: collections.Counter[str] = collections.Counter()
        self.calls: collections.Counter[str] = collections.Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        start = time.perf_counter()
        out = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        self.seconds[name] += time.perf_counter() - start
        self.calls[name] += 1
        return out


def profile(model: str, rank: int, hook_name: str, steps: int, warmup: int, group: Any) -> dict[str, Any]:
    buckets = make_buckets(model_parameters(model))
    generator = torch.Generator().manual_seed(0)
    sources = [torch.randn(b.buffer().numel(), generator=generator) for b in buckets]

    def refill() -> None:
        for bucket, source in zip(buckets, sources):
            bucket.buffer().copy_(source)

    state, hook = make_variants(rank, group)[hook_name]
    for _ in range(START_POWERSGD_ITER + warmup):
        refill()
        run_step(state, hook, buckets)
    timer = OpTimer()
    for _ in range(steps):
        refill()
        with timer:
            run_step(state, hook, buckets)
    per_step = {op: 1e3 * s / steps for op, s in timer.seconds.items()}
    return {"model": model, "rank": rank, "hook": hook_name, "steps": steps,
            "op_ms_per_step": round(sum(per_step.values()), 2),
            "products_ms_per_step": round(sum(v for op, v in per_step.items() if op in PRODUCTS), 2),
            "ops": {op: {"ms": round(v, 2), "calls": round(timer.calls[op] / steps, 1)}
                    for op, v in sorted(per_step.items(), key=lambda kv: -kv[1])}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="resnet50", help="a gradpress bench model (default: %(default)s)")
    parser.add_argument("--rank", type=int, default=4)
    parser.add_argument("--hooks", default="ours,torch_batched",
                        help="comma-separated: ours, torch_batched, torch (default: %(default)s)")
    parser.add_argument("--steps", type=int, default=5, help="compressed steps timed (default: %(default)s)")
    parser.add_argument("--warmup", type=int, default=3, help="compressed steps untimed first")
    parser.add_argument("--top", type=int, default=10, help="ops printed per hook")
    parser.add_argument("--json", default=None, help="write the results here")
    args = parser.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        group = make_group(len(make_buckets(model_parameters(args.model))) + 2)
        results = [profile(args.model, args.rank, h, args.steps, args.warmup, group) for h in args.hooks.split(",")]
    finally:
        dist.destroy_process_group()
    for r in results:
        print(f"{r['hook']}: {args.model} rank {args.rank}: {r['op_ms_per_step']} ms of ops per step, "
              f"products {r['products_ms_per_step']} ms")
        for op, v in list(r["ops"].items())[:args.top]:
            print(f"  {op:24s} {v['ms']:8.2f} ms  {v['calls']:7.1f} calls")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
    # PyTorch's hook leaves futures on the extra gloo group's threads, which abort the interpreter's
    # teardown ("Resource deadlock avoided") after the results are out: end the process here instead.
    sys.stdout.flush()
    os._exit(0)

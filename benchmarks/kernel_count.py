"""Kernel-launching ops per compressed step: gradpress's ``powerSGD_hook`` beside PyTorch's, and the
``PowerSGD`` aggregator's default scheme (one alternating iteration per step) and two iterations.

Counts the ATen ops each dispatches during one steady-state compressed step with a model's gradient
shapes (GPT-2 small by default), with a ``TorchDispatchMode`` (:mod:`gradpress.tools.bench.kernels`): the
hooks on a one-rank DDP model (DDP's own 25 MB buckets), the aggregator in one ``aggregate_`` call; on the
CPU code path (real tensors, a gloo group) and on the accelerator code path (``meta`` tensors, gradpress
only). On a GPU each counted op is about one kernel launch, 7-10 us of host time. Views, allocations and
metadata ops are not counted; each ``_foreach_*`` op counts once (one launch per ~100 tensors on CUDA).

    python benchmarks/kernel_count.py                       # GPT-2 small, rank 32: a markdown table
    python benchmarks/kernel_count.py --model resnet50 --rank 4 --json out.json
    python benchmarks/kernel_count.py --by-op               # each op's count too
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from gradpress.tools.bench.buckets import model_names
from gradpress.tools.bench.kernels import count_aggregator_kernels, count_hook_kernels


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="gpt2", choices=model_names())
    parser.add_argument("--rank", type=int, default=32)
    parser.add_argument("--json", help="also write the counts to this file")
    parser.add_argument("--by-op", action="store_true", help="print each op's count")
    args = parser.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    counts = [count_hook_kernels(args.model, path=path, rank=args.rank, fp16_wire=fp16)
              for path in ("meta", "cpu") for fp16 in (False, True)]
    counts += [count_aggregator_kernels(args.model, path=path, rank=args.rank, fp16_wire=fp16, num_iters_per_step=k)
               for k in (1, 2) for path in ("meta", "cpu") for fp16 in (False, True)]
    counts.append(count_hook_kernels(args.model, hook="torch", path="cpu", rank=args.rank))
    names = {"gradpress": "gradpress `powerSGD_hook`", "torch": "PyTorch `powerSGD_hook`",
             "aggregator": "gradpress `PowerSGD` aggregator"}
    print("| what | code path | wire | calls | kernel ops per compressed step | of them collectives |")
    print("|---|---|---|---|---|---|")
    for count in counts:
        print(f"| {names[count.hook]} | {count.path} | {count.wire} | {count.buckets} | {count.ops} | "
              f"{count.collectives} |")
        if args.by_op:
            print("|  |  |  |  | " + ", ".join(f"{op} {n}" for op, n in count.by_op.items()) + " |  |")
    if args.json:
        with open(args.json, "w") as handle:
            json.dump({"model": args.model, "rank": args.rank, "counts": [c.as_dict() for c in counts]}, handle,
                      indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())

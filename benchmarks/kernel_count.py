"""Kernel-launching ops per compressed step: gradpress's ``powerSGD_hook`` beside PyTorch's.

Counts the ATen ops each hook dispatches during one steady-state compressed iteration of a one-rank DDP
model with a model's gradient shapes (GPT-2 small by default; DDP's own 25 MB buckets), with a
``TorchDispatchMode`` (:mod:`gradpress.tools.bench.kernels`): on the CPU code path (a real gloo DDP model),
and on the accelerator code path (``meta`` tensors, DDP's initial layout, gradpress only). On a GPU each
counted op is about one kernel launch, 7-10 us of host time. Views, allocations and metadata ops are not
counted; each ``_foreach_*`` op counts once (one launch per ~100 tensors on CUDA).

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
from gradpress.tools.bench.kernels import count_hook_kernels


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="gpt2", choices=model_names())
    parser.add_argument("--rank", type=int, default=32)
    parser.add_argument("--json", help="also write the counts to this file")
    parser.add_argument("--by-op", action="store_true", help="print each op's count")
    args = parser.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    cases = [("gradpress", "cpu", False), ("gradpress", "cpu", True), ("gradpress", "meta", False),
             ("gradpress", "meta", True), ("torch", "cpu", False)]
    counts = [count_hook_kernels(args.model, hook=hook, path=path, rank=args.rank, fp16_wire=fp16)
              for hook, path, fp16 in cases]
    print("| hook | code path | wire | hook calls | kernel ops per compressed step | of them collectives |")
    print("|---|---|---|---|---|---|")
    for count in counts:
        name = "gradpress `powerSGD_hook`" if count.hook == "gradpress" else "PyTorch `powerSGD_hook`"
        print(f"| {name} | {count.path} | {count.wire} | {count.buckets} | {count.ops} | {count.collectives} |")
        if args.by_op:
            print("|  |  |  |  | " + ", ".join(f"{op} {n}" for op, n in count.by_op.items()) + " |  |")
    if args.json:
        with open(args.json, "w") as handle:
            json.dump({"model": args.model, "rank": args.rank, "counts": [c.as_dict() for c in counts]}, handle,
                      indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())

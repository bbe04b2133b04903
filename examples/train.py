"""Train one of ``gradpress demo``'s tasks with any gradpress method, under ``torchrun``.

The same code path as the demo (:func:`gradpress.tools.workloads.train`), launched the way real jobs are::

    torchrun --standalone --nproc-per-node 4 examples/train.py --method powersgd:2 --steps 300
    torchrun --standalone --nproc-per-node 2 examples/train.py --task charlm --method multi:2,allreduce

On several machines, use torchrun's usual ``--nnodes``/``--rdzv-endpoint`` options. NCCL with one GPU
per process when CUDA is available, gloo on CPU otherwise. Rank 0 prints one line per method and, with
``--json PATH``, writes the full results (curves included).

Fault tolerance: with ``--checkpoint-dir DIR`` every rank saves its whole training state atomically every
``--checkpoint-every`` steps, and a start that finds checkpoints in DIR resumes from the newest step all
ranks completed. Under ``torchrun --max-restarts K`` a lost worker restarts the group, which resumes and
ends with the same parameters as a run that never stopped::

    torchrun --standalone --nproc-per-node 2 --max-restarts 3 examples/train.py \\
        --method powersgd:2 --checkpoint-dir ckpt --checkpoint-every 50 --timeout 300

``--fail-at-step N --fail-kind sigkill`` kills rank ``--fail-rank`` at step N of every method that
starts from scratch (a resumed one goes on): a fire drill for the restart path, one restart per method.
``--timeout``: seconds a collective waits for a dead or stuck peer.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch.distributed as dist

from gradpress.launch import init_distributed
from gradpress.tools.workloads import METHOD_KINDS, DemoConfig, default_start_iter, parse_methods, task_names, train
from gradpress.tools.workloads.config import FAIL_KINDS


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
    parser.add_argument("--checkpoint-dir", default=None, help="save every rank's state here, and resume from it")
    parser.add_argument("--checkpoint-every", type=int, default=None, metavar="N",
                        help="steps between checkpoints (default: a tenth of --steps; needs --checkpoint-dir)")
    parser.add_argument("--timeout", type=float, default=None, metavar="SECONDS",
                        help="how long a collective waits for its peers (default: torch's, 30 min)")
    parser.add_argument("--fail-at-step", type=int, default=None, metavar="N",
                        help="fault drill: rank --fail-rank fails at step N of each method not resumed "
                             "from a checkpoint")
    parser.add_argument("--fail-rank", type=int, default=1)
    parser.add_argument("--fail-kind", default="sigkill", choices=FAIL_KINDS)
    args = parser.parse_args()
    try:
        methods = parse_methods(args.method, [args.rank])
    except ValueError as exc:
        parser.error(str(exc))
    if "RANK" not in os.environ:
        parser.error("run me under torchrun, e.g. torchrun --standalone --nproc-per-node 2 examples/train.py")
    if args.checkpoint_every is not None and (args.checkpoint_dir is None or args.checkpoint_every < 1):
        parser.error("--checkpoint-every needs --checkpoint-dir and an integer >= 1")
    if args.timeout is not None and not args.timeout > 0:
        parser.error(f"--timeout must be > 0 seconds, got {args.timeout}")
    every = args.checkpoint_every
    if args.checkpoint_dir is not None and every is None:
        every = max(1, args.steps // 10)

    device = init_distributed(timeout=args.timeout)
    rank, world = dist.get_rank(), dist.get_world_size()
    start_iter = default_start_iter(args.steps) if args.start_iter is None else args.start_iter
    config = DemoConfig(task=args.task, steps=args.steps, start_iter=start_iter, seed=args.seed,
                        fail_at_step=args.fail_at_step, fail_rank=args.fail_rank, fail_kind=args.fail_kind)
    results = []
    for method in methods:
        result = train(rank, world, method, config, device=device, checkpoint_dir=args.checkpoint_dir,
                       checkpoint_every=every)
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

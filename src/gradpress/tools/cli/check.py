"""``gradpress check``: on your own machines, check that gradpress computes the right thing and say which
method will train fastest.

Run it under torchrun with the layout you train with (gloo or NCCL, CPU or CUDA)::

    torchrun --nnodes 2 --nproc-per-node 8 ... -m gradpress check --model mypkg.models:build --json check.json

Without torchrun it runs as one process (the correctness checks run; the link has nothing to measure).
Rank 0 prints the report (see :func:`gradpress.tools.check.report.format_report`); the exit status is 0 when
every correctness check passed, 1 when one failed, 2 for bad arguments.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

from ..check.report import TOKENS_PER_STEP_HELP
from .args import int_list, int_at_least, positive_float

__all__ = ["register", "run"]


def register(subparsers: Any) -> argparse.ArgumentParser:
    """Add the ``check`` subcommand to ``subparsers`` (an ``add_subparsers()`` result)."""
    parser: argparse.ArgumentParser = subparsers.add_parser(
        "check", help="check correctness on this cluster, measure the link, and say which method trains fastest",
        description="Run under torchrun on your machines: checks that PowerSGD, the cast hooks and wrappers, "
                    "the non-finite skip and (across nodes) the hierarchical wrapper compute the right thing on "
                    "this backend and device; measures allreduce bus bandwidth and latency; times each method's "
                    "hook compute on your model's gradient shapes; and ranks the methods by predicted step time "
                    "(compute step + hook compute + the bytes on the measured link).")
    parser.add_argument("--model", default="charlm", metavar="NAME",
                        help="a demo task (charlm, gpt-wide, ...), a gradpress.tools.zoo model, or "
                             "module.path:function returning your nn.Module or (module, example_batch) "
                             "(default: charlm)")
    parser.add_argument("--step-ms", type=positive_float, default=None, metavar="MS",
                        help="your forward + backward time per step, when the model gives no example batch")
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                        help="auto: this rank's GPU (LOCAL_RANK) when CUDA is available, else the CPU")
    parser.add_argument("--backend", choices=("auto", "gloo", "nccl"), default="auto",
                        help="auto: nccl on CUDA, gloo on the CPU (used when the process group is created here)")
    parser.add_argument("--powersgd-ranks", type=int_list(1), default=[4], metavar="R[,R...]",
                        help="PowerSGD ranks to predict with an fp32 wire (the quality map's configuration for the "
                             "model, or without --optimizer the measured recipes' rank for its width, is always a "
                             "candidate; docs/tuning.md)")
    parser.add_argument("--local-sgd-period", type=int_at_least(1), default=8, metavar="H")
    parser.add_argument("--diloco-period", type=int_at_least(1), default=64, metavar="H")
    parser.add_argument("--max-steps", type=int_at_least(1), default=None, metavar="N",
                        help="your run's length in optimizer steps (Trainer's max_steps), for DiLoCo's outer "
                             "settings: outer momentum was measured to pay only in runs of tens of outer steps "
                             "(default: the most measured length, 200 steps, and the longer run's choice quoted)")
    parser.add_argument("--optimizer", choices=("sgd", "adamw"), default=None,
                        help="your optimizer, for the quality map's advice (docs/tuning.md): where PowerSGD was "
                             "measured behind allreduce at your global batch, it is not recommended")
    parser.add_argument("--tokens-per-step", type=int_at_least(1), default=None, metavar="N",
                        help=TOKENS_PER_STEP_HELP)
    parser.add_argument("--iters", type=int_at_least(1), default=5, metavar="N", help="timed allreduces per size")
    parser.add_argument("--world-size", type=int_at_least(1), default=None, metavar="W",
                        help="the world size of the link-bytes table (what one rank's link carries per step, "
                             "ring-equivalent; W = 8, 64 and 512 are printed too; default: the launched ranks)")
    parser.add_argument("--json", default=None, metavar="PATH", help="also write the report as JSON (rank 0)")
    parser.set_defaults(func=run)
    return parser


def _device(choice: str) -> Any:
    import torch

    if choice == "cuda" or (choice == "auto" and torch.cuda.is_available()):
        if not torch.cuda.is_available():
            raise ValueError("--device cuda: CUDA is not available on this machine; use --device cpu")
        index = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(index)
        return torch.device("cuda", index)
    return torch.device("cpu")


def _init(device: Any, backend: str) -> bool:
    """Join torchrun's process group, or make a one-process one; True if created here."""
    import torch.distributed as dist

    if dist.is_initialized():
        return False
    chosen = ("nccl" if device.type == "cuda" else "gloo") if backend == "auto" else backend
    if "WORLD_SIZE" in os.environ:
        dist.init_process_group(chosen)
    else:
        from ..processes import free_port

        # a group of this process alone
        dist.init_process_group(chosen, init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    return True


def run(args: argparse.Namespace) -> int:
    """``gradpress check``: 0 if every correctness check passed, 1 if one failed, 2 for bad arguments."""
    import torch.distributed as dist

    from ..check.report import collect, format_report

    try:
        device = _device(args.device)
    except ValueError as exc:
        print(f"gradpress check: error: {exc}", file=sys.stderr)
        return 2
    created = _init(device, args.backend)
    try:
        local = os.environ.get("LOCAL_WORLD_SIZE")
        try:
            report = collect(args.model, device, args.step_ms, local_world_size=int(local) if local else None,
                             iters=args.iters, powersgd_ranks=args.powersgd_ranks,
                             local_sgd_period=args.local_sgd_period, diloco_period=args.diloco_period,
                             optimizer=args.optimizer, tokens_per_step=args.tokens_per_step,
                             world_size=args.world_size, max_steps=args.max_steps)
        except ValueError as exc:
            print(f"gradpress check: error: {exc}", file=sys.stderr)
            return 2
        if dist.get_rank() == 0:
            print(format_report(report))
            if args.json:
                with open(args.json, "w", encoding="utf-8") as handle:
                    json.dump(report, handle, indent=2)
        return 0 if report["ok"] else 1
    finally:
        if created:
            dist.destroy_process_group()

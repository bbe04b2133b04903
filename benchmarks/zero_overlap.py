"""Per-step time of a ZeRO (sharded Adam) step overlapped with DDP's communication vs. not overlapped.

Every variant trains its own copy of the same model (an MLP of ``--layers`` Linear(``--width``, ``--width``),
from the same initial weights, on the same random batches) on ``--world`` local gloo processes:

* ``ddp+adam``: DDP, then ``torch.optim.Adam.step()`` on every parameter (no sharding);
* ``zero``: DDP, then ``ZeroRedundancyOptimizer(Adam).step()`` (sharded state; step and broadcasts after
  backward);
* ``zero-overlap``: ``gradpress.hook_with_zero_step(allreduce_hook, ..., shard_buckets=True)`` (step
  inside backward; ``--no-shard-buckets`` gives whole buckets to ranks round-robin);
* ``zero-overlap-interleaved``: ``gradpress.hook_with_zero_step_interleaved(allreduce_hook, ...)``;
* ``powersgd+zero`` / ``powersgd+zero-overlap``: the same two with ``gradpress.powerSGD_hook`` (rank
  ``--rank``, compressing from the 2nd step) as the communication.

A step is forward + backward + (optimizer step if not overlapped) + ``zero_grad``, timed on every rank
(the step time is the slowest rank's). After ``--warmup`` untimed steps, each of ``--rounds`` rounds
times ``--block`` steps of every variant, the order rotating from round to round, so that all variants
are measured side by side in time. Reports the median step time per variant and ratios to ``zero`` and to
``ddp+adam``, and the optimizer-state bytes per rank. PyTorch's own ``hook_with_zero_step`` is not in the
table: it refuses gloo.

    python benchmarks/zero_overlap.py --json benchmarks/results/zero-overlap-results.json

About 2 minutes on a 2-core VM with the defaults.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
import warnings
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn.parallel import DistributedDataParallel as DDP

from gradpress.tools.processes import free_port

VARIANTS = ("ddp+adam", "zero", "zero-overlap", "zero-overlap-interleaved", "powersgd+zero", "powersgd+zero-overlap")


def _model(width: int, layers: int) -> nn.Module:
    torch.manual_seed(0)
    blocks: list[nn.Module] = []
    for _ in range(layers):
        blocks += [nn.Linear(width, width), nn.ReLU()]
    return nn.Sequential(*blocks[:-1])


def _build(variant: str, args: argparse.Namespace) -> tuple[DDP, Any, Any]:
    """``(ddp, optimizer to step after backward or None, optimizer whose .state holds this rank's state)``."""
    import gradpress

    ddp = DDP(_model(args.width, args.layers))
    if variant == "ddp+adam":
        adam = torch.optim.Adam(ddp.parameters(), lr=1e-4)
        return ddp, adam, adam
    overlap = variant.endswith("overlap") or variant.endswith("interleaved")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        zero = ZeroRedundancyOptimizer(ddp.parameters(), torch.optim.Adam, overlap_with_ddp=overlap, lr=1e-4)
    if variant.startswith("powersgd"):
        state: Any = gradpress.PowerSGDState(None, matrix_approximation_rank=args.rank, start_powerSGD_iter=2)
        hook: Any = gradpress.powerSGD_hook
    else:
        state, hook = None, gradpress.allreduce_hook
    if overlap:
        wrap = (gradpress.hook_with_zero_step_interleaved if variant.endswith("interleaved")
                else gradpress.hook_with_zero_step)
        ddp.register_comm_hook(state, wrap(hook, ddp, zero, shard_buckets=args.shard_buckets))
        return ddp, None, zero
    if state is not None:
        ddp.register_comm_hook(state, hook)
    return ddp, zero, zero


def _state_bytes(holder: Any) -> int:
    """Bytes of the optimizer state tensors this rank holds (ZeRO: its local optimizer's)."""
    inner = getattr(holder, "optim", holder)
    state = getattr(inner, "state", {})
    return sum(t.numel() * t.element_size() for s in state.values() for t in s.values()
               if torch.is_tensor(t) and t.dim() > 0)


def _step(ddp: DDP, optimizer: Any, x: torch.Tensor, y: torch.Tensor) -> float:
    start = time.perf_counter()
    nn.functional.mse_loss(ddp(x), y).backward()
    if optimizer is not None:
        optimizer.step()
    ddp.zero_grad(set_to_none=False)
    return time.perf_counter() - start


def _worker(rank: int, args: argparse.Namespace, port: int, out: str) -> None:
    torch.set_num_threads(args.threads)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=args.world)
    built = {variant: _build(variant, args) for variant in args.variant_list}
    g = torch.Generator().manual_seed(rank)
    batches = [(torch.randn(args.batch, args.width, generator=g), torch.randn(args.batch, args.width, generator=g))
               for _ in range(4)]
    times: dict[str, list[float]] = {v: [] for v in args.variant_list}
    step = 0
    for variant in args.variant_list:
        ddp, optimizer, _ = built[variant]
        for i in range(args.warmup):
            _step(ddp, optimizer, *batches[i % len(batches)])
    for round_index in range(args.rounds):
        shift = round_index % len(args.variant_list)
        for variant in args.variant_list[shift:] + args.variant_list[:shift]:
            ddp, optimizer, _ = built[variant]
            for _ in range(args.block):
                elapsed = torch.tensor([_step(ddp, optimizer, *batches[step % len(batches)])])
                dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)  # the step takes as long as the slowest rank
                times[variant].append(elapsed.item())
                step += 1
    agree = {}
    memory = {}
    for variant, (ddp, _, holder) in built.items():
        flat = torch.cat([p.detach().reshape(-1) for p in ddp.module.parameters()])
        gathered = [torch.empty_like(flat) for _ in range(args.world)]
        dist.all_gather(gathered, flat)
        agree[variant] = all(torch.equal(t, flat) for t in gathered)
        nbytes = torch.tensor([_state_bytes(holder)], dtype=torch.float64)
        dist.all_reduce(nbytes, op=dist.ReduceOp.MAX)  # the most loaded rank
        memory[variant] = nbytes.item()
    if rank == 0:
        with open(out, "w") as f:
            json.dump({"times": times, "agree": agree, "state_bytes": memory}, f)
    dist.destroy_process_group()


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="zero_overlap", description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, default=2, help="gloo processes (default: %(default)s)")
    parser.add_argument("--width", type=int, default=1024, help="Linear width (default: %(default)s)")
    parser.add_argument("--layers", type=int, default=8, help="Linear layers (default: %(default)s)")
    parser.add_argument("--batch", type=int, default=32, help="samples per rank per step (default: %(default)s)")
    parser.add_argument("--rank", type=int, default=4, help="PowerSGD rank (default: %(default)s)")
    parser.add_argument("--variants", default=",".join(VARIANTS), help=f"from {', '.join(VARIANTS)}")
    parser.add_argument("--rounds", type=int, default=6, help="(default: %(default)s)")
    parser.add_argument("--block", type=int, default=5, help="timed steps per variant per round (default: %(default)s)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps per variant (default: %(default)s)")
    parser.add_argument("--shard-buckets", action=argparse.BooleanOptionalAction, default=True,
                        help="shard_buckets of the overlapped variants (default: on, balanced shards)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per process (default: %(default)s)")
    parser.add_argument("--json", default=None, help="write the results here")
    args = parser.parse_args(argv)
    args.variant_list = [v for v in args.variants.split(",") if v]
    unknown = [v for v in args.variant_list if v not in VARIANTS]
    if unknown or min(args.world, args.width, args.layers, args.batch, args.rank, args.rounds, args.block) < 1:
        parser.error(f"--variants from {', '.join(VARIANTS)} (got {unknown}); sizes and counts must be >= 1")
    command = "python benchmarks/zero_overlap.py " + " ".join(sys.argv[1:] if argv is None else argv)
    out = f"/tmp/gradpress-zero-overlap-{os.getpid()}.json"
    started = time.perf_counter()
    mp.spawn(_worker, args=(args, free_port(), out), nprocs=args.world)
    with open(out) as f:
        raw = json.load(f)
    os.unlink(out)
    medians = {v: statistics.median(t) * 1000 for v, t in raw["times"].items()}
    params = sum(p.numel() for p in _model(args.width, args.layers).parameters())
    rows = ["| variant | median step ms | vs zero | vs ddp+adam | optimizer state MiB (max over ranks) | ranks agree |",
            "|---|---|---|---|---|---|"]
    for v in args.variant_list:
        vs_zero = f"{medians[v] / medians['zero']:.2f}x" if "zero" in medians else "n/a"
        vs_ddp = f"{medians[v] / medians['ddp+adam']:.2f}x" if "ddp+adam" in medians else "n/a"
        rows.append(f"| {v} | {medians[v]:.1f} | {vs_zero} | {vs_ddp} | {raw['state_bytes'][v] / 2**20:.1f} "
                    f"| {'yes' if raw['agree'][v] else 'NO'} |")
    report = {"command": command.strip(), "parameters": params, "settings": {k: v for k, v in vars(args).items()},
              "environment": {"torch": torch.__version__, "python": platform.python_version(),
                              "cpus": os.cpu_count(), "backend": "gloo (loopback)"},
              "median_ms": medians, "raw": raw, "total_seconds": time.perf_counter() - started,
              "markdown": "\n".join(rows)}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    print(f"{command.strip()}\n{params:,} parameters, {args.world} ranks, "
          f"{report['total_seconds']:.0f} s\n\n" + report["markdown"])
    return 0


if __name__ == "__main__":
    sys.exit(main())

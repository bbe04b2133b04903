"""gradpress's hooks against PyTorch's on one GPU: step time and host syncs per step.

One process, NCCL at world size 1: the collectives move no bytes, so what differs between methods is
each hook's own compute, its launches and the host syncs it makes. The model is GPT-2 small
(``gradpress.tools.zoo.gpt2``, 124M parameters) on random tokens, forward under bf16 autocast (fp32
gradients, as users train), SGD. Every method starts from the same initial weights with DDP's default
buckets; ``--warmup`` untimed steps (PowerSGD compresses from step 3), then ``--steps`` timed steps
(each between two CUDA events, the median reported), then ``--sync-steps`` steps under
``torch.cuda.set_sync_debug_mode("warn")``, counting the synchronising CUDA calls per step (DDP's own
included: ``allreduce`` is the baseline). Methods run in ``--rounds`` interleaved rounds; each round's
timed steps are pooled.

Methods: ``allreduce`` (DDP's built-in), ``torch_fp16`` / ``fp16``, ``torch_powersgd:R`` / ``powersgd:R``,
``torch_batched:R`` / ``batched:R`` (PyTorch's hooks from ``torch.distributed.algorithms.ddp_comm_hooks``
and gradpress's drop-ins, same options), ``powersgd_diag:R`` (gradpress measuring its global residual on
every step), ``powersgd_fp16:R`` (gradpress with an fp16 wire, ``bytes_per_weight=2``: the recipe's).
``--device cpu --tiny`` runs the same code on gloo with a 2-layer model (the test suite's smoke run; its
timings mean nothing).

    python3 benchmarks/gpu_hooks.py --json benchmarks/results/gpu/hooks-h100.json
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import sys
import time
import warnings
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import gradpress
from gradpress.tools import zoo

DEFAULT_METHODS = ("allreduce,torch_fp16,fp16,torch_powersgd:4,powersgd:4,torch_powersgd:32,powersgd:32,"
                   "powersgd_diag:32,torch_batched:4,batched:4")
START_ITER = 2


def make_ddp(spec: str, model: nn.Module, device: torch.device) -> DDP:
    """A fresh DDP around ``model`` with the hook that ``spec`` names (see the module's docstring)."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as torch_psgd

    kind, _, number = spec.partition(":")
    ddp = DDP(model, device_ids=[device.index] if device.type == "cuda" else None)
    if kind == "allreduce":
        return ddp
    if kind == "torch_fp16":
        ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
        return ddp
    if kind == "fp16":
        ddp.register_comm_hook(None, gradpress.fp16_compress_hook)
        return ddp
    rank = int(number)
    if kind in ("torch_powersgd", "torch_batched"):
        state: Any = torch_psgd.PowerSGDState(None, matrix_approximation_rank=rank, start_powerSGD_iter=START_ITER)
        hook: Callable[..., Any] = (torch_psgd.powerSGD_hook if kind == "torch_powersgd"
                                    else torch_psgd.batched_powerSGD_hook)
    elif kind in ("powersgd", "batched", "powersgd_diag", "powersgd_fp16"):
        every = 1 if kind == "powersgd_diag" else None
        state = gradpress.PowerSGDState(None, matrix_approximation_rank=rank, start_powerSGD_iter=START_ITER,
                                        approximation_error_every_n_iters=every,
                                        global_residual_every_n_iters=every,
                                        bytes_per_weight=2 if kind == "powersgd_fp16" else 4)
        hook = gradpress.batched_powerSGD_hook if kind == "batched" else gradpress.powerSGD_hook
    else:
        raise ValueError(f"unknown method {spec!r}; valid kinds: allreduce, torch_fp16, fp16, torch_powersgd:R, "
                         "powersgd:R, powersgd_diag:R, powersgd_fp16:R, torch_batched:R, batched:R")
    ddp.register_comm_hook(state, hook)
    return ddp


def run_method(spec: str, base: nn.Module, tokens: torch.Tensor, args: argparse.Namespace,
               device: torch.device) -> dict[str, Any]:
    ddp = make_ddp(spec, copy.deepcopy(base), device)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=1e-4, momentum=0.9)
    vocab = base.wte.num_embeddings

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        with torch.autocast(device.type, dtype=torch.bfloat16):
            logits = ddp(tokens[:, :-1])
        loss = nn.functional.cross_entropy(logits.float().reshape(-1, vocab), tokens[:, 1:].reshape(-1))
        loss.backward()
        optimizer.step()

    for _ in range(args.warmup):
        step()
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.synchronize()
    times = []
    for _ in range(args.steps):
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            step()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            began = time.perf_counter()
            step()
            times.append(1000 * (time.perf_counter() - began))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if cuda:
            torch.cuda.set_sync_debug_mode("warn")
        try:
            for _ in range(args.sync_steps):
                step()
        finally:
            if cuda:
                torch.cuda.set_sync_debug_mode("default")
    if cuda:
        torch.cuda.synchronize()
    # PyTorch's own words for a sync ("called a synchronizing CUDA operation"), not its one-time notice that
    # the debug mode is a prototype.
    syncs = [str(w.message).splitlines()[0] for w in caught if "called a synchronizing" in str(w.message)]
    return {"method": spec, "times_ms": times, "syncs_per_step": len(syncs) / max(1, args.sync_steps),
            "sync_messages": sorted(set(syncs))[:5]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--methods", default=DEFAULT_METHODS, help="comma-separated (default: %(default)s)")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--warmup", type=int, default=8)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--sync-steps", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                        help="cpu: gloo, wall-clock timing, no sync count (a smoke run)")
    parser.add_argument("--tiny", action="store_true", help="a 2-layer GPT-2 of width 64 instead of GPT-2 small")
    parser.add_argument("--port", type=int, default=29531)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("gpu_hooks.py: error: --device cuda needs a CUDA GPU (--device cpu for a smoke run)", file=sys.stderr)
        return 2
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(args.port))
    dist.init_process_group("nccl" if args.device == "cuda" else "gloo", rank=0, world_size=1)
    device = torch.device("cuda", 0) if args.device == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    torch.manual_seed(0)
    base = (zoo.GPT2(vocab_size=256, context=64, n_layers=2, d_model=64, n_heads=4) if args.tiny
            else zoo.gpt2()).to(device)
    tokens = torch.randint(0, base.wte.num_embeddings, (args.batch_size, args.context + 1), device=device)
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    started = time.time()
    pooled: dict[str, dict[str, Any]] = {}
    failed: dict[str, str] = {}
    for round_index in range(args.rounds):
        for spec in methods:
            if spec in failed:
                continue
            try:
                result = run_method(spec, base, tokens, args, device)
            except Exception as exc:  # a hook that fails here is a finding, not the end of the run
                failed[spec] = f"{type(exc).__name__}: {exc}".splitlines()[0]
                print(f"round {round_index}: {spec}: failed: {failed[spec]}", file=sys.stderr, flush=True)
                continue
            entry = pooled.setdefault(spec, {"method": spec, "times_ms": [], "round_medians_ms": [],
                                             "syncs_per_step": result["syncs_per_step"],
                                             "sync_messages": result["sync_messages"]})
            entry["times_ms"] += result["times_ms"]
            entry["round_medians_ms"].append(statistics.median(result["times_ms"]))
            print(f"round {round_index}: {spec}: {statistics.median(result['times_ms']):.2f} ms/step, "
                  f"{result['syncs_per_step']:.1f} syncs/step", file=sys.stderr, flush=True)
    base_ms = statistics.median(pooled["allreduce"]["times_ms"]) if "allreduce" in pooled else None
    print(f"| method | ms/step (median of {args.rounds} x {args.steps}) | vs allreduce | vs PyTorch's | "
          "host syncs/step |")
    print("|---|---|---|---|---|")
    for spec, entry in pooled.items():
        entry["median_ms"] = statistics.median(entry["times_ms"])
        twin = {"fp16": "torch_fp16", "powersgd": "torch_powersgd", "batched": "torch_batched",
                "powersgd_diag": "torch_powersgd", "powersgd_fp16": "torch_powersgd"}.get(spec.partition(":")[0])
        twin_spec = None if twin is None else twin + spec[len(spec.partition(":")[0]):]
        versus = (f"{entry['median_ms'] / statistics.median(pooled[twin_spec]['times_ms']):.2f}x"
                  if twin_spec in pooled else "-")
        ratio = f"{entry['median_ms'] / base_ms:.2f}x" if base_ms else "-"
        print(f"| {spec} | {entry['median_ms']:.2f} | {ratio} | {versus} | {entry['syncs_per_step']:.1f} |")
    for spec, error in failed.items():
        print(f"| {spec} | failed: {error} | - | - | - |")
    report = {"command": " ".join(["python3", "benchmarks/gpu_hooks.py", *(argv or sys.argv[1:])]),
              "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
              "torch": torch.__version__,
              "seconds": time.time() - started, "batch": [args.batch_size, args.context],
              "methods": list(pooled.values()), "failed": failed}
    if args.json:
        with open(args.json, "w") as out:
            json.dump(report, out, indent=1)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())

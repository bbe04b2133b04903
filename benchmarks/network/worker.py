"""One rank of the network benchmark: time DDP training steps with each method over the shaped link.

Started by ``run.py`` inside the rank's network namespace (``GLOO_SOCKET_IFNAME=eth0``), one process
per rank, all methods in sequence in the same process group (start-up paid once; one untimed noop run
first, since the first method of a process pays for page faults). For each method a fresh model and DDP
wrapper, ``--warmup`` untimed steps (the compressed methods start compressing after 2 of them), then
``--steps`` timed steps. ``powersgd-eager:R`` / ``multi-eager:R`` use the hook's pipeline as it was of the
first releases (``advance_on_submit=True``: each bucket's hook first finishes the previous buckets' P phase,
waiting for it inside the backward pass); ``powersgd-lazy:R`` / ``multi-lazy:R`` name today's default
explicitly (every Q phase at the last bucket). ``powersgd-held:R`` holds every bucket until the last and
compresses them in one step (``PowerSGDState(overlap="none")``), ``powersgd-overlap:R`` issues each bucket's P
product and all-reduce as it arrives (``overlap="p-phase"``). ``--rounds N`` runs every method N times,
interleaved, and pools the timed steps (each round's median is kept too). With ``--ranks-per-node L`` (nodes
of L ranks sharing a namespace), ``hier-powersgd:R`` / ``hier-allreduce`` / ``hier-noop`` (nothing across
nodes: the intra-node collectives alone) wrap the hook in ``gradpress.hierarchical_wrapper`` (exact inside the
node, the hook across nodes); ``hsdp`` is FSDP2's native hybrid sharding (sharded inside the node, all-reduced
across nodes) and ``fsdp-powersgd:R`` the same sharding with PowerSGD across nodes
(``gradpress.register_fsdp_comm_hook``). Per step, per rank: forward, backward (which includes the hooks and
DDP's wait for the last collectives), optimizer (and local SGD's averaging), total; the time spent inside the
comm hook calls on the autograd thread, and, for gradpress's hooks, the part of it blocked waiting for a
collective. Rank 0 writes the slowest rank's times per step as JSON.

Workloads:
  * ``shapes``: ResNet-18-CIFAR's parameter shapes (11.2M floats, 62 tensors) with a trivial backward:
    ``loss = sum((p * g_p).sum())`` with fixed per-rank ``g_p``, so every step's gradients are ``g_p``
    and communication dominates;
  * ``resnet18``: ResNet-18-CIFAR (``gradpress.tools.zoo``) on synthetic 32x32 images, batch 8 per rank;
  * ``transformer``: a 4-layer GPT-2-style LM (d=256, 4 heads, vocab 256, context 128; 3.3M parameters)
    on random tokens, batch 8 x 128 per rank.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from datetime import timedelta
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import gradpress
from gradpress import comm as gp_comm
from gradpress.tools import zoo

METHODS = ("noop", "allreduce", "fp16", "torch_powersgd:2", "powersgd:1", "powersgd:2", "powersgd:4", "multi:2",
           "localsgd:8")
WORKLOADS = ("shapes", "resnet18", "transformer")
START_ITER = 2


class Shapes(nn.Module):
    """Parameters of ResNet-18-CIFAR's shapes; ``forward()`` makes each gradient a fixed per-rank tensor."""

    def __init__(self, rank: int) -> None:
        super().__init__()
        shapes = [p.shape for p in zoo.build_model("resnet18-cifar").parameters()]
        generator = torch.Generator().manual_seed(0)
        self.weights = nn.ParameterList(nn.Parameter(torch.randn(s, generator=generator)) for s in shapes)
        generator.manual_seed(1000 + rank)
        self.grads = [torch.randn(s, generator=generator) for s in shapes]

    def forward(self) -> torch.Tensor:
        return torch.stack([(w * g).sum() for w, g in zip(self.weights, self.grads)]).sum()


def make_workload(name: str, rank: int) -> tuple[nn.Module, Callable[[nn.Module, int], torch.Tensor]]:
    """``(model, loss(ddp_model, step))``; the same weights on every rank, other data per rank."""
    torch.manual_seed(0)
    if name == "shapes":
        return Shapes(rank), lambda model, step: model()
    if name == "resnet18":
        model = zoo.build_model("resnet18-cifar", "cpu")

        def loss(ddp: nn.Module, step: int) -> torch.Tensor:
            g = torch.Generator().manual_seed(10_000 * rank + step)
            x = torch.randn(8, 3, 32, 32, generator=g)
            y = torch.randint(0, 10, (8,), generator=g)
            return nn.functional.cross_entropy(ddp(x), y)
        return model, loss
    if name == "transformer":
        model = zoo.GPT2(vocab_size=256, context=128, n_layers=4, d_model=256, n_heads=4)

        def loss(ddp: nn.Module, step: int) -> torch.Tensor:
            g = torch.Generator().manual_seed(10_000 * rank + step)
            tokens = torch.randint(0, 256, (8, 129), generator=g)
            logits = ddp(tokens[:, :-1])
            return nn.functional.cross_entropy(logits.reshape(-1, 256), tokens[:, 1:].reshape(-1))
        return model, loss
    raise ValueError(f"unknown workload {name!r}; valid: {', '.join(WORKLOADS)}")


def _noop_hook(state, bucket):  # no annotations: DDP checks them, and these would be strings
    fut: torch.futures.Future = torch.futures.Future()
    fut.set_result(bucket.buffer())
    return fut


def make_method(spec: str, model: nn.Module) -> tuple[DDP, Any, Any]:
    """``(ddp, hook state, averager or None)`` for a method spec (see :data:`METHODS`)."""
    kind, _, number = spec.partition(":")
    averager = None
    if kind == "torch_powersgd":  # one bucket: with DDP's default buckets PyTorch's hook deadlocks on gloo
        from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as torch_psgd

        ddp = DDP(model, bucket_cap_mb=10_000)
        state = torch_psgd.PowerSGDState(None, matrix_approximation_rank=int(number),
                                         start_powerSGD_iter=START_ITER, min_compression_rate=2)
        ddp.register_comm_hook(state, _timed(torch_psgd.powerSGD_hook))
        return ddp, state, None
    ddp = DDP(model)
    if kind == "noop":
        state, hook = None, _noop_hook
    elif kind == "allreduce":
        state, hook = None, gradpress.allreduce_hook
    elif kind == "fp16":
        state, hook = None, gradpress.fp16_compress_hook
    elif kind in ("powersgd", "multi", "powersgd-lazy", "multi-lazy", "powersgd-eager", "multi-eager",
                  "powersgd-held", "powersgd-overlap"):
        overlap = {"powersgd-held": "none", "powersgd-overlap": "p-phase"}.get(kind, "auto")
        state = gradpress.PowerSGDState(None, matrix_approximation_rank=int(number), start_powerSGD_iter=START_ITER,
                                        num_iters_per_step=1 if kind.startswith("multi") else None, overlap=overlap)
        if kind.endswith(("-lazy", "-eager")):  # the two orders of the pipeline (lazy: the default)
            state.session.pipeline.advance_on_submit = kind.endswith("-eager")
        hook = gradpress.powerSGD_hook
    elif kind in ("hier-powersgd", "hier-allreduce", "hier-noop"):  # exact in the node, hook across
        if _GROUPS["intra"] is None:
            raise ValueError(f"{spec} needs --ranks-per-node >= 2")
        # hier-noop: only the intra-node reduce-scatter and all-gather (what a fast node link would make free)
        inner = {"hier-powersgd": gradpress.powerSGD_hook, "hier-allreduce": gradpress.allreduce_hook,
                 "hier-noop": _noop_hook}[kind]
        state = _GROUPS["inter"] if kind != "hier-powersgd" else gradpress.PowerSGDState(
            _GROUPS["inter"], matrix_approximation_rank=int(number), start_powerSGD_iter=START_ITER)
        hook = gradpress.hierarchical_wrapper(inner, _GROUPS["intra"])
    elif kind in ("hsdp", "fsdp-powersgd"):  # FSDP2 sharded inside the node, replicas across nodes
        from torch.distributed.fsdp import fully_shard

        mesh = _GROUPS["mesh"]
        if mesh is None:
            raise ValueError(f"{spec} needs --ranks-per-node >= 2")
        if kind == "hsdp":  # native HSDP: FSDP all-reduces across replicas itself
            fully_shard(model, mesh=mesh)
            return model, None, None
        fully_shard(model, mesh=mesh["shard"])
        state = gradpress.PowerSGDState(mesh["replicate"].get_group(), matrix_approximation_rank=int(number),
                                        start_powerSGD_iter=START_ITER)
        gradpress.register_fsdp_comm_hook(model, state, _timed(gradpress.powerSGD_hook))
        return model, state, None
    elif kind == "localsgd":
        state = gradpress.PostLocalSGDState(None, None, start_localSGD_iter=START_ITER,
                                            post_local_gradient_allreduce=False)
        hook = gradpress.post_localSGD_hook
        averager = gradpress.PeriodicModelAverager(int(number), warmup_steps=START_ITER)
    else:
        raise ValueError(f"unknown method {spec!r}; valid: {', '.join(METHODS)}")
    ddp.register_comm_hook(state, _timed(hook))
    return ddp, state, averager


#: This rank's node (``intra``), the ranks with its local index on every node (``inter``) and the
#: ``(replicate, shard)`` mesh they come from, built once by :func:`make_node_groups` when
#: ``--ranks-per-node`` is above 1.
_GROUPS: dict[str, Any] = {"intra": None, "inter": None, "mesh": None}


def make_node_groups(ranks_per_node: int) -> None:
    """Nodes of consecutive ranks: the mesh's ``shard`` dimension is the node, ``replicate`` the ranks
    with the same local index (every rank builds every group, as torch.distributed requires)."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (dist.get_world_size() // ranks_per_node, ranks_per_node),
                            mesh_dim_names=("replicate", "shard"))
    _GROUPS.update(mesh=mesh, intra=mesh["shard"].get_group(), inter=mesh["replicate"].get_group())


# Time inside hook calls (autograd thread) and, within it, blocked on gradpress's collectives.
_CLOCK = {"hook": 0.0, "blocked": 0.0}


def _timed(hook: Callable) -> Callable:
    def timed(state, bucket):  # no annotations, as _noop_hook
        start = time.perf_counter()
        try:
            return hook(state, bucket)
        finally:
            _CLOCK["hook"] += time.perf_counter() - start
    return timed


_original_wait = gp_comm.Work.wait


def _timed_wait(self: Any) -> torch.Tensor:
    start = time.perf_counter()
    try:
        return _original_wait(self)
    finally:
        _CLOCK["blocked"] += time.perf_counter() - start


gp_comm.Work.wait = _timed_wait  # type: ignore[method-assign]

PHASES = ("step", "forward", "backward", "optimizer", "hook", "blocked")


def run_method(spec: str, workload: str, rank: int, warmup: int, steps: int) -> dict[str, Any]:
    model, loss_fn = make_workload(workload, rank)
    ddp, state, averager = make_method(spec, model)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=1e-4)
    times = torch.zeros(steps, len(PHASES), dtype=torch.float64)
    dist.barrier()
    for step in range(warmup + steps):
        _CLOCK["hook"] = _CLOCK["blocked"] = 0.0
        t0 = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        loss = loss_fn(ddp, step)
        t1 = time.perf_counter()
        loss.backward()
        t2 = time.perf_counter()
        optimizer.step()
        if averager is not None:
            averager.average_parameters(ddp.parameters())
        t3 = time.perf_counter()
        if step >= warmup:
            times[step - warmup] = torch.tensor([t3 - t0, t1 - t0, t2 - t1, t3 - t2, _CLOCK["hook"],
                                                 _CLOCK["blocked"]], dtype=torch.float64)
    slowest = times.clone()
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)  # per step and phase, the slowest rank
    per_phase = {name: [1000 * float(v) for v in slowest[:, i]] for i, name in enumerate(PHASES)}
    result = {"method": spec, "workload": workload, "steps": steps, **_summary(per_phase),
              "numel": sum(p.numel() for p in model.parameters())}
    numel = result["numel"]
    compressed_steps = warmup + steps - START_ITER
    if isinstance(state, gradpress.PowerSGDState):
        result["compression_rate"] = state.compression_stats()[0]
        result["bytes_per_step"] = state.bytes_stats()[2] / compressed_steps
    elif spec.startswith("torch_powersgd"):
        result["bytes_per_step"] = 4 * state.total_numel_after_compression / compressed_steps
    else:
        period = averager.period if averager is not None else None
        per_element = {"noop": 0, "allreduce": 4, "fp16": 2}.get(spec.partition(":")[0], 4)
        result["bytes_per_step"] = per_element * numel / (period or 1)
        if spec in ("hsdp", "hier-allreduce"):  # what crosses nodes per rank: its 1/L of the gradients
            result["bytes_per_step"] /= dist.get_world_size(_GROUPS["intra"])
        elif spec == "hier-noop":
            result["bytes_per_step"] = 0
    del ddp
    dist.barrier()
    return result


def _summary(per_phase: dict[str, list[float]]) -> dict[str, Any]:
    return {"median_ms": {name: statistics.median(v) for name, v in per_phase.items()},
            "mean_ms": {name: statistics.fmean(v) for name, v in per_phase.items()},
            "step_ms": per_phase["step"], "per_step_ms": per_phase}


def merge_rounds(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """One method's results from several rounds as one: every timed step pooled (median, mean), and
    each round's median step (``round_step_ms``) to show the drift between rounds."""
    pooled = {name: [v for r in rounds for v in r["per_step_ms"][name]] for name in PHASES}
    return {**rounds[0], "steps": sum(r["steps"] for r in rounds), "rounds": len(rounds), **_summary(pooled),
            "round_step_ms": [r["median_ms"]["step"] for r in rounds]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--world-size", type=int, required=True)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--workloads", default="shapes")
    parser.add_argument("--methods", default=",".join(METHODS))
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=1, help="run every method this many times, interleaved")
    parser.add_argument("--ranks-per-node", type=int, default=1, help="ranks per node (hier-* methods)")
    parser.add_argument("--json", required=True, help="rank 0 writes the results here")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://{os.environ['MASTER_ADDR']}:{args.port}", rank=args.rank,
                            world_size=args.world_size, timeout=timedelta(seconds=600))
    if args.ranks_per_node > 1:
        make_node_groups(args.ranks_per_node)
    results = []
    for workload in args.workloads.split(","):
        # Untimed: the first method a process runs pays for page faults and allocator growth.
        run_method("noop", workload, args.rank, args.warmup, 1)
        specs = args.methods.split(",")
        # Rounds interleave the methods, so that a slow spell of the shared machine hits them all alike.
        by_spec: dict[str, list[dict[str, Any]]] = {spec: [] for spec in specs}
        for round_index in range(args.rounds):
            for spec in specs:
                result = run_method(spec, workload, args.rank, args.warmup, args.steps)
                by_spec[spec].append(result)
                if args.rank == 0:
                    med = result["median_ms"]
                    print(f"[rank 0] {workload:11s} {spec:16s} round {round_index + 1} step {med['step']:8.1f} ms "
                          f"(backward {med['backward']:.1f}, hook {med['hook']:.1f}, blocked {med['blocked']:.1f})",
                          file=sys.stderr, flush=True)
        results += [merge_rounds(by_spec[spec]) for spec in specs]
    if args.rank == 0:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Two-shot reduction of compressed outer gradients against the all-gather: bytes per rank, wall time of one
sync, and numerics. One JSON per run in ``benchmarks/results/`` (``two_shot_<part>.json``), a markdown table
on stdout. Not part of CI; CPU-heavy: run one part at a time.

``bytes``: each DiLoCo sync's bytes per rank on gloo at W = 2..16 (processes on this machine), as the
averagers count them (``bytes_sent``: the payload handed to the collectives; ``link_bytes``: what one rank's
link carries, ring-equivalent), beside the loopback interface's own count (``/proc/net/dev``, bytes sent on
``lo`` during the sync less those of an idle interval as long, divided by W: gloo's TCP traffic, headers
included, and whatever else used ``lo`` meanwhile), then by formula to W = 1024
(:func:`gradpress.tools.bytes.sync_link_bytes`)::

    python3 benchmarks/two_shot.py bytes --worlds 2,3,4,5,6,8,12,16 --numel 2097152

``time``: the wall time of one sync (``OuterOptimizerAverager.average_parameters``, barrier to barrier, the
slowest rank; median of ``--repeats``) at one world size, all-gather against two-shot, with the load
average before and after (``os.getloadavg``, what ``uptime`` prints)::

    python3 benchmarks/two_shot.py time --world 8 --numel 2097152 --compressor int8
    python3 benchmarks/two_shot.py time --world 16 --numel 2097152 --compressor int4

``numerics``: W ranks simulated in one process by the functions the ranks call
(:mod:`gradpress.averaging.twoshot`): rank ``i``'s outer gradient at round ``t`` is ``g + xi_it``, ``g``
fixed across rounds and ranks (the signal the replicas share), ``xi`` independent noise of the same scale
(both N(0, 1)). One region of ``--region`` values per owner (here 1024: one chunk of the default
compressors); up to ``--owners`` owners are simulated (all of them at W <= 16; beyond, the first
``--owners`` regions: regions are independent and alike, so their error is the whole vector's, and with
nearest rounding their numbers are bitwise those the ranks compute on those regions). Relative error of one
round ``||U - mean|| / ||mean||`` and cumulative after ``--rounds`` rounds ``||sum U - sum mean|| /
||sum mean||``, two-shot with and without the owner's error feedback, and the all-gather::

    python3 benchmarks/two_shot.py numerics --worlds 2,4,8,16,32,64,128,256,512,1024 --rounds 20

``quality``: the table of ``benchmarks/replica_study.py`` runs (``--out``) that differ only in
``--schedule``: each two-shot run's final perplexity against its all-gather twin's (labels ending in
``-two-shot`` and ``-all-gather``)::

    python3 benchmarks/replica_study.py --task charlm --replicas 8 --methods streaming-int4:8 --schedule two-shot \
        --lr 2.0 --start-iter 24 --steps 240 --evals 8 --out benchmarks/results/two-shot-quality \
        --label twoshot-charlm-r8-streaming-int4-8-two-shot           # and --schedule all-gather, ...-all-gather
    python3 benchmarks/two_shot.py quality --out benchmarks/results/two-shot-quality
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"


def _compressor(name: str) -> Any:
    from gradpress import QuantizeInt4, QuantizeInt8, TopK

    return {"int8": QuantizeInt8(), "int4": QuantizeInt4(), "int4-stochastic": QuantizeInt4(rounding="stochastic"),
            "int8-stochastic": QuantizeInt8(rounding="stochastic"), "topk": TopK(k=32, chunk_size=1024)}[name]


# -- processes -------------------------------------------------------------------------------------------

def _worker(rank: int, world: int, port: int, task: Callable[..., Any], args: tuple, queue: Any) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    import torch.distributed as dist

    from gradpress.tools.processes import join_group

    try:
        join_group("gloo", port, rank, world)
        queue.put((rank, True, task(rank, world, *args)))
        dist.destroy_process_group()
    except BaseException as exc:  # reported to the caller, which stops the others
        import traceback

        queue.put((rank, False, f"{exc!r}\n{traceback.format_exc()}"))


def run_group(world: int, task: Callable[..., Any], *args: Any, timeout: float = 1800.0) -> list[Any]:
    """``task(rank, world, *args)`` on ``world`` gloo processes of this machine; their results by rank."""
    from gradpress.tools.cli.demo.supervisor import context
    from gradpress.tools.processes import serve_rendezvous

    ctx = context()
    store = serve_rendezvous(world)
    queue = ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(r, world, store.port, task, args, queue), daemon=True)
             for r in range(world)]
    for proc in procs:
        proc.start()
    out: dict[int, Any] = {}
    try:
        while len(out) < world:
            rank, ok, value = queue.get(timeout=timeout)
            if not ok:
                raise RuntimeError(f"rank {rank} of {world} failed: {value}")
            out[rank] = value
    finally:
        for proc in procs:
            proc.join(timeout=30)
            if proc.is_alive():
                proc.kill()
    return [out[r] for r in range(world)]


def _lo_sent() -> int:
    """Bytes sent on the loopback interface so far (``/proc/net/dev``; -1 where there is none)."""
    try:
        for line in Path("/proc/net/dev").read_text().splitlines():
            name, _, rest = line.partition(":")
            if name.strip() == "lo":
                return int(rest.split()[8])
    except OSError:
        pass
    return -1


# -- bytes ------------------------------------------------------------------------------------------------

CASES = [("exact fp32", None, "auto"), ("int8 all-gather", "int8", "all-gather"), ("int8 two-shot", "int8", "two-shot"),
         ("int8 auto", "int8", "auto"), ("int4 all-gather", "int4", "all-gather"),
         ("int4 two-shot", "int4", "two-shot"), ("int4 auto", "int4", "auto")]


def _sync_once(rank: int, world: int, numel: int, compression: Any, schedule: str) -> tuple[Any, torch.nn.Parameter]:
    """An OuterOptimizerAverager anchored on ``numel`` parameters that moved since: ready to sync."""
    from gradpress import OuterOptimizerAverager

    param = torch.nn.Parameter(torch.randn(numel, generator=torch.Generator().manual_seed(rank)))
    averager = OuterOptimizerAverager(1, outer_lr=1.0, outer_momentum=0.0, compression=compression,
                                      schedule=schedule)
    averager.anchor_parameters([param])
    with torch.no_grad():
        param.add_(torch.randn(numel, generator=torch.Generator().manual_seed(1000 + rank)) * 1e-2)
    return averager, param


def counted_bytes(rank: int, world: int, numel: int, repeats: int) -> list[dict[str, Any]]:
    """Per case, one sync's counted bytes and the loopback's bytes per rank (median of ``repeats`` syncs,
    each less an idle interval as long right after it)."""
    import torch.distributed as dist

    out = []
    for label, name, schedule in CASES:
        compression = None if name is None else _compressor(name)
        averager, param = _sync_once(rank, world, numel, compression, schedule)
        counts, measured = None, []
        for k in range(repeats):
            if k:
                with torch.no_grad():
                    param.add_(torch.randn(numel, generator=torch.Generator().manual_seed(k * 7919 + rank)) * 1e-2)
            before = averager.bytes_sent, averager.link_bytes
            dist.barrier()
            lo0, t0 = _lo_sent(), time.perf_counter()
            averager.average_parameters([param])
            dist.barrier()
            lo1, seconds = _lo_sent(), time.perf_counter() - t0
            time.sleep(seconds)  # an idle interval as long: what else used lo meanwhile
            lo2 = _lo_sent()
            dist.barrier()
            sync = (averager.bytes_sent - before[0], averager.link_bytes - before[1])
            # Every sync of a case counts the same (the link bytes are floats: 2 (W - 1) / W of a payload).
            assert counts is None or (sync[0] == counts[0] and abs(sync[1] - counts[1]) <= 1e-6 * counts[1])
            counts = counts or sync
            measured.append(((lo1 - lo0) - (lo2 - lo1)) / world)
        assert counts is not None
        out.append({"case": label, "bytes_sent": counts[0], "link_bytes": counts[1],
                    "lo_per_rank": None if _lo_sent() < 0 else statistics.median(measured),
                    "lo_per_rank_each": measured})
    return out


def bytes_part(args: argparse.Namespace) -> dict[str, Any]:
    from gradpress.tools.bytes import sync_link_bytes

    n = args.numel
    fp32 = [torch.float32]
    counted = {}
    for world in args.worlds:
        rows = run_group(world, counted_bytes, n, args.repeats)[0]
        counted[world] = rows
        print(f"W = {world}: " + ", ".join(f"{r['case']} {r['link_bytes'] / n:.3f}n" for r in rows), flush=True)
    formula_worlds = [2, 3, 4, 8, 16, 32, 64, 128, 256, 512, 1024]
    formula = {label: [sum(sync_link_bytes([(args.formula_numel,)], fp32, None if name is None else _compressor(name),
                                           world=w, schedule=schedule)) / args.formula_numel for w in formula_worlds]
               for label, name, schedule in CASES}
    return {"numel": n, "formula_numel": args.formula_numel, "repeats": args.repeats, "counted": counted,
            "formula_worlds": formula_worlds, "formula": formula}


def bytes_table(result: dict[str, Any]) -> list[str]:
    """The markdown tables of :func:`bytes_part`'s JSON (world sizes as the JSON's string keys)."""
    n = result["numel"]
    worlds = sorted(result["counted"], key=int)
    lines = [f"Counted on gloo (n = {n:,} values, one sync; link bytes per rank / n, in brackets the loopback "
             f"interface's bytes per rank / n, median of {result.get('repeats', 1)} syncs):", "",
             "| schedule | " + " | ".join(f"W = {w}" for w in worlds) + " |", "|---|" + "---:|" * len(worlds)]
    for i, first in enumerate(result["counted"][worlds[0]]):
        cells = []
        for w in worlds:
            row = result["counted"][w][i]
            lo = "" if row["lo_per_rank"] is None else f" ({row['lo_per_rank'] / n:.3f})"
            cells.append(f"{row['link_bytes'] / n:.3f}{lo}")
        lines.append(f"| {first['case']} | " + " | ".join(cells) + " |")
    fn, fw = result["formula_numel"], result["formula_worlds"]
    lines += ["", f"By formula (n = {fn:,}; link bytes per rank / n):", "",
              "| schedule | " + " | ".join(f"W = {w}" for w in fw) + " |", "|---|" + "---:|" * len(fw)]
    for label, values in result["formula"].items():
        lines.append(f"| {label} | " + " | ".join(f"{v:.3f}" for v in values) + " |")
    return lines


# -- time ------------------------------------------------------------------------------------------------

def timed_syncs(rank: int, world: int, numel: int, name: str, repeats: int) -> dict[str, list[float]]:
    import torch.distributed as dist

    out: dict[str, list[float]] = {}
    for schedule in ("all-gather", "two-shot"):
        times = []
        for _ in range(repeats + 1):  # the first is a warm-up
            averager, param = _sync_once(rank, world, numel, _compressor(name), schedule)
            dist.barrier()
            start = time.perf_counter()
            averager.average_parameters([param])
            dist.barrier()
            elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
            times.append(float(elapsed))
        out[schedule] = times[1:]
    return out


def time_part(args: argparse.Namespace) -> dict[str, Any]:
    load_before = os.getloadavg()
    times = run_group(args.world, timed_syncs, args.numel, args.compressor, args.repeats)[0]
    load_after = os.getloadavg()
    medians = {k: statistics.median(v) for k, v in times.items()}
    return {"world": args.world, "numel": args.numel, "compressor": args.compressor, "repeats": args.repeats,
            "cores": os.cpu_count(), "load_before": load_before, "load_after": load_after, "times_s": times,
            "median_s": medians, "ratio": medians["two-shot"] / medians["all-gather"]}


def time_table(result: dict[str, Any]) -> list[str]:
    m = result["median_s"]
    load = "/".join(f"{x:.2f}" for x in result["load_before"]) + " -> " + "/".join(
        f"{x:.2f}" for x in result["load_after"])
    return [f"| {result['world']} | {result['compressor']} | {result['numel']:,} | {1000 * m['all-gather']:.0f} | "
            f"{1000 * m['two-shot']:.0f} | {result['ratio']:.2f}x | {result['cores']} cores, load {load} |"]


# -- numerics --------------------------------------------------------------------------------------------

def simulate(compressor: Any, world: int, rounds: int, region: int, owners: int, seed: int = 0,
             schedule: str = "two-shot", owner_feedback: bool = True) -> dict[str, float]:
    """Rounds of one reduction over ``world`` ranks on the first ``min(world, owners)`` regions of
    ``region`` values, by the ranks' own functions; errors against the exact mean in fp64."""
    from gradpress.averaging.compress import rounding_generator
    from gradpress.averaging.transport import sync_seed
    from gradpress.averaging.twoshot import decode_regions, encode_regions, owner_reduce, regions

    k = min(world, owners)
    numel = k * region
    plan = regions(compressor, numel, k)  # the first k regions of the full vector: the same bounds
    if plan.bounds != tuple((r * region, (r + 1) * region) for r in range(k)):
        raise ValueError("--region must be a multiple of the compressor's chunk size")
    gen = torch.Generator().manual_seed(seed)
    signal = torch.randn(numel, generator=gen)
    residuals = torch.zeros(world, numel)
    owner_res: list[torch.Tensor | None] = [None] * k
    applied_sum = torch.zeros(numel, dtype=torch.float64)
    true_sum = torch.zeros(numel, dtype=torch.float64)
    first = None
    stochastic = compressor.rounding == "stochastic"
    for t in range(rounds):
        noise_gen = torch.Generator().manual_seed(seed * 100_003 + t + 1)
        deltas = signal + torch.randn(world, numel, generator=noise_gen)
        mean = deltas.double().mean(0)
        e = deltas + residuals * getattr(compressor, "error_decay", 1.0)
        if schedule == "all-gather":
            total = torch.zeros(numel)
            for i in range(world):
                g = rounding_generator(sync_seed(compressor.seed, i, 0, t), "cpu") if stochastic else None
                decoded = compressor.decode(compressor.encode(e[i], g).unsqueeze(0), numel, torch.float32)[0]
                residuals[i] = e[i] - decoded
                total += decoded  # in rank order, as the decoded rows are summed
            update = total.div_(world)
        else:
            rows = []
            for i in range(world):
                g = rounding_generator(sync_seed(compressor.seed, i, 0, t), "cpu") if stochastic else None
                sent = encode_regions(compressor, e[i], plan, g)
                residuals[i] = e[i] - decode_regions(compressor, sent, plan, torch.float32)
                rows.append(sent)
            stacked = torch.stack(rows)  # (ranks, owners, row)
            owned = []
            for r in range(k):
                g = rounding_generator(sync_seed(compressor.seed, r, 0, t, stream=1), "cpu") if stochastic else None
                row, res = owner_reduce(compressor, stacked[:, r], plan.length(r), owner_res[r], torch.float32, g)
                owner_res[r] = res if owner_feedback else None
                owned.append(row)
            update = decode_regions(compressor, torch.stack(owned), plan, torch.float32)
        applied_sum += update.double()
        true_sum += mean
        if first is None:
            first = float((update.double() - mean).norm() / mean.norm())
    assert first is not None
    return {"one_round": first, "cumulative": float((applied_sum - true_sum).norm() / true_sum.norm())}


def numerics_part(args: argparse.Namespace) -> dict[str, Any]:
    rows = []
    for name in args.compressors:
        compressor = _compressor(name)
        for world in args.worlds:
            variants = {"two-shot": simulate(compressor, world, args.rounds, args.region, args.owners),
                        "two-shot, no owner feedback": simulate(compressor, world, args.rounds, args.region,
                                                                args.owners, owner_feedback=False),
                        "all-gather": simulate(compressor, world, args.rounds, args.region, args.owners,
                                               schedule="all-gather")}
            rows.append({"compressor": name, "world": world, "owners_simulated": min(world, args.owners),
                         **{f"{k}: {m}": v for k, r in variants.items() for m, v in r.items()}})
            print(f"{name} W = {world}: " + ", ".join(f"{k} {r['one_round']:.4f} / {r['cumulative']:.2e}"
                                                   for k, r in variants.items()), flush=True)
    return {"rounds": args.rounds, "region": args.region, "owners": args.owners, "rows": rows}


def numerics_table(result: dict[str, Any]) -> list[str]:
    lines = [f"| compressor | W | regions simulated | two-shot: one round | two-shot: after {result['rounds']} | "
             f"no owner feedback: after {result['rounds']} | all-gather: one round | all-gather: after "
             f"{result['rounds']} |", "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in result["rows"]:
        lines.append(f"| {r['compressor']} | {r['world']} | {r['owners_simulated']} | {r['two-shot: one_round']:.4f} | "
                     f"{r['two-shot: cumulative']:.2e} | {r['two-shot, no owner feedback: cumulative']:.2e} | "
                     f"{r['all-gather: one_round']:.4f} | {r['all-gather: cumulative']:.2e} |")
    return lines


# -- quality ---------------------------------------------------------------------------------------------

def _link_per_step(run: dict[str, Any]) -> float:
    """What one replica's link carries per step once ``run`` (a replica_study JSON) syncs, from the byte model
    at the run's configuration and world size: the runs' own figure, for runs the model already counted right
    (it cuts the fragments from the averager's parameter list, AdamW's groups included)."""
    from gradpress.powersgd import make_plan
    from gradpress.tools.workloads import DemoConfig, get_task, parse_methods
    from gradpress.tools.workloads.methods import method_kind
    from gradpress.tools.workloads.training import make_optimizer

    config = DemoConfig(**run["config"])
    method = parse_methods(run["method"], [1])[0]
    optimizer = make_optimizer(list(get_task(config.task).model(config.seed).parameters()), config)
    plan = make_plan([p.shape for group in optimizer.param_groups for p in group["params"]], method.rank or 1,
                     config.min_compression_rate)
    return method_kind(method.kind).bytes_per_step(method, plan, config, [], run["workers"], link=True)


def quality_part(args: argparse.Namespace) -> dict[str, Any]:
    runs = {}
    for path in sorted(Path(args.out).glob("*.json")):
        run = json.loads(path.read_text())
        runs[run["label"]] = run
    rows = []
    for label, two_shot in sorted(runs.items()):
        if not label.endswith("-two-shot"):
            continue
        twin = runs.get(label[: -len("-two-shot")] + "-all-gather")
        if twin is None:
            continue
        rows.append({"label": label[: -len("-two-shot")], "task": two_shot["config"]["task"],
                     "replicas": two_shot["workers"], "method": two_shot["method"],
                     "steps": two_shot["config"]["steps"], "ppl_all_gather": twin["ppl_end"],
                     "ppl_two_shot": two_shot["ppl_end"], "vs_all_gather": two_shot["ppl_end"] / twin["ppl_end"] - 1,
                     "link_all_gather": _link_per_step(twin), "link_two_shot": _link_per_step(two_shot),
                     "link_allreduce": two_shot.get("link_bytes_allreduce_per_step"),
                     "commands": [twin["command"], two_shot["command"]]})
    return {"out": args.out, "rows": rows}


def quality_table(result: dict[str, Any]) -> list[str]:
    lines = ["| task | replicas | method | steps | ppl, all-gather | ppl, two-shot | two-shot vs all-gather | "
             "link B/step all-gather / two-shot (allreduce's) |", "|---|---:|---|---:|---:|---:|---:|---|"]
    for r in sorted(result["rows"], key=lambda r: (r["task"], r["replicas"])):
        link = (f"{r['link_all_gather']:,.0f} / {r['link_two_shot']:,.0f} ({r['link_allreduce']:,.0f})"
                if r["link_two_shot"] else "")
        lines.append(f"| {r['task']} | {r['replicas']} | {r['method']} | {r['steps']} | {r['ppl_all_gather']:.4f} | "
                     f"{r['ppl_two_shot']:.4f} | {100 * r['vs_all_gather']:+.2f}% | {link} |")
    return lines


# -- main ------------------------------------------------------------------------------------------------

def _ints(text: str) -> list[int]:
    return [int(t) for t in text.split(",") if t.strip()]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="part", required=True)
    b = sub.add_parser("bytes")
    b.add_argument("--worlds", type=_ints, default=[2, 3, 4, 5, 6, 8, 12, 16])
    b.add_argument("--numel", type=int, default=2 ** 21)
    b.add_argument("--formula-numel", type=int, default=2 ** 24)
    b.add_argument("--repeats", type=int, default=3, help="syncs per case on the loopback count (median)")
    t = sub.add_parser("time")
    t.add_argument("--world", type=int, default=8)
    t.add_argument("--numel", type=int, default=2 ** 21)
    t.add_argument("--compressor", default="int8")
    t.add_argument("--repeats", type=int, default=5)
    n = sub.add_parser("numerics")
    n.add_argument("--worlds", type=_ints, default=[2, 4, 8, 16, 32, 64, 128, 256, 512, 1024])
    n.add_argument("--compressors", type=lambda s: s.split(","), default=["int4", "int8"])
    n.add_argument("--rounds", type=int, default=20)
    n.add_argument("--region", type=int, default=1024)
    n.add_argument("--owners", type=int, default=16)
    q = sub.add_parser("quality")
    q.add_argument("--out", default=str(RESULTS / "two-shot-quality"), help="replica_study.py's --out")
    for p in (b, t, n, q):
        p.add_argument("--label", default=None, help="the JSON's name in benchmarks/results/ (default: by part)")
    args = parser.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    command = "python3 benchmarks/two_shot.py " + " ".join(argv if argv is not None else sys.argv[1:])
    part = {"bytes": bytes_part, "time": time_part, "numerics": numerics_part, "quality": quality_part}[args.part]
    start = time.perf_counter()
    result = {"command": command, "torch": torch.__version__, **part(args), "elapsed_s": 0.0}
    result["elapsed_s"] = time.perf_counter() - start
    label = args.label or (f"two_shot_{args.part}" if args.part != "time" else
                           f"two_shot_time_w{args.world}_{args.compressor}")
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"{label}.json").write_text(json.dumps(result, indent=1) + "\n")
    table = {"bytes": bytes_table, "time": time_table, "numerics": numerics_table, "quality": quality_table}[args.part]
    print("\n".join(table(json.loads(json.dumps(result)))))
    print(f"({result['elapsed_s']:.0f} s; benchmarks/results/{label}.json)")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Network benchmark: DDP step time per method over real, rate-limited links between local ranks.

Builds ``--world-sizes`` ranks in network namespaces on a bridge (``netns.py``: veth + ``tc tbf`` both
ways), runs ``worker.py`` in each namespace for every rate, then tears everything down. Needs root and
iproute2; refuses clearly otherwise. Not part of CI.

    sudo python3 benchmarks/network/run.py --rates 1gbit --world-sizes 2 --workloads shapes
    sudo python3 benchmarks/network/run.py --rates 100mbit,1gbit,10gbit --world-sizes 2,4 \\
        --workloads shapes,resnet18,transformer --json benchmarks/network/results.json
    sudo python3 benchmarks/network/run.py --cleanup          # remove namespaces left by a killed run

Per cell (workload, method, ranks, rate): median step time of the slowest rank, and its parts:
forward, backward (hooks and DDP's final wait included), optimizer; time inside the hook calls on the
autograd thread and, for gradpress, blocked on a collective there. The ``floor`` of a PowerSGD cell is
the noop step + the hook's compute (its hook time at 10 Gbit/s minus its blocked time there) + the
factor bytes / rate (ring allreduce: 2 (n-1)/n x bytes), see :func:`floor_ms`.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from netns import Network, NetworkError, check_can_build, cleanup, parse_rate  # noqa: E402

DEFAULT_METHODS = "noop,allreduce,fp16,torch_powersgd:2,powersgd:1,powersgd:2,powersgd:4,multi:2,localsgd:8"


def _port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def run_workers(net: Network, script: Path, args: list[str], timeout: float) -> Any:
    """Run ``script`` once per rank inside the ranks' namespaces with ``--rank R --world-size N --port P
    --json FILE`` plus ``args``; return what rank 0 wrote to FILE (JSON). Only rank 0's output is shown;
    every worker is killed if the deadline passes or one fails."""
    port = _port()
    with tempfile.TemporaryDirectory(prefix="gradpress-net-") as tmp:
        out = Path(tmp) / "results.json"
        procs = []
        for rank in range(net.world_size):
            env = {**os.environ, **net.env(rank), "OMP_NUM_THREADS": "1"}
            command = net.exec_prefix(rank) + [sys.executable, str(script), "--rank", str(rank),
                                                "--world-size", str(net.world_size), "--port", str(port),
                                                "--json", str(out), *args]
            procs.append(subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL if rank else None))
        deadline = time.monotonic() + timeout
        try:
            for proc in procs:
                proc.wait(timeout=max(1.0, deadline - time.monotonic()))
        finally:
            for proc in procs:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
        codes = [proc.returncode for proc in procs]
        if any(codes):
            raise RuntimeError(f"workers exited with {codes} (their output is above)")
        return json.loads(out.read_text())


def run_cell(net: Network, workloads: str, methods: str, warmup: int, steps: int, timeout: float,
             rounds: int = 1) -> list[dict[str, Any]]:
    """Run every method of ``methods`` on every workload over ``net`` as it is shaped now."""
    return run_workers(net, HERE / "worker.py", ["--workloads", workloads, "--methods", methods, "--warmup",
                                                 str(warmup), "--steps", str(steps), "--rounds", str(rounds),
                                                 "--ranks-per-node", str(net.ranks_per_node)], timeout)


def floor_ms(noop_step: float, hook_compute: float, bytes_sent: float, world_size: int, rate_bits: float) -> float:
    """Physical floor of a step: compute (noop step + the hook's own compute) + the bytes' time on the
    link for a ring allreduce, ``2 (n - 1) / n x bytes x 8 / rate``."""
    return noop_step + hook_compute + 1000 * 2 * (world_size - 1) / world_size * bytes_sent * 8 / rate_bits


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="DDP step time per method over rate-limited links (needs root).")
    parser.add_argument("--rates", default="1gbit", help="comma-separated tc rates (default: %(default)s)")
    parser.add_argument("--world-sizes", default="2", help="comma-separated rank counts (default: %(default)s)")
    parser.add_argument("--workloads", default="shapes", help="shapes, resnet18, transformer (comma-separated)")
    parser.add_argument("--methods", default=DEFAULT_METHODS, help="default: %(default)s")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=1,
                        help="run every method this many times, interleaved, and pool the steps (default 1)")
    parser.add_argument("--ranks-per-node", type=int, default=1,
                        help="ranks per node: they share a namespace, only links between nodes are shaped")
    parser.add_argument("--timeout", type=float, default=1800)
    parser.add_argument("--json", type=Path, default=None, help="write every result here")
    parser.add_argument("--cleanup", action="store_true", help="only delete namespaces left by a killed run")
    args = parser.parse_args(argv)
    try:
        check_can_build()
    except NetworkError as exc:
        print(f"run.py: error: {exc}", file=sys.stderr)
        return 2
    if args.cleanup:
        print(f"deleted: {', '.join(cleanup()) or 'nothing'}")
        return 0
    rates = [r.strip() for r in args.rates.split(",") if r.strip()]
    for rate in rates:
        parse_rate(rate)
    results: list[dict[str, Any]] = []
    started = time.time()
    for world_size in (int(w) for w in args.world_sizes.split(",")):
        with Network(world_size, rates[0], args.ranks_per_node) as net:
            for rate in rates:
                net.set_rate(rate)
                print(f"== {world_size} ranks ({net.nodes} nodes), {rate} ==", file=sys.stderr, flush=True)
                for result in run_cell(net, args.workloads, args.methods, args.warmup, args.steps, args.timeout,
                                           args.rounds):
                    results.append({**result, "world_size": world_size, "rate": rate,
                                    "ranks_per_node": args.ranks_per_node})
    report = {"command": " ".join(["python3", "benchmarks/network/run.py", *(argv or sys.argv[1:])]),
              "seconds": time.time() - started, "results": results}
    print(markdown(results))
    if args.json is not None:
        args.json.write_text(json.dumps(report, indent=1) + "\n")
    return 0


def _spread(result: dict[str, Any]) -> str:
    """The lowest and highest of the rounds' median steps (``--rounds``), or "1 round"."""
    rounds = result.get("round_step_ms", [])
    return f"{min(rounds):.0f}-{max(rounds):.0f} ({len(rounds)})" if len(rounds) > 1 else "1 round"


def markdown(results: list[dict[str, Any]]) -> str:
    """One table per (workload, ranks, rate): median step and its parts, ratio to allreduce."""
    lines = []
    cells: dict[tuple[str, int, str], list[dict[str, Any]]] = {}
    for r in results:
        cells.setdefault((r["workload"], r["world_size"], r["rate"]), []).append(r)
    for (workload, world_size, rate), rows in cells.items():
        by_method = {r["method"]: r for r in rows}
        base = by_method.get("allreduce", {}).get("median_ms", {}).get("step")
        noop = by_method.get("noop", {}).get("median_ms", {}).get("step")
        per_node = rows[0].get("ranks_per_node", 1)
        nodes = f" ({world_size // per_node} nodes of {per_node})" if per_node > 1 else ""
        lines += ["", f"{workload}, {world_size} ranks{nodes}, {rate}:", "",
                  "| method | step ms (median) | mean | forward | backward | optimizer | in hook | blocked "
                  "| bytes/step | floor ms | step / floor | vs allreduce | round medians |",
                  "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for r in rows:
            med, mean = r["median_ms"], r["mean_ms"]
            ratio = f"{med['step'] / base:.2f}x" if base else "n/a"
            # The floor's ring model assumes one rank per link: with nodes of several ranks it does not apply.
            shared = r.get("ranks_per_node", 1) > 1
            floor = None if noop is None or shared else floor_ms(noop, med["hook"] - med["blocked"],
                                                                 r["bytes_per_step"], world_size, parse_rate(rate))
            floor_text = "n/a" if floor is None else f"{floor:.1f}"
            above = "n/a" if floor is None else f"{med['step'] / floor:.2f}x"
            lines.append(f"| {r['method']} | {med['step']:.1f} | {mean['step']:.1f} | {med['forward']:.1f} | "
                         f"{med['backward']:.1f} | {med['optimizer']:.1f} | {med['hook']:.1f} | "
                         f"{med['blocked']:.1f} | {r['bytes_per_step'] / 1e6:.3g} MB | {floor_text} | {above} | "
                         f"{ratio} | {_spread(r)} |")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())

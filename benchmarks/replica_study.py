"""Quality per step of one method on W replicas simulated in one process: local SGD, DiLoCo and their
streamed and compressed variants at 8, 16 or 32 replicas on a machine with 2 cores.

``quality_study.py`` runs ``--workers`` gloo processes; the model-averaging methods' results depend on the
number of replicas (not only on the global batch, as PowerSGD's do), and 32 processes do not fit 2 cores.
Here ``--replicas W`` runs ``gradpress.tools.workloads.training.train`` for every rank as a thread of this
process (``gradpress.tools.workloads.replicas.train_replicas``: torch's threaded process group, the demo's
code path unchanged; ``tests/tools/test_replicas.py`` checks it equals gloo processes). One run per call, one JSON
per run in ``--out`` with quality_study's fields (``workers`` is W), so both scripts' runs share a table::

    python3 benchmarks/replica_study.py --task charlm --replicas 16 --steps 800 --start-iter 80 --evals 20 \\
        --methods diloco:8 --lr 2.0 --label replicas-charlm-w16-diloco8-lr2.0
    python3 benchmarks/replica_study.py --replicas 16 --methods allreduce --lr 2.0 --label replicas-charlm-w16-allreduce
    python3 benchmarks/quality_study.py --table [--out DIR]      # or this script's --table: the same

The record adds ``replicas`` and ``simulated: "threads"``; its times are those of W threads sharing this
machine's cores, not of W workers. Any method of the demo runs, allreduce included (the baseline of the
same replicas). Not part of CI.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from quality_study import (DEFAULT_OUT, add_run_arguments, command_line, load, outer_options,  # noqa: E402
                           powersgd_options, run_record, table)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--replicas", type=int, default=8, help="W, the simulated workers")
    add_run_arguments(parser, "replica")
    parser.add_argument("--methods", "--method", default="diloco", help="one method, e.g. localsgd:8 or diloco-int4:8")
    parser.add_argument("--powersgd-options", "--options", default=None,
                        help='JSON object of further PowerSGDState arguments, e.g. \'{"num_iters_per_step": 2}\'')
    parser.add_argument("--clip-grad-norm", type=float, default=None, metavar="NORM",
                        help="clip the averaged gradient to this norm every step")
    parser.add_argument("--label", default=None, help="the run's name (its JSON is LABEL.json in --out)")
    parser.add_argument("--out", default=str(DEFAULT_OUT))
    parser.add_argument("--table", action="store_true", help="print the markdown table of the runs in --out")
    parser.add_argument("--match", default="", help="--table: only the runs whose label contains this")
    parser.add_argument("--baseline", default=None, help="--table: as quality_study.py's")
    args = parser.parse_args(argv)
    if args.table:
        print(table([run for run in load(Path(args.out)) if args.match in run["label"]], args.baseline))
        return 0
    if not args.label:
        parser.error("--label is required for a run")
    if args.replicas < 1:
        parser.error(f"--replicas must be >= 1, got {args.replicas}")
    if args.clip_grad_norm is not None and not args.clip_grad_norm > 0:
        parser.error(f"--clip-grad-norm must be > 0, got {args.clip_grad_norm}")
    try:
        options = powersgd_options(args.powersgd_options)
    except (ValueError, TypeError) as exc:
        parser.error(f"--powersgd-options: {exc}")
    command = command_line("replica_study.py", argv if argv is not None else sys.argv[1:])

    os.environ["OMP_NUM_THREADS"] = "1"
    import torch

    from gradpress.tools.workloads import DemoConfig, parse_methods
    from gradpress.tools.workloads.replicas import train_replicas

    torch.set_num_threads(1)  # each replica thread one core's worth, as each gloo worker has
    config = DemoConfig(task=args.task, steps=args.steps, start_iter=args.start_iter, seed=args.seed, lr=args.lr,
                        momentum=args.momentum, evals=args.evals, powersgd_options=options,
                        clip_grad_norm=args.clip_grad_norm, optimizer=args.optimizer, batch_size=args.batch_size,
                        schedule=args.schedule, **outer_options(args))
    methods = parse_methods(args.methods, [1])
    if len(methods) != 1:
        parser.error(f"--methods must name one method, got {args.methods!r}")

    def progress(label: str, step: int, steps: int, loss: float) -> None:
        print(f"{label} on {args.replicas} replicas: step {step}/{steps}, train loss {loss:.4f}", flush=True)

    start = time.perf_counter()
    results = train_replicas(methods[0], config, args.replicas, on_progress=progress, device=args.device)
    record = run_record(results[0], config, label=args.label, command=command, workers=args.replicas,
                        replicas=args.replicas, simulated="threads", device=args.device,
                        elapsed_s=time.perf_counter() - start)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{args.label}.json").write_text(json.dumps(record, indent=1) + "\n")
    per_step = record["bytes_per_step"]
    fewer = f" ({record['bytes_allreduce_per_step'] / per_step:.2f}x fewer than allreduce)" if per_step else ""
    link = record.get("link_bytes_per_step")
    if link:  # what each replica's link carries (ring-equivalent), beside the payload
        fewer += (f", {link:,.0f} B/step on each link ({record['link_bytes_allreduce_per_step'] / link:.2f}x fewer "
                  "than allreduce's)")
    print(f"{args.label}: {record['ppl_mid']:.4g} at step {args.steps // 2}, {record['ppl_end']:.4g} at the end "
          f"({results[0]['metric_name']}), {per_step:,.0f} B/step after warm-up{fewer}; {args.replicas} replicas "
          f"simulated in {record['elapsed_s']:.1f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

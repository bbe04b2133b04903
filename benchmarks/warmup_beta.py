"""Does ``warm_up_beta_factor`` help when compression starts? The demo's loss curve with and without it.

Runs ``gradpress demo``'s workload (digits CNN, 4 gloo workers, 300 steps, PowerSGD from step 30) for
each method, beta and seed, with the test metric measured every 10 steps, and reports per method and
beta (median over seeds):

* ``spike``: the largest train loss logged in the 60 steps after compression starts, divided by the
  train loss logged just before it (1.0: no spike);
* ``dip``: the lowest test accuracy in those 60 steps;
* the final test accuracy and test loss.

    python benchmarks/warmup_beta.py --json benchmarks/results/warmup-beta-results.json \\
        --plot benchmarks/results/warmup-beta.png

About 4 minutes on a 2-core VM with the defaults.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Sequence
from typing import Any

from gradpress.tools.cli.demo import run_workers
from gradpress.tools.workloads import DemoConfig, parse_methods


def _betas(text: str) -> list[float | None]:
    return [None if t in ("none", "off") else float(t) for t in text.split(",")]


def figures(result: dict[str, Any], start: int, window: int = 60) -> dict[str, float]:
    curve = result["curve"]
    before = [c for c in curve if 0 < c["step"] <= start][-1]
    after = [c for c in curve if start < c["step"] <= start + window]
    return {
        "spike": max(c["train_loss"] for c in after) / before["train_loss"],
        "dip": min(c["metric"] for c in after),
        "final_accuracy": result["metric"],
        "final_test_loss": result["test_loss"],
    }


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--methods", default="powersgd:1,multi:1,multi:2")
    parser.add_argument("--betas", type=_betas, default=_betas("none,0.5,0.25"))
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--start-iter", type=int, default=30)
    parser.add_argument("--json", default=None)
    parser.add_argument("--plot", default=None)
    args = parser.parse_args(argv)
    methods = parse_methods(args.methods, [1])
    runs: list[dict[str, Any]] = []
    began = time.perf_counter()
    for seed in range(args.seeds):
        for beta in args.betas:
            config = DemoConfig(steps=args.steps, start_iter=args.start_iter, seed=seed, evals=args.steps // 10,
                                warm_up_beta=beta)
            results = run_workers(config, args.workers, methods=methods)
            for spec, per_rank in results.items():
                runs.append({"method": spec, "beta": beta, "seed": seed, "curve": per_rank[0]["curve"],
                             **figures(per_rank[0], args.start_iter)})
            print(f"[warmup_beta] seed {seed} beta {beta}: done ({time.perf_counter() - began:.0f} s)",
                  file=sys.stderr, flush=True)
    rows = ["| method | beta | loss spike after start (x) | lowest test acc in steps 31-90 | final test acc | "
            "final test loss |", "|---|---|---|---|---|---|"]
    table = []
    for method in methods:
        for beta in args.betas:
            mine = [r for r in runs if r["method"] == method.spec and r["beta"] == beta]
            med = {k: statistics.median(r[k] for r in mine)
                   for k in ("spike", "dip", "final_accuracy", "final_test_loss")}
            table.append({"method": method.spec, "beta": beta, **med})
            rows.append(f"| {method.label} | {'off' if beta is None else beta} | {med['spike']:.2f} | "
                        f"{100 * med['dip']:.1f}% | {100 * med['final_accuracy']:.1f}% | "
                        f"{med['final_test_loss']:.4f} |")
    command = "python benchmarks/warmup_beta.py " + " ".join(sys.argv[1:] if argv is None else argv)
    print(command + f"\n(median over {args.seeds} seeds, {args.workers} workers)\n\n" + "\n".join(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"command": command, "table": table, "markdown": "\n".join(rows),
                       "runs": [{k: v for k, v in r.items() if k != "curve"} for r in runs]}, f, indent=2)
    if args.plot:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        fig, axes = plt.subplots(1, len(methods), figsize=(5 * len(methods), 4), constrained_layout=True,
                                 squeeze=False)
        for ax, method in zip(axes[0], methods):
            for beta in args.betas:
                run = next(r for r in runs if r["method"] == method.spec and r["beta"] == beta and r["seed"] == 0)
                curve = run["curve"][1:]
                ax.plot([c["step"] for c in curve], [c["train_loss"] for c in curve],
                        label=f"beta {'off' if beta is None else beta}")
            ax.axvline(args.start_iter, color="grey", linestyle=":", linewidth=1)
            ax.set_yscale("log")
            ax.set_title(method.label)
            ax.set_xlabel("step")
            ax.set_ylabel("train loss (log)")
            ax.legend()
        fig.suptitle("warm_up_beta_factor: train loss, seed 0 (compression starts at the dotted line)")
        fig.savefig(args.plot, dpi=100)
    return 0


if __name__ == "__main__":
    sys.exit(main())

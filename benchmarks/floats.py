"""Floats sent per step: classic PowerSGD vs multi-iteration PowerSGD (``num_iters_per_step``).

Pure arithmetic from :func:`gradpress.make_plan` on the gradient shapes of real models (built on the
meta device, nothing is trained): for each rank r, the elements one worker puts on the wire per step
with plain allreduce, classic two-sided PowerSGD (``powerSGD_hook``, ``Config(num_iters_per_step=None)``)
and k one-sided iterations (the aggregator's default, k=1, and k=2, 4), averaged over steps since the
alternating scheme sends P and Q on alternate iterations. The same figures are what the code counts
(``PowerSGD.floats_per_step``, ``PowerSGDState.compression_stats()``; tests check both against the plan).

    python benchmarks/floats.py                     # markdown table on stdout
    python benchmarks/floats.py --models resnet18 --ranks 1,2,4 --iters 1,2,4
    python benchmarks/floats.py --models gpt2,lstm-wikitext2   # any gradpress.tools.zoo model
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

import gradpress
from gradpress.tools.bench.buckets import model_names, model_parameters  # gradpress.tools.zoo models, + resnet18


def rows(models: Sequence[str], ranks: Sequence[int], iters: Sequence[int], min_rate: float) -> list[str]:
    header = ["model", "r", "params", "classic PowerSGD"] + [f"k={k}" for k in iters] + \
             ["k=" + "/".join(map(str, iters)) + " vs classic"]
    out = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for model in models:
        shapes = [tuple(p.shape) for p in model_parameters(model)]
        for rank in ranks:
            plan = gradpress.make_plan(shapes, rank, min_rate)
            classic = plan.mean_numel_sent(None)
            cells = [model, str(rank), f"{plan.numel:,}", f"{classic:,.0f} ({plan.numel / classic:.0f}x)"]
            ratios = []
            for k in iters:
                sent = plan.mean_numel_sent(k)
                cells.append(f"{sent:,.0f} ({plan.numel / sent:.0f}x)")
                ratios.append(f"{sent / classic:.2f}")
            cells.append(" / ".join(ratios))
            out.append("| " + " | ".join(cells) + " |")
    return out


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="floats", description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="resnet18,resnet50", help=f"from {', '.join(model_names())}")
    parser.add_argument("--ranks", default="1,2,4")
    parser.add_argument("--iters", default="1,2,4", help="num_iters_per_step values")
    parser.add_argument("--min-compression-rate", type=float, default=2.0)
    args = parser.parse_args(argv)
    models = [m for m in args.models.split(",") if m]
    for m in models:
        if m not in model_names():
            parser.error(f"--models: unknown model {m!r}; choose from {', '.join(model_names())}")
    try:
        ranks = [int(r) for r in args.ranks.split(",")]
        iters = [int(k) for k in args.iters.split(",")]
    except ValueError:
        parser.error("--ranks and --iters must be comma-separated integers")
    if min(ranks) < 1 or min(iters) < 1:
        parser.error("--ranks and --iters must be integers >= 1")
    print("\n".join(rows(models, ranks, iters, args.min_compression_rate)))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Householder QR (``torch.linalg.qr``, one batched call per shape) against gradpress's batched Cholesky-QR
(``gradpress.powersgd.linalg.orthogonalize_groups_``, one call for all shapes) on the P factors of a
model's compressed matrices: GPT-2 small by default (heights 768 x 36, 3072 x 12, 1024 and 50257 at rank
32, as one compressed step orthogonalizes them). Medians of interleaved timed calls; on CUDA each call is
bracketed by ``torch.cuda.synchronize()``. Also reports the orthogonality error of each.

    python benchmarks/orthogonalize.py                       # CPU
    python benchmarks/orthogonalize.py --device cuda --json benchmarks/results/gpu/orthogonalize-h100.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections import Counter

import torch

from gradpress.powersgd import make_plan
from gradpress.powersgd.linalg import orthogonalize_groups_
from gradpress.tools.bench.buckets import model_names, model_parameters


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="gpt2", choices=model_names())
    parser.add_argument("--rank", type=int, default=32)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--json", help="also write the figures to this file")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    plan = make_plan([tuple(p.shape) for p in model_parameters(args.model)], args.rank, 2)
    heights = Counter({(g.n, g.rank): 0 for g in plan.groups})
    for g in plan.groups:
        heights[(g.n, g.rank)] += g.batch
    generator = torch.Generator().manual_seed(0)
    factors = [torch.randn(b, n, r, generator=generator).to(device) for (n, r), b in sorted(heights.items())]

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize()

    def householder() -> list[torch.Tensor]:
        return [torch.linalg.qr(p, mode="reduced")[0] for p in factors]

    def cholesky() -> list[torch.Tensor]:
        out = [p.clone() for p in factors]
        orthogonalize_groups_(out)
        return out

    times: dict[str, list[float]] = {"householder": [], "cholesky": []}
    for repeat in range(args.repeats + 1):
        for name, function in (("householder", householder), ("cholesky", cholesky)):
            sync()
            start = time.perf_counter()
            function()
            sync()
            if repeat:
                times[name].append(time.perf_counter() - start)
    errors = {}
    for name, function in (("householder", householder), ("cholesky", cholesky)):
        errors[name] = max(float((q.double().transpose(1, 2) @ q.double()
                                  - torch.eye(q.shape[2], dtype=torch.float64, device=device)).abs().max())
                           for q in function())
    medians = {name: statistics.median(values) * 1e3 for name, values in times.items()}
    print(f"{args.model}, rank {args.rank}, {args.device}: P factors {dict(sorted(heights.items()))}")
    print("| method | ms (median) | max |P^T P - I| |")
    print("|---|---|---|")
    for name in times:
        print(f"| {name} | {medians[name]:.2f} | {errors[name]:.1e} |")
    print(f"Cholesky-QR / Householder: {medians['cholesky'] / medians['householder']:.2f}x")
    if args.json:
        with open(args.json, "w") as handle:
            json.dump({"model": args.model, "rank": args.rank, "device": str(device),
                       "heights": {f"{n}x{r}": b for (n, r), b in sorted(heights.items())},
                       "median_ms": medians, "orthogonality_error": errors,
                       "torch": torch.__version__}, handle, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())

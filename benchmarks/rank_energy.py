"""What the automatic rank would see on the quality study's settings: the captured energy E(k) of the
averaged gradient at the end of the warm-up (:func:`gradpress.autorank.energy_profile`), for comparing
with the ranks that held or fell behind there.

One setting per call: the task's model trained with AdamW exactly as the study's warm-up (the study's
schedule for ``--steps``, the learning rate rising over the first tenth) for ``--start-iter`` steps on
``--sequences`` sequences a step in one process. The gradient of the mean loss over those sequences is the
average the warm-up's allreduce gives W workers of ``sequences / W`` each (up to float rounding and the
data order: the study's workers each read their own shard). E(k) is summed over the last
``--measure-iters`` steps (before each optimizer step), as ``AutoRank(measure_iters=...)`` does, over
the matrices PowerSGD would compress (``min_compression_rate`` 2, the study's).

Beside E(k) it measures the **noise energy of the average**, what ``AutoRank(criterion="noise")`` reads
from the workers' own gradients before the warm-up's allreduce: on the measured steps the sequences are
split into ``--groups`` equal groups, each group's mean gradient g_j taken apart (their mean is the step's
gradient, so the run is the same), and N = (mean_j ||g_j||^2 - ||mean_j g_j||^2) / (groups - 1), an
unbiased estimate of E||g - E g||^2 for the mean over all the sequences, whatever the split (two halves
read the same quantity with more spread; ``noise_halves`` keeps that estimate too). With T the squared
norm of the mean, the *residual over noise* of rank k is (1 - E(k)) T / N, summed over the measured
steps before dividing::

    python3 benchmarks/rank_energy.py --task gpt --sequences 32 --lr 3e-3 --out benchmarks/results/rank-energy
    python3 benchmarks/rank_energy.py --table --out benchmarks/results/rank-energy
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

import torch

from gradpress.autorank import energy_profile
from gradpress.tools.workloads import DemoConfig, get_task
from gradpress.tools.workloads.training import make_optimizer

RANKS = (4, 8, 12, 16, 22, 24, 32, 48, 64)


def group_gradients(task, model, x, y, groups: int) -> tuple[list[list[torch.Tensor]], float]:
    """Each of ``groups`` equal groups' mean gradient (parameters with a gradient, in order), and the mean
    of their losses (the step's loss)."""
    size = len(y) // groups
    params = [p for p in model.parameters() if p.requires_grad]
    parts, losses = [], []
    for j in range(groups):
        loss = task.loss(model, x[j * size:(j + 1) * size], y[j * size:(j + 1) * size])
        parts.append(list(torch.autograd.grad(loss, params)))
        losses.append(loss.item())
    return parts, sum(losses) / groups


def measure(task_name: str, sequences: int, lr: float, seed: int, steps: int, start_iter: int,
            measure_iters: int, max_rank: int, groups: int = 4) -> dict:
    task = get_task(task_name)
    data = task.load(seed)
    model = task.model(seed)
    config = DemoConfig(task=task_name, steps=steps, start_iter=start_iter, optimizer="adamw", lr=lr, seed=seed)
    optimizer = make_optimizer(list(model.parameters()), config)
    generator = torch.Generator().manual_seed(40_000 + seed)
    profile = torch.zeros(max_rank + 1, dtype=torch.float64)
    noise = halves = 0.0
    losses = []
    for step in range(1, start_iter + 1):
        index = torch.randint(len(data.y_train), (sequences,), generator=generator)
        optimizer.zero_grad(set_to_none=True)
        for group in optimizer.param_groups:
            group["lr"] = config.lr_at(step)
        x, y = data.x_train[index], data.y_train[index]
        if step > start_iter - measure_iters:
            params = [p for p in model.parameters() if p.requires_grad]
            parts, loss_value = group_gradients(task, model, x, y, groups)
            for i, p in enumerate(params):   # the step's gradient: the mean of the groups' (equal sizes)
                p.grad = torch.stack([part[i] for part in parts]).mean(dim=0)
            losses.append(loss_value)
            keep = [i for i, p in enumerate(params) if p.dim() >= 2]
            matrices = [params[i].grad for i in keep]
            profile += energy_profile(matrices, max_rank, config.min_compression_rate, seed=step)
            mean_sq = sum(float(params[i].grad.double().square().sum()) for i in keep)
            own = sum(float(part[i].double().square().sum()) for part in parts for i in keep) / groups
            noise += (own - mean_sq) / (groups - 1)
            half = groups // 2
            a = [torch.stack([part[i] for part in parts[:half]]).mean(0) for i in keep]
            b = [torch.stack([part[i] for part in parts[half:]]).mean(0) for i in keep]
            halves += sum(float((u - v).double().square().sum()) for u, v in zip(a, b)) / 4
        else:
            loss = task.loss(model, x, y)
            loss.backward()
            losses.append(loss.item())
        optimizer.step()
    captured = (profile[:-1] / profile[-1]).tolist()
    return {"task": task_name, "sequences": sequences, "lr": lr, "seed": seed, "steps": steps,
            "start_iter": start_iter, "measure_iters": measure_iters, "captured": captured,
            "groups": groups, "total": float(profile[-1]), "noise": noise, "noise_halves": halves,
            "residual_over_noise": [(1 - e) * float(profile[-1]) / noise for e in captured],
            "train_loss_last": sum(losses[-measure_iters:]) / measure_iters}


def shown(energy: float) -> str:
    """E to four decimals, cut rather than rounded: a value shown reaches a threshold of four decimals (the
    automatic rank's default, 0.997) exactly when the measured one does."""
    return f"{math.floor(energy * 1e4) / 1e4:.4f}"


def table(out: Path) -> None:
    rows = sorted((json.loads(p.read_text()) for p in out.glob("*.json")),
                  key=lambda r: (r["task"], r["sequences"], r["seed"]))
    print("| task | sequences/step | lr | seed | " + " | ".join(f"E({k})" for k in RANKS) + " |")
    print("|---|---|---|---|" + "---|" * len(RANKS))
    for r in rows:
        print(f"| {r['task']} | {r['sequences']} | {r['lr']:g} | {r['seed']} | "
              + " | ".join(shown(r["captured"][k - 1]) for k in RANKS) + " |")
    noisy = [r for r in rows if "noise" in r]
    if not noisy:
        return
    ranks = [k for k in RANKS if k >= 16]
    print("\n| task | sequences/step | N / T | N, two halves / four groups | "
          + " | ".join(f"R({k})" for k in ranks) + " |")
    print("|---|---|---|---|" + "---|" * len(ranks))
    for r in noisy:
        ratios = r["residual_over_noise"]
        print(f"| {r['task']} | {r['sequences']} | {r['noise'] / r['total']:.3f} | "
              f"{r['noise_halves'] / r['noise']:.2f} | "
              + " | ".join(f"{ratios[k - 1]:.4f}" if k <= len(ratios) else "" for k in ranks) + " |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--task", default="gpt")
    parser.add_argument("--sequences", type=int, default=32, help="per step, all workers together")
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--steps", type=int, default=800, help="the run whose warm-up this is (its schedule)")
    parser.add_argument("--start-iter", type=int, default=80)
    parser.add_argument("--measure-iters", type=int, default=4)
    parser.add_argument("--max-rank", type=int, default=64)
    parser.add_argument("--groups", type=int, default=4, help="equal groups the noise is measured from (>= 2, even)")
    parser.add_argument("--out", default="benchmarks/results/rank-energy")
    parser.add_argument("--table", action="store_true")
    args = parser.parse_args()
    if args.groups < 2 or args.groups % 2 or args.sequences % args.groups:
        parser.error(f"--groups must be even, >= 2 and divide --sequences ({args.sequences}), got {args.groups}")
    out = Path(args.out)
    if args.table:
        table(out)
        return
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    start = time.perf_counter()
    result = measure(args.task, args.sequences, args.lr, args.seed, args.steps, args.start_iter,
                     args.measure_iters, args.max_rank, args.groups)
    result["seconds"] = time.perf_counter() - start
    result["command"] = "python3 " + " ".join(sys.argv)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{args.task}-s{args.sequences}-lr{args.lr:g}-seed{args.seed}.json"
    if path.exists():   # a run measured before the noise was: keep its E beside the new one's
        result["captured_before"] = json.loads(path.read_text())["captured"]
    path.write_text(json.dumps(result, indent=1))
    print(f"{args.task}, {args.sequences} sequences/step: " +
          ", ".join(f"E({k})={shown(result['captured'][k - 1])}" for k in RANKS) + f" ({result['seconds']:.0f} s)")


if __name__ == "__main__":
    main()

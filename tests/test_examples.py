"""``examples/train.py`` runs under torchrun with the demo's code path and agrees with the demo."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import gradpress
from gradpress.workloads import get_task

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "train.py"


def test_example_runs_under_torchrun_and_matches_the_plan(tmp_path: Path) -> None:
    out = tmp_path / "results.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           str(EXAMPLE), "--method", "powersgd:1,fp16", "--steps", "6", "--start-iter", "3",
                           "--json", str(out)], capture_output=True, text=True, timeout=180, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "powersgd r=1: test accuracy" in proc.stdout and "fp16: test accuracy" in proc.stdout
    powersgd, fp16 = json.loads(out.read_text())
    assert powersgd["world_size"] == 2 and powersgd["steps"] == 6
    shapes = [tuple(s) for s in (p.shape for p in get_task("digits").model(0).parameters())]
    plan = gradpress.make_plan(shapes, 1, 2)
    assert powersgd["bytes_per_step"] == 4 * plan.numel_sent and powersgd["counted"]["ok"]
    assert fp16["bytes_per_step"] == 2 * plan.numel


def test_example_refuses_to_run_outside_torchrun() -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
    proc = subprocess.run([sys.executable, str(EXAMPLE), "--method", "powersgd:1"], capture_output=True,
                          text=True, timeout=60, env=env)
    assert proc.returncode == 2 and "torchrun" in proc.stderr

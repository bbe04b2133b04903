"""benchmarks/gpu_hooks.py (gradpress's hooks against PyTorch's on a GPU) runs end to end on the CPU.

Its figures come from a GPU (BENCHMARKS.md); here the same code runs on gloo with a tiny model, so a
change that breaks the script is seen before a GPU is lent."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "gpu_hooks.py"


def _run(*args: str, tmp_path: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT / "src")}
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, env=env,
                          cwd=tmp_path, timeout=300)


@pytest.mark.slow
def test_every_method_is_timed_or_its_failure_reported(tmp_path: Path) -> None:
    out = tmp_path / "hooks.json"
    methods = "allreduce,fp16,torch_powersgd:4,powersgd:4,powersgd_fp16:4,powersgd_diag:4"
    proc = _run("--device", "cpu", "--tiny", "--context", "16", "--warmup", "4", "--steps", "2", "--sync-steps", "1",
                "--rounds", "2", "--methods", methods, "--port", "29617", "--json", str(out), tmp_path=tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    report = json.loads(out.read_text())
    timed = {entry["method"]: entry for entry in report["methods"]}
    assert set(timed) | set(report["failed"]) == set(methods.split(","))
    assert not report["failed"], report["failed"]  # every hook above works on gloo with this torch
    for entry in timed.values():
        assert len(entry["times_ms"]) == 4 and all(t > 0 for t in entry["times_ms"])
        assert len(entry["round_medians_ms"]) == 2
    # The table compares each gradpress hook with its PyTorch twin.
    assert "| powersgd:4 |" in proc.stdout and "vs PyTorch's" in proc.stdout


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message given where there is no GPU")
def test_without_a_gpu_it_says_so(tmp_path: Path) -> None:
    proc = _run("--steps", "1", tmp_path=tmp_path)
    assert proc.returncode == 2 and "--device cuda needs a CUDA GPU" in proc.stderr

"""benchmarks/hook_op_times.py (each ATen op a hook dispatches, timed and summed) runs end to end on a
user's model given as ``module:factory``, for our hook and PyTorch's."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "hook_op_times.py"


@pytest.mark.slow
def test_each_hooks_ops_are_timed_and_its_products_are_among_them(tmp_path: Path) -> None:
    (tmp_path / "tiny_model.py").write_text(
        "import torch\n\ndef build():\n"
        "    return torch.nn.Sequential(torch.nn.Linear(96, 64), torch.nn.ReLU(), torch.nn.Linear(64, 48))\n")
    out = tmp_path / "ops.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(tmp_path)])}
    proc = subprocess.run([sys.executable, str(SCRIPT), "--model", "tiny_model:build", "--rank", "2", "--steps", "2",
                           "--warmup", "1", "--json", str(out)], capture_output=True, text=True, env=env,
                          cwd=tmp_path, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    results = {r["hook"]: r for r in json.loads(out.read_text())}
    assert set(results) == {"ours", "torch_batched"}
    for hook, r in results.items():
        assert 0 < r["products_ms_per_step"] <= r["op_ms_per_step"], (hook, r)
        # the total is the sum of the per-op figures (each rounded to 0.01 ms)
        assert abs(r["op_ms_per_step"] - sum(v["ms"] for v in r["ops"].values())) <= 0.01 * len(r["ops"]) + 0.01
        assert any(r["ops"].get(op, {}).get("calls", 0) > 0 for op in ("mm", "bmm")), (hook, sorted(r["ops"]))
        assert f"{hook}: tiny_model:build rank 2" in proc.stdout

"""The examples run under torchrun as their docstrings and the README say (``examples/train.py`` under a real
kill and restart: tests/tools/test_elastic.py).

Each example is started by a real ``torchrun`` once; a test's further runs of the same example (a resume
from what that run saved, a compiled variant) run its code path as ``__main__`` on processes forked from
the tests' server (``distributed.run_script``: the environment torchrun gives its workers, the group made
by the script itself), which saves an interpreter start and an ``import torch`` per process and run.
"""

from __future__ import annotations

import io
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import gradpress
import gradpress.tools.zoo
from distributed import run_script
from torchrun import torchrun_script

pytestmark = pytest.mark.slow

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "train.py"


def _example_module(path: Path):
    """An example script imported as a module (its ``main`` not run), to call its functions here."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(f"example_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_example_refuses_to_run_outside_torchrun(monkeypatch: pytest.MonkeyPatch,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    """In this process (the example's run under torchrun is tests/tools/test_elastic.py's killed run,
    checked there against the library's own ``train``)."""
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.setattr(sys, "argv", [str(EXAMPLE), "--method", "powersgd:1"])
    with pytest.raises(SystemExit) as exited:
        _example_module(EXAMPLE).main()
    assert exited.value.code == 2 and "torchrun" in capsys.readouterr().err


def _torchrun(script: str, *args: str, nproc: int = 4) -> str:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = torchrun_script(EXAMPLE.parent / script, list(args), nproc=nproc, timeout=240, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


def _in_process(script: str, *args: str, nproc: int = 4, cwd: Path | None = None, timeout: float = 240) -> str:
    """What ``_torchrun(script, *args)`` prints, the script's code path run by ``distributed.run_script``
    (every rank's output, rank 0's first)."""
    ranks = run_script(EXAMPLE.parent / script, list(args), nproc, env={**os.environ, "OMP_NUM_THREADS": "1"},
                       cwd=cwd, timeout=timeout)
    assert [code for code, _ in ranks] == [0] * nproc, ranks
    return "".join(out for _, out in ranks)


def test_fsdp_example_of_the_readme_compresses_across_replicas() -> None:
    out = _torchrun("fsdp_powersgd.py", "--steps", "12", "--start-iter", "4")
    losses = [float(line.split()[-1]) for line in out.splitlines() if line.startswith("step ")]
    assert len(losses) >= 2 and losses[-1] < losses[0]
    assert "PowerSGD across 2 replicas: 12 iterations" in out


def test_fsdp_islands_example_resumes_from_its_distributed_checkpoint_bit_for_bit(tmp_path: Path) -> None:
    ckpt, summary = tmp_path / "ckpt", tmp_path / "summary.json"
    out = _torchrun("fsdp_islands_diloco.py", "--verify-resume", "--steps", "24", "--checkpoint-dir", str(ckpt))
    assert "parameters equal to never stopping, bit for bit, on every rank: True" in out
    # That run left its half-way checkpoint (step 12) in --checkpoint-dir: new processes resume from it (the
    # example's code path on processes of their own; its launch under torchrun was the run above).
    out = _in_process("fsdp_islands_diloco.py", "--steps", "24", "--checkpoint-dir", str(ckpt), "--json", str(summary))
    assert f"resumed from {ckpt} at step 12" in out
    result = json.loads(summary.read_text())
    assert result["step"] == 24 and result["fragment_syncs"] > 0


def test_hierarchical_example_of_the_readme_sends_half_the_flat_bytes_per_node() -> None:
    out = _torchrun("hierarchical_powersgd.py", "--steps", "8")
    losses = [float(line.split()[-1]) for line in out.splitlines() if line.startswith("step ")]
    assert len(losses) >= 2 and losses[-1] < losses[0]
    flat = next(line for line in out.splitlines() if line.strip().startswith("flat:"))
    hierarchical = next(line for line in out.splitlines() if line.strip().startswith("hierarchical:"))
    per_rank = int(flat.split()[1].replace(",", ""))
    per_node = int(hierarchical.split("), ")[1].split()[0].replace(",", ""))
    assert per_node == per_rank  # a node sends what one flat rank sends: 1/L per rank with L = 2


OWN_SCRIPT = EXAMPLE.parent / "own_script.py"


def _own_script(tmp_path: Path, *args: str, launch: str = "in-process") -> dict:
    """``examples/own_script.py`` on 2 ranks, started by ``torchrun`` (``launch="torchrun"``: once in this
    module) or in processes of their own (``distributed.run_script``); what it wrote to ``--json``."""
    tmp_path.mkdir(exist_ok=True)
    out = tmp_path / f"run{len(list(tmp_path.glob('run*.json')))}.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    # A compiled run in a fresh environment compiles its C++ kernels with no cache: 20-25 s on an idle
    # 2-core machine, over 240 s measured beside a 2-process training run.
    timeout = 900 if "--compile" in args else 240
    argv = ["--out-dir", str(tmp_path / "out"), "--json", str(out), *args]
    if launch == "torchrun":
        proc = torchrun_script(OWN_SCRIPT, argv, nproc=2, timeout=timeout, env=env, cwd=tmp_path)
        assert proc.returncode == 0, proc.stderr[-3000:]
        stdout = proc.stdout
    else:
        assert launch == "in-process", launch
        ranks = run_script(OWN_SCRIPT, argv, 2, env=env, cwd=tmp_path, timeout=timeout)
        assert [code for code, _ in ranks] == [0, 0], ranks
        stdout = "".join(printed for _, printed in ranks)
    return {**json.loads(out.read_text()), "stdout": stdout}


def test_own_script_saves_on_rank_0_only_and_resumes_as_if_never_stopped(tmp_path: Path) -> None:
    whole = _own_script(tmp_path / "whole", "--max-iters", "40")
    # Accumulation: the hook ran on the synchronizing micro-step only, once per optimizer step.
    assert whole["hook_iter"] == whole["iter_num"] == 40
    plan = gradpress.make_plan([p.shape for p in _own_gpt().parameters()], 4, 2)
    assert whole["compression"] == pytest.approx(plan.compression_rate) and plan.compression_rate > 1
    assert whole["saved_at"] == [10, 20, 30]
    files = sorted(p.name for p in (tmp_path / "whole" / "out").iterdir())
    assert files == ["ckpt.pt"]  # one file, written by rank 0
    ckpt = gradpress.checkpoint.load(tmp_path / "whole" / "out" / "ckpt.pt")
    entries = ckpt["powersgd"]["ranks"]
    assert [list(entry["per_rank"]) for entry in entries] == [["rank_0"], ["rank_1"]]
    entries = [_own_entry(entry, rank) for rank, entry in enumerate(entries)]
    assert [entry["placement"]["rank"] for entry in entries] == [0, 1]  # every rank's own state
    assert not torch_equal(entries[0]["memory"], entries[1]["memory"])  # error memory differs per rank
    # What it costs, as docs/own-script.md says: per rank, n x m error memory + m x r factor per compressed matrix.
    expected = _state_bytes(_own_gpt(ckpt["model"]["wte.weight"].shape[0]), rank=4)
    assert [gradpress.state_nbytes(entry) for entry in entries] == [expected, expected]
    # As if the run had stopped during iteration 36: a new torchrun resumes from the newest checkpoint (30)
    # and redoes the iterations after it (this module's one launch of the example under torchrun; the run
    # that never stopped ran its code path on processes of their own).
    shutil.copytree(tmp_path / "whole" / "out", tmp_path / "split" / "out")
    resumed = _own_script(tmp_path / "split", "--max-iters", "40", "--init-from", "resume", launch="torchrun")
    assert resumed["hook_iter"] == resumed["iter_num"] == 40
    # Resumed at 30: its evaluation there is the uninterrupted run's (and no better, so nothing is saved).
    assert resumed["val_losses"] == whole["val_losses"][2:] and resumed["saved_at"] == []
    assert resumed["digest"] == whole["digest"]  # bitwise the run that never stopped


def _own_entry(state: dict, rank: int) -> dict:
    """Rank ``rank``'s values in a ``PowerSGDState.state_dict()`` (:func:`gradpress.checkpoint.per_rank_state`)."""
    import torch

    return torch.load(io.BytesIO(state["per_rank"][f"rank_{rank}"]), weights_only=True)


def torch_equal(a: dict, b: dict) -> bool:
    import torch

    return all(torch.equal(a[key]["error"], b[key]["error"]) for key in a)


def _own_gpt(vocab: int | None = None):
    """The example's model (its default sizes; ``vocab``: the example's text's unless given)."""
    module = _example_module(OWN_SCRIPT)
    return module.GPT(module.text_codes()[2] if vocab is None else vocab, block_size=32)


def _state_bytes(model, rank: int) -> int:
    """One rank's PowerSGD state in bytes from the plan: fp32 error memory n x m and warm-start Q m x r."""
    plan = gradpress.make_plan([p.shape for p in model.parameters()], rank, 2)
    return 4 * sum(n * m + m * t.rank for t in plan.compressed for n, m in [t.matrix])


def test_own_script_compiled_either_way_runs_the_hook_and_resumes(tmp_path: Path) -> None:
    # torch.compile(DDP(model)): the hook still compresses every optimizer step, and only those, as planned.
    ddp_compiled = _own_script(tmp_path / "ddp", "--max-iters", "20", "--compile", "ddp")
    assert ddp_compiled["hook_iter"] == ddp_compiled["iter_num"] == 20
    plan = gradpress.make_plan([p.shape for p in _own_gpt().parameters()], 4, 2)
    assert ddp_compiled["compression"] == pytest.approx(plan.compression_rate) and plan.compression_rate > 1
    assert ddp_compiled["saved_at"] == [10]
    # DDP(torch.compile(model)), nanoGPT's order, resumed from that run's checkpoint (iteration 10): the
    # checkpoint holds the uncompiled model's keys, and the run ends bitwise where the other order ends (the
    # model fits one DDP bucket, so both orders compile the same graph).
    shutil.copytree(tmp_path / "ddp" / "out", tmp_path / "model" / "out")
    resumed = _own_script(tmp_path / "model", "--max-iters", "20", "--compile", "model", "--init-from", "resume")
    assert resumed["hook_iter"] == resumed["iter_num"] == 20
    assert resumed["digest"] == ddp_compiled["digest"]


def test_own_script_page_matches_the_example_and_the_formula() -> None:
    """docs/own-script.md's snippets are excerpts of examples/own_script.py (which the tests above run):
    they compile, name only what gradpress exports, and the example makes the same calls; its sizes are
    the plan's arithmetic."""
    import re

    page = (EXAMPLE.parent.parent / "docs" / "own-script.md").read_text()
    example = OWN_SCRIPT.read_text()
    blocks = re.findall(r"```python\n(.*?)```", page, flags=re.S)
    assert len(blocks) == 3
    for block in blocks:
        compile(block, "own-script.md", "exec")
    for name in set(re.findall(r"gradpress\.([A-Za-z_]\w*)", page)):
        assert hasattr(gradpress, name), name
    for line in ("dist.broadcast(improved, 0)", "hooks = gradpress.gather_state(state)",
                 "gradpress.scatter_state(state, checkpoint[\"powersgd\"] if rank == 0 else None)",
                 "model.register_comm_hook(state, gradpress.powerSGD_hook)", "model.require_backward_grad_sync",
                 "model = torch.compile(model)", "model = DDP(model)"):
        assert line in page and line in example, line
    prose = " ".join(page.split())
    example_kib = float(re.search(r"for the example's model about (\d+) KiB per rank", prose).group(1))
    assert example_kib == pytest.approx(_state_bytes(_own_gpt(), rank=4) / 2**10, abs=5)
    gpt2_mib = float(re.search(r"GPT-2 small \(124M parameters, rank 4\) (\d+) MiB", prose).group(1))
    assert gpt2_mib == pytest.approx(_state_bytes(gradpress.tools.zoo.build_model("gpt2"), rank=4) / 2**20, abs=1)


def test_torchft_example_heals_a_joiner_after_a_kill(tmp_path: Path) -> None:
    """examples/torchft_diloco.py as its docstring runs it: a lighthouse, three replica groups under torchrun,
    one killed with SIGKILL mid-run, a fourth joining: the survivors and the joiner end with the same global
    state (the driver compares them and fails otherwise)."""
    pytest.importorskip("torchft", reason="torchft is not installed (pip install 'gradpress[torchft]')")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, str(EXAMPLE.parent / "torchft_diloco.py"), "--syncs", "10",
                           "--log-dir", str(tmp_path)], capture_output=True, text=True, timeout=400, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "killed replica 2" in proc.stdout and "replica 3: healed from a peer" in proc.stdout
    assert "global state identical on replicas 0, 1 and the joiner 3" in proc.stdout

"""Training that survives a lost worker.

``examples/train.py --checkpoint-dir`` saves every rank's state atomically and resumes from the newest
step all ranks completed; under ``torchrun --max-restarts`` a worker killed with SIGKILL restarts the
group, which ends with parameters bitwise equal to a run that never stopped. In-process tests cover the
resume itself (every method, a rank that missed the last save, another run's checkpoint, a corrupt
file); one ``torchrun`` test kills a real worker.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from gradpress import make_plan
from gradpress.launch import restart_store_prefix
from gradpress.tools.workloads import get_task
from distributed import run

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
METHODS = ["allreduce", "powersgd:2", "multi:2", "localsgd:4", "diloco:4"]
KILLED = ["powersgd:2", "diloco:4"]  # the torchrun test's methods: the hook's state, the averager's
STEPS = 24  # the torchrun test's steps per method


def _train(rank: int, world: int, spec: str, directory: str, steps: int, every: int, seed: int = 0) -> dict:
    from gradpress.tools.workloads import DemoConfig, parse_methods, train

    method = parse_methods(spec, [2])[0]
    config = DemoConfig(steps=steps, start_iter=3, seed=seed, evals=4)
    return train(rank, world, method, config, checkpoint_dir=directory, checkpoint_every=every)


def _train_keeping_every_checkpoint(rank: int, world: int, spec: str, directory: str, steps: int,
                                    every: int) -> dict:
    from gradpress.tools.workloads import checkpoints

    prune = checkpoints.prune
    checkpoints.prune = lambda *args, **kwargs: None  # keep the history, to resume from the middle
    try:
        return _train(rank, world, spec, directory, steps, every)
    finally:
        checkpoints.prune = prune


def _steps_on_disk(directory: str, spec: str, rank: int) -> list[int]:
    from gradpress.tools.workloads import checkpoints

    return checkpoints.steps_saved(checkpoints.run_directory(directory, spec), rank)


def _drop_after(directory: str, spec: str, step: int, ranks: list[int]) -> None:
    from gradpress.tools.workloads import checkpoints

    run_dir = checkpoints.run_directory(directory, spec)
    for rank in ranks:
        for saved in checkpoints.steps_saved(run_dir, rank):
            if saved > step:
                os.unlink(checkpoints.checkpoint_path(run_dir, saved, rank))


@pytest.mark.parametrize("spec", METHODS)
def test_resume_from_the_middle_ends_bitwise_equal_to_never_stopping(tmp_path: Path, spec: str) -> None:
    directory = str(tmp_path)
    full = run(_train_keeping_every_checkpoint, 2, spec, directory, 16, 4)
    assert _steps_on_disk(directory, spec, 0) == [4, 8, 12, 16]
    # As if the run had died during step 11: the files after step 8 never existed.
    _drop_after(directory, spec, 8, [0, 1])
    resumed = run(_train, 2, spec, directory, 16, 4)
    for before, after in zip(full, resumed):
        assert after["digest"] == before["digest"], spec
        assert after["bytes_total"] == before["bytes_total"]
        assert [p["metric"] for p in after["curve"]] == [p["metric"] for p in before["curve"]]
        assert after.get("counted") == before.get("counted")
    assert full[0]["digest"] == full[1]["digest"]
    # Once every rank holds the last step, each keeps only that one.
    assert _steps_on_disk(directory, spec, 0) == _steps_on_disk(directory, spec, 1) == [16]


def test_a_rank_that_missed_the_newest_save_makes_everyone_resume_from_the_step_before(tmp_path: Path) -> None:
    directory, spec = str(tmp_path), "powersgd:2"
    full = run(_train_keeping_every_checkpoint, 2, spec, directory, 12, 4)
    _drop_after(directory, spec, 8, [0, 1])
    _drop_after(directory, spec, 4, [1])  # rank 1 was killed while writing step 8
    assert _steps_on_disk(directory, spec, 0) == [4, 8] and _steps_on_disk(directory, spec, 1) == [4]
    resumed = run(_train, 2, spec, directory, 12, 4)
    assert [r["digest"] for r in resumed] == [r["digest"] for r in full]


def test_a_checkpoint_of_another_run_is_refused_naming_what_differs(tmp_path: Path) -> None:
    directory = str(tmp_path)
    run(_train, 2, "allreduce", directory, 8, 4)
    with pytest.raises(AssertionError, match=r"belongs to another run.*seed=0 \(now 1\)"):
        run(_train, 2, "allreduce", directory, 8, 4, 1)


def test_a_corrupt_checkpoint_is_named_not_silently_skipped(tmp_path: Path) -> None:
    directory, spec = str(tmp_path), "allreduce"
    run(_train, 2, spec, directory, 8, 4)
    from gradpress.tools.workloads import checkpoints

    path = checkpoints.checkpoint_path(checkpoints.run_directory(directory, spec), 8, 1)
    with open(path, "r+b") as f:
        f.truncate(100)
    # Every rank raises (rank 0's file is fine): none is left waiting in a collective for rank 1.
    with pytest.raises(AssertionError, match=r"(?s)rank\(s\) \[0, 1\].*rank 1: checkpoint file .*"
                                             r"step-00000008\.rank-1\.pt.*truncated or corrupt"):
        run(_train, 2, spec, directory, 8, 4)


def test_checkpoint_arguments_are_checked() -> None:
    from gradpress.tools.workloads import DemoConfig, parse_methods, train

    method = parse_methods("allreduce", [1])[0]
    with pytest.raises(ValueError, match="checkpoint_every must be an integer >= 1, got 0"):
        train(0, 1, method, DemoConfig(steps=4, start_iter=2), checkpoint_dir="x", checkpoint_every=0)
    with pytest.raises(ValueError, match="checkpoint_every was given without checkpoint_dir"):
        train(0, 1, method, DemoConfig(steps=4, start_iter=2), checkpoint_every=2)
    with pytest.raises(ValueError, match="fail_kind must be one of raise, sigkill, hang"):
        DemoConfig(fail_kind="segfault")


def test_restart_store_prefix_names_the_attempt_only_where_every_worker_agrees_on_it() -> None:
    shared = {"TORCHELASTIC_USE_AGENT_STORE": "True", "TORCHELASTIC_MAX_RESTARTS": "3",
              "TORCHELASTIC_RESTART_COUNT": "2", "GROUP_WORLD_SIZE": "1"}
    assert restart_store_prefix(shared) == "gradpress/attempt_2"
    assert restart_store_prefix({**shared, "TORCHELASTIC_MAX_RESTARTS": "0"}) is None  # no restarts
    assert restart_store_prefix({**shared, "TORCHELASTIC_USE_AGENT_STORE": "False"}) is None  # fresh store
    assert restart_store_prefix({**shared, "GROUP_WORLD_SIZE": "2"}) is None  # per-agent counts differ
    assert restart_store_prefix({}) is None


def _never_killed(rank: int, world: int, spec: str, steps: int) -> list[dict]:
    """What ``examples/train.py --method SPEC --steps STEPS`` returns on ``rank``, run without a checkpoint."""
    from gradpress.tools.workloads import DemoConfig, default_start_iter, parse_methods, train

    config = DemoConfig(task="digits", steps=steps, start_iter=default_start_iter(steps), seed=0)
    return [train(rank, world, method, config) for method in parse_methods(spec, [2])]


def _torchrun(out: Path, launcher: list[str], train: list[str]) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT / "src")}
    with open(out.with_suffix(".log"), "w") as log:
        return subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
                                 "2", *launcher, str(ROOT / "examples" / "train.py"), "--method", ",".join(KILLED),
                                 "--steps", str(STEPS), "--json", str(out), *train],
                                cwd=out.parent, env=env, stdout=log, stderr=subprocess.STDOUT)


def test_torchrun_restarts_after_a_sigkill_and_ends_bitwise_equal_to_an_uninterrupted_run(tmp_path: Path) -> None:
    """Rank 1 kills itself (SIGKILL) at step 14 of each method, after the checkpoint of step 12: one
    restart per method, each resuming from step 12, and every method's final parameters equal those of
    the run that was never killed. Two methods, the hook's state and the averager's: every method's
    resume is checked in-process above, bit for bit; this test is about the real kill, torchrun's restart
    and its fresh rendezvous. The run that was never killed is the example's code path on the test's own
    worker group (``train`` with the config ``examples/train.py`` builds from the same arguments): no
    second ``torchrun``, whose three interpreters and imports of torch cost more than its training."""
    killed = _torchrun(tmp_path / "killed.json", ["--max-restarts", str(len(KILLED))],
                       ["--checkpoint-dir", str(tmp_path / "ckpt"), "--checkpoint-every", "6",
                        "--fail-at-step", "14", "--fail-kind", "sigkill"])
    expected = run(_never_killed, 2, ",".join(KILLED), STEPS)[0]
    # The limit catches a hang, not slowness: the killed run starts three times over.
    assert killed.wait(timeout=900) == 0, (tmp_path / "killed.log").read_text()[-3000:]
    log = (tmp_path / "killed.log").read_text()
    assert log.count("exitcode: -9") == len(KILLED), log[-3000:]  # one SIGKILL per method, each restarted
    assert "connectFullMesh" not in log
    got = json.loads((tmp_path / "killed.json").read_text())
    assert [r["method"] for r in got] == KILLED
    for before, after in zip(expected, got):
        assert after["digest"] == before["digest"], before["method"]
        assert after["bytes_total"] == before["bytes_total"] and after["metric"] == before["metric"]
    # Rank 0 printed one line per method, and the hook sent what the plan says over the wire it counted.
    assert "powersgd r=2: test accuracy" in log and "diloco H=4: test accuracy" in log
    shapes = [tuple(p.shape) for p in get_task("digits").model(0).parameters()]
    assert got[0]["world_size"] == 2 and got[0]["bytes_per_step"] == 4 * make_plan(shapes, 2, 2).numel_sent
    assert got[0]["counted"]["ok"]

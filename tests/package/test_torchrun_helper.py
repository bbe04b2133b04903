"""tests/torchrun.py: a run that hangs is stopped with every worker's Python stacks, and a worker stuck
after its peers printed their last line is run once more."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from torchrun import Hang, torchrun  # noqa: E402

_ENV = {**os.environ, "OMP_NUM_THREADS": "1"}
# Rank 1 waits in a function whose name the dump must show, unless the marker file is there; it
# leaves the marker behind, so a second run finishes.
_SCRIPT = ("import os, sys, time\n"
           "def stuck_in_teardown():\n"
           "    while True: time.sleep(1)\n"
           "rank = os.environ['RANK']\n"
           "if rank == '1' and not os.path.exists('marker'):\n"
           "    open('marker', 'w').close()\n"
           "    stuck_in_teardown()\n"
           "sys.stdout.write(f'rank {rank} done\\n'); sys.stdout.flush()\n")


@pytest.mark.slow
def test_a_worker_stuck_after_its_peer_finished_is_dumped_and_run_again(tmp_path: Path) -> None:
    with pytest.warns(UserWarning, match="(?s)hung after its last line.*stuck_in_teardown"):
        proc = torchrun(["--no-python", sys.executable, "-c", _SCRIPT], timeout=300, env=_ENV, cwd=tmp_path,
                        finished=r"rank \d done", straggler_s=5)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert sorted(line for line in proc.stdout.splitlines() if "done" in line) == ["rank 0 done", "rank 1 done"]


@pytest.mark.slow
def test_a_run_past_its_time_fails_with_the_workers_stacks(tmp_path: Path) -> None:
    script = ("import sys, time\ndef waits_for_ever():\n    time.sleep(10_000)\n"
              "sys.stdout.write('waiting\\n'); sys.stdout.flush(); waits_for_ever()\n")
    # 15 s: time for torchrun (its import of torch) and both workers (plain Python) to start on a busy
    # machine; a worker that had not started is not required to have stacks
    with pytest.raises(Hang, match="did not finish in 15 s") as caught:
        torchrun(["--no-python", sys.executable, "-c", script], timeout=15, env=_ENV, cwd=tmp_path)
    started = caught.value.stdout.count("waiting")
    assert caught.value.stderr.count("in waits_for_ever") >= started  # the stacks of every worker that started

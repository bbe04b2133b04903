"""Run a script under ``torchrun`` and, when it hangs, say where each worker stood.

``torchrun(args, timeout=...)`` is ``subprocess.run([python, -m, torch.distributed.run, *args])`` with
three additions for tests:

* the workers run with ``PYTHONFAULTHANDLER=1``: when the run outlives ``timeout``, each worker still
  alive gets ``SIGABRT`` first, so its Python stacks (every thread) land in the stderr the assertion
  prints, instead of a bare "did not finish";
* ``finished``: a pattern each worker prints once as its last line. When some workers have printed it
  and another has not ``straggler_s`` seconds later, that worker is stuck in its teardown (its peers got
  past the same last collective long ago): its stacks are dumped and the whole run is started once more,
  with a warning that carries the stacks. A second such hang fails the test;
* the outputs are read while the run goes on, so a hang still shows what was printed.

``torchrun_script(script, args, ...)`` runs a script that way: each worker runs it as ``python script
args`` would (``runpy``, as ``__main__``) and then prints that last line itself, so a worker stuck in its
teardown after the script (a gloo group's destructor waiting for the GIL, see ``distributed._script``)
costs ``straggler_s`` and a second run instead of the whole ``timeout`` and a failed test.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
import warnings
from pathlib import Path
from typing import IO


class Hang(AssertionError):
    """The run did not end: ``stdout`` and ``stderr`` (with the workers' stacks) so far."""

    def __init__(self, what: str, stdout: str, stderr: str) -> None:
        super().__init__(f"{what}; stdout:\n{stdout[-4000:]}\nstderr:\n{stderr[-6000:]}")
        self.stdout, self.stderr = stdout, stderr


def _descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (read from ``/proc``: each process's parent is in its ``stat``)."""
    parents: dict[int, int] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        parents[int(stat.parent.name)] = int(fields[1])
    found: list[int] = []
    pending = [pid]
    while pending:
        parent = pending.pop()
        children = [child for child, of in parents.items() if of == parent]
        found += children
        pending += children
    return found


def _alive(pid: int) -> bool:
    """Whether ``pid`` still runs (a zombie, dead but not yet reaped by its parent, does not)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def _read(stream: IO[str], into: list[str]) -> None:
    for line in iter(stream.readline, ""):
        into.append(line)


def _once(command: list[str], timeout: float, env: dict[str, str], cwd: str | os.PathLike[str] | None,
          finished: str | None, nproc: int, straggler_s: float) -> subprocess.CompletedProcess[str]:
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=cwd)
    assert proc.stdout is not None and proc.stderr is not None
    out: list[str] = []
    err: list[str] = []
    readers = [threading.Thread(target=_read, args=(proc.stdout, out), daemon=True),
               threading.Thread(target=_read, args=(proc.stderr, err), daemon=True)]
    for reader in readers:
        reader.start()
    start = time.monotonic()
    first_done: float | None = None
    what = None
    while proc.poll() is None:
        time.sleep(0.5)
        now = time.monotonic()
        if finished is not None:
            done = len(re.findall(finished, "".join(out)))
            if done and first_done is None:
                first_done = now
            if 0 < done < nproc and first_done is not None and now - first_done > straggler_s:
                what = (f"{nproc - done} of {nproc} workers did not finish {straggler_s:.0f} s after the "
                        f"first one did (a hang in their teardown)")
        if what is None and now - start > timeout:
            what = f"the run did not finish in {timeout:.0f} s"
        if what is not None:
            break
    if what is None:
        for reader in readers:
            reader.join()
        return subprocess.CompletedProcess(command, proc.returncode, "".join(out), "".join(err))
    workers = _descendants(proc.pid)
    os.kill(proc.pid, signal.SIGSTOP)  # torchrun would stop the other workers when the first one dies
    for pid in workers:  # faulthandler prints every thread's Python stack, then the worker dies: one at
        try:             # a time, or the workers' dumps interleave in the stderr they share
            os.kill(pid, signal.SIGABRT)
        except ProcessLookupError:
            continue
        for _ in range(50):
            if not _alive(pid):
                break
            time.sleep(0.1)
    for pid in [proc.pid, *workers]:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    proc.wait()
    for reader in readers:
        reader.join(timeout=10)
    raise Hang(what, "".join(out), "".join(err))


def torchrun(args: list[str], *, timeout: float, nproc: int = 2, env: dict[str, str] | None = None,
             cwd: str | os.PathLike[str] | None = None, finished: str | None = None,
             straggler_s: float = 180.0) -> subprocess.CompletedProcess[str]:
    """``torchrun --standalone --nproc-per-node NPROC *args`` (see the module's docstring)."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc), *args]
    env = {**(os.environ if env is None else env), "PYTHONFAULTHANDLER": "1"}
    try:
        return _once(command, timeout, env, cwd, finished, nproc, straggler_s)
    except Hang as hang:
        if "teardown" not in str(hang).splitlines()[0]:
            raise
        warnings.warn(f"a worker hung after its last line and was run again:\n{hang.stderr[-6000:]}",
                      stacklevel=2)
    return _once(command, timeout, env, cwd, finished, nproc, straggler_s)


#: What each worker of :func:`torchrun_script` prints once its script has returned (with its exit code).
FINISHED = "tests/torchrun.py: the script returned"


def torchrun_script(script: str | os.PathLike[str], args: list[str], *, timeout: float, nproc: int = 2,
                    env: dict[str, str] | None = None, cwd: str | os.PathLike[str] | None = None,
                    straggler_s: float = 30.0) -> subprocess.CompletedProcess[str]:
    """``torchrun --standalone --nproc-per-node NPROC script args`` through :func:`torchrun`, each worker
    running the script as ``__main__`` and then printing :data:`FINISHED` (one write: the workers share
    the pipe); the run's exit code is the script's. 30 s after a peer's last line, a worker still in its
    teardown is stuck: past its last collective what is left takes milliseconds on any machine."""
    wrapper = ("import os, runpy, sys\n"
               "sys.argv = sys.argv[1:]\n"
               "sys.path[0] = os.path.dirname(os.path.abspath(sys.argv[0]))  # as python script puts it\n"
               "code = 0\n"
               "try:\n"
               "    runpy.run_path(sys.argv[0], run_name='__main__')\n"
               "except SystemExit as exc:\n"
               "    code = exc.code\n"
               f"sys.stdout.write(f'{FINISHED} (exit code {{code}})\\n')\n"
               "sys.stdout.flush()\n"
               "sys.exit(code)\n")
    return torchrun(["--no-python", sys.executable, "-c", wrapper, os.fspath(script), *args], timeout=timeout,
                    nproc=nproc, env=env, cwd=cwd, finished=re.escape(FINISHED), straggler_s=straggler_s)

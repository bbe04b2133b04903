"""int4 streaming DiLoCo across torchft replica groups: one is killed mid-run, another joins and is healed.

Run it (CPU, gloo; about 30 s on 2 cores)::

    pip install "gradpress[torchft]"
    python examples/torchft_diloco.py                      # the driver: lighthouse + 3 replica groups

The driver starts a torchft lighthouse and three replica groups, each under its own ``torchrun`` (one
process per group here; more with ``--nproc-per-node``, every rank of a group training the same
replica), kills one with SIGKILL once it has synced a few times, then starts a fourth, which torchft heals
from a healthy peer at its first quorum: it copies the model, the inner optimizer and the averager's
*global* state (anchors, outer momentum, step and sync counters); its residuals start from zero. Training
goes on with whoever is in each sync's quorum; a sync that loses a member is not committed and is
retried. At the end the survivors' global states are compared (bitwise equal).

The same script is each replica group's training loop when run under torchrun with ``--replica N``
(what the driver does; by hand: ``torchft_lighthouse --min_replicas 2`` and, per group,
``TORCHFT_LIGHTHOUSE=http://host:port torchrun --nproc-per-node 1 examples/torchft_diloco.py --replica 0``).
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tempfile
import time
from datetime import timedelta

import torch
from torch import nn


def replica(args: argparse.Namespace) -> None:
    """One replica group's training loop (under torchrun: its store is torchrun's)."""
    from torchft import Manager, ProcessGroupGloo

    import gradpress
    from gradpress.integrations.torchft import FaultTolerantGroup

    torch.set_num_threads(1)
    print(f"replica {args.replica}: pid {os.getpid()}", flush=True)   # the driver kills this process
    manager = Manager(pg=ProcessGroupGloo(timeout=timedelta(seconds=30)), load_state_dict=None, state_dict=None,
                      min_replica_size=2, replica_id=f"replica_{args.replica}", use_async_quorum=False,
                      timeout=timedelta(seconds=30),
                      # a joiner waits for the incumbents' next sync: the quorum timeout must cover H inner steps
                      quorum_timeout=timedelta(minutes=5))
    group = FaultTolerantGroup(manager)
    torch.manual_seed(0)                                   # the same initial model everywhere (torchft syncs it too)
    model = nn.Sequential(nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 8))
    teacher = nn.Linear(32, 8)
    inner = torch.optim.AdamW(model.parameters(), lr=3e-3)
    averager = gradpress.StreamingDiLoCoAverager(sync_every=8, num_fragments=2, fragment_sync_delay=1,
                                                 fragment_phase="end", compression=gradpress.QuantizeInt4(),
                                                 sync_group=group)
    group.register("model", model)
    group.register("inner", inner)
    group.register("diloco", averager)                     # global state only: residuals stay local
    averager.anchor_parameters(list(model.parameters()))
    data = torch.Generator().manual_seed(1000 + args.replica)
    quorums = 0
    joined_at: int | None = None
    loss = torch.tensor(float("nan"))
    marker = os.path.join(args.log_dir, "joined")       # the joiner's sign that it is in (--await-joiner waits for it)
    while True:
        x = torch.randn(32, 32, generator=data)
        loss = nn.functional.mse_loss(model(x), teacher(x).detach())
        loss.backward()
        inner.step()
        inner.zero_grad()
        time.sleep(args.step_seconds)                      # stands for a real model's compute
        averager.average_parameters(model.parameters())
        if len(group.quorums) > quorums:
            quorums = len(group.quorums)
            if quorums == 1 and args.joiner:
                joined_at = group.committed()
                with open(marker, "w") as f:               # everyone trains on 4 syncs with the joiner
                    f.write(str(joined_at))
            if quorums == 1 and group.healed_bytes:
                print(f"replica {args.replica}: healed from a peer at sync {group.committed()}: "
                      f"{sum(group.healed_bytes):,} bytes, quorum wait {group.quorum_seconds[0]:.2f} s", flush=True)
        if group.last_commit is not None:
            committed, world = group.committed(), group.quorums[-1][2]
            print(f"replica {args.replica}: sync {committed:3d} among {world} replica groups "
                  f"{'committed' if group.last_commit else f'NOT committed (retried): {manager.errored()}'}, "
                  f"loss {loss.item():.4f}",
                  flush=True)
            group.last_commit = None
            # stop between syncs (nothing in flight), once the joiner is in
            if joined_at is None and args.await_joiner and os.path.exists(marker):
                with open(marker) as f:
                    joined_at = int(f.read() or 0)
            if group.committed() >= max(args.syncs, (joined_at or 0) + 4) and \
                    (not args.await_joiner or joined_at is not None):
                break
    state = averager.global_state_dict()
    digest = sum(float(t.double().sum()) for f in state["fragments"] for t in f["anchor"])
    print(f"replica {args.replica}: done at sync {group.committed()}, loss {loss.item():.4f}, "
          f"longest quorum wait {max(group.quorum_seconds):.2f} s, global state digest {digest!r}", flush=True)
    manager.shutdown(wait=False)


def _launch(index: int, lighthouse: str, syncs: int, step_seconds: float, log_dir: str) -> subprocess.Popen:
    env = {**os.environ, "TORCHFT_LIGHTHOUSE": lighthouse, "OMP_NUM_THREADS": "1", "RUST_LOG": "error"}
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1",
               os.path.abspath(__file__), "--replica", str(index), "--syncs", str(syncs), "--step-seconds",
               str(step_seconds), "--log-dir", log_dir] + (["--joiner"] if index == 3 else ["--await-joiner"])
    stderr = open(os.path.join(log_dir, f"replica_{index}.log"), "w")   # torchft's and torchrun's logs
    return subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=stderr, text=True,
                            start_new_session=True)            # its own process group: killed with its worker


def driver(args: argparse.Namespace) -> None:
    from torchft.coordination import LighthouseServer

    lighthouse = LighthouseServer(bind="[::]:0", min_replicas=2, join_timeout_ms=5000, heartbeat_timeout_ms=2000)
    os.makedirs(args.log_dir, exist_ok=True)
    if os.path.exists(os.path.join(args.log_dir, "joined")):
        os.remove(os.path.join(args.log_dir, "joined"))
    print(f"lighthouse at {lighthouse.address()}; the replica groups' logs in {args.log_dir}", flush=True)
    groups = {i: _launch(i, lighthouse.address(), args.syncs, args.step_seconds, args.log_dir) for i in range(3)}
    lines: dict[int, list[str]] = {i: [] for i in range(4)}
    os.set_blocking(groups[2].stdout.fileno(), False)  # type: ignore[union-attr]
    start = time.monotonic()
    pid = None
    while True:                                         # replica 2 syncs a few times, then it is killed
        line = groups[2].stdout.readline()  # type: ignore[union-attr]
        if line:
            print(line, end="", flush=True)
            lines[2].append(line)
            if line.startswith("replica 2: pid "):
                pid = int(line.split()[-1])
            if line.count("committed") and "sync" in line and int(line.split("sync")[1].split()[0]) >= args.kill_at:
                break
        elif groups[2].poll() is not None or time.monotonic() - start > 300:
            raise SystemExit(f"replica 2 stopped before sync {args.kill_at}")
        else:
            time.sleep(0.05)
    assert pid is not None
    os.kill(pid, signal.SIGKILL)                        # the training process itself (torchrun's worker)
    os.killpg(groups[2].pid, signal.SIGKILL)            # and its torchrun, which would restart it
    groups[2].wait()
    print("driver: killed replica 2 (SIGKILL); starting replica 3", flush=True)
    groups[3] = _launch(3, lighthouse.address(), args.syncs, args.step_seconds, args.log_dir)
    for i in (0, 1, 3):
        try:
            out, _ = groups[i].communicate(timeout=600)
        except subprocess.TimeoutExpired:
            for g in groups.values():
                if g.poll() is None:
                    os.killpg(g.pid, signal.SIGKILL)
            raise SystemExit(f"replica {i} did not finish within 10 minutes (its log: {args.log_dir})")
        print(out, end="", flush=True)
        lines[i] += out.splitlines()
        if groups[i].returncode != 0:
            raise SystemExit(f"replica {i} failed (exit code {groups[i].returncode})")
    lighthouse.shutdown()
    digests = {i: next(s for s in lines[i] if "digest" in s).rsplit(" ", 1)[1] for i in (0, 1, 3)}
    same = len(set(digests.values())) == 1
    failed = sum("NOT committed" in s for i in (0, 1) for s in lines[i])
    print(f"driver: {failed} uncommitted syncs seen by the survivors; global state "
          f"{'identical' if same else 'DIFFERENT'} on replicas 0, 1 and the joiner 3; "
          f"{time.monotonic() - start:.1f} s", flush=True)
    if not same:
        raise SystemExit(1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--replica", type=int, default=None, help="run one replica group (under torchrun)")
    parser.add_argument("--syncs", type=int, default=40,
                        help="committed syncs to train for (at least, with --await-joiner)")
    parser.add_argument("--step-seconds", type=float, default=0.05, help="sleep per inner step (its compute)")
    parser.add_argument("--kill-at", type=int, default=6, help="the driver kills replica 2 after this sync")
    parser.add_argument("--joiner", action="store_true", help="this replica group joins mid-run (the driver's 3)")
    parser.add_argument("--await-joiner", action="store_true",
                        help="train on past --syncs until the joiner is in (the driver's 0-2)")
    parser.add_argument("--log-dir", default=os.path.join(tempfile.gettempdir(), "torchft_diloco"),
                        help="where the driver writes each replica group's log")
    args = parser.parse_args()
    if args.replica is not None:
        replica(args)
    else:
        driver(args)


if __name__ == "__main__":
    main()

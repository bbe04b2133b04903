"""gradpress over torchft: a lighthouse in the test process, one-process replica groups on gloo as worker
processes (forked from the demo's server that imported torch once), each with its own torchft ``Manager``.

Oracles:

* PowerSGD over :class:`FaultTolerantGroup`'s communicator at fixed membership (2 replica groups) equals
  the same run over a plain gloo process group **bitwise**: the engine issues the same sum all-reduces of
  the same buffers, and a sum of two floats does not depend on the order (at 2 replicas; beyond, gloo's
  ring could add in another order), for the aggregator and for the DDP hook (:func:`fault_tolerant_ddp`
  against plain DDP).
* PowerSGD (the aggregator, and the DDP hook in :func:`fault_tolerant_ddp`; momentum SGD) with 3 replica
  groups: one is lost after a step's quorum, before its first all-reduce; that step does not commit on
  the others (no optimizer step; error memory, factors and parameters bitwise as before) and is taken
  again. A replica joins: right after its quorum
  its global PowerSGD state (factors, counters) equals its peer's and its error memory is zero; after
  every later step all replicas' parameters are bitwise equal (the same all-reduced update everywhere).
* Streaming DiLoCo int4 (two fragments, ``τ = 1``: the two-shot all-to-all at the send step, the
  all-gather one step later) with 3 replica groups: one dies between the two phases; the sync is not
  committed on the others, every averager tensor is bitwise as before it, the fragment's parameters are
  back at its anchor, and the same fragment is sent again at the next round (by all-gather at 2). Then a
  replica joins: right after its quorum its global state (step, layout, anchors, outer momentum, sync
  counts) equals its peers' bitwise and it holds no residual; after every later sync all members' global
  states are bitwise equal.
* The membership replay: the quorums the torchft run recorded, replayed for its replicas as threads of
  one process (:mod:`gradpress.tools.workloads.membership`), give bitwise the same global state and
  parameters after every committed sync (the payloads' exchange is data movement only; every sum and
  rounding is gradpress's own in both).
* Bad input: torchft's ``Manager`` or process group given where a process group is expected, and the
  reverse, raise ``TypeError`` naming the argument before anything is sent.
"""

from __future__ import annotations

import io
import os
import queue
import time
import traceback
from datetime import timedelta
from typing import Any

import pytest

torchft = pytest.importorskip("torchft", reason="torchft is not installed (pip install 'gradpress[torchft]')")

import torch  # noqa: E402
from torch import nn  # noqa: E402

import gradpress  # noqa: E402
from gradpress.integrations.torchft import FaultTolerantGroup, fault_tolerant_ddp  # noqa: E402
from gradpress.tools.cli.demo.supervisor import context  # noqa: E402
from gradpress.tools.processes import free_port  # noqa: E402

# the runs of replica groups are slow (each a few seconds of processes); the bad-input tests are quick
pytestmark = [pytest.mark.xdist_group("torchft")]

TIMEOUT = 150.0          # per run, on a loaded 2-core machine; a healthy run takes a few seconds
QUORUM = timedelta(seconds=60)


# -- the harness -----------------------------------------------------------------------------------

def _quiet() -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    os.environ.setdefault("RUST_LOG", "error")
    torch.set_num_threads(1)
    import logging
    logging.getLogger("torchft").setLevel(logging.ERROR)


_STORES: list[Any] = []


def _manager(name: str, lighthouse: str, min_replicas: int) -> Any:
    import torch.distributed as dist
    from torchft import Manager, ProcessGroupGloo

    store = dist.TCPStore("localhost", 0, is_master=True, wait_for_workers=False)
    _STORES.append(store)  # the replica group's store lives as long as its process
    return Manager(pg=ProcessGroupGloo(timeout=timedelta(seconds=30)), load_state_dict=None, state_dict=None,
                   min_replica_size=min_replicas, replica_id=name, store_addr="localhost", store_port=store.port,
                   rank=0, world_size=1, lighthouse_addr=lighthouse, use_async_quorum=False,
                   timeout=timedelta(seconds=30), quorum_timeout=QUORUM, connect_timeout=timedelta(seconds=30))


def _entry(fn: Any, results: Any, args: tuple) -> None:
    _quiet()
    try:
        payload = io.BytesIO()
        torch.save(fn(*args), payload)
        results.put((args[0], True, payload.getvalue()))
    except BaseException:
        results.put((args[0], False, traceback.format_exc()))


class Replicas:
    """Worker processes reporting one result each (``torch.save``'d) through one queue."""

    def __init__(self) -> None:
        self.ctx = context()
        self.results = self.ctx.Queue()
        self.processes: dict[str, Any] = {}

    def start(self, fn: Any, name: str, *args: Any) -> Any:
        process = self.ctx.Process(target=_entry, args=(fn, self.results, (name, *args)), daemon=True)
        process.start()
        self.processes[name] = process
        return process

    def collect(self, names: set[str], deadline: float) -> dict[str, Any]:
        out: dict[str, Any] = {}
        while set(out) < names:
            try:
                name, ok, payload = self.results.get(timeout=max(0.1, deadline - time.monotonic()))
            except queue.Empty:
                raise AssertionError(f"replicas {sorted(names - set(out))} did not report within {TIMEOUT} s")
            if not ok:
                raise AssertionError(f"replica {name} failed:\n{payload}")
            out[name] = torch.load(io.BytesIO(payload), weights_only=False)
        return out

    def close(self) -> None:
        for process in self.processes.values():
            process.join(timeout=5)
            if process.is_alive():
                process.kill()


@pytest.fixture
def lighthouse():
    from torchft.coordination import LighthouseServer

    server = LighthouseServer(bind="[::]:0", min_replicas=2, join_timeout_ms=10000, heartbeat_timeout_ms=3000)
    yield server
    server.shutdown()


def _batch(name: str, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * int(name[-1]) + step)  # every replica name ends with its digit
    return torch.randn(8, 12, generator=g), torch.randn(8, 6, generator=g)


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(12, 16), nn.Tanh(), nn.Linear(16, 6))


# -- (a) PowerSGD at fixed membership equals the plain process group's run ------------------------------

STEPS = 6


def _powersgd_replica(name: str, lighthouse: str, port: int) -> dict[str, Any]:
    import torch.distributed as dist

    rank = int(name[-1])
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=timedelta(seconds=60))
    config = gradpress.Config(rank=2, start_compressing_after_num_steps=2, random_seed=3)
    manager = _manager(name, lighthouse, 2)
    group = FaultTolerantGroup(manager)
    out: dict[str, Any] = {}

    def aggregator_run(fault_tolerant: bool) -> list[torch.Tensor]:
        model = _model()
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        agg = gradpress.PowerSGD(model.parameters(), config, communicator=group.communicator()) if fault_tolerant \
            else gradpress.PowerSGD(model.parameters(), config)
        if fault_tolerant:
            group.register("agg_model", model)
            group.register("agg_powersgd", agg)
        for step in range(STEPS):
            if fault_tolerant:
                group.begin()
            x, y = _batch(name, step)
            nn.functional.mse_loss(model(x), y).backward()
            assert gradpress.optimizer_step(opt, agg)
        return [p.detach().clone() for p in model.parameters()]

    def ddp_run(fault_tolerant: bool) -> list[torch.Tensor]:
        module = _model()
        opt = torch.optim.SGD(module.parameters(), lr=0.05)
        if fault_tolerant:
            state = gradpress.PowerSGDState(None, matrix_approximation_rank=2, start_powerSGD_iter=2,
                                            random_seed=3, communicator=group.communicator("powerSGD_hook"))
            model = fault_tolerant_ddp(module, state)
        else:
            state = gradpress.PowerSGDState(None, matrix_approximation_rank=2, start_powerSGD_iter=2, random_seed=3)
            model = nn.parallel.DistributedDataParallel(module)
            model.register_comm_hook(state, gradpress.powerSGD_hook)
        for step in range(STEPS):
            if fault_tolerant:
                group.begin()
            x, y = _batch(name, step)
            nn.functional.mse_loss(model(x), y).backward()
            assert not fault_tolerant or group.last_commit
            opt.step()
            opt.zero_grad()
        return [p.detach().clone() for p in module.parameters()]

    start = time.perf_counter()
    out["plain"] = aggregator_run(False)
    out["ft"] = aggregator_run(True)
    out["ddp_plain"] = ddp_run(False)
    out["ddp_ft"] = ddp_run(True)
    out["seconds"] = time.perf_counter() - start
    out["quorums"] = list(group.quorums)
    manager.shutdown(wait=False)
    dist.destroy_process_group()
    return out


@pytest.mark.slow
def test_powersgd_over_torchft_equals_the_process_group_run(lighthouse):
    replicas = Replicas()
    port = free_port()
    try:
        for name in ("r0", "r1"):
            replicas.start(_powersgd_replica, name, lighthouse.address(), port)
        results = replicas.collect({"r0", "r1"}, time.monotonic() + TIMEOUT)
    finally:
        replicas.close()
    for name, out in results.items():
        assert [w for _, _, w in out["quorums"]] == [2] * (2 * STEPS), out["quorums"]
        for ft, plain in (("ft", "plain"), ("ddp_ft", "ddp_plain")):
            for a, b in zip(out[ft], out[plain]):
                assert torch.equal(a, b), (name, ft, (a - b).abs().max())
        # the run trained (the result is not the initial model) and both replicas agree
        assert not all(torch.equal(a, b) for a, b in zip(out["ft"], _model().parameters()))
    for a, b in zip(results["r0"]["ft"], results["r1"]["ft"]):
        assert torch.equal(a, b)


# -- PowerSGD: a peer lost mid-step, a joiner healed ------------------------------------------------------

LOSE_AT = 3            # the step (committed count) whose peer dies after the quorum, before sending


def _elastic_powersgd_replica(name: str, lighthouse: str, role: str, barrier: Any, results: Any,
                              front: str) -> dict[str, Any]:
    from gradpress.integrations.torchft import powersgd_global_state

    manager = _manager(name, lighthouse, 2)
    group = FaultTolerantGroup(manager)
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    if front == "aggregator":
        agg: Any = gradpress.PowerSGD(model.parameters(), gradpress.Config(
            rank=2, start_compressing_after_num_steps=1, random_seed=3), communicator=group.communicator())
        run = model
    else:  # the DDP hook, in DDP built as torchft's
        agg = gradpress.PowerSGDState(None, matrix_approximation_rank=2, start_powerSGD_iter=2, random_seed=3,
                                      communicator=group.communicator("powerSGD_hook"))
        run = fault_tolerant_ddp(model, agg)
    for key, obj in (("model", model), ("optimizer", opt), ("powersgd", agg)):
        group.register(key, obj)
    if barrier is not None:
        barrier.wait(timeout=TIMEOUT)
    steps: list[dict[str, Any]] = []
    lost: dict[str, Any] = {}
    join_at = None
    deadline = time.monotonic() + 100
    while time.monotonic() < deadline:
        group.begin()
        committed, _, world = group.quorums[-1]
        if role == "leave" and committed == LOSE_AT:
            payload = io.BytesIO()
            torch.save({}, payload)
            results.put((name, True, payload.getvalue()))
            results.close()
            results.join_thread()
            os._exit(0)   # in the quorum, gone before its first all-reduce
        if join_at is None and (role == "join" or (lost and world == 3)):
            join_at = committed
        healed = powersgd_global_state(agg) if join_at == committed else None
        local = agg.local_state_dict()["memory"]
        before = _tensors(local) + [p.detach().clone() for p in model.parameters()]
        x, y = _batch(name, len(steps))
        nn.functional.mse_loss(run(x), y).backward()
        if front == "aggregator":
            stepped = gradpress.optimizer_step(opt, agg)
            assert stepped == group.last_commit
        else:
            stepped = bool(group.last_commit)   # decided at the iteration's last bucket
            if stepped:
                opt.step()
            opt.zero_grad()
        steps.append({"committed": committed, "world": world, "stepped": stepped, "healed": healed,
                      "errors_zero": all(e["error"] is None for e in local.values()),
                      "params": [p.detach().clone() for p in model.parameters()]})
        if not stepped and not lost:
            lost = {"committed": committed, "world": world,
                    "unchanged": _same(before, _tensors(agg.local_state_dict()["memory"]) +
                                       [p.detach().clone() for p in model.parameters()])}
        if join_at is not None and group.committed() >= join_at + 3:
            break
    else:
        raise AssertionError(f"{name}: ran out of time: {[(s['committed'], s['world'], s['stepped']) for s in steps]}")
    manager.shutdown(wait=False)
    return {"steps": steps, "lost": lost, "join_at": join_at, "healed_bytes": list(group.healed_bytes)}


@pytest.mark.slow
@pytest.mark.parametrize("front", ["aggregator", "ddp"])
def test_powersgd_over_torchft_loses_a_peer_mid_step_and_heals_a_joiner(lighthouse, front):
    replicas = Replicas()
    start = time.monotonic()
    try:
        barrier = replicas.ctx.Barrier(3)
        for name, role in (("p0", "stay"), ("q1", "stay"), ("s2", "leave")):
            replicas.start(_elastic_powersgd_replica, name, lighthouse.address(), role, barrier, replicas.results,
                           front)
        replicas.processes["s2"].join(timeout=TIMEOUT)
        replicas.start(_elastic_powersgd_replica, "t3", lighthouse.address(), "join", None, replicas.results, front)
        results = replicas.collect({"p0", "q1", "s2", "t3"}, start + TIMEOUT)
    finally:
        replicas.close()
    p, q, t = results["p0"], results["q1"], results["t3"]
    for out in (p, q):
        # the step whose peer was lost did not commit: no optimizer step, error memory and factors as before
        assert out["lost"] == {"committed": LOSE_AT, "world": 3, "unchanged": True}, out["lost"]
        assert [s["stepped"] for s in out["steps"]].count(False) == 1
        retry = out["steps"][[s["stepped"] for s in out["steps"]].index(False) + 1]
        assert retry["committed"] == LOSE_AT and retry["stepped"]          # ... and the step was taken again
    # the joiner: its global state (factors, counters) is its peers' at that quorum, its error memory zero
    assert p["join_at"] == q["join_at"] == t["join_at"] is not None and t["healed_bytes"]
    joined, peer = t["steps"][0], next(s for s in p["steps"] if s["committed"] == t["join_at"] and s["stepped"])
    assert joined["errors_zero"] and not peer["errors_zero"]
    theirs, ours = peer["healed"], joined["healed"]
    counter = "step_counter" if front == "aggregator" else "iter"
    assert theirs[counter] == ours[counter]
    assert _same(_tensors(theirs["memory"]), _tensors(ours["memory"]))
    # every replica applies the same averaged gradient: parameters bitwise equal after every common step
    for s in p["steps"]:
        for other in (q, t):
            same_step = [o for o in other["steps"] if o["committed"] == s["committed"] and o["stepped"]]
            assert not s["stepped"] or all(_same(s["params"], o["params"]) for o in same_step), s["committed"]
    assert len([s for s in t["steps"] if s["stepped"]]) >= 3


# -- (b, c) streaming DiLoCo int4: a peer dies between the two phases, a replica joins -------------------

KILL_AT = 3            # the sync (committed count) whose peer dies after its all-to-all
AFTER_JOIN = 4         # syncs committed with the joiner before everyone stops


def _tensors(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, dict):
        return [t for k in sorted(value, key=str) for t in _tensors(value[k])]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _tensors(v)]
    return []


def _same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(x.shape == y.shape and torch.equal(x, y) for x, y in zip(a, b))


class _Recording(FaultTolerantGroup):
    """Records the averager's global state (and whether it holds residuals) right after each quorum."""

    averager: Any = None
    after_quorum: list[tuple[int, int, dict[str, Any], bool]]

    def begin(self) -> None:
        super().begin()
        local = self.averager.local_state_dict()
        holds = any(f.get("residual") is not None or f.get("owner_residual") is not None for f in local["fragments"])
        self.after_quorum.append((self.committed(), self.world, self.averager.global_state_dict(), holds))


def _diloco(group: Any) -> tuple[nn.Module, torch.optim.Optimizer, Any]:
    """The replica's model, inner optimizer and averager: the same under torchft and in the replay."""
    model = _model()
    inner = torch.optim.SGD(model.parameters(), lr=0.05)
    averager = gradpress.StreamingDiLoCoAverager(sync_every=4, num_fragments=2, fragment_sync_delay=1,
                                                 fragment_phase="end", compression=gradpress.QuantizeInt4(),
                                                 sync_group=group)
    group.register("model", model)
    group.register("diloco", averager)
    averager.anchor_parameters(list(model.parameters()))
    return model, inner, averager


def _inner_step(name: str, local_step: int, model: nn.Module, inner: torch.optim.Optimizer) -> None:
    x, y = _batch(name, local_step)
    nn.functional.mse_loss(model(x), y).backward()
    inner.step()
    inner.zero_grad()


def _after_sync(averager: Any, model: nn.Module) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """What is compared after each committed sync: the global state's tensors (the same on every member)
    and this replica's parameters (the other fragment's are its own)."""
    return _tensors(averager.global_state_dict()["fragments"]), [p.detach().clone() for p in model.parameters()]


def _records(group: Any) -> list[tuple[int, int, int, bool | None]]:
    commits = list(group.commits)
    return [(c, r, w, commits[i] if i < len(commits) else None) for i, (c, r, w) in enumerate(group.quorums)]


def _streaming_replica(name: str, lighthouse: str, role: str, barrier: Any, results: Any) -> dict[str, Any]:
    manager = _manager(name, lighthouse, 2)
    group = _Recording(manager)
    group.after_quorum = []
    model, inner, averager = _diloco(group)
    group.averager = averager
    if barrier is not None:  # the first three are heartbeating before any asks for a quorum: all in the first
        barrier.wait(timeout=TIMEOUT)
    syncs: list[dict[str, Any]] = []        # per sync: committed before, world, fragment, committed or not
    applied: dict[int, Any] = {}            # committed count -> global state's tensors and parameters after it
    failed_check: dict[str, Any] = {}
    snapshot = None
    join_at: int | None = 0 if role == "join" else None
    seen_failure = False
    deadline = time.monotonic() + 100
    local_step = 0
    while time.monotonic() < deadline:
        step = averager.step
        if role == "leave" and syncs and syncs[-1]["committed_before"] == KILL_AT and averager.in_flight:
            payload = io.BytesIO()
            torch.save({"records": _records(group)}, payload)   # what it took part in, for the replay
            results.put((name, True, payload.getvalue()))
            results.close()
            results.join_thread()
            averager.local_state_dict()  # waits for the sync's all-to-all: done on every member; then die
            time.sleep(0.2)              # ... before the all-gather
            os._exit(0)
        _inner_step(name, local_step, model, inner)
        local_step += 1
        sends = averager.fragment_sent_at(step) is not None
        if sends and group.committed() == KILL_AT and role == "stay" and snapshot is None:
            snapshot = _tensors(averager.local_state_dict()["fragments"])
        quorums = len(group.quorums)
        fragment = averager.fragment_sent_at(step)
        averager.average_parameters(model.parameters())
        if len(group.quorums) > quorums:
            before, _, world = group.quorums[-1]
            syncs.append({"committed_before": before, "world": world, "fragment": fragment, "commit": None})
            if role == "join" and len(syncs) == 1:
                join_at = before
            if role != "join" and seen_failure and world == 3 and join_at is None:
                join_at = before
        if group.last_commit is not None and syncs and syncs[-1]["commit"] is None:
            syncs[-1]["commit"] = group.last_commit
            if group.last_commit:
                applied[group.committed()] = _after_sync(averager, model)
            elif not seen_failure:
                seen_failure = True
                fr = syncs[-1]["fragment"]
                layout = averager.fragment_layout
                members = [p.detach().clone() for p, f in zip(model.parameters(), layout) if f == fr]
                anchor = averager.global_state_dict()["fragments"][fr]["anchor"]
                failed_check = {"unchanged": snapshot is not None and
                                _same(snapshot, _tensors(averager.local_state_dict()["fragments"])),
                                "at_anchor": _same(members, anchor), "fragment": fr, "world": syncs[-1]["world"],
                                "error": str(manager.errored())}
            if not seen_failure and role == "stay":
                time.sleep(0.01)
        if not seen_failure and role == "stay" and group.committed() > KILL_AT + 2:
            raise AssertionError(f"{name}: no sync failed after the peer died: {syncs}")
        if seen_failure and join_at is None:
            time.sleep(0.02)     # wait for the joiner without spinning through syncs
        if join_at is not None and group.committed() >= join_at + AFTER_JOIN and syncs[-1]["commit"] is not None:
            break
    else:
        raise AssertionError(f"{name}: ran out of time: {syncs}")
    manager.shutdown(wait=False)
    return {"syncs": syncs, "applied": applied, "after_quorum": group.after_quorum, "failed": failed_check,
            "join_at": join_at, "healed_bytes": list(group.healed_bytes), "quorum_seconds": list(group.quorum_seconds),
            "records": _records(group)}


@pytest.mark.slow
def test_streaming_diloco_int4_survives_a_peer_lost_mid_sync_and_heals_a_joiner(lighthouse):
    replicas = Replicas()
    start = time.monotonic()
    try:
        barrier = replicas.ctx.Barrier(3)
        for name, role in (("a0", "stay"), ("b1", "stay"), ("c2", "leave")):
            replicas.start(_streaming_replica, name, lighthouse.address(), role, barrier, replicas.results)
        replicas.processes["c2"].join(timeout=TIMEOUT)
        assert replicas.processes["c2"].exitcode == 0
        left = time.monotonic()
        replicas.start(_streaming_replica, "d3", lighthouse.address(), "join", None, replicas.results)
        results = replicas.collect({"a0", "b1", "c2", "d3"}, start + TIMEOUT)
    finally:
        replicas.close()
    a, b, d = results["a0"], results["b1"], results["d3"]
    # (c) the sync whose peer died between the phases did not commit and changed no averager tensor
    for out in (a, b):
        failed = [s for s in out["syncs"] if s["commit"] is False]
        assert len(failed) == 1 and failed[0]["committed_before"] == KILL_AT and failed[0]["world"] == 3, out["syncs"]
        assert all(s["world"] == 3 for s in out["syncs"][:KILL_AT]), out["syncs"]
        assert out["failed"]["unchanged"] and out["failed"]["at_anchor"], out["failed"]
        assert out["failed"]["error"].startswith("all-gather of fragment"), out["failed"]  # the second phase
        # ... and it was retried: the next sync sends the same fragment, among the two left (and the joiner,
        # where it has come up by then: the quorum waits for a replica that heartbeats), and commits
        retry = out["syncs"][out["syncs"].index(failed[0]) + 1]
        assert (retry["fragment"], retry["commit"], retry["committed_before"]) == \
            (failed[0]["fragment"], True, KILL_AT) and retry["world"] in (2, 3), out["syncs"]
    # (b) the joiner: at its first quorum, its global state is its peers' (bitwise), with no residual
    assert a["join_at"] == b["join_at"] == d["join_at"] is not None
    joined = d["after_quorum"][0]
    peer = next(q for q in a["after_quorum"] if q[0] == joined[0] and q[1] == 3)
    assert joined[1] == 3 and not joined[3]
    assert joined[2]["step"] == peer[2]["step"] and joined[2]["layout"] == peer[2]["layout"]
    assert _same(_tensors(joined[2]["fragments"]), _tensors(peer[2]["fragments"]))
    assert d["healed_bytes"] and d["healed_bytes"][0] > 0
    # every member applies the same updates: global states bitwise equal after each common sync
    for m, tensors in a["applied"].items():
        assert m not in b["applied"] or _same(tensors[0], b["applied"][m][0]), m
        assert m not in d["applied"] or _same(tensors[0], d["applied"][m][0]), m
    assert len(set(a["applied"]) & set(d["applied"])) >= AFTER_JOIN - 1
    assert all(s["commit"] for s in d["syncs"])
    # the oracle for membership: the recorded quorums replayed in one process give bitwise the same global
    # state and parameters after every committed sync, on every replica
    replayed = _replay({name: out["records"] for name, out in results.items()})
    for name in ("a0", "b1", "d3"):
        ours = results[name]["applied"]
        assert set(ours) <= set(replayed[name]), (name, sorted(ours), sorted(replayed[name]))
        for m, (global_state, params) in sorted(ours.items()):
            assert _same(global_state, replayed[name][m][0]) and _same(params, replayed[name][m][1]), (name, m)
    wait = [s for s in a["quorum_seconds"]]
    print(f"\ntorchft streaming: join {time.monotonic() - left:.1f} s after the leave; healing "
          f"{d['healed_bytes']} bytes; quorum waits max {max(wait):.2f} s, joiner's first "
          f"{d['quorum_seconds'][0]:.2f} s; total {time.monotonic() - start:.1f} s")


def _replay(records: dict[str, list[tuple[int, int, int, bool | None]]]) -> dict[str, dict[int, Any]]:
    """Every replica of the torchft run again, as threads of this process, in its recorded quorums."""
    import threading

    from gradpress.tools.workloads.membership import Departed, Membership, schedule_from_records

    membership = Membership(schedule_from_records(records), timeout_s=60.0)
    applied: dict[str, dict[int, Any]] = {name: {} for name in records}
    errors: list[BaseException] = []

    built = {}
    for name in records:  # here, one after the other: _model() seeds torch's global generator
        group = membership.group(name)
        built[name] = (group, *_diloco(group))

    def replica(name: str) -> None:
        try:
            group, model, inner, averager = built[name]
            local_step = 0
            while True:
                _inner_step(name, local_step, model, inner)
                local_step += 1
                try:
                    averager.average_parameters(model.parameters())
                except Departed:
                    return
                if group.last_commit:
                    applied[name][group.committed()] = _after_sync(averager, model)
                    group.last_commit = None
        except BaseException as error:  # noqa: BLE001 - raised below, in the test's thread
            errors.append(error)

    threads = [threading.Thread(target=replica, args=(name,), daemon=True) for name in records]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=TIMEOUT)
    assert not errors, errors
    assert not any(thread.is_alive() for thread in threads)
    return applied


# -- (d) bad input ------------------------------------------------------------------------------------

def test_torchft_objects_where_a_process_group_is_expected_and_the_reverse(lighthouse):
    from torchft import ProcessGroupGloo

    manager = _manager("bad", lighthouse.address(), 1)
    try:
        pg = ProcessGroupGloo()
        params = list(_model().parameters())
        for torchft_object in (manager, pg):
            with pytest.raises(TypeError, match="process_group.*FaultTolerantGroup"):
                gradpress.PowerSGDState(torchft_object, matrix_approximation_rank=2)
            with pytest.raises(TypeError, match="process_group.*FaultTolerantGroup"):
                gradpress.PowerSGD(params, gradpress.Config(rank=2), process_group=torchft_object)
            with pytest.raises(TypeError, match="process_group.*FaultTolerantGroup"):
                gradpress.StreamingDiLoCoAverager(sync_every=4, process_group=torchft_object)
            with pytest.raises(TypeError, match="communicator.*FaultTolerantGroup"):
                gradpress.PowerSGD(params, gradpress.Config(rank=2), communicator=torchft_object)
            with pytest.raises(TypeError, match="sync_group.*FaultTolerantGroup"):
                gradpress.StreamingDiLoCoAverager(sync_every=4, fragment_phase="end", sync_group=torchft_object,
                                                  compression=gradpress.QuantizeInt4())
        # the reverse: a process group (or anything else) where the Manager is expected
        for not_a_manager in (pg, object()):
            with pytest.raises(TypeError, match="FaultTolerantGroup's manager must be a torchft.Manager"):
                FaultTolerantGroup(not_a_manager)
        group = FaultTolerantGroup(manager)
        with pytest.raises(ValueError, match="fragment_phase must be 'end'"):
            gradpress.StreamingDiLoCoAverager(sync_every=4, sync_group=group)
        for untested in (None, "fp16"):
            with pytest.raises(ValueError, match="compression must be QuantizeInt8.*under a sync_group"):
                gradpress.StreamingDiLoCoAverager(sync_every=4, fragment_phase="end", compression=untested,
                                                  sync_group=group)
        with pytest.raises(ValueError, match="not supported under a sync_group"):
            gradpress.StreamingDiLoCoAverager(sync_every=4, fragment_phase="end", compression=gradpress.Config(rank=1),
                                              sync_group=group)
        with pytest.raises(TypeError, match="register's obj"):
            group.register("x", object())
        with pytest.raises(TypeError, match="fault_tolerant_ddp's state"):
            fault_tolerant_ddp(_model(), gradpress.PowerSGDState(None, matrix_approximation_rank=2))
        assert group.quorums == []  # nothing was sent: no quorum was ever asked for
    finally:
        manager.shutdown(wait=False)


def test_an_asynchronous_quorum_is_refused(lighthouse):
    import torch.distributed as dist
    from torchft import Manager, ProcessGroupGloo

    store = dist.TCPStore("localhost", 0, is_master=True, wait_for_workers=False)
    manager = Manager(pg=ProcessGroupGloo(), load_state_dict=None, state_dict=None, min_replica_size=1,
                      replica_id="async", store_addr="localhost", store_port=store.port, rank=0, world_size=1,
                      lighthouse_addr=lighthouse.address(), use_async_quorum=True)
    try:
        with pytest.raises(ValueError, match="use_async_quorum=False"):
            FaultTolerantGroup(manager)
    finally:
        manager.shutdown(wait=False)

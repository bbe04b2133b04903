"""Non-finite steps: an inf/NaN gradient on one rank is skipped by every rank.

The contract, for the DDP hooks, the standalone aggregator and the engine: when anything a step
averaged is not finite (the sum carries one rank's inf to every rank), the error memory and warm-start
factors of every segment on every rank end bitwise as they were before the step, the gradients handed
back are non-finite (so a ``GradScaler`` skips the step on every rank), and the step counter advances.

The oracle: run A trains with an inf injected into one parameter's gradient on rank 1 at step ``BAD``;
run B is the same run with that step left out (its batch never used). B tells the state about the
missing step the way the API says to (``PowerSGDState.update_state()``, ``step_counter += 1``) and
mirrors the GradScaler's backoff (``scaler.update(new_scale=...)``: the scale of every later step is
then the same in both runs). Everything is deterministic on CPU with gloo, so the tolerance is zero:
A's losses without step ``BAD`` equal B's losses bitwise, and so do the final parameters.
"""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import gradpress
import models
from distributed import run

WORLD = 2
STEPS = 7
BAD = 4  # the step whose gradient is non-finite on rank 1 (after start_powerSGD_iter=2)
INIT_SCALE = 2.0 ** 10


def _poison(grad: torch.Tensor) -> torch.Tensor:
    """One inf in one parameter's gradient: a single bucket (a single matrix) is non-finite."""
    grad = grad.clone()
    grad.view(-1)[5] = float("inf")
    return grad


def _scaler() -> torch.amp.GradScaler:
    # Growth never happens within these runs, so only the backoff moves the scale.
    return torch.amp.GradScaler("cpu", init_scale=INIT_SCALE, growth_interval=10_000)


def _memory(state) -> dict:
    """Everything of a PowerSGDState that later numbers depend on, as plain copies."""
    if state is None:
        return {}
    sd = state.local_state_dict()
    out = {"iter": sd["iter"]}
    for kind in ("memory", "padded"):
        for key, entry in sd[kind].items():
            for field in ("error", "q", "p"):
                out[(kind, key, field)] = entry[field]
    return out


def _same(a: dict, b: dict, skip=()) -> bool:
    if a.keys() != b.keys():
        return False
    for key in a:
        if key in skip:
            continue
        x, y = a[key], b[key]
        if isinstance(x, torch.Tensor) or isinstance(y, torch.Tensor):
            if x is None or y is None or not torch.equal(x, y):
                return False
        elif x != y:
            return False
    return True


def _params(model) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def _optimizer_unchanged(before, after) -> bool:
    state_a, state_b = before["state"], after["state"]
    return state_a.keys() == state_b.keys() and all(
        torch.equal(state_a[k]["momentum_buffer"], state_b[k]["momentum_buffer"]) for k in state_a)


# --- DDP hooks ---------------------------------------------------------------------------------------------

def _ddp_run(rank, hook_name, wrapper, num_iters, skip_step):
    """One training run; ``skip_step``: None (run A, bad step injected) or the step left out (run B)."""
    model = DDP(models.make_model(), bucket_cap_mb=0.0001)  # about one parameter per bucket
    hook = getattr(gradpress, hook_name)
    if wrapper:
        hook = getattr(gradpress, wrapper)(hook)
    state = None
    if "powerSGD" in hook_name:
        state = gradpress.PowerSGDState(None, matrix_approximation_rank=1, start_powerSGD_iter=2,
                                        min_compression_rate=0, num_iters_per_step=num_iters)
    model.register_comm_hook(state, hook)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    scaler = _scaler()
    out = {"losses": [], "scales": []}
    for step in range(STEPS):
        if step == skip_step:
            scaler.update(new_scale=scaler.get_scale() * scaler.get_backoff_factor())
            if state is not None:
                state.update_state()
            continue
        x, y = models.batch(rank, step)
        optimizer.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = models.loss_fn(model, x, y)
        bad = skip_step is None and step == BAD
        if bad:
            out["before"] = (_memory(state), _params(model), copy.deepcopy(optimizer.state_dict()))
        handle = model.module.conv2.weight.register_hook(_poison) if bad and rank == 1 else None
        scaler.scale(loss).backward()
        if handle is not None:
            handle.remove()
        if bad:
            out["finite_outputs"] = [bool(torch.isfinite(p.grad).all()) for p in model.parameters()]
        scaler.step(optimizer)
        scaler.update()
        if bad:
            out["after"] = (_memory(state), _params(model), copy.deepcopy(optimizer.state_dict()))
        out["losses"].append(loss.detach())
        out["scales"].append(scaler.get_scale())
    out["params"] = _params(model)
    out["memory"] = _memory(state)
    return out


def _ddp_runs(rank, world, hook_name, wrapper, num_iters):
    return _ddp_run(rank, hook_name, wrapper, num_iters, None), _ddp_run(rank, hook_name, wrapper, num_iters, BAD)


@pytest.mark.parametrize("hook_name, wrapper, num_iters", [
    ("powerSGD_hook", None, None),                    # classic, per tensor
    ("powerSGD_hook", None, 1),                       # multi-iteration, one factor per step
    ("batched_powerSGD_hook", None, None),            # one padded square per bucket
    ("powerSGD_hook", "fp16_compress_wrapper", None),  # fp16 gradients into fp32 memory
    ("fp16_compress_hook", None, None),               # no state: the inf passes through
    ("bf16_compress_hook", None, None),
], ids=["classic", "multi-1", "batched", "fp16-wrapped", "fp16-hook", "bf16-hook"])
def test_ddp_step_with_inf_on_one_rank_is_skipped_everywhere_and_training_continues_as_without_it(
        hook_name, wrapper, num_iters):
    results = run(_ddp_runs, WORLD, hook_name, wrapper, num_iters)
    for rank, (bad_run, reference) in enumerate(results):
        # Every rank got non-finite gradients back, and its scaler skipped the step (same backoff).
        assert not all(bad_run["finite_outputs"]), rank
        assert bad_run["scales"][BAD] == INIT_SCALE / 2 and bad_run["scales"][BAD - 1] == INIT_SCALE, rank
        # Parameters, optimizer state, error memory and factors: bitwise as before the step; the
        # iteration counter advanced.
        memory_before, params_before, optim_before = bad_run["before"]
        memory_after, params_after, optim_after = bad_run["after"]
        assert all(torch.equal(a, b) for a, b in zip(params_before, params_after)), rank
        assert _optimizer_unchanged(optim_before, optim_after), rank
        assert _same(memory_before, memory_after, skip={"iter"}), rank
        if memory_before:
            assert memory_after["iter"] == memory_before["iter"] + 1
            assert any(k[2] == "error" and v is not None and v.abs().max() > 0 for k, v in memory_after.items()
                       if isinstance(k, tuple)), "the test needs non-zero error memory to mean anything"
        # The run goes on exactly as the one without the bad step (tolerance: none).
        losses = [loss for step, loss in enumerate(bad_run["losses"]) if step != BAD]
        assert len(losses) == len(reference["losses"]) == STEPS - 1
        assert all(torch.equal(a, b) for a, b in zip(losses, reference["losses"])), rank
        assert [s for step, s in enumerate(bad_run["scales"]) if step != BAD] == reference["scales"]
        assert all(torch.equal(a, b) for a, b in zip(bad_run["params"], reference["params"])), rank
        assert _same(bad_run["memory"], reference["memory"]), rank
        assert all(torch.isfinite(p).all() for p in bad_run["params"])
    # All ranks identical.
    assert all(torch.equal(a, b) for a, b in zip(results[0][0]["params"], results[1][0]["params"]))
    assert results[0][0]["scales"] == results[1][0]["scales"]


# --- the standalone aggregator ---------------------------------------------------------------------------

def _aggregator_run(rank, num_iters, use_scaler, skip_step):
    model = models.make_model()
    params = list(model.parameters())
    powersgd = gradpress.PowerSGD(params, gradpress.Config(rank=1, min_compression_rate=0, num_iters_per_step=num_iters,
                                                           start_compressing_after_num_steps=2))
    optimizer = torch.optim.SGD(params, lr=0.05, momentum=0.9)
    scaler = _scaler() if use_scaler else None
    out = {"losses": [], "stepped": []}
    for step in range(STEPS):
        if step == skip_step:
            powersgd.step_counter += 1
            if scaler is not None:
                scaler.update(new_scale=scaler.get_scale() * scaler.get_backoff_factor())
            continue
        x, y = models.batch(rank, step)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = models.loss_fn(model, x, y)
        bad = skip_step is None and step == BAD
        if bad:
            out["before"] = (powersgd.local_state_dict(), _params(model), copy.deepcopy(optimizer.state_dict()))
        handle = model.conv2.weight.register_hook(_poison) if bad and rank == 1 else None
        (scaler.scale(loss) if scaler is not None else loss).backward()
        if handle is not None:
            handle.remove()
        if scaler is not None:
            powersgd.aggregate_([p.grad for p in params])
            scale = scaler.get_scale()
            scaler.step(optimizer)
            scaler.update()
            out["stepped"].append(scaler.get_scale() == scale)
            optimizer.zero_grad()
        else:
            out["stepped"].append(gradpress.optimizer_step(optimizer, powersgd))
        if bad:
            out["finite"] = getattr(powersgd, "finite", None)  # (absent in code without the commit)
            out["after"] = (powersgd.local_state_dict(), _params(model), copy.deepcopy(optimizer.state_dict()))
        out["losses"].append(loss.detach())
    out["params"] = _params(model)
    out["state"] = powersgd.local_state_dict()
    return out


def _aggregator_runs(rank, world, num_iters, use_scaler):
    return (_aggregator_run(rank, num_iters, use_scaler, None), _aggregator_run(rank, num_iters, use_scaler, BAD))


def _aggregator_memory(state_dict) -> dict:
    return {(key, field): entry[field] for key, entry in state_dict["memory"].items() for field in ("error", "q", "p")}


@pytest.mark.parametrize("num_iters, use_scaler", [(None, True), (1, True), (2, False)],
                         ids=["classic-scaler", "multi-1-scaler", "multi-2-optimizer_step"])
def test_aggregator_step_with_inf_on_one_rank_leaves_its_state_and_is_skipped(num_iters, use_scaler):
    results = run(_aggregator_runs, WORLD, num_iters, use_scaler)
    for rank, (bad_run, reference) in enumerate(results):
        state_before, params_before, optim_before = bad_run["before"]
        state_after, params_after, optim_after = bad_run["after"]
        assert _same(_aggregator_memory(state_before), _aggregator_memory(state_after)), rank
        assert state_after["step_counter"] == state_before["step_counter"] + 1
        assert all(torch.equal(a, b) for a, b in zip(params_before, params_after)), rank
        assert _optimizer_unchanged(optim_before, optim_after), rank
        losses = [loss for step, loss in enumerate(bad_run["losses"]) if step != BAD]
        assert all(torch.equal(a, b) for a, b in zip(losses, reference["losses"])), rank
        assert all(torch.equal(a, b) for a, b in zip(bad_run["params"], reference["params"])), rank
        assert _same(_aggregator_memory(bad_run["state"]), _aggregator_memory(reference["state"])), rank
        # Reported on every rank, and skipped (by the scaler, or by optimizer_step).
        assert bad_run["finite"] is not None and not bool(bad_run["finite"]), rank
        assert bad_run["stepped"][BAD] is False, rank
        assert all(bad_run["stepped"][:BAD]) and all(bad_run["stepped"][BAD + 1:]), rank
    assert all(torch.equal(a, b) for a, b in zip(results[0][0]["params"], results[1][0]["params"]))


# --- DiLoCo: the outer step ----------------------------------------------------------------------------------

def _outer_runs(rank, world):
    out = {}
    for name, compression in (("plain", None), ("fp16", "fp16"), ("bf16", "bf16"),
                              ("powersgd", gradpress.Config(rank=1, min_compression_rate=0,
                                                            start_compressing_after_num_steps=0))):
        model = models.make_model()
        averager = gradpress.OuterOptimizerAverager(period=2, outer_lr=0.7, outer_momentum=0.9,
                                                    compression=compression)
        optimizer = gradpress.PostLocalSGDOptimizer(torch.optim.SGD(model.parameters(), lr=0.05), averager)
        record = {}
        for step in range(7):  # syncs at 0 (sets the anchor), 2, 4 (the bad one), 6 (the last step)
            x, y = models.batch(rank, step)
            optimizer.zero_grad()
            models.loss_fn(model, x, y).backward()
            if step == 4:  # rank 1's parameters blew up since the last synchronization
                record["before"] = (copy.deepcopy(averager.local_state_dict()), _params(model))
                if rank == 1:
                    with torch.no_grad():
                        model.conv2.weight.view(-1)[3] = float("nan")
            optimizer.step()
            if step == 4:
                record["after"] = (copy.deepcopy(averager.local_state_dict()), _params(model))
        record["params"] = _params(model)
        record["skipped"] = getattr(averager, "num_skipped", None)  # (absent in code without the commit)
        record["averages"] = averager.num_averages
        out[name] = record
    return out


def _outer_state_equal(a, b) -> bool:
    if not all(torch.equal(x, y) for x, y in zip(a["anchor"], b["anchor"])):
        return False
    momentum_a, momentum_b = a["outer"]["state"], b["outer"]["state"]
    if momentum_a.keys() != momentum_b.keys() or not all(
            torch.equal(momentum_a[k]["momentum_buffer"], momentum_b[k]["momentum_buffer"]) for k in momentum_a):
        return False
    if "powersgd" in a:
        return _same(_aggregator_memory(a["powersgd"]), _aggregator_memory(b["powersgd"]))
    return True


def test_outer_optimizer_never_applies_a_non_finite_delta():
    results = run(_outer_runs, WORLD)
    for name in results[0]:
        for rank, out in enumerate(results):
            record = out[name]
            state_before, _ = record["before"]
            state_after, params_after = record["after"]
            # The outer step was skipped: anchor, outer momentum and PowerSGD memory as before ...
            assert _outer_state_equal(state_before, state_after), (name, rank)
            # ... and every rank went back to the anchor.
            assert all(torch.equal(p, a) for p, a in zip(params_after, state_after["anchor"])), (name, rank)
            assert record["skipped"] == 1 and record["averages"] == 3, (name, rank)
            assert all(torch.isfinite(p).all() for p in record["params"]), (name, rank)
        assert all(torch.equal(a, b) for a, b in zip(results[0][name]["params"], results[1][name]["params"])), name


# --- the engine: one commit for all segments of a step, no host reads ------------------------------------------

SHAPES_A = [(8, 6), (8, 6), (5,)]
SHAPES_B = [(5, 7), (6, 2, 2, 2), (3,)]
ENGINE_CONFIGS = {
    "classic": {},
    "classic-no-feedback": {"use_error_feedback": False},
    "classic-no-warm-start": {"warm_start": False},
    "classic-fp16-wire": {"bytes_per_weight": 2},
    "feedback-every-2-beta": {"feedback_every_n_iters": 2, "warm_up_beta_factor": 0.5, "warm_up_steps": 3},
    "one-iteration": {"num_iters_per_step": 1},
    "three-iterations": {"num_iters_per_step": 3},
}


def _engine_segments(config, dtype=torch.float32):
    from gradpress.powersgd.memory import work_dtype_for

    segments = []
    for offset, shapes in ((0, SHAPES_A), (10, SHAPES_B)):
        plan = gradpress.powersgd.make_plan(shapes, config.rank, config.min_compression_rate)
        segments.append(gradpress.powersgd.Segment(plan, [offset + i for i in range(len(shapes))],
                                                   torch.device("cpu"), work_dtype_for(dtype)))
    return segments


def _engine_grads(step, bad, dtype):
    generator = torch.Generator().manual_seed(500 + step)
    grads = [[torch.randn(s, generator=generator, dtype=dtype) for s in shapes] for shapes in (SHAPES_A, SHAPES_B)]
    if bad:
        grads[1][0][2, 3] = float("inf")  # only the second segment sees it
    return grads


def _engine_step(segments, grads, config, compressed_step):
    """One step of both segments, committed together; the step's all-finite flag."""
    from gradpress.comm import LocalCommunicator
    from gradpress.powersgd.pipeline import OrderedPipeline
    from gradpress.powersgd import step as step_module

    # Without the commit, each segment settled its own memory (the test then fails
    # on what it checks, not on this import).
    commit = step_module.StepCommit() if hasattr(step_module, "StepCommit") else None
    pipeline = OrderedPipeline()
    for segment, tensors in zip(segments, grads):
        extra = () if commit is None else (commit,)
        task, _ = step_module.compress_step(segment, tensors, LocalCommunicator(), config, compressed_step, *extra)
        pipeline.submit(task, lambda: None, lambda exc: None)
    pipeline.drain()
    return None if commit is None else commit.apply()


def _engine_state(segments):
    """Error memory (matrix by matrix: the buffers hold alignment padding), Q and P of each segment."""
    return [([w.clone() for w in s.error_views], s.q.clone(), s.phase1[:s.plan.p_numel].clone()) for s in segments]


def _equal_lists(a, b) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


@pytest.mark.parametrize("path", ["cpu", "accelerator"])
@pytest.mark.parametrize("name", list(ENGINE_CONFIGS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_engine_non_finite_step_restores_every_segment_bitwise(name, path, dtype):
    from host_reads import as_on_an_accelerator, no_host_reads

    config = gradpress.powersgd.EngineConfig(rank=2, min_compression_rate=0, random_seed=5, **ENGINE_CONFIGS[name])
    with_p = config.num_iters_per_step is not None
    bad, clean = _engine_segments(config, dtype), _engine_segments(config, dtype)
    for compressed_step in range(5):
        with contextlib.ExitStack() as stack:
            if path == "accelerator":  # the device-side choice, with no read of any value
                stack.enter_context(as_on_an_accelerator())
                stack.enter_context(no_host_reads())
            if compressed_step == 2:
                before = _engine_state(bad)
                bad_grads = _engine_grads(compressed_step, True, dtype)
                finite = _engine_step(bad, bad_grads, config, compressed_step)
                after = _engine_state(bad)
                # clean never runs step 2 (its counter still moves on, as update_state() does)
                continue
            outputs = []
            for segments in (bad, clean):
                grads = _engine_grads(compressed_step, False, dtype)
                _engine_step(segments, grads, config, compressed_step)
                outputs.append(grads)
        assert all(torch.equal(a, b) for x, y in zip(*outputs) for a, b in zip(x, y)), compressed_step
    assert not torch.isfinite(bad_grads[1][0]).all()  # the bad matrix's output reports the overflow
    for (work, q, p), (work_after, q_after, p_after) in zip(before, after):
        if config.use_error_feedback:
            assert _equal_lists(work, work_after)
        if config.warm_start:
            assert torch.equal(q, q_after)
        if with_p:
            assert torch.equal(p, p_after)
    assert finite is not None and not bool(finite)
    for a, b in zip(_engine_state(bad), _engine_state(clean)):
        assert _equal_lists(a[0], b[0]) or not config.use_error_feedback
        assert torch.equal(a[1], b[1])
        assert torch.equal(a[2], b[2]) or not with_p


def test_engine_reads_one_flag_per_step_on_the_cpu_and_holds_one_m_buffer_beside_the_memory():
    from host_reads import CountSyncingOps
    from gradpress.powersgd.memory import ALIGNMENT_BYTES, Workspace

    config = gradpress.powersgd.EngineConfig(rank=2, min_compression_rate=0)
    segments = _engine_segments(config)
    workspace = Workspace()
    for segment in segments:  # as the segments of one state share it
        segment.workspace = workspace
    _engine_step(segments, _engine_grads(0, False, torch.float32), config, 0)
    counter = CountSyncingOps()
    with counter:
        _engine_step(segments, _engine_grads(1, False, torch.float32), config, 1)
    assert counter.count == 1  # one flag for the whole step (two segments), read where reading is free
    # Held: the error memory and the M = g + e buffer the step builds once (one (2, size) tensor: the two
    # swap roles at each commit), the factors (and their saved copy), and one workspace of at most the
    # largest shape group (plus alignment), which the CPU's finite steps do not even touch.
    largest_group = max(g.batch * g.n * g.m for s in segments for g in s.plan.groups) * 4
    largest_batch = max(g.batch for s in segments for g in s.plan.groups)
    assert workspace.nbytes <= largest_group + 2 * ALIGNMENT_BYTES * largest_batch
    assert workspace.nbytes < sum(s.error_memory.numel() for s in segments) * 4
    for segment in segments:
        held = [getattr(segment, name) for name in segment.__slots__]
        storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                    for t in held if isinstance(t, torch.Tensor)}  # (views share their buffer's storage)
        # (the wire's buffer holds one line more, to align its start; the saved Q is the wire's Q region)
        numel = 2 * segment.error_memory.numel() + segment.wire.numel() + ALIGNMENT_BYTES // 4 + segment.q.numel()
        assert sum(storages.values()) == 4 * numel


class _Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(6, 5))


def test_optimizer_step_skips_a_non_finite_step_on_one_worker():
    model = _Tiny()
    powersgd = gradpress.PowerSGD(model.parameters(), gradpress.Config(rank=1, min_compression_rate=0,
                                                                       start_compressing_after_num_steps=0))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model.weight.grad = torch.full((6, 5), 2.0)
    stepped = [gradpress.optimizer_step(optimizer, powersgd)]
    before = (model.weight.detach().clone(), powersgd.local_state_dict())
    model.weight.grad = torch.full((6, 5), 2.0)
    model.weight.grad[1, 1] = float("nan")
    stepped.append(gradpress.optimizer_step(optimizer, powersgd))
    assert torch.equal(model.weight.detach(), before[0])
    assert _same(_aggregator_memory(before[1]), _aggregator_memory(powersgd.local_state_dict()))
    assert not model.weight.grad.any()  # zeroed as after any optimizer_step
    assert stepped == [True, False] and not bool(powersgd.finite)
    # Exact averaging (before compression starts) reports too.
    allreduce = gradpress.AllReduce()
    allreduce.aggregate_([torch.tensor([1.0, float("inf")])])
    assert not bool(allreduce.finite)

"""PowerSGDState's further options: error_feedback, bytes_per_weight, lr_scheduler, feedback_every_n_iters,
warm_up_beta_factor, update_state (2 gloo ranks unless noted)."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from distributed import run
from gradpress import PowerSGDState, powerSGD_hook

WORLD = 2


def _digest(module) -> torch.Tensor:
    return torch.cat([p.detach().flatten() for p in module.parameters()])


# --- the documented constructor call ------------------------------------------------------------------

def documented_call_trains(rank, world):
    torch.manual_seed(0)
    model = DDP(nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 4)))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    lr_scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=400, gamma=0.5)
    pg = None  # the default group
    state = PowerSGDState(process_group=pg, matrix_approximation_rank=1, start_powerSGD_iter=1000,
                          warm_up_beta_factor=0.5, lr_scheduler=lr_scheduler, bytes_per_weight=4,
                          comm_device="cpu", error_feedback=True, feedback_every_n_iters=100)
    model.register_comm_hook(state, powerSGD_hook)
    g = torch.Generator().manual_seed(rank)
    for _ in range(1020):
        x = torch.randn(16, 8, generator=g)
        optimizer.zero_grad()
        (model(x) - x[:, :4]).square().mean().backward()
        optimizer.step()
        lr_scheduler.step()
    return _digest(model), state.compression_stats()


@pytest.mark.slow
def test_the_documented_constructor_call_constructs_and_trains():
    (d0, (_, _, after0)), (d1, _) = run(documented_call_trains, WORLD)
    assert after0 > 0, "compression never became active"
    assert torch.equal(d0, d1), "ranks hold different parameters"


# --- a recording harness: per step, each rank's local gradient, the applied one, the LR, the memory --------

class _Weights(nn.Module):
    """Two matrices whose gradients are exactly the given tensors (plus a bias, sent uncompressed)."""

    def __init__(self, dtype) -> None:
        super().__init__()
        self.a = nn.Parameter(torch.zeros(24, 16, dtype=dtype))
        self.b = nn.Parameter(torch.zeros(12, 20, dtype=dtype))
        self.c = nn.Parameter(torch.zeros(5, dtype=dtype))

    def forward(self, ga, gb, gc):
        return (self.a * ga).sum() + (self.b * gb).sum() + (self.c * gc).sum()


def _gradients(rank, step, dtype, scale=1.0):
    g = torch.Generator().manual_seed(100 * step + rank)
    return [scale * torch.randn(*shape, generator=g, dtype=torch.float64).to(dtype)
            for shape in ((24, 16), (12, 20), (5,))]


def record(rank, world, steps, options, lrs=None, dtype=torch.float64, scale=1.0):
    net = DDP(_Weights(dtype))
    scheduler = None
    if lrs is not None:
        class Schedule:  # anything with get_last_lr() will do
            t = 0

            def get_last_lr(self):
                return [lrs[Schedule.t]]
        scheduler = Schedule()
    options = {"matrix_approximation_rank": 1, "bytes_per_weight": 8 if dtype == torch.float64 else 4, **options}
    state = PowerSGDState(None, start_powerSGD_iter=2, min_compression_rate=0, lr_scheduler=scheduler, **options)
    trace = []

    def hook(state, bucket):
        local = [g.clone() for g in bucket.gradients()]
        compressing = state.iter >= state.start_powerSGD_iter
        fut = powerSGD_hook(state, bucket)

        def done(f):
            applied = [g.clone() for g in bucket.gradients()]
            memory = {k: v["error"] for k, v in state.local_state_dict()["memory"].items()} if compressing else {}
            trace.append({"local": local, "applied": applied, "compressing": compressing,
                          "lr": lrs[Schedule.t] if lrs else None, "memory": memory,
                          "keys": [state._params.key_of(p) for p in bucket.parameters()]})
            return f.value()
        return fut.then(done)

    net.register_comm_hook(state, hook)
    for step in range(steps):
        net.zero_grad()
        net(*_gradients(rank, step, dtype, scale)).backward()
        if lrs is not None:
            Schedule.t += 1
    return trace, state.bytes_stats(), state.session.last_lr, _digest(net)


def _conservation_residual(trace, weighted):
    """max |sum_t w_t applied_t + w_last e_final - sum_t w_t local_t| over compressed params."""
    steps = [t for t in trace if t["compressing"]]
    keys = steps[0]["keys"]
    final = steps[-1]["memory"]
    worst = 0.0
    for i, key in enumerate(keys):
        if key not in final:
            continue
        w = [t["lr"] if weighted else 1.0 for t in steps]
        final_error = final[key].reshape(steps[0]["local"][i].shape)
        lhs = sum(wt * t["applied"][i] for wt, t in zip(w, steps)) + w[-1] * final_error
        rhs = sum(wt * t["local"][i] for wt, t in zip(w, steps))
        worst = max(worst, (lhs - rhs).abs().max().item())
    return worst


# --- bytes_per_weight -------------------------------------------------------------------------------------

def test_half_precision_wire_halves_the_bytes():
    steps = 5
    r4 = run(record, WORLD, steps, dict(bytes_per_weight=4), None, torch.float32)
    r2 = run(record, WORLD, steps, dict(bytes_per_weight=2), None, torch.float32)
    for (_, (_, before4, after4), *_), (_, (_, before2, after2), *_) in zip(r4, r2):
        assert before4 == before2 > 0 and after2 * 2 == after4
    # None, as Config documents it: the working precision, fp32 for fp32 gradients: the same run as 4.
    r_none = run(record, WORLD, steps, dict(bytes_per_weight=None), None, torch.float32)
    for with_none, with_four in zip(r_none, r4):
        assert with_none[1] == with_four[1] and torch.equal(with_none[3], with_four[3])


def full_rank_fp16(rank, world, bytes_per_weight, scale):
    net = DDP(_Weights(torch.float16))
    state = PowerSGDState(None, matrix_approximation_rank=64, start_powerSGD_iter=2, min_compression_rate=0,
                          bytes_per_weight=bytes_per_weight)
    net.register_comm_hook(state, powerSGD_hook)
    out = []
    for step in range(4):
        net.zero_grad()
        net(*_gradients(rank, step, torch.float16, scale)).backward()
        out.append([p.grad.float().clone() for p in net.parameters()])
    return out, state.bytes_stats()


def test_fp16_wire_does_not_overflow_and_equals_fp32_wire_within_fp16_tolerance():
    # Gradients up to ~60000 (fp16's max is 65504): P = M Q sums hundreds of such products, far beyond
    # fp16's range unless the wire is scaled.
    scale = 15000.0
    half = run(full_rank_fp16, WORLD, 2, scale)[0][0]
    single = run(full_rank_fp16, WORLD, 4, scale)[0][0]
    for step_half, step_single in zip(half[2:], single[2:]):  # compressed steps
        for h, s in zip(step_half, step_single):
            assert torch.isfinite(h).all()
            torch.testing.assert_close(h, s, atol=2e-3 * s.abs().max().item(), rtol=0)


def bf16_wire(rank, world):
    net = DDP(_Weights(torch.bfloat16))
    state = PowerSGDState(None, matrix_approximation_rank=2, start_powerSGD_iter=2, bytes_per_weight=2)
    net.register_comm_hook(state, powerSGD_hook)
    for step in range(4):
        net.zero_grad()
        net(*_gradients(rank, step, torch.bfloat16)).backward()
    return all(torch.isfinite(p.grad.float()).all() for p in net.parameters()), state.bytes_stats(), \
        state.compression_stats()


def test_bf16_gradients_travel_as_bf16():
    for finite, (_, _, after_bytes), (_, _, after_numel) in run(bf16_wire, WORLD):
        assert finite and after_bytes == 2 * after_numel


# --- lr_scheduler ----------------------------------------------------------------------------------------

def test_lr_aware_error_feedback_conserves_updates_under_a_step_decay():
    steps = 14
    lrs = [0.1] * 6 + [0.01] * 4 + [0.001] * 4  # step decays, the last one at the end
    for trace, _, last_lr, _ in run(record, WORLD, steps, {}, lrs):
        assert last_lr == 0.001
        assert _conservation_residual(trace, weighted=True) < 1e-12
        # and it is not the unweighted law: the memory really was rescaled
        assert _conservation_residual(trace, weighted=False) > 1e-6


def test_constant_lr_is_bitwise_the_same_as_no_scheduler():
    steps = 8
    with_scheduler = run(record, WORLD, steps, {}, [0.1] * steps)
    without = run(record, WORLD, steps, {})
    for (_, _, _, a), (_, _, _, b) in zip(with_scheduler, without):
        assert torch.equal(a, b)
    for (ta, *_), (tb, *_) in zip(with_scheduler, without):
        for sa, sb in zip(ta, tb):
            assert all(torch.equal(x, y) for x, y in zip(sa["applied"], sb["applied"]))


# --- feedback_every_n_iters --------------------------------------------------------------------------

@pytest.mark.parametrize("n", [1, 3, 100])
def test_delayed_feedback_conserves_mass(n):
    for trace, *_ in run(record, WORLD, 12, dict(feedback_every_n_iters=n)):
        assert _conservation_residual(trace, weighted=False) < 1e-12


def test_feedback_every_iteration_is_bitwise_the_default():
    a = run(record, WORLD, 8, dict(feedback_every_n_iters=1))
    b = run(record, WORLD, 8, {})
    for (ta, *_), (tb, *_) in zip(a, b):
        for sa, sb in zip(ta, tb):
            assert all(torch.equal(x, y) for x, y in zip(sa["applied"], sb["applied"]))


def test_delayed_feedback_feeds_the_memory_back_only_every_nth_step():
    # Oracle: without warm start every step draws fresh seeded factors, so a step that does not feed
    # back must apply exactly what a state without any error feedback applies to the same gradient;
    # a step that feeds back must not (its memory is non-zero at rank 1).
    n, steps = 3, 2 + 3 * 3
    delayed = run(record, WORLD, steps, dict(feedback_every_n_iters=n, warm_start=False))
    none = run(record, WORLD, steps, dict(use_error_feedback=False, warm_start=False))
    for (trace, *_), (plain, *_) in zip(delayed, none):
        compressed = [t for t in trace if t["compressing"]]
        reference = [t for t in plain if t["compressing"]]
        for index, (t, r) in enumerate(zip(compressed, reference)):
            same = all(torch.equal(a, b) for a, b in zip(t["applied"], r["applied"]))
            assert same == ((index + 1) % n != 0), index


# --- warm_up_beta_factor --------------------------------------------------------------------------------

def test_warm_up_damping_applies_exactly_during_the_documented_steps():
    beta, start = 0.5, 2  # start_powerSGD_iter=2: damping on compressed steps 0 and 1, then full feedback
    for trace, *_ in run(record, WORLD, start + 6, dict(warm_up_beta_factor=beta)):
        compressed = [t for t in trace if t["compressing"]]
        for index, t in enumerate(compressed):
            prior = compressed[index - 1]["memory"] if index else {}
            for i, key in enumerate(t["keys"]):
                if key not in t["memory"]:
                    continue
                e_before = prior[key].reshape(-1) if key in prior else 0
                residual = t["local"][i].reshape(-1) + e_before - t["applied"][i].reshape(-1)
                factor = beta if index < start else 1.0
                torch.testing.assert_close(t["memory"][key].reshape(-1), factor * residual, atol=1e-12, rtol=0)


# --- update_state, aliases, validation (one process) --------------------------------------------------

def test_update_state_advances_the_iteration_and_rescales_memory_to_a_new_lr():
    lr = [0.1]

    class Schedule:
        def get_last_lr(self):
            return list(lr)

    state = PowerSGDState(None, start_powerSGD_iter=5, lr_scheduler=Schedule())
    state.load_state_dict({**state.local_state_dict(), "param_shapes": [[4, 4]],
                           "memory": {0: {"shape": [4, 4], "error": torch.ones(4, 4), "q": None, "p": None}}})
    state.update_state()
    assert state.iter == 1
    lr[0] = 0.025
    state.update_state()
    assert state.iter == 2
    torch.testing.assert_close(state.local_state_dict()["memory"][0]["error"], torch.full((4, 4), 4.0))


def test_signature_defaults_equal_pytorchs():
    """Tools that read defaults from the signature (config systems, CLI generators) see PyTorch's values."""
    import inspect

    from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import PowerSGDState as TorchState

    ours = inspect.signature(PowerSGDState).parameters
    for name, param in inspect.signature(TorchState).parameters.items():
        assert name in ours, name
        assert ours[name].default == param.default, name
        assert type(ours[name].default) is type(param.default), name


def test_error_feedback_alias():
    assert PowerSGDState(None, start_powerSGD_iter=2, error_feedback=False).use_error_feedback is False
    assert PowerSGDState(None, start_powerSGD_iter=2, use_error_feedback=True, error_feedback=True).error_feedback
    with pytest.raises(ValueError, match="error_feedback"):
        PowerSGDState(None, start_powerSGD_iter=2, use_error_feedback=False, error_feedback=True)


@pytest.mark.parametrize("kwargs, error, name", [
    (dict(bytes_per_weight=3), ValueError, "bytes_per_weight.*2.*4.*8"),
    (dict(warm_up_beta_factor=0), ValueError, r"warm_up_beta_factor.*\(0, 1\]"),
    (dict(warm_up_beta_factor=1.5), ValueError, r"warm_up_beta_factor.*\(0, 1\]"),
    (dict(feedback_every_n_iters=0), ValueError, "feedback_every_n_iters.*>= 1"),
    (dict(lr_scheduler=object()), TypeError, "lr_scheduler.*get_last_lr"),
    (dict(start_powerSGD_iter=-1), ValueError, r"^start_powerSGD_iter must be an integer >= 0, got -1$"),
    (dict(start_powerSGD_iter="10"), ValueError, r"^start_powerSGD_iter must be an integer >= 0, got '10'$"),
])
def test_invalid_options_name_the_argument_and_allowed_values(kwargs, error, name):
    with pytest.raises(error, match=name):
        PowerSGDState(None, **{"start_powerSGD_iter": 2, **kwargs})


def test_options_survive_state_dict_and_pickle():
    import pickle
    state = PowerSGDState(None, start_powerSGD_iter=2, bytes_per_weight=2, feedback_every_n_iters=3,
                          warm_up_beta_factor=0.25)
    clone = pickle.loads(pickle.dumps(state))
    assert (clone.bytes_per_weight, clone.feedback_every_n_iters, clone.warm_up_beta_factor) == (2, 3, 0.25)


def test_compression_stats_are_zero_before_start_and_the_start_is_logged_once(caplog):
    import logging

    state = PowerSGDState(None, start_powerSGD_iter=3)
    with caplog.at_level(logging.INFO, logger="gradpress.hooks.powersgd"):
        for _ in range(5):
            assert state.compression_stats() == (0, 0, 0)  # update_state compresses nothing
            state.update_state()
    starts = [r for r in caplog.records if "Start to apply PowerSGD" in r.getMessage()]
    assert len(starts) == 1 and "after 3 iterations" in starts[0].getMessage()
    assert "(0, 0, 0)" in starts[0].getMessage()
    assert "(0, 0, 0) until iteration" in PowerSGDState.compression_stats.__doc__


def test_last_step_bytes_stats_reads_one_compressed_iteration_not_the_warm_up():
    import gradpress
    """bytes_stats() is cumulative and includes the warm-up; last_step_bytes_stats() is the last compressed
    iteration's, equal to the plan's bytes per step."""
    from gradpress.comm import LocalCommunicator
    from gradpress.hooks.bucket import DenseBucket
    from gradpress.powersgd import make_plan

    shapes = [(32, 16), (16,), (8, 8)]
    params = [torch.zeros(shape) for shape in shapes]
    state = gradpress.PowerSGDState(None, matrix_approximation_rank=2, start_powerSGD_iter=2,
                                    min_compression_rate=0, warm_up_bytes_per_weight=2)
    state._comm = LocalCommunicator()
    assert state.last_step_bytes_stats() == (0, 0, 0)
    for step in range(4):
        buffer = torch.randn(sum(torch.Size(s).numel() for s in shapes))
        gradpress.powerSGD_hook(state, DenseBucket(0, True, params, buffer)).wait()
        if step == 1:
            assert state.last_step_bytes_stats() == (0, 0, 0)  # the warm-up is not a compressed step
    plan = make_plan(shapes, 2, 0)
    numel = sum(torch.Size(s).numel() for s in shapes)
    assert state.last_step_bytes_stats() == (numel / plan.numel_sent, 4 * numel, 4 * plan.numel_sent)
    assert state.bytes_stats()[2] > 2 * 4 * plan.numel_sent  # cumulative: the warm-up's and both steps'

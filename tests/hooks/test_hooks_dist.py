"""DDP hooks on 2 gloo ranks: oracles against plain DDP, SVD, conservation, checkpoints, ordering."""

from __future__ import annotations

import hashlib
import pickle
import random
import time

import pytest
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import gradpress
import models
from distributed import run, run_fresh

WORLD = 2


def _ddp(model, **kwargs):
    return DDP(model, **kwargs)


def _param_digest(model) -> str:
    h = hashlib.sha256()
    for p in model.parameters():
        # Bitwise digest without numpy (not a dependency: a fresh install does not have it).
        h.update(bytes(p.detach().cpu().contiguous().view(-1).view(torch.uint8).tolist()))
    return h.hexdigest()


def _sgd_step(model, lr=0.05):
    with torch.no_grad():
        for p in model.parameters():
            p -= lr * p.grad


# --- full rank == plain DDP -----------------------------------------------------------------------------

def full_rank_matches_ddp(rank, world, hook_name, wrapper, bucket_cap_mb, jitter, num_iters=None,
                          advance_on_submit=True, overlap="auto"):
    ref = _ddp(models.make_model())
    net = _ddp(models.make_model(), bucket_cap_mb=bucket_cap_mb)
    state = gradpress.PowerSGDState(None, matrix_approximation_rank=128, min_compression_rate=0,
                                    start_powerSGD_iter=2, num_iters_per_step=num_iters, overlap=overlap)
    state.session.pipeline.advance_on_submit = advance_on_submit
    hook = getattr(gradpress, hook_name)
    if wrapper:
        hook = getattr(gradpress, wrapper)(hook)
    net.register_comm_hook(state, hook)
    if jitter:
        # Different, random delays per rank between bucket hooks: collective order must not depend on timing.
        rng = random.Random(rank)
        for p in net.parameters():
            p.register_hook(lambda g: (time.sleep(rng.random() * 0.003), g)[1])
    worst = 0.0
    for step in range(6):
        x, y = models.batch(rank, step)
        for m in (ref, net):
            m.zero_grad()
            models.loss_fn(m, x, y).backward()
        worst = max(worst, max((a.grad - b.grad).abs().max().item()
                               for a, b in zip(ref.parameters(), net.parameters())))
        _sgd_step(ref)
        with torch.no_grad():
            for a, b in zip(ref.parameters(), net.parameters()):
                b.copy_(a)
    return worst, state.compression_stats(), len(list(net.parameters()))


@pytest.mark.parametrize("hook_name, wrapper, tol, num_iters", [
    ("powerSGD_hook", None, 1e-5, None),
    ("batched_powerSGD_hook", None, 1e-5, None),
    ("powerSGD_hook", "fp16_compress_wrapper", 2e-3, None),
    ("powerSGD_hook", "bf16_compress_wrapper", 2e-2, None),
    # Multi-iteration: two one-sided iterations at full rank reconstruct exactly,
    # (I - P P^T) M (I - Q Q^T) = 0 once either projector is the identity.
    ("powerSGD_hook", None, 1e-5, 2),
    ("batched_powerSGD_hook", None, 1e-5, 2),
])
def test_full_rank_gives_the_mean_gradient_of_plain_ddp(hook_name, wrapper, tol, num_iters):
    results = run(full_rank_matches_ddp, WORLD, hook_name, wrapper, 25, False, num_iters)
    for worst, (rate, before, after), _ in results:
        assert after > 0, "compression never ran"
        assert worst < tol


@pytest.mark.parametrize("advance_on_submit, num_iters, overlap", [(True, None, "none"), (False, None, "none"),
                                                                  (False, 2, "none"), (False, None, "p-phase")])
def test_many_buckets_with_timing_jitter_keep_collective_order(advance_on_submit, num_iters, overlap):
    # One parameter per bucket (tiny cap) and random per-rank delays: a mismatched collective order would
    # hang or mix up buckets' factors, so the full-rank result would not equal plain DDP. Also with the
    # pipeline that defers every later phase to the last bucket (no wait inside the backward pass), and
    # with each bucket's P all-reduce issued as the bucket arrives.
    results = run(full_rank_matches_ddp, WORLD, "powerSGD_hook", None, 0.0001, True, num_iters, advance_on_submit,
                  overlap)
    for worst, (rate, before, after), _ in results:
        assert after > 0 and worst < 1e-5


def _overlap_run(rank, world, overlap, bytes_per_weight):
    net = _ddp(models.make_model(), bucket_cap_mb=0.002)
    state = gradpress.PowerSGDState(None, matrix_approximation_rank=2, start_powerSGD_iter=2, overlap=overlap,
                                    bytes_per_weight=bytes_per_weight, min_compression_rate=1)
    net.register_comm_hook(state, gradpress.powerSGD_hook)
    for step in range(6):
        x, y = models.batch(rank, step)
        net.zero_grad()
        models.loss_fn(net, x, y).backward()
        _sgd_step(net)
    return [p.detach().clone() for p in net.parameters()], state.compression_stats(), state.bytes_stats()


@pytest.mark.parametrize("bytes_per_weight", [4, 2])
def test_issuing_each_buckets_p_phase_on_arrival_gives_the_batched_steps_numbers(bytes_per_weight):
    """``overlap="p-phase"`` (each bucket its own segment, its P product and all-reduce issued as it
    arrives; the rest batched at the last bucket) computes what the model-wide step does, on several
    buckets, and sends the same bytes: on the CPU bit for bit (a matrix's products, QR and fp16 scale do
    not depend on what shares its segment)."""
    batched = run(_overlap_run, WORLD, "none", bytes_per_weight)
    overlapped = run(_overlap_run, WORLD, "p-phase", bytes_per_weight)
    for (a, stats_a, bytes_a), (b, stats_b, bytes_b) in zip(batched, overlapped):
        assert stats_a == stats_b and bytes_a == bytes_b and stats_a[2] > 0
        assert all(torch.equal(x, y) for x, y in zip(a, b))


def test_overlap_is_checked():
    with pytest.raises(ValueError, match="overlap must be one of 'auto', 'none', 'p-phase'"):
        gradpress.PowerSGDState(None, overlap="each")
    with pytest.raises(ValueError, match="overlap='p-phase' issues classic PowerSGD's P phase per bucket"):
        gradpress.PowerSGDState(None, overlap="p-phase", num_iters_per_step=2)


# --- SVD oracle through DDP -------------------------------------------------------------------------------

class _Bilinear(nn.Module):
    """loss = <W, x>: the gradient with respect to W is exactly x."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(40, 30, dtype=torch.float64))

    def forward(self, x):
        return (self.weight * x).sum()


def converges_to_svd(rank, world, r):
    net = _ddp(_Bilinear())
    # bytes_per_weight=8: fp64 on the wire for these fp64 gradients (the default 4 would send fp32).
    state = gradpress.PowerSGDState(None, matrix_approximation_rank=r, start_powerSGD_iter=2,
                                    min_compression_rate=0, use_error_feedback=False, bytes_per_weight=8)
    net.register_comm_hook(state, gradpress.powerSGD_hook)
    g = torch.Generator().manual_seed(0)
    u, _ = torch.linalg.qr(torch.randn(40, 6, generator=g, dtype=torch.float64))
    v, _ = torch.linalg.qr(torch.randn(30, 6, generator=g, dtype=torch.float64))
    base = u @ torch.diag(torch.tensor([9.0, 7, 5, 3, 1, 0.5], dtype=torch.float64)) @ v.T
    # Each rank's gradient differs (+/- a full-rank perturbation); their mean is `base`.
    local = base + (rank - (world - 1) / 2) * torch.randn(40, 30, generator=g, dtype=torch.float64)
    for _ in range(60):
        net.zero_grad()
        net(local).backward()
    return local, net.module.weight.grad.clone()


@pytest.mark.parametrize("r", [1, 3])
def test_warm_start_converges_to_best_rank_r_approximation_of_the_mean(r):
    results = run(converges_to_svd, WORLD, r)
    mean = sum(local for local, _ in results) / WORLD
    u, s, vh = torch.linalg.svd(mean)
    best = u[:, :r] @ torch.diag(s[:r]) @ vh[:r]
    for _, grad in results:
        torch.testing.assert_close(grad, best, atol=1e-7, rtol=0)


# --- conservation, identical replicas, stats --------------------------------------------------------------

def train_recording(rank, world, steps, r, num_iters=None):
    torch.manual_seed(0)
    net = _ddp(models.make_model(dtype=torch.float64))
    state = gradpress.PowerSGDState(None, matrix_approximation_rank=r, start_powerSGD_iter=2,
                                    num_iters_per_step=num_iters)
    local_sum = {id(p): torch.zeros_like(p) for p in net.parameters()}
    applied_sum = {id(p): torch.zeros_like(p) for p in net.parameters()}

    def recording_hook(state, bucket):
        params = bucket.parameters()
        compressing = state.iter >= state.start_powerSGD_iter
        if compressing:
            for p, g in zip(params, bucket.gradients()):
                local_sum[id(p)] += g
        fut = gradpress.powerSGD_hook(state, bucket)

        def record(f):
            if compressing:
                for p, g in zip(params, bucket.gradients()):
                    applied_sum[id(p)] += g
            return f.value()
        return fut.then(record)

    net.register_comm_hook(state, recording_hook)
    for step in range(steps):
        x, y = models.batch(rank, step, dtype=torch.float64)
        net.zero_grad()
        models.loss_fn(net, x, y).backward()
        _sgd_step(net)
    sd = state.local_state_dict()
    plan = gradpress.make_plan([p.shape for p in net.parameters()], r, 2)
    # Elements sent over all compressed steps, from the plan's arithmetic (parity alternates per step).
    sent = sum(plan.numel_sent_per_step(num_iters, step * (num_iters or 0)) for step in range(steps - 2))
    # Per compressed parameter and rank: sum of local gradients == sum of applied updates + final error.
    # (Uncompressed tensors are averaged exactly; they keep no memory.)
    key_of = {pid: key for pid, (_, key) in state._params.keys.items()}
    worst, checked = 0.0, 0
    for p in net.parameters():
        entry = sd["memory"].get(key_of[id(p)])
        if entry is None:
            continue
        checked += 1
        worst = max(worst, (applied_sum[id(p)] + entry["error"].reshape(p.shape) - local_sum[id(p)]).abs().max().item())
    assert checked == len(plan.compressed)
    return worst, _param_digest(net), state.compression_stats(), plan.numel, sent


@pytest.mark.parametrize("num_iters", [None, 1, 2])
def test_error_feedback_conserves_mass_and_replicas_stay_identical(num_iters):
    steps, r = 50 + 2, 1
    results = run(train_recording, WORLD, steps, r, num_iters)
    digests = {digest for _, digest, *_ in results}
    assert len(digests) == 1, "ranks hold different parameters"
    for worst, _, (rate, before, after), numel, sent in results:
        assert worst < 1e-9
        compressed_steps = steps - 2
        assert before == compressed_steps * numel and after == sent
        assert rate == pytest.approx(compressed_steps * numel / sent) and rate > 1.5


# --- checkpoints -------------------------------------------------------------------------------------------

def _train(net, state, rank, steps, start, opt):
    for step in range(start, start + steps):
        x, y = models.batch(rank, step)
        opt.zero_grad()
        models.loss_fn(net, x, y).backward()
        opt.step()


def _setup(hook_name, num_iters=None):
    net = _ddp(models.make_model())
    state = gradpress.PowerSGDState(None, matrix_approximation_rank=2, start_powerSGD_iter=3,
                                    num_iters_per_step=num_iters)
    net.register_comm_hook(state, getattr(gradpress, hook_name))
    opt = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)
    return net, state, opt


def ckpt_uninterrupted(rank, world, hook_name, total, num_iters=None):
    net, state, opt = _setup(hook_name, num_iters)
    _train(net, state, rank, total, 0, opt)
    return [p.detach().clone() for p in net.parameters()]


def ckpt_first_half(rank, world, hook_name, k, path, use_pickle, num_iters=None):
    net, state, opt = _setup(hook_name, num_iters)
    _train(net, state, rank, k, 0, opt)
    blob = pickle.dumps(state) if use_pickle else state.state_dict()
    torch.save({"model": net.module.state_dict(), "opt": opt.state_dict(), "powersgd": blob},
               f"{path}.{rank}")


def ckpt_second_half(rank, world, hook_name, k, total, path, use_pickle, num_iters=None):
    net, state, opt = _setup(hook_name, num_iters)
    saved = torch.load(f"{path}.{rank}", weights_only=False)
    net.module.load_state_dict(saved["model"])
    opt.load_state_dict(saved["opt"])
    if use_pickle:
        state = pickle.loads(saved["powersgd"])
        net = _ddp(net.module)  # re-register on a fresh DDP wrapper with the unpickled state
        net.register_comm_hook(state, getattr(gradpress, hook_name))
        opt = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)
        opt.load_state_dict(saved["opt"])
    else:
        state.load_state_dict(saved["powersgd"])
    _train(net, state, rank, total - k, k, opt)
    return [p.detach().clone() for p in net.parameters()]


@pytest.mark.slow
@pytest.mark.parametrize("use_pickle, num_iters", [(False, None), (True, None), (False, 1)])
def test_resume_from_checkpoint_equals_uninterrupted_run(tmp_path, use_pickle, num_iters):
    # num_iters=1: the resumed run must continue on the right side (P or Q) with the saved P memory.
    total, k = 14, 8
    path = str(tmp_path / "ckpt")
    expected = run(ckpt_uninterrupted, WORLD, "powerSGD_hook", total, num_iters)
    run(ckpt_first_half, WORLD, "powerSGD_hook", k, path, use_pickle, num_iters)  # saves; the resume starts afresh
    resumed = run_fresh(ckpt_second_half, WORLD, "powerSGD_hook", k, total, path, use_pickle, num_iters)
    for want, got in zip(expected, resumed):
        for a, b in zip(want, got):
            torch.testing.assert_close(b, a, atol=1e-6, rtol=0)


def load_moves_devices_and_checks_options(rank, world):
    net, state, opt = _setup("powerSGD_hook")
    _train(net, state, rank, 5, 0, opt)
    sd = state.local_state_dict()
    assert all(isinstance(v["error"], torch.Tensor) for v in sd["memory"].values())
    assert "process_group" not in str(sd["options"])
    other = gradpress.PowerSGDState(None, matrix_approximation_rank=3, start_powerSGD_iter=3)
    try:
        other.load_state_dict(sd)
    except ValueError as exc:
        return str(exc)
    return None


def test_load_state_dict_rejects_other_rank():
    for message in run(load_moves_devices_and_checks_options, WORLD):
        assert message is not None and "matrix_approximation_rank=2" in message


# --- dtypes, devices, plain hooks --------------------------------------------------------------------------

def low_precision_training(rank, world, dtype):
    net = _ddp(models.make_model(dtype=dtype))
    state = gradpress.PowerSGDState(None, matrix_approximation_rank=1, start_powerSGD_iter=2)
    net.register_comm_hook(state, gradpress.powerSGD_hook)
    for step in range(8):
        x, y = models.batch(rank, step, dtype=dtype)
        net.zero_grad()
        models.loss_fn(net, x, y).backward()
        _sgd_step(net)
    finite = all(torch.isfinite(p).all() for p in net.parameters())
    return finite, _param_digest(net), state.compression_stats()[2] > 0


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_low_precision_gradients_train_identically_on_all_ranks(dtype):
    results = run(low_precision_training, WORLD, dtype)
    assert all(finite and compressed for finite, _, compressed in results)
    assert len({digest for _, digest, _ in results}) == 1


def plain_hooks_match_ddp(rank, world, hook_name, tol):
    ref = _ddp(models.make_model())
    net = _ddp(models.make_model())
    net.register_comm_hook(None, getattr(gradpress, hook_name))
    x, y = models.batch(rank, 0)
    for m in (ref, net):
        models.loss_fn(m, x, y).backward()
    return max((a.grad - b.grad).abs().max().item() for a, b in zip(ref.parameters(), net.parameters())) < tol


@pytest.mark.parametrize("hook_name, tol", [("allreduce_hook", 1e-7), ("fp16_compress_hook", 1e-3),
                                            ("bf16_compress_hook", 1e-2)])
def test_plain_and_cast_hooks_match_ddp(hook_name, tol):
    assert all(run(plain_hooks_match_ddp, WORLD, hook_name, tol))


def cpu_tensors_on_a_cuda_machine(rank, world):
    # PyTorch's hook calls torch.cuda.synchronize(device) whenever CUDA is available, which fails for CPU
    # tensors. Pretend CUDA is there and make any device-wide sync an error.
    def forbidden(*args, **kwargs):
        raise AssertionError("device-wide synchronize called")
    saved = torch.cuda.is_available, torch.cuda.synchronize
    torch.cuda.is_available, torch.cuda.synchronize = (lambda: True), forbidden
    try:
        net = _ddp(models.make_model())
        state = gradpress.PowerSGDState(None, matrix_approximation_rank=1, start_powerSGD_iter=2,
                                        comm_device="cpu")
        net.register_comm_hook(state, gradpress.powerSGD_hook)
        for step in range(4):
            x, y = models.batch(rank, step)
            net.zero_grad()
            models.loss_fn(net, x, y).backward()
        return state.compression_stats()[2] > 0
    finally:
        torch.cuda.is_available, torch.cuda.synchronize = saved


def test_cpu_tensors_work_when_cuda_is_available():
    assert all(run(cpu_tensors_on_a_cuda_machine, WORLD))


# --- bad input ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("kwargs, name", [
    ({"start_powerSGD_iter": 1}, "start_powerSGD_iter"),
    ({"matrix_approximation_rank": 0}, "rank"),
    ({"min_compression_rate": -2}, "min_compression_rate"),
    ({"orthogonalization_epsilon": -1.0}, "orthogonalization_epsilon"),
    ({"comm_device": "not-a-device"}, "comm_device"),
    ({"random_seed": -3}, "random_seed"),
])
def test_invalid_state_arguments_raise_value_error_naming_them(kwargs, name):
    with pytest.raises(ValueError, match=name):
        gradpress.PowerSGDState(None, **kwargs)


def test_start_iter_may_be_small_without_memory():
    state = gradpress.PowerSGDState(None, start_powerSGD_iter=0, use_error_feedback=False, warm_start=False)
    assert state.start_powerSGD_iter == 0


def test_hook_rejects_a_foreign_state():
    with pytest.raises(TypeError, match="PowerSGDState"):
        gradpress.powerSGD_hook(object(), None)  # type: ignore[arg-type]


def test_a_rank_given_as_first_argument_is_a_clear_type_error_at_construction():
    # PowerSGDState(4, 30): the user took the first argument for the rank.
    with pytest.raises(TypeError, match=r"process_group.*got int 4.*PowerSGDState\(None, matrix_approximation_rank=4"):
        gradpress.PowerSGDState(4, 30)
    with pytest.raises(TypeError, match="process_group"):
        gradpress.PowerSGDState("gloo")
    with pytest.raises(TypeError, match="PowerSGD's process_group"):
        gradpress.PowerSGD([nn.Parameter(torch.ones(2, 2))], gradpress.Config(rank=2), process_group=3)
    with pytest.raises(TypeError, match="AllReduce's process_group"):
        gradpress.AllReduce(process_group=3)


def _plain_hook_with_powersgd_state(rank, world_size, hook_name):
    torch.manual_seed(0)
    model = DDP(models.make_model())
    model.register_comm_hook(gradpress.PowerSGDState(None, 2, 10), getattr(gradpress, hook_name))
    x, y = models.batch(rank, 0)
    try:
        models.loss_fn(model, x, y).backward()
    except TypeError as error:
        return str(error)
    return "no error"


@pytest.mark.parametrize("hook_name", ["fp16_compress_hook", "bf16_compress_hook", "allreduce_hook"])
def test_a_plain_hook_given_a_powersgd_state_is_a_clear_type_error(hook_name):
    messages = run(_plain_hook_with_powersgd_state, WORLD, hook_name)
    for message in messages:
        assert f"{hook_name}'s state" in message and "PowerSGDState is the state of powerSGD_hook" in message
        if hook_name != "allreduce_hook":
            assert f"{hook_name[:4]}_compress_wrapper(powerSGD_hook)" in message


def _one_state_two_models(rank, world_size, together):
    torch.manual_seed(0)
    first, second = DDP(models.make_model()), DDP(models.make_model())
    state = gradpress.PowerSGDState(None, 2, 10)
    first.register_comm_hook(state, gradpress.powerSGD_hook)
    second.register_comm_hook(state, gradpress.powerSGD_hook)
    x, y = models.batch(rank, 0)
    try:
        if together:   # backward passes through both models (the second one is refused at the latest)
            for _ in range(2):
                (models.loss_fn(first, x, y) + models.loss_fn(second, x, y)).backward()
        else:          # the models in turn
            for _ in range(2):
                models.loss_fn(first, x, y).backward()
                models.loss_fn(second, x, y).backward()
    except RuntimeError as error:
        return str(error)
    return "no error"


@pytest.mark.parametrize("together", [True, False])
def test_one_state_registered_on_two_models_is_refused(together):
    for message in run(_one_state_two_models, WORLD, together):
        assert "registered on two DDP models" in message and "its own PowerSGDState" in message


def _one_state_moved_to_a_new_model(rank, world_size, hook_name):
    """PyTorch's c10d pattern: the state of a finished model registered on a new DDP model (with another
    hook and other shapes). The new model starts with fresh memory; the old one is refused afterwards."""
    import warnings

    state = gradpress.PowerSGDState(None, matrix_approximation_rank=2, start_powerSGD_iter=2,
                                    min_compression_rate=0)
    first = DDP(models.make_model(0))
    first.register_comm_hook(state, gradpress.powerSGD_hook)
    for step in range(4):  # two of them compressed
        first.zero_grad()
        models.loss_fn(first, *models.batch(rank, step)).backward()
    second = DDP(models.make_model(1, width=4))
    second.register_comm_hook(state, getattr(gradpress, hook_name))
    exact = DDP(models.make_model(1, width=4))  # the same model and data with a fresh state: the oracle
    fresh = gradpress.PowerSGDState(None, matrix_approximation_rank=2, start_powerSGD_iter=2, min_compression_rate=0)
    exact.register_comm_hook(fresh, getattr(gradpress, hook_name))
    fresh.iter = state.iter  # the iteration count goes on, as in PyTorch
    same = True
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(3):
            for net in (second, exact):
                net.zero_grad()
                models.loss_fn(net, *models.batch(rank, step)).backward()
            same &= all(torch.equal(a.grad, b.grad) for a, b in zip(second.parameters(), exact.parameters()))
    moved = [str(w.message) for w in caught if "another DDP model" in str(w.message)]
    shapes = state.local_state_dict()["param_shapes"]
    iters = state.iter
    try:
        models.loss_fn(first, *models.batch(rank, 9)).backward()
        back = "no error"
    except RuntimeError as error:
        back = str(error)
    return same, len(moved), shapes, [list(p.shape) for p in second.module.parameters()], iters, back


@pytest.mark.parametrize("hook_name", ["powerSGD_hook", "batched_powerSGD_hook"])
def test_a_state_moved_to_a_new_model_starts_afresh_and_the_old_model_is_refused(hook_name):
    for same, warned, shapes, new_shapes, iters, back in run(_one_state_moved_to_a_new_model, WORLD, hook_name):
        # Per-parameter keys of the new model only (the batched hook keeps its memory by bucket, no keys).
        assert sorted(shapes) == (sorted(new_shapes) if hook_name == "powerSGD_hook" else [])
        assert same and warned == 1 and iters == 7
        assert "registered on two DDP models" in back and "trained in turn" in back


def _loaded_then_moved(rank, world_size):
    """A checkpoint loaded into a state that served another model, then a new model: refused (starting
    afresh would throw the loaded memory away), not silently moved."""
    state = gradpress.PowerSGDState(None, matrix_approximation_rank=2, start_powerSGD_iter=2)
    first = DDP(models.make_model(0))
    first.register_comm_hook(state, gradpress.powerSGD_hook)
    for step in range(3):
        models.loss_fn(first, *models.batch(rank, step)).backward()
    state.load_state_dict(state.state_dict())
    second = DDP(models.make_model(0))
    second.register_comm_hook(state, gradpress.powerSGD_hook)
    try:
        models.loss_fn(second, *models.batch(rank, 3)).backward()
    except RuntimeError as error:
        return str(error)
    return "no error"


def test_a_state_loaded_after_serving_a_model_is_not_moved_silently():
    for message in run(_loaded_then_moved, WORLD):
        assert "checkpoint was loaded" in message and "fresh PowerSGDState" in message


def _one_state_one_model_retried(rank, world_size):
    # Many buckets, DDP's bucket rebuild after the first iteration, the start of compression: one model.
    torch.manual_seed(0)
    model = DDP(models.make_model(), bucket_cap_mb=0.001)
    state = gradpress.PowerSGDState(None, 2, 3)
    model.register_comm_hook(state, gradpress.powerSGD_hook)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    for step in range(6):
        x, y = models.batch(rank, step)
        opt.zero_grad()
        models.loss_fn(model, x, y).backward()
        opt.step()
    return state.iter


def test_one_model_over_many_iterations_is_accepted():
    assert run(_one_state_one_model_retried, WORLD) == [6, 6]


def ckpt_second_half_loaded_before_registering(rank, world, hook_name, k, total, path):
    net = _ddp(models.make_model())
    saved = torch.load(f"{path}.{rank}", weights_only=False)
    net.module.load_state_dict(saved["model"])
    state = gradpress.PowerSGDState(None, matrix_approximation_rank=2, start_powerSGD_iter=3)
    state.load_state_dict(saved["powersgd"])  # before register_comm_hook
    net.register_comm_hook(state, getattr(gradpress, hook_name))
    opt = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)
    opt.load_state_dict(saved["opt"])
    _train(net, state, rank, total - k, k, opt)
    return [p.detach().clone() for p in net.parameters()]


@pytest.mark.slow
def test_load_state_dict_before_or_after_register_comm_hook_resumes_the_same(tmp_path):
    total, k = 12, 6
    path = str(tmp_path / "ckpt")
    run(ckpt_first_half, WORLD, "powerSGD_hook", k, path, False)
    after = run_fresh(ckpt_second_half, WORLD, "powerSGD_hook", k, total, path, False)
    before = run_fresh(ckpt_second_half_loaded_before_registering, WORLD, "powerSGD_hook", k, total, path)
    for a, b in zip(after, before):
        for x, y in zip(a, b):
            assert torch.equal(x, y)

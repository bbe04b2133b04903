"""Approximation-error diagnostics: float64 oracles on known matrices, full rank, every n-th step,
non-finite steps, names, the DDP hook on 2 ranks, and the TensorBoard call."""

from __future__ import annotations

import doctest

import pytest
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import gradpress
import gradpress.diagnostics
import models
from distributed import run
from gradpress import Config, PowerSGD
from gradpress.comm import LocalCommunicator
from gradpress.powersgd import EngineConfig, Segment, make_plan
from gradpress.powersgd.step import compress_step
from host_reads import as_on_an_accelerator, no_host_reads

WORLD = 2
SHAPES = [(12, 9), (12, 9), (7, 10), (5,), (6, 2, 2, 2)]

CONFIGS = {
    "classic": {},
    "classic-no-feedback": {"use_error_feedback": False},
    "classic-feedback-every-2-beta": {"feedback_every_n_iters": 2, "warm_up_beta_factor": 0.5, "warm_up_steps": 2},
    "one-iteration": {"num_iters_per_step": 1},
    "two-iterations": {"num_iters_per_step": 2},
    "classic-fp16-wire": {"bytes_per_weight": 2},
}


def _gradients(step, bad=False):
    generator = torch.Generator().manual_seed(700 + step)
    grads = [torch.randn(shape, generator=generator) for shape in SHAPES]
    if bad:
        grads[0][1, 1] = float("inf")
    return grads


def _segment(config):
    plan = make_plan(SHAPES, config.rank, config.min_compression_rate)
    return Segment(plan, list(range(len(SHAPES))), torch.device("cpu"), torch.float32)


def _step(segment, grads, config, compressed_step, measure=True):
    task, _ = compress_step(segment, grads, LocalCommunicator(), config, compressed_step, measure=measure,
                            global_residual=measure)
    for handle in task:
        handle.wait()


def _measured(segment):
    """{tensor index: relative error} from the segment's recorded norms."""
    norms = segment.approximation_norms().double()
    return {i: float(norms[j, 1] / norms[j, 0]) for j, i in enumerate(segment.compressed_order)}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_the_error_equals_a_float64_computation_of_m_minus_the_applied_approximation(name):
    config = EngineConfig(rank=2, min_compression_rate=0, random_seed=1, **CONFIGS[name])
    segment = _segment(config)
    order = segment.compressed_order
    for compressed_step in range(5):
        grads = _gradients(compressed_step)
        with_memory = config.use_error_feedback and (compressed_step + 1) % config.feedback_every_n_iters == 0
        memory = {i: segment.error_views[j].double().clone() for j, i in enumerate(order)}
        compressed = {i: grads[i].double().view(segment.plan.tensors[i].matrix) + (memory[i] if with_memory else 0)
                      for i in order}
        _step(segment, grads, config, compressed_step)
        for i, value in _measured(segment).items():
            applied = grads[i].double().view(segment.plan.tensors[i].matrix)
            expected = float((compressed[i] - applied).norm() / compressed[i].norm())
            assert value == pytest.approx(expected, rel=1e-4, abs=1e-6), (name, compressed_step, i)
            assert 0 < value < 1.5


@pytest.mark.parametrize("num_iters", [None, 2])
def test_the_error_is_zero_at_full_rank(num_iters):
    config = EngineConfig(rank=12, min_compression_rate=0, num_iters_per_step=num_iters)
    segment = _segment(config)
    for compressed_step in range(3):
        _step(segment, _gradients(compressed_step), config, compressed_step)
        assert max(_measured(segment).values()) < 1e-5


def test_the_device_path_measures_the_same_and_reads_nothing_on_the_host():
    config = EngineConfig(rank=2, min_compression_rate=0, random_seed=2)
    on_cpu, on_device = _segment(config), _segment(config)
    for compressed_step in range(3):
        _step(on_cpu, _gradients(compressed_step), config, compressed_step)
        with as_on_an_accelerator(), no_host_reads():
            _step(on_device, _gradients(compressed_step), config, compressed_step)
        torch.testing.assert_close(on_device.approximation_norms(), on_cpu.approximation_norms())


@pytest.mark.parametrize("accelerator_path", [False, True])
def test_a_non_finite_step_leaves_the_measurement_as_it_was(accelerator_path):
    config = EngineConfig(rank=2, min_compression_rate=0)
    segment = _segment(config)
    _step(segment, _gradients(0), config, 0)
    before = segment.approximation_norms().clone()
    global_before = segment.global_residual_norms().clone()
    if accelerator_path:
        with as_on_an_accelerator():
            _step(segment, _gradients(1, bad=True), config, 1)
    else:
        _step(segment, _gradients(1, bad=True), config, 1)
    assert torch.equal(segment.approximation_norms(), before)
    assert torch.equal(segment.global_residual_norms(), global_before)  # the sketch of that step is dropped
    assert bool(torch.isfinite(global_before).all())


def test_the_aggregator_measures_every_nth_compressed_step_and_names_parameters():
    layer = nn.Sequential(nn.Linear(16, 12), nn.ReLU(), nn.Linear(12, 8))
    powersgd = PowerSGD(layer.named_parameters(), Config(rank=2, num_iters_per_step=None,
                                                         start_compressing_after_num_steps=2,
                                                         approximation_error_every_n_iters=3))
    history = []
    for step in range(9):
        torch.manual_seed(step)
        layer.zero_grad()
        layer(torch.randn(32, 16)).square().mean().backward()
        powersgd.aggregate_([p.grad for p in layer.parameters()])
        history.append(powersgd.approximation_error())
    assert history[0] == history[1] == {}  # exact averaging: nothing compressed, nothing measured
    assert set(history[2]) == {"0.weight", "2.weight"}  # biases are sent exactly
    # Measured on compressed steps 0, 3, 6 (steps 2, 5, 8): unchanged in between.
    assert history[3] == history[4] == history[2] != history[5]
    assert history[6] == history[7] == history[5] != history[8]
    summary = powersgd.approximation_error_summary()
    assert summary.parameters == 2 and summary.worst == max(history[8].values())
    assert summary.worst_name == max(history[8], key=history[8].get)
    assert min(history[8].values()) <= summary.overall <= summary.worst


def test_unnamed_parameters_are_numbered_and_bad_arguments_are_clear():
    params = [nn.Parameter(torch.zeros(10, 10)), nn.Parameter(torch.zeros(10))]
    powersgd = PowerSGD(params, Config(rank=1, num_iters_per_step=None, start_compressing_after_num_steps=0,
                                       approximation_error_every_n_iters=1))
    powersgd.aggregate_([torch.randn(10, 10), torch.randn(10)])
    assert list(powersgd.approximation_error()) == ["#0"]
    powersgd.name_parameters([("w", params[0]), ("b", params[1])])
    assert list(powersgd.approximation_error()) == ["w"]
    for bad in (0, -2, 1.5, True, "10"):
        with pytest.raises(ValueError, match="approximation_error_every_n_iters"):
            Config(rank=1, approximation_error_every_n_iters=bad)
        with pytest.raises(ValueError, match="approximation_error_every_n_iters"):
            gradpress.PowerSGDState(None, approximation_error_every_n_iters=bad)
    with pytest.raises(TypeError, match="named_parameters"):
        powersgd.name_parameters([params[0]])


def test_measuring_changes_no_number_of_the_training():
    def train(every):
        torch.manual_seed(0)
        layer = nn.Linear(16, 12)
        powersgd = PowerSGD(layer.parameters(), Config(rank=2, start_compressing_after_num_steps=1,
                                                        approximation_error_every_n_iters=every))
        for step in range(5):
            torch.manual_seed(step)
            layer.zero_grad()
            layer(torch.randn(8, 16)).square().mean().backward()
            powersgd.aggregate_([p.grad for p in layer.parameters()])
        return layer.weight.grad.clone(), powersgd.local_state_dict()["memory"]

    grad, memory = train(None)
    grad_measured, memory_measured = train(1)
    assert torch.equal(grad, grad_measured)
    for key in memory:
        assert torch.equal(memory[key]["error"], memory_measured[key]["error"])


class _Writer:
    def __init__(self):
        self.scalars = []

    def add_scalar(self, tag, value, step=None):
        self.scalars.append((tag, value, step))


def test_log_approximation_error_writes_one_scalar_per_parameter_and_the_summary():
    layer = nn.Linear(16, 12)
    powersgd = PowerSGD(layer.named_parameters(), Config(rank=2, start_compressing_after_num_steps=0,
                                                         approximation_error_every_n_iters=1,
                                                         global_residual_every_n_iters=1))
    writer = _Writer()
    assert gradpress.log_approximation_error(writer, powersgd, 0) == {} and writer.scalars == []
    layer(torch.randn(8, 16)).square().mean().backward()
    powersgd.aggregate_([p.grad for p in layer.parameters()])
    written = gradpress.log_approximation_error(writer, powersgd, 7)
    tag, global_tag = "powersgd/approximation_error", "powersgd/global_residual"
    assert set(written) == {f"{tag}/weight", f"{tag}/overall", f"{tag}/worst", f"{global_tag}/weight",
                            f"{global_tag}/overall", f"{global_tag}/worst", f"{global_tag}/captured_energy"}
    assert writer.scalars == [(name, value, 7) for name, value in written.items()]
    assert written[f"{tag}/weight"] == powersgd.approximation_error()["weight"]
    assert written[f"{global_tag}/weight"] == powersgd.global_residual()["weight"]
    assert written[f"{global_tag}/captured_energy"] == pytest.approx(1 - written[f"{global_tag}/overall"] ** 2)


def test_the_module_example_runs():
    result = doctest.testmod(gradpress.diagnostics)
    assert result.attempted > 0 and result.failed == 0


# --- the DDP hook on 2 ranks ----------------------------------------------------------------------------

def _ddp_errors(rank, world_size):
    torch.manual_seed(0)
    model = models.make_model()
    ddp = DDP(model)
    state = gradpress.PowerSGDState(None, matrix_approximation_rank=2, start_powerSGD_iter=2,
                                    approximation_error_every_n_iters=1)
    state.name_parameters(ddp)
    ddp.register_comm_hook(state, gradpress.powerSGD_hook)
    for step in range(2):  # plain averaging: nothing measured yet
        x, y = models.batch(rank, step)
        models.loss_fn(ddp, x, y).backward()
        ddp.zero_grad()
    assert state.approximation_error() == {}
    x, y = models.batch(rank, 2)
    with ddp.no_sync():  # this rank's own gradient, M on the first compressed step (no memory yet)
        models.loss_fn(ddp, x, y).backward()
    local = {name: p.grad.clone() for name, p in model.named_parameters()}
    ddp.zero_grad()
    models.loss_fn(ddp, x, y).backward()
    expected = {}
    for name, p in model.named_parameters():
        m = local[name].double().reshape(p.shape[0], -1)
        expected[name] = float((m - p.grad.double().reshape(p.shape[0], -1)).norm() / m.norm())
    return state.approximation_error(), expected


def test_the_ddp_hook_measures_each_rank_against_its_own_gradient_by_name():
    for errors, expected in run(_ddp_errors, WORLD):
        assert errors and all(name in expected for name in errors)
        assert all(not name.endswith("bias") for name in errors)
        for name, value in errors.items():
            assert value == pytest.approx(expected[name], rel=1e-4)


def _demo_run(rank, world_size, spec):
    from gradpress.tools.workloads import DemoConfig, parse_methods, train

    return train(rank, world_size, parse_methods(spec, [2])[0], DemoConfig(steps=8, start_iter=2, evals=4))


@pytest.mark.slow
def test_the_demo_training_records_the_error_along_its_curve():
    from gradpress.tools.workloads.tasks import get_task

    model = get_task("digits").model(0)
    plan = make_plan([p.shape for p in model.parameters()], 2, 2.0)
    compressed = {name for (name, _), t in zip(model.named_parameters(), plan.tensors) if t.compressed}
    results = run(_demo_run, WORLD, "powersgd:2")
    for result in results:
        measured = [p["approximation_error"] for p in result["curve"] if p.get("approximation_error") is not None]
        assert len(measured) == 3  # evaluations at steps 4, 6, 8; compression from step 3
        assert result["approximation_error"] == pytest.approx(sum(measured) / 3)
        assert set(result["approximation_errors"]) == compressed and "fc2.bias" not in compressed
        assert all(0 < value < 1.5 for value in result["approximation_errors"].values())
        residuals = [p["global_residual"] for p in result["curve"] if p.get("global_residual") is not None]
        assert len(residuals) == 3 and result["global_residual"] == pytest.approx(sum(residuals) / 3)
        assert set(result["global_residuals"]) == compressed
        assert all(0 < value < 1 for value in result["global_residuals"].values())
    # The global residual is the workers' (of their mean), the same on each.
    assert results[0]["global_residuals"] == results[1]["global_residuals"]
    for result in run(_demo_run, WORLD, "allreduce"):
        assert result["approximation_error"] is None and result["approximation_errors"] is None
        assert result["global_residual"] is None and result["global_residuals"] is None


def test_the_tuning_guides_first_example_runs_and_reports_by_name(capsys):
    import pathlib
    import re

    text = (pathlib.Path(__file__).resolve().parents[2] / "docs" / "tuning.md").read_text()
    snippet = re.findall(r"```python\n(.*?)```", text, re.S)[0]
    exec(compile(snippet, "docs/tuning.md", "exec"), {})
    out = capsys.readouterr().out
    assert out.startswith("['1.weight', '3.weight'] overall ") and "worst " in out  # the embedding is exact


# --- the global residual: ||mean M - P Q^T|| / ||mean M||, sketched ------------------------------------------

# m > 16: a Gaussian sketch (an estimate); m <= 16: the identity (exact). A vector, sent exactly.
GLOBAL_SHAPES = [(48, 64), (48, 64), (40, 30), (12, 9), (7,), (6, 2, 2, 2)]


def _worker_gradients(rank, step, shapes):
    """A part every worker shares plus this worker's own (so the mean differs from each worker's M)."""
    shared = torch.Generator().manual_seed(900 + step)
    own = torch.Generator().manual_seed(1000 + 31 * step + rank)
    return [torch.randn(shape, generator=shared) + torch.randn(shape, generator=own) for shape in shapes]


def _engine_steps(rank, world, config, shapes, steps, gradients, measure=lambda step: True):
    """Run ``steps`` compressed steps of one segment over the default group; yield, per step, the workers'
    mean M in float64 (gathered before the step: every rank's gradient plus error memory) and the outputs."""
    import torch.distributed as dist

    from gradpress.comm import ProcessGroupCommunicator

    plan = make_plan(shapes, config.rank, config.min_compression_rate)
    segment = Segment(plan, list(range(len(shapes))), torch.device("cpu"), torch.float32)
    comm = ProcessGroupCommunicator()
    order = segment.compressed_order
    for step in range(steps):
        grads = gradients(rank, step)
        with_memory = config.use_error_feedback and (step + 1) % config.feedback_every_n_iters == 0
        means = []
        for j, i in enumerate(order):
            m = grads[i].double().view(plan.tensors[i].matrix)
            if with_memory:
                m = m + segment.error_views[j].double()
            parts = [torch.empty_like(m) for _ in range(world)]
            dist.all_gather(parts, m)
            means.append(torch.stack(parts).mean(0))
        task, _ = compress_step(segment, grads, comm, config, step, measure=measure(step),
                                global_residual=measure(step))
        for handle in task:
            handle.wait()
        applied = [grads[i].double().view(plan.tensors[i].matrix) for i in order]
        yield step, segment, means, applied


def _global_against_oracles(rank, world, num_iters):
    from gradpress.powersgd.seeding import seeded_sketch

    config = EngineConfig(rank=2, min_compression_rate=0, random_seed=5, num_iters_per_step=num_iters)
    rows = []
    for step, segment, means, applied in _engine_steps(
            rank, world, config, GLOBAL_SHAPES, 4, lambda r, s: _worker_gradients(r, s, GLOBAL_SHAPES)):
        norms = segment.global_residual_norms().double()
        for j, (mean, output) in enumerate(zip(means, applied)):
            omega = seeded_sketch(mean.shape[1], config.random_seed, step).double()
            rows.append({"m": mean.shape[1], "measured": norms[j].tolist(),
                         "sketch": [float((mean @ omega).norm()), float(((mean - output) @ omega).norm())],
                         "exact": float((mean - output).norm() / mean.norm())})
    return rows


@pytest.mark.parametrize("num_iters", [None, 2], ids=["classic", "two-iterations"])
@pytest.mark.parametrize("world", [2, 3])
def test_the_global_residual_is_a_float64_sketch_of_the_mean_and_estimates_the_exact_value(world, num_iters):
    results = run(_global_against_oracles, world, num_iters)
    assert all(rows == results[0] for rows in results[1:])  # the same numbers on every rank
    estimates = []
    for row in results[0]:
        (whole, residual), (sketch_whole, sketch_residual) = row["measured"], row["sketch"]
        assert whole == pytest.approx(sketch_whole, rel=1e-5)
        assert residual == pytest.approx(sketch_residual, rel=1e-4, abs=1e-6 * sketch_whole)
        if row["m"] <= 16:  # the identity sketch: exact
            assert residual / whole == pytest.approx(row["exact"], rel=1e-4)
        else:
            estimates.append(residual / whole / row["exact"])
    # The sketch's statistical error (k = 16; these residuals spread over many directions): a few percent
    # (measured: within 2.6%, mean 1.000 +- 0.003, on 2 and 3 ranks, both schemes).
    assert len(estimates) == 12
    assert max(abs(ratio - 1) for ratio in estimates) < 0.06
    assert abs(sum(estimates) / len(estimates) - 1) < 0.02


def _global_at_full_rank(rank, world, num_iters):
    shapes = [(20, 30), (30, 20), (12, 40), (40, 12)]
    config = EngineConfig(rank=40, min_compression_rate=0, num_iters_per_step=num_iters)
    worst = 0.0
    for _, segment, _, _ in _engine_steps(rank, world, config, shapes, 3,
                                          lambda r, s: _worker_gradients(r, s, shapes)):
        norms = segment.global_residual_norms()
        assert bool((norms[:, 0] > 1).all())
        worst = max(worst, float((norms[:, 1] / norms[:, 0]).max()))
    return worst


@pytest.mark.parametrize("num_iters", [None, 2], ids=["classic", "two-iterations"])
def test_the_global_residual_is_zero_at_full_rank_on_several_workers(num_iters):
    assert max(run(_global_at_full_rank, 3, num_iters)) < 1e-5


def _global_by_rank(rank, world, ranks, num_iters):
    """A fixed mean matrix with singular values 0.6^j (each worker: it plus or minus a private part), no
    error feedback: warm-started iterations converge to the best rank-r approximation of the mean."""
    n, m = 48, 64
    generator = torch.Generator().manual_seed(77)
    u, _ = torch.linalg.qr(torch.randn(n, n, generator=generator, dtype=torch.float64))
    v, _ = torch.linalg.qr(torch.randn(m, n, generator=generator, dtype=torch.float64))
    sigma = 0.6 ** torch.arange(n, dtype=torch.float64)
    mean = (u * sigma) @ v.T
    private = torch.randn(n, m, generator=generator, dtype=torch.float64)
    grad = (mean + (1 if rank == 0 else -1) * private).float()
    steps = 40
    values, exact = [], []
    for r in ranks:
        config = EngineConfig(rank=r, min_compression_rate=0, use_error_feedback=False, num_iters_per_step=num_iters)
        for step, segment, means, applied in _engine_steps(rank, world, config, [(n, m)], steps,
                                                           lambda *_: [grad.clone()], lambda s: s == steps - 1):
            pass  # measured at the last step only: the same Omega for every rank r
        whole, residual = segment.global_residual_norms()[0].tolist()
        values.append(residual / whole)
        exact.append(float((means[0] - applied[0]).norm() / means[0].norm()))
    tail = [float(sigma[r:].norm() / sigma.norm()) for r in ranks]
    return values, exact, tail


@pytest.mark.parametrize("num_iters", [None, 1], ids=["classic", "one-iteration"])
def test_the_global_residual_decreases_strictly_with_the_rank_once_converged(num_iters):
    ranks = [1, 2, 4, 8]
    values, exact, tail = run(_global_by_rank, WORLD, ranks, num_iters)[0]
    assert all(a > b for a, b in zip(values, values[1:])), values
    assert exact == pytest.approx(tail, rel=1e-3)  # converged: the best rank-r approximation of the mean
    # One Omega on a residual of a few dominant directions (stable rank ~3): a rougher estimate than for
    # spread-out residuals (measured: 0.706, 0.357, 0.121, 0.018 against 0.600, 0.360, 0.130, 0.017).
    assert values == pytest.approx(exact, rel=0.25)


def _collectives(rank, world, num_iters, global_every=3):
    from gradpress.tools.bench.buckets import FakeBucket
    from gradpress.hooks import powersgd as hook_module

    class Recording:
        def __init__(self, comm):
            self.comm, self.calls = comm, []

        @property
        def world_size(self):
            return self.comm.world_size

        def allreduce_sum(self, buffer):
            self.calls.append(("sum", buffer.numel()))
            return self.comm.allreduce_sum(buffer)

        def allreduce_max(self, buffer):
            self.calls.append(("max", buffer.numel()))
            return self.comm.allreduce_max(buffer)

    shapes = [(40, 30), (40, 30), (12, 9), (7,), (24, 20)]
    params = [torch.zeros(shape) for shape in shapes]
    buckets = [FakeBucket(0, params[4:], False, torch.float32), FakeBucket(1, params[2:4], False, torch.float32),
               FakeBucket(2, params[:2], True, torch.float32)]
    state = gradpress.PowerSGDState(None, matrix_approximation_rank=2, start_powerSGD_iter=2, min_compression_rate=0,
                                    num_iters_per_step=num_iters, approximation_error_every_n_iters=3,
                                    global_residual_every_n_iters=global_every)
    per_iteration = []
    from gradpress.comm import make_communicator

    recording = []

    def make_recording(*args, **kwargs):
        recording.append(Recording(make_communicator(*args, **kwargs)))
        return recording[-1]

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(hook_module, "make_communicator", make_recording)
        for step in range(8):
            grads = dict(zip(map(id, params), _worker_gradients(rank, step, shapes)))
            for bucket in buckets:
                torch._foreach_copy_(bucket.gradients(), [grads[id(p)] for p in bucket.parameters()])
            before = len(recording[0].calls) if recording else 0
            for future in [gradpress.powerSGD_hook(state, bucket) for bucket in buckets]:
                future.wait()
            per_iteration.append(recording[0].calls[before:] if recording else [])
    return per_iteration, state.global_residual()


@pytest.mark.parametrize("num_iters", [None, 2], ids=["classic", "two-iterations"])
def test_the_sketch_is_one_more_collective_per_step_on_measured_steps_in_the_same_order_everywhere(num_iters):
    results = run(_collectives, WORLD, num_iters)
    assert results[0][0] == results[1][0]  # every collective, in the same order, on every rank
    per_iteration, residuals = results[0]
    # Before start_powerSGD_iter: one exact sum of each bucket, through the engine's communicator.
    assert per_iteration[:2] == [[("sum", 24 * 20), ("sum", 12 * 9 + 7), ("sum", 2 * 40 * 30)]] * 2
    compressed = per_iteration[2:]  # compressed steps 0..5: 0 and 3 measure
    plain = [c for step, c in enumerate(compressed) if step % 3]
    assert all(c == plain[0] for c in plain)
    # One all-reduce of n x k per compressed matrix (k = min(m, 16)) of every bucket, issued after every
    # other collective of the step (the hook compresses all buckets in one step, at the last bucket).
    sketches = [("sum", 24 * 16 + 12 * 9 + 2 * 40 * 16)]  # buckets 0, 1, 2
    for step in (0, 3):
        assert compressed[step] == plain[0] + sketches, step
    assert len(residuals) == 4 and all(0 < value < 1 for value in residuals.values())  # the vector is exact


def test_the_per_worker_error_alone_costs_no_collective():
    """approximation_error_every_n_iters without global_residual_every_n_iters: every compressed step
    issues the same collectives, measured or not, and the global residual is never measured."""
    per_iteration, residuals = run(_collectives, WORLD, None, None)[0]
    compressed = per_iteration[2:]
    assert all(c == compressed[1] for c in compressed) and residuals == {}

"""gradpress hooks as FSDP2's all-reduce across replicas: 4 gloo ranks, a (replicate=2, shard=2) mesh.

Oracle: native HSDP (``fully_shard`` over the 2-D mesh) trained on the same data. The model's last layer
has 11 rows, so its shards are uneven (6 and 5 rows) and shard rank 1 carries a padding row.
"""

from __future__ import annotations

import io

import pytest
import torch
from torch import nn

import gradpress
from distributed import run
from gradpress.powersgd import make_plan

# On one test worker, where the module's runs (the module-scoped fixtures) are made once.
pytestmark = pytest.mark.xdist_group("fsdp")

WORLD = 4
STEPS = 10
_TEACHER = torch.randn(32, 11, generator=torch.Generator().manual_seed(0)) / 32 ** 0.5


def _mesh():
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))


def _model(shard_mesh, mp_policy=None, **settings):
    """Three units: two inner ``fully_shard`` layers and the root, which owns the last layer.

    ``settings``: ``FSDPModule`` setters and their value, e.g. ``gradient_divide_factor=2.0``.
    """
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 48), nn.ReLU(), nn.Linear(48, 11))
    for unit in (model[0], model[2], model):
        fully_shard(unit, mesh=shard_mesh, mp_policy=mp_policy or MixedPrecisionPolicy())
        for name, value in settings.items():
            getattr(unit, f"set_{name}")(value)
    return model


def _train(model, rank, steps):
    """Plain SGD on this rank's batch; returns the losses and this rank's local shards."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.3)
    x = torch.randn(32, 32, generator=torch.Generator().manual_seed(rank))
    y = x @ _TEACHER
    losses = []
    for _ in range(steps):
        loss = nn.functional.mse_loss(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses, [p.to_local().detach().clone() for p in model.parameters()]


def _worst(a, b):
    return max((x - y).abs().max().item() for x, y in zip(a, b))


# --- oracles: equal to native HSDP -------------------------------------------------------------------------

def against_native_hsdp(rank, world):
    mesh = _mesh()
    replicate = mesh["replicate"].get_group()
    _, native = _train(_model(mesh), rank, STEPS)

    def full_rank():
        return gradpress.PowerSGDState(replicate, matrix_approximation_rank=64, min_compression_rate=0,
                                       start_powerSGD_iter=2)

    runs = {
        "allreduce_hook": (replicate, gradpress.allreduce_hook),
        "powerSGD_hook": (full_rank(), gradpress.powerSGD_hook),
        "batched_powerSGD_hook": (full_rank(), gradpress.batched_powerSGD_hook),
        "fp16_compress_hook": (replicate, gradpress.fp16_compress_hook),
        "fp16_compress_wrapper(powerSGD_hook)": (full_rank(), gradpress.fp16_compress_wrapper(gradpress.powerSGD_hook)),
    }
    worst, iters = {}, {}
    for name, (state, hook) in runs.items():
        model = _model(mesh["shard"])
        gradpress.register_fsdp_comm_hook(model, state, hook)
        worst[name] = _worst(_train(model, rank, STEPS)[1], native)
        if isinstance(state, gradpress.PowerSGDState):
            iters[name] = (state.iter, state.compression_stats()[2])

    # FSDP's reduction options keep their meaning: a divide factor (native HSDP sums over all ranks and
    # divides by it), sum-only collectives (FSDP divides after the hook), a bf16 reduce dtype.
    from torch.distributed.fsdp import MixedPrecisionPolicy

    for name, settings in {"divide_factor": dict(gradient_divide_factor=2.0),
                           "force_sum": dict(force_sum_reduction_for_comms=True),
                           "bf16_reduce": dict(mp_policy=MixedPrecisionPolicy(reduce_dtype=torch.bfloat16))}.items():
        _, reference = _train(_model(mesh, **settings), rank, STEPS)
        model = _model(mesh["shard"], **settings)
        gradpress.register_fsdp_comm_hook(model, replicate, gradpress.allreduce_hook)
        worst[name] = _worst(_train(model, rank, STEPS)[1], reference)
    return worst, iters


@pytest.fixture(scope="module")
def native_results():
    return run(against_native_hsdp, WORLD)


@pytest.mark.parametrize("name, tol", [
    ("allreduce_hook", 1e-6),
    ("divide_factor", 1e-6),
    ("powerSGD_hook", 1e-5),               # full rank: exact up to the orthogonalization's rounding
    ("batched_powerSGD_hook", 1e-5),
    ("fp16_compress_hook", 1e-4),
    ("fp16_compress_wrapper(powerSGD_hook)", 1e-4),
    ("force_sum", 1e-6),
    ("bf16_reduce", 1e-6),
])
def test_training_equals_native_hsdp(native_results, name, tol):
    for worst, _ in native_results:
        assert worst[name] < tol, (name, worst[name])


def test_powersgd_counts_one_iteration_per_backward_and_compresses(native_results):
    for _, iters in native_results:
        for name, (iteration, numel_after) in iters.items():
            assert iteration == STEPS, name
            assert numel_after > 0, f"{name}: compression never ran"


# --- rank-2 compression: bytes, replicas, loss, checkpoints ----------------------------------------------------

def compressed_training(rank, world):
    mesh = _mesh()
    replicate = mesh["replicate"].get_group()
    options = dict(matrix_approximation_rank=2, start_powerSGD_iter=3)
    steps, stop = 12, 5

    model = _model(mesh["shard"])
    state = gradpress.PowerSGDState(replicate, **options)
    gradpress.register_fsdp_comm_hook(model, state, gradpress.powerSGD_hook)
    losses, params = _train(model, rank, steps)
    # What the plan says for the local shards, unit by unit (padding rows are not gradients).
    shapes = [[p.to_local().shape for p in unit.parameters(recurse=False)] for unit in (model[0], model[2], model[4])]
    plans = [make_plan(s, 2, state.min_compression_rate) for s in shapes]

    # Stop after `stop` steps, checkpoint the hook state, resume with a fresh state.
    resumed = _model(mesh["shard"])
    first = gradpress.PowerSGDState(replicate, **options)
    gradpress.register_fsdp_comm_hook(resumed, first, gradpress.powerSGD_hook)
    _train(resumed, rank, stop)
    saved = io.BytesIO()
    torch.save(first.state_dict(), saved)
    second = gradpress.PowerSGDState(replicate, **options)
    second.load_state_dict(torch.load(io.BytesIO(saved.getvalue())))
    gradpress.register_fsdp_comm_hook(resumed, second, gradpress.powerSGD_hook)
    _, resumed_params = _train(resumed, rank, steps - stop)

    compressed_steps = steps - options["start_powerSGD_iter"]
    return {
        "losses": losses,
        "params": params,
        "shapes": shapes,
        "stats": state.compression_stats(),
        "bytes": state.bytes_stats(),
        "expected": (compressed_steps * sum(plan.numel for plan in plans),
                     compressed_steps * sum(plan.numel_sent for plan in plans)),
        "compressed": sum(len(p.compressed) for p in plans),
        "resume_gap": _worst(params, resumed_params),
    }


@pytest.fixture(scope="module")
def compressed_results():
    return run(compressed_training, WORLD)


def test_uneven_shards_are_the_row_blocks_without_padding(compressed_results):
    # Shard rank s = rank % 2 holds rows [6s, 6s + 6) of the 11-row last layer.
    assert [r["shapes"][2] for r in compressed_results] == [[(6, 48), (6,)], [(5, 48), (5,)]] * 2
    assert all(r["compressed"] == 3 for r in compressed_results)  # one weight per unit


def test_bytes_counted_are_the_plan_of_the_local_shards(compressed_results):
    for r in compressed_results:
        _, before, after = r["stats"]
        assert (before, after) == r["expected"]
        assert r["bytes"][1:] == (4 * before, 4 * after)  # fp32 gradients and wire


def test_replicas_hold_identical_parameters_and_the_loss_falls(compressed_results):
    # Mesh (replicate, shard): ranks 0 and 2 hold shard 0, ranks 1 and 3 shard 1.
    for a, b in ((0, 2), (1, 3)):
        for x, y in zip(compressed_results[a]["params"], compressed_results[b]["params"]):
            assert torch.equal(x, y)
    for r in compressed_results:
        assert all(b < a for a, b in zip(r["losses"], r["losses"][1:]))
        assert r["losses"][-1] < 0.95 * r["losses"][0]


def test_checkpoint_and_resume_equals_not_stopping(compressed_results):
    for r in compressed_results:
        assert r["resume_gap"] == 0.0


# --- gradient accumulation, errors ----------------------------------------------------------------------------

def _accumulate(model, rank, steps=3, micro_batches=2):
    """SGD where only the last micro-batch's backward synchronizes gradients."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.3)
    x = torch.randn(micro_batches, 8, 32, generator=torch.Generator().manual_seed(rank))
    for _ in range(steps):
        optimizer.zero_grad()
        for micro in range(micro_batches):
            model.set_requires_gradient_sync(micro == micro_batches - 1)
            nn.functional.mse_loss(model(x[micro]), x[micro] @ _TEACHER).backward()
        optimizer.step()
    return [p.to_local().detach().clone() for p in model.parameters()]


class _SkipsAUnit(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.used, self.unused = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x):
        return self.used(x)


def edge_cases(rank, world):
    from torch.distributed.fsdp import fully_shard

    mesh = _mesh()
    replicate = mesh["replicate"].get_group()
    errors = {}

    def expect(name, exc_type, call):
        try:
            call()
        except exc_type as exc:
            errors[name] = str(exc)
        else:
            errors[name] = None

    expect("no unit", ValueError,
           lambda: gradpress.register_fsdp_comm_hook(nn.Linear(4, 4), replicate, gradpress.allreduce_hook))
    hsdp = nn.Linear(4, 4)
    fully_shard(hsdp, mesh=mesh)
    expect("2-D mesh", ValueError,
           lambda: gradpress.register_fsdp_comm_hook(hsdp, replicate, gradpress.allreduce_hook))
    sharded = _model(mesh["shard"])
    expect("hook", TypeError, lambda: gradpress.register_fsdp_comm_hook(sharded, replicate, "powerSGD_hook"))
    expect("default group", ValueError,
           lambda: gradpress.register_fsdp_comm_hook(sharded, gradpress.PowerSGDState(None), gradpress.powerSGD_hook))

    # A unit whose parameters get no gradient is not reduced: PowerSGD would miss the end of the iteration.
    skipped = _SkipsAUnit()
    for unit in (skipped.used, skipped.unused, skipped):
        fully_shard(unit, mesh=mesh["shard"])
    gradpress.register_fsdp_comm_hook(skipped, replicate, gradpress.allreduce_hook)
    expect("unused unit", RuntimeError, lambda: skipped(torch.randn(2, 4)).sum().backward())

    accumulating = _model(mesh["shard"])
    state = gradpress.PowerSGDState(replicate, matrix_approximation_rank=64, min_compression_rate=0,
                                    start_powerSGD_iter=2)
    gradpress.register_fsdp_comm_hook(accumulating, state, gradpress.powerSGD_hook)
    accumulation_gap = _worst(_accumulate(accumulating, rank), _accumulate(_model(mesh), rank))
    return errors, accumulation_gap, state.iter


@pytest.fixture(scope="module")
def edge_results():
    return run(edge_cases, WORLD)


def test_gradient_accumulation_counts_synchronized_backwards_only(edge_results):
    for _, accumulation_gap, iterations in edge_results:
        assert iterations == 3 and accumulation_gap < 1e-5


def test_bad_inputs_raise_early_and_say_what_to_do(edge_results):
    for errors, _, _ in edge_results:
        assert "no fully_shard unit" in errors["no unit"]
        assert "2-D mesh" in errors["2-D mesh"] and "mesh['shard']" in errors["2-D mesh"]
        assert errors["hook"] is not None and "hook must be a callable" in errors["hook"]
        assert "mesh['replicate'].get_group()" in errors["default group"]
        assert "1 of 2 fully_shard units" in errors["unused unit"]


# --- a rank policy and approximation errors by name -----------------------------------------------------------

def policy_training(rank, world):
    mesh = _mesh()
    model = _model(mesh["shard"])
    names = [name for name, _ in model.named_parameters()]
    state = gradpress.PowerSGDState(mesh["replicate"].get_group(), matrix_approximation_rank=1, start_powerSGD_iter=2,
                                    rank_policy={"4.*": None, "0.weight": 4}, approximation_error_every_n_iters=1)
    gradpress.register_fsdp_comm_hook(model, state, gradpress.powerSGD_hook)
    _train(model, rank, 5)
    local = {name: p.to_local().shape for name, p in model.named_parameters()}
    ranks = [None if name.startswith("4.") else 4 if name == "0.weight" else 1 for name in names]
    plan = make_plan([local[name] for name in names], 1, state.min_compression_rate, ranks)
    return {"stats": state.compression_stats(), "expected": 3 * plan.numel_sent,
            "compressed": {name for name, t in zip(names, plan.tensors) if t.compressed},
            "errors": state.approximation_error()}


def test_a_rank_policy_applies_to_each_ranks_shard_and_errors_are_named():
    for r in run(policy_training, WORLD):
        assert r["stats"][2] == r["expected"]  # 3 compressed steps of the per-parameter plan
        assert "4.weight" not in r["compressed"] and "0.weight" in r["compressed"]
        assert set(r["errors"]) == r["compressed"]

"""Checkpoints written before the engine session was factored out still load, and the same steps give
the same memory and outputs.

A loaded checkpoint must hold the saved tensors bitwise. What is computed again (the steps' outputs and
memory) is compared to a float32 rounding tolerance: the file was written on another CPU, whose matrix
products round differently in the last bits; an engine that computed something else would be off by far
more.

``tests/data/powersgd_checkpoints_v1.pt`` was written by this module's ``build()`` with the code of that
time: a hook state (``powerSGD_hook``, then ``batched_powerSGD_hook`` on another state),
a multi-iteration hook state with an LR scheduler, and a ``PowerSGD`` aggregator, each after a few steps
on fixed gradients, one process (no process group).
"""

import contextlib
import tempfile
from collections.abc import Iterator
from pathlib import Path

import torch
import torch.distributed as dist

import gradpress
from gradpress.hooks.bucket import DenseBucket

DATA = Path(__file__).resolve().parents[1] / "data" / "powersgd_checkpoints_v1.pt"


@contextlib.contextmanager
def _one_process() -> Iterator[None]:
    """A world of one gloo process (the hooks' warm-up allreduce needs a group), torn down after."""
    with tempfile.TemporaryDirectory() as directory:
        dist.init_process_group("gloo", init_method=f"file://{directory}/store", rank=0, world_size=1)
        try:
            yield
        finally:
            dist.destroy_process_group()


def _params() -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(5)
    shapes = [(12, 10), (10,), (6, 4, 3), (8, 8)]
    return [torch.randn(s, generator=generator) for s in shapes]


def _gradients(step: int, params: list[torch.Tensor]) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(100 + step)
    return [torch.randn(p.shape, generator=generator) for p in params]


class _Schedule:
    def __init__(self) -> None:
        self.step = 0

    def get_last_lr(self) -> list[float]:
        return [0.1 / (1 + self.step)]


def _run_hook(state: gradpress.PowerSGDState, hook, params, steps: int, schedule=None) -> list[torch.Tensor]:
    outputs = []
    for step in range(steps):
        grads = _gradients(step, params)
        halves = [(0, params[:2]), (1, params[2:])]
        futures = []
        for index, group in halves:
            buffer = torch.cat([g.reshape(-1) for g in (grads[:2] if index == 0 else grads[2:])])
            bucket = DenseBucket(index, index == 1, group, buffer)
            futures.append(hook(state, bucket))
        # As DDP does: every bucket of a step is handed over before any is waited on (a pipelined engine
        # may finish early buckets only when it sees the last one).
        outputs.extend(future.wait().clone() for future in futures)
        if schedule is not None:
            schedule.step += 1
    return outputs


def build() -> dict[str, object]:
    with _one_process():
        return _build()


def _build() -> dict[str, object]:
    params = _params()
    # The file's states compressed every matrix in PyTorch's (shape[0], -1) view: orient_matrices=False.
    hook_state = gradpress.PowerSGDState(None, matrix_approximation_rank=2, start_powerSGD_iter=2,
                                         min_compression_rate=0, orient_matrices=False)
    hook_out = _run_hook(hook_state, gradpress.powerSGD_hook, params, 5)
    hook_saved = hook_state.local_state_dict()
    hook_next = _run_hook(hook_state, gradpress.powerSGD_hook, params, 1)
    batched_state = gradpress.PowerSGDState(None, matrix_approximation_rank=1, start_powerSGD_iter=2,
                                            orient_matrices=False)
    batched_out = _run_hook(batched_state, gradpress.batched_powerSGD_hook, params, 4)
    batched_saved = batched_state.local_state_dict()
    batched_next = _run_hook(batched_state, gradpress.batched_powerSGD_hook, params, 1)
    schedule = _Schedule()
    multi_state = gradpress.PowerSGDState(None, matrix_approximation_rank=1, start_powerSGD_iter=2,
                                          min_compression_rate=0, num_iters_per_step=2,
                                          lr_scheduler=schedule, warm_up_beta_factor=0.5, orient_matrices=False)
    multi_out = _run_hook(multi_state, gradpress.powerSGD_hook, params, 5, schedule)
    aggregator = gradpress.PowerSGD(params, gradpress.Config(rank=2, min_compression_rate=0,
                                                             start_compressing_after_num_steps=1,
                                                             orient_matrices=False),
                                    init_sync=False)
    aggregated = []
    for step in range(4):
        grads = _gradients(step, params)
        aggregator.aggregate_(grads)
        aggregated.extend(grads)
    return {"hook": hook_saved, "hook_out": hook_out, "hook_next": hook_next,
            "batched": batched_saved, "batched_out": batched_out, "batched_next": batched_next,
            "multi": multi_state.local_state_dict(), "multi_out": multi_out,
            "aggregator": aggregator.local_state_dict(), "aggregator_out": aggregated}


#: Relative to the largest magnitude of a tensor: float32 rounding across CPUs, far below an engine's error.
ROUNDING = 1e-5


def _same(a: object, b: object, where: str = "", exact: bool = True) -> None:
    """``a`` and ``b`` hold the same values: tensors bitwise when ``exact``, else floating-point tensors
    within :data:`ROUNDING` of their largest magnitude (same shape and dtype always)."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.shape == b.shape and a.dtype == b.dtype, where
        if exact or not a.is_floating_point() or a.numel() == 0:
            assert torch.equal(a, b), where
        else:
            scale = float(a.abs().max())
            torch.testing.assert_close(b, a, rtol=0.0, atol=ROUNDING * max(scale, 1e-30), msg=where)
    elif isinstance(a, dict):
        assert isinstance(b, dict) and set(map(str, a)) == set(map(str, b)), (where, sorted(map(str, a)),
                                                                             sorted(map(str, b)))
        by_name = {str(k): v for k, v in b.items()}
        for key, value in a.items():
            _same(value, by_name[str(key)], f"{where}.{key}", exact)
    elif isinstance(a, (list, tuple)):
        assert isinstance(b, (list, tuple)) and len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            _same(x, y, f"{where}[{i}]", exact)
    else:
        assert a == b, (where, a, b)


def _legacy() -> dict[str, object]:
    return torch.load(DATA, weights_only=True)


#: Options saved since the file was written, each at the value that means what the file's state did: a
#: resaved old checkpoint may add these keys, and no other.
LATER_OPTIONS = {"orient_matrices": False}


def _same_options(legacy: dict, saved: dict, where: str) -> None:
    """``saved`` holds every option of ``legacy`` with its value, and beside them only :data:`LATER_OPTIONS`
    at their old meaning."""
    added = {key: saved[key] for key in set(saved) - set(legacy)}
    assert added == {key: LATER_OPTIONS[key] for key in added if key in LATER_OPTIONS} == \
        {key: value for key, value in added.items() if key in LATER_OPTIONS}, (where, added)
    _same(legacy, {key: saved[key] for key in legacy}, where)


def _factor_products(memory: dict) -> dict:
    """The memory with each warm-start factor ``F`` (Q, and P where kept) replaced by ``F F^T``: the
    orthogonalization may return another orthonormal basis of the same span (P R with R orthogonal,
    hence Q R too), which changes neither the outputs nor the error memory, only the factors' basis."""
    return {key: {name: (value @ value.T if name in ("q", "p") and isinstance(value, torch.Tensor) else value)
                  for name, value in entry.items()} if isinstance(entry, dict) else entry
            for key, entry in memory.items()}


def test_the_same_steps_give_the_same_memory_and_outputs_as_before() -> None:
    legacy, now = _legacy(), build()
    for name in ("hook_out", "hook_next", "batched_out", "batched_next", "multi_out", "aggregator_out"):
        _same(legacy[name], now[name], name, exact=False)
    for name in ("hook", "batched", "multi", "aggregator"):
        _same(_factor_products(legacy[name]["memory"]), _factor_products(now[name]["memory"]), name, exact=False)


def test_old_hook_checkpoints_load_and_resume() -> None:
    legacy = _legacy()
    params = _params()
    for name, hook, kwargs in (("hook", gradpress.powerSGD_hook, dict(matrix_approximation_rank=2,
                                                                       min_compression_rate=0)),
                               ("batched", gradpress.batched_powerSGD_hook, dict(matrix_approximation_rank=1))):
        state = gradpress.PowerSGDState(None, start_powerSGD_iter=2, **kwargs)
        state.load_state_dict(legacy[name])
        saved = state.local_state_dict()
        assert set(legacy[name]) <= set(saved), (name, set(legacy[name]) - set(saved))  # no key dropped
        _same(legacy[name]["memory"], saved["memory"], name)
        _same(legacy[name]["padded"], saved["padded"], name)
        assert saved["iter"] == legacy[name]["iter"]
        assert state.compression_stats() == (
            legacy[name]["total_numel_before_compression"] / legacy[name]["total_numel_after_compression"],
            legacy[name]["total_numel_before_compression"], legacy[name]["total_numel_after_compression"])
        # One more step from the loaded state gives the outputs of a run that never stopped.
        with _one_process():
            out = _run_hook(state, hook, params, 1)
        _same(legacy[f"{name}_next"], out, f"{name}_next", exact=False)


def test_old_multi_iteration_checkpoint_with_an_lr_scheduler_loads() -> None:
    legacy = _legacy()["multi"]
    schedule = _Schedule()
    schedule.step = 5
    state = gradpress.PowerSGDState(None, matrix_approximation_rank=1, start_powerSGD_iter=2, min_compression_rate=0,
                                    num_iters_per_step=2, lr_scheduler=schedule, warm_up_beta_factor=0.5)
    state.load_state_dict(legacy)
    saved = state.local_state_dict()
    assert set(legacy) <= set(saved), set(legacy) - set(saved)
    _same(legacy["memory"], saved["memory"], "multi")
    for key in set(legacy) - {"memory", "padded", "options"}:
        _same(legacy[key], saved[key], f"multi.{key}")
    _same_options(legacy["options"], saved["options"], "multi.options")


def test_old_aggregator_checkpoint_loads() -> None:
    legacy = _legacy()["aggregator"]
    aggregator = gradpress.PowerSGD(_params(), gradpress.Config(rank=2, min_compression_rate=0,
                                                                start_compressing_after_num_steps=1),
                                    init_sync=False)
    aggregator.load_state_dict(legacy)
    saved = aggregator.local_state_dict()
    assert set(legacy) <= set(saved), set(legacy) - set(saved)
    _same(legacy["memory"], saved["memory"], "aggregator")
    for key in ("step_counter", "total_numel", "total_floats_sent", "total_bytes_sent"):
        assert saved[key] == legacy[key], key
    _same_options(legacy["config"], saved["config"], "aggregator.config")


if __name__ == "__main__":
    # Only to write a new generation of test data, beside this one (never over it: the point of the file
    # is that the code that wrote it is gone).
    import sys

    if len(sys.argv) != 2 or Path(sys.argv[1]).resolve() == DATA.resolve():
        raise SystemExit(f"usage: python {sys.argv[0]} NEW_FILE (not {DATA.name})")
    torch.save(build(), sys.argv[1])

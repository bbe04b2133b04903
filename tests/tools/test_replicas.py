"""Replicas simulated as threads in one process (``gradpress.tools.workloads.replicas``) against the oracle:
the same ``train()`` on as many gloo processes (``tests/distributed.py``).

With 2 replicas the two agree bitwise: every sum over ranks has two terms, and a + b == b + a. With 4,
the threaded group sums in rank order and gloo's ring in another, so each average may differ in the last
bit; a dozen steps carry that to an ulp or two of the weights (at most 9e-8 apart in every state tensor
on these runs), so they must agree to ``ATOL`` plus ``RTOL`` of their size (ten times that and more), and
the accuracy curve to within one test sample (an argmax a rounding can flip). A quantized outer gradient
rounds to a grid, and inputs an ulp apart can land on neighbouring codes: such a value moves by one grid step
(2e-5 on these weights), on both schedules, twice as often under two-shot (which rounds the mean again, at
4 ranks by default); so ``diloco-int4`` at 4 ranks may differ in a handful of values by such a step
(``QUANTIZED_FLIPS``).
"""

from __future__ import annotations

import io

import math
from pathlib import Path
from typing import Any

import pytest
import torch

from distributed import run
from gradpress.tools.workloads import DemoConfig, parse_methods, train
from gradpress.tools.workloads.checkpoints import checkpoint_path, run_directory
from gradpress.tools.workloads.replicas import train_replicas

# A dozen digits steps of 8 samples per replica: warm-up 3, a sync every 2 steps, the last step one of them.
CONFIG = DemoConfig(task="digits", steps=12, start_iter=3, evals=3, batch_size=8)
METHODS = ["localsgd:2", "diloco:2", "diloco-int4:2"]
RTOL, ATOL = 1e-5, 1e-6
#: Quantized methods on 4 ranks: at most this many values of a tensor (or a thousandth of them) beyond
#: the tolerance, each by at most ``FLIP_STEP`` (a few grid steps of int4 on these weights).
QUANTIZED_FLIPS, FLIP_STEP = 4, 1e-3
TEST_SAMPLES = 300  # digits' test set: one sample more or less right moves the accuracy by 1/300

_RUNS: dict[tuple[str, str, int], tuple[list[dict[str, Any]], list[dict[str, Any]]]] = {}


def _train_on_gloo(rank: int, world_size: int, spec: str, config: DemoConfig, root: str) -> dict[str, Any]:
    torch.set_num_threads(1)
    return train(rank, world_size, parse_methods(spec, [1])[0], config, checkpoint_dir=root)


def _saved(root: Path, spec: str, world_size: int) -> list[dict[str, Any]]:
    """Every rank's checkpoint of the last step: model, optimizer with the averager's state (outer momentum,
    error feedback), data position."""
    directory = run_directory(root, spec)
    return [torch.load(checkpoint_path(directory, CONFIG.steps, rank), weights_only=False)
            for rank in range(world_size)]


def _runs(where: str, spec: str, world_size: int, tmp_path_factory: pytest.TempPathFactory
          ) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """``(results, checkpoints)`` of every rank, trained on gloo processes or simulated; once per session."""
    key = (where, spec, world_size)
    if key not in _RUNS:
        root = tmp_path_factory.mktemp(f"{where}-{spec.replace(':', '-')}-w{world_size}")
        if where == "gloo":
            results = run(_train_on_gloo, world_size, spec, CONFIG, str(root))
        else:
            threads = torch.get_num_threads()
            torch.set_num_threads(1)
            try:
                results = train_replicas(parse_methods(spec, [1])[0], CONFIG, world_size, checkpoint_dir=root)
            finally:
                torch.set_num_threads(threads)
        _RUNS[key] = results, _saved(root, spec, world_size)
    return _RUNS[key]


def _leaves(tree: Any, prefix: str = "") -> dict[str, Any]:
    """The tensors and numbers of a nested state, by path (a per-rank entry, serialized by
    ``gradpress.checkpoint.per_rank_state``, read back into its own)."""
    if isinstance(tree, bytes) and prefix.rsplit("/", 2)[-2:-1] == ["per_rank"]:
        return _leaves(torch.load(io.BytesIO(tree), weights_only=True), prefix)
    if isinstance(tree, dict):
        return {k: v for key, value in tree.items() for k, v in _leaves(value, f"{prefix}/{key}").items()}
    if isinstance(tree, (list, tuple)):
        return {k: v for i, value in enumerate(tree) for k, v in _leaves(value, f"{prefix}/{i}").items()}
    return {prefix: tree}


def _untimed(curve: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{k: v for k, v in point.items() if k != "time_s"} for point in curve]


def _assert_close_but_flips(sim: torch.Tensor, real: torch.Tensor, path: str) -> None:
    """Within the tolerance but for at most ``QUANTIZED_FLIPS`` values (or a thousandth), each by one grid step."""
    gap = (sim.double() - real.double()).abs()
    beyond = gap > ATOL + RTOL * real.double().abs()
    assert int(beyond.sum()) <= max(QUANTIZED_FLIPS, real.numel() // 1000), (path, int(beyond.sum()))
    assert gap.numel() == 0 or float(gap.max()) <= FLIP_STEP, (path, float(gap.max()))


def _assert_states_agree(simulated: dict[str, Any], real: dict[str, Any], exact: bool,
                         quantized: bool = False) -> None:
    sim, gloo = _leaves({k: simulated[k] for k in ("model", "optimizer", "data")}), \
        _leaves({k: real[k] for k in ("model", "optimizer", "data")})
    assert sim.keys() == gloo.keys()
    for path, value in gloo.items():
        if isinstance(value, torch.Tensor):
            if exact or not value.is_floating_point():
                assert torch.equal(sim[path], value), path
            elif quantized:
                _assert_close_but_flips(sim[path], value, path)
            else:
                torch.testing.assert_close(sim[path], value, rtol=RTOL, atol=ATOL, msg=path)
        elif isinstance(value, float) and not exact:
            assert math.isclose(sim[path], value, rel_tol=RTOL, abs_tol=ATOL), path
        else:
            assert sim[path] == value, path


@pytest.mark.slow
@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("spec", METHODS)
def test_simulated_replicas_equal_gloo_replicas(spec, world_size, tmp_path_factory):
    real, real_saved = _runs("gloo", spec, world_size, tmp_path_factory)
    simulated, simulated_saved = _runs("threads", spec, world_size, tmp_path_factory)
    assert len(simulated) == world_size
    exact = world_size == 2
    for rank in range(world_size):
        sim, gloo = simulated[rank], real[rank]
        assert (sim["rank"], sim["world_size"]) == (rank, world_size)
        # Bytes come from the same schedule and the averagers' own counters.
        for key in ("bytes_per_step", "bytes_allreduce_per_step", "bytes_total", "bytes_warm_up", "synchronizations",
                    "counted"):
            assert sim[key] == gloo[key], key
        assert sim["counted"]["ok"]
        assert [p["step"] for p in sim["curve"]] == [p["step"] for p in gloo["curve"]]
        if exact:
            assert sim["digest"] == gloo["digest"]
            assert _untimed(sim["curve"]) == _untimed(gloo["curve"])
        else:
            assert math.isclose(sim["checksum"], gloo["checksum"], rel_tol=RTOL, abs_tol=1e-4)
            for a, b in zip(sim["curve"], gloo["curve"]):
                assert math.isclose(a["test_loss"], b["test_loss"], rel_tol=RTOL)
                assert abs(a["metric"] - b["metric"]) <= 1 / TEST_SAMPLES + 1e-12
                assert (a["train_loss"] is None) == (b["train_loss"] is None)
                if a["train_loss"] is not None:
                    assert math.isclose(a["train_loss"], b["train_loss"], rel_tol=RTOL)
        _assert_states_agree(simulated_saved[rank], real_saved[rank], exact, quantized="int" in spec)
    # The replicas end on one model, as real workers do.
    assert len({r["digest"] for r in simulated}) == 1


@pytest.mark.slow
def test_the_number_of_replicas_matters(tmp_path_factory):
    """Not a run of one model under another name: DiLoCo on 2 and on 4 replicas (same per-replica batch)
    train different models, and local SGD differs from DiLoCo on the same replicas."""
    two, _ = _runs("threads", "diloco:2", 2, tmp_path_factory)
    four, four_saved = _runs("threads", "diloco:2", 4, tmp_path_factory)
    local, _ = _runs("threads", "localsgd:2", 4, tmp_path_factory)
    assert two[0]["digest"] != four[0]["digest"] != local[0]["digest"]
    losses = [[p["test_loss"] for p in run[0]["curve"][1:]] for run in (two, four)]
    assert losses[0] != pytest.approx(losses[1])
    # Each replica trained on its own shard: their data positions differ while their models agree.
    orders = [saved["data"]["order"] for saved in four_saved]
    assert all(not torch.equal(orders[0], other) for other in orders[1:])


@pytest.mark.slow
def test_a_failing_replica_stops_the_others_and_raises():
    config = DemoConfig(task="digits", steps=6, start_iter=2, evals=1, batch_size=4, fail_at_step=3, fail_rank=1)
    with pytest.raises(RuntimeError, match="replica 1 of 3 failed") as caught:
        train_replicas(parse_methods("diloco:2", [1])[0], config, 3, timeout_s=120)
    assert "injected failure on rank 1" in str(caught.value.__cause__)
    # The process's torch.distributed is as before: a second simulation runs.
    assert not torch.distributed.is_initialized()
    result = train_replicas(parse_methods("localsgd:2", [1])[0], DemoConfig(task="digits", steps=3, start_iter=2,
                                                                              evals=1, batch_size=4), 2)
    assert result[0]["digest"] == result[1]["digest"]


def test_arguments_that_cannot_be_simulated_are_refused():
    method = parse_methods("diloco:2", [1])[0]
    with pytest.raises(ValueError, match="replicas must be an integer >= 1, got 0"):
        train_replicas(method, CONFIG, 0)
    with pytest.raises(ValueError, match="fail_kind='sigkill' cannot be simulated"):
        train_replicas(method, DemoConfig(task="digits", fail_at_step=2, fail_kind="sigkill"), 2)


def test_a_caller_inside_a_process_group_is_refused(tmp_path):
    torch.distributed.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        with pytest.raises(ValueError, match="already has a default process group"):
            train_replicas(parse_methods("diloco:2", [1])[0], CONFIG, 2)
    finally:
        torch.distributed.destroy_process_group()


def test_the_byte_model_cuts_fragments_from_the_averaged_list_under_adamw():
    """AdamW's groups hand the averager the matrices, then the vectors: its fragments (and a two-shot
    sync's regions and padding) are cut from that order, and the counted bytes must equal the model's."""
    config = DemoConfig(task="digits", steps=12, start_iter=3, evals=1, batch_size=8, optimizer="adamw")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        results = train_replicas(parse_methods("streaming-int4:4", [1])[0], config, 4)
    finally:
        torch.set_num_threads(threads)
    assert results[0]["counted"]["averages"] > 0
    assert all(r["counted"]["ok"] for r in results), results[0]["counted"]

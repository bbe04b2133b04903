"""PowerSGD is linear in the workers' gradients: how a global batch is split over workers does not matter.

Once the shared factors are fixed, every step of PowerSGD is linear in the workers' matrices
``M_i = gradient_i + error_i``: ``P = mean_i(M_i Q) = mean_i(M_i) Q``; ``P^ = orth(P)`` is the same on
every worker; ``Q' = mean_i(M_i)^T P^``; each worker keeps ``error_i = M_i - P^ Q'^T``. The one nonlinear
operation, orthogonalization, only ever sees the mean. So the error memories are per worker (and differ),
but their mean evolves exactly as one worker's would with the mean gradient, and only that mean enters the
update. With a loss that is a MEAN over the batch, 4 workers with ``b`` samples each have the mean gradient
of the concatenated ``4b`` samples, as do 2 workers with ``2b`` samples each (worker ``j`` of 2 holds
shards ``2j`` and ``2j + 1`` of the 4-way split). Both runs follow the same training trajectory, and
memory ``j`` of the 2-worker run is the mean of memories ``2j`` and ``2j + 1`` of the 4-worker run.

Rounding: the two splits sum in different orders, and warm-started rank-r power iteration amplifies that
rounding along a training run. Measured on this MLP at rank 2: a 1e-7 difference after the exact warm-up
grows to 6e-5..4e-2 relative after 50 compressed fp32 steps, by front-end and learning rate (the hook's
two-sided iterations amplify most; at full rank it stays at 4e-7), and the rounding of an fp32 wire on
fp64 gradients grows the same way. So the 50-step check runs in float64 with an fp64 wire
(``bytes_per_weight=8``), where the same amplification leaves ~1e-12..1e-9, and the fp32 wire
(``bytes_per_weight=4``, fp32 model) is checked over the first 8 compressed steps, before the
amplification matters. Each check carries negative controls that its tolerance must reject: 2 workers with
``b`` samples (half of the global batch) and, for the fp32 wire, an fp16 wire (``bytes_per_weight=2``),
which rounds each worker's factors before they are summed and so is not linear.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import gradpress
from distributed import run

WARM_UP = 2             # exact averaging first (start_powerSGD_iter / start_compressing_after_num_steps)
SHARD = 8               # b: samples per worker in the 4-worker run
GLOBAL = 4 * SHARD      # samples per step, whatever the split
RANK = 2
LR = 0.2


def _mlp(dtype: torch.dtype) -> nn.Module:
    torch.manual_seed(0)  # the same initial weights on every rank of every run
    return nn.Sequential(nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(),
                         nn.Linear(64, 10)).to(dtype)


def _global_batch(step: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Step ``step``'s global batch: ``GLOBAL`` inputs labelled by a fixed random teacher (so it trains)."""
    teacher = torch.randn(32, 10, generator=torch.Generator().manual_seed(12345))
    x = torch.randn(GLOBAL, 32, generator=torch.Generator().manual_seed(1000 + step))
    return x.to(dtype), (x @ teacher).argmax(1)


def train_on_shards(rank: int, world: int, front: str, shard: int, dtype: torch.dtype, bytes_per_weight: int,
                    compressed_steps: int) -> dict:
    """Train the MLP with plain SGD for ``WARM_UP + compressed_steps`` steps, averaging with PowerSGD through
    DDP's ``powerSGD_hook`` (``front="hook"``) or the aggregator and ``optimizer_step``
    (``"aggregator"``, its default one-sided iterations). This rank's batch is samples
    ``[rank*shard, (rank+1)*shard)`` of every global batch. Returns the final parameters (flat), the global
    batch's loss before each step, this rank's error memory per compressed parameter, and the floats sent
    per compressed step against plain averaging's."""
    net = _mlp(dtype)
    opt = torch.optim.SGD(net.parameters(), lr=LR)
    if front == "hook":
        state = gradpress.PowerSGDState(None, matrix_approximation_rank=RANK, start_powerSGD_iter=WARM_UP,
                                        min_compression_rate=0, use_error_feedback=True, warm_start=True,
                                        bytes_per_weight=bytes_per_weight)
        model = DDP(net)
        model.register_comm_hook(state, gradpress.powerSGD_hook)
    else:
        aggregator = gradpress.PowerSGD(net.parameters(), gradpress.Config(
            rank=RANK, min_compression_rate=0, start_compressing_after_num_steps=WARM_UP,
            bytes_per_weight=bytes_per_weight))
        model = net
    losses = []
    for step in range(WARM_UP + compressed_steps):
        x, y = _global_batch(step, dtype)
        with torch.no_grad():
            losses.append(nn.functional.cross_entropy(net(x), y))
        mine = slice(rank * shard, (rank + 1) * shard)
        opt.zero_grad()
        nn.functional.cross_entropy(model(x[mine]), y[mine]).backward()  # a MEAN over the batch
        if front == "hook":
            opt.step()
        else:
            gradpress.optimizer_step(opt, aggregator)
    if front == "hook":
        memory = state.local_state_dict()["memory"]
        _, plain, sent = state.compression_stats()
    else:
        memory = aggregator.local_state_dict()["memory"]
        sent, plain = aggregator.floats_per_step, aggregator.numel
    return {"params": torch.cat([p.detach().reshape(-1) for p in net.parameters()]),
            "losses": torch.stack(losses),
            "errors": {key: entry["error"].clone() for key, entry in memory.items()},
            "sent": sent, "plain": plain}


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    """Max abs difference relative to the max abs value (the parameter / loss / memory scale)."""
    return ((a - b).abs().max() / b.abs().max()).item()


def _train(front: str, workers: int, shard: int, dtype: torch.dtype, bytes_per_weight: int,
           compressed_steps: int) -> list[dict]:
    results = run(train_on_shards, workers, front, shard, dtype, bytes_per_weight, compressed_steps)
    for r in results[1:]:
        assert torch.equal(r["params"], results[0]["params"]), "replicas differ within a run"
    assert 0 < results[0]["sent"] < results[0]["plain"], "nothing was compressed"
    return results


def _check_linear(front: str, dtype: torch.dtype, bytes_per_weight: int, compressed_steps: int,
                  tolerance: float) -> dict[str, float]:
    """4 workers x b == 2 workers x 2b (parameters, per-step loss, pairwise mean of error memories), and
    2 workers x b (half of the global batch) is rejected by ``tolerance``. Returns the measured differences."""
    four = _train(front, 4, SHARD, dtype, bytes_per_weight, compressed_steps)
    two = _train(front, 2, 2 * SHARD, dtype, bytes_per_weight, compressed_steps)
    half = _train(front, 2, SHARD, dtype, bytes_per_weight, compressed_steps)
    measured = {"params": _relative(four[0]["params"], two[0]["params"]),
                "losses": _relative(four[0]["losses"], two[0]["losses"]),
                "half-batch control": _relative(half[0]["params"], two[0]["params"])}

    # Memories are per worker and differ, yet memory j of 2 workers is the mean of memories 2j, 2j+1 of 4.
    keys = four[0]["errors"].keys()
    assert len(keys) == 3 and keys == two[0]["errors"].keys(), "all three weight matrices are compressed"
    memory_diff, spread = 0.0, float("inf")
    for key in keys:
        for j in range(2):
            a, b = four[2 * j]["errors"][key], four[2 * j + 1]["errors"][key]
            spread = min(spread, _relative(a, b))
            memory_diff = max(memory_diff, _relative((a + b) / 2, two[j]["errors"][key]))
    measured.update({"memories": memory_diff, "memory spread between workers": spread})
    print(f"\n{front} {dtype} wire {bytes_per_weight} B, {compressed_steps} compressed steps: " +
          ", ".join(f"{name} {value:.1e}" for name, value in measured.items()))

    assert four[0]["losses"][-1] < 0.95 * four[0]["losses"][0], "the model did not train"
    assert measured["params"] < tolerance and measured["losses"] < tolerance
    # The memory is a residual, smaller than the M_i whose rounding it carries: a looser bound (workers'
    # memories differ by ~100% of their scale).
    assert measured["memories"] < 10 * tolerance
    assert spread > 0.1, "each worker's memory should be its own"
    assert measured["half-batch control"] > 1000 * tolerance, "the tolerance does not reject another batch"
    return measured


@pytest.mark.parametrize("front", ["hook", "aggregator"])
def test_four_workers_with_b_samples_train_like_two_workers_with_2b_over_50_steps(front):
    # float64 and an fp64 wire: rounding (~1e-16) amplified over 50 steps stays ~1e-12..1e-9.
    _check_linear(front, torch.float64, 8, 50, tolerance=1e-7)


@pytest.mark.parametrize("front", ["hook", "aggregator"])
def test_with_an_fp32_wire_four_workers_with_b_train_like_two_with_2b_and_an_fp16_wire_does_not(front):
    tolerance, steps = 1e-5, 8  # fp32 rounding: 2.4e-7 after 8 compressed steps
    _check_linear(front, torch.float32, 4, steps, tolerance)
    # Negative control: an fp16 wire rounds each worker's factors before the sum, so the split matters.
    four = _train(front, 4, SHARD, torch.float32, 2, steps)
    two = _train(front, 2, 2 * SHARD, torch.float32, 2, steps)
    fp16_diff = _relative(four[0]["params"], two[0]["params"])
    print(f"{front} fp16 wire control: params {fp16_diff:.1e}")
    assert fp16_diff > 10 * tolerance, "the tolerance does not reject an fp16 wire"

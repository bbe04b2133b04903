"""The automatic rank's noise criterion (``AutoRank(criterion="noise")``, the default): the noise energy of
the averaged gradient read from the workers' own gradients, checked on real DDP ranks against the same
quantities computed here from every worker's gradients and exact singular values; that it reads the
batch (less noise, a higher rank), where the energy alone goes the other way; that one worker falls back
to the energy; and that a measurement saved halfway resumes to the same decision, float for float. The
default multiple against the quality study's own runs is ``test_auto_rank_study.py``'s."""

from __future__ import annotations

import io
import logging
import math

import pytest
import torch

import gradpress
from gradpress.autorank import CRITERIA, AutoRank, residual_over_noise
from gradpress.powersgd.plan import should_compress

from distributed import run
from models import GivenGradients

START, MEASURED, MAX_RANK = 4, 2, 40   # iterations 2 and 3 measured; 64 x 48 matrices measured exactly
RATE = 1.0   # min_compression_rate: rank k compresses a 64 x 48 matrix up to k = 27, and sends it whole above


def test_less_noise_in_the_mean_asks_for_a_higher_rank() -> None:
    """The same mean gradient (its E(k)), with the noise of two batches 16x apart: the noise criterion takes
    more rank where the mean is less noisy; the energy criterion cannot tell them apart."""
    captured = [1 - 0.5 * 0.8 ** k for k in range(1, 65)]
    rule = AutoRank(max_rank=64, min_rank=1, noise_multiple=0.1)
    small, large = rule.choose_by_noise(captured, 1.0, 0.16), rule.choose_by_noise(captured, 1.0, 0.01)
    assert (small, large) == (16, 32)   # R(k) = 0.5 x 0.8^k / N <= 0.1
    low, below = residual_over_noise(captured, 1.0, 0.16, [16, 12])
    assert low <= 0.1 < below and math.isclose(low, 0.5 * 0.8 ** 16 / 0.16)
    energy = AutoRank(max_rank=64, min_rank=1, criterion="energy")
    assert energy.choose(captured) == 24   # the same at any batch: E does not see the noise


@pytest.mark.parametrize("bad, match", [
    ({"criterion": "residual"}, "AutoRank.criterion must be one of 'noise', 'energy', got 'residual'"),
    ({"noise_multiple": 0}, "AutoRank.noise_multiple must be a finite number > 0, got 0"),
    ({"noise_multiple": math.inf}, "noise_multiple must be a finite number > 0, got inf"),
    ({"noise_multiple": True}, "noise_multiple must be a finite number > 0, got True"),
])
def test_bad_options_are_refused_naming_the_argument(bad: dict, match: str) -> None:
    assert CRITERIA == ("noise", "energy")
    with pytest.raises(ValueError, match=match):
        AutoRank(**bad)


def _gradients(rank: int, step: int, sigma: float) -> list[torch.Tensor]:
    """Worker ``rank``'s gradients at ``step``: a shared matrix with singular values 10 x 0.8^i (the
    signal) plus the worker's own Gaussian noise of scale ``sigma``."""
    shared = torch.Generator().manual_seed(1000 + step)
    own = torch.Generator().manual_seed(7000 + 31 * step + rank)
    out = []
    for _ in range(2):
        u = torch.linalg.qr(torch.randn(64, 40, generator=shared)).Q
        v = torch.linalg.qr(torch.randn(48, 40, generator=shared)).Q
        signal = u @ torch.diag(10 * 0.8 ** torch.arange(40, dtype=torch.float32)) @ v.T
        out.append(signal + sigma * torch.randn(64, 48, generator=own))
    return out


def _oracle(world: int, sigma: float) -> tuple[list[float], list[float]]:
    """E(k) and R(k), k = 1 .. MAX_RANK, from every worker's gradients of the measured iterations: exact
    singular values of the mean (a rank that would not compress carries it whole), N = (mean over workers
    of ||g_i||^2 - ||mean||^2) / (world - 1)."""
    kept = torch.zeros(MAX_RANK, dtype=torch.float64)
    total = own = 0.0
    for step in range(START - MEASURED, START):
        workers = [_gradients(r, step, sigma) for r in range(world)]
        for j in range(2):
            mean = sum(g[j] for g in workers) / world
            values = torch.linalg.svdvals(mean.double()).square()
            whole = torch.tensor([not should_compress(64, 48, k, RATE) for k in range(1, MAX_RANK + 1)])
            kept += torch.where(whole, values.sum(), values.cumsum(0)[:MAX_RANK])
            total += float(values.sum())
            own += sum(float(g[j].double().square().sum()) for g in workers) / world
    noise = (own - total) / (world - 1)
    captured = (kept / total).tolist()
    return captured, residual_over_noise(captured, total, noise, range(1, MAX_RANK + 1))


def _train(rank: int, world: int, sigma: float, criterion: str, steps: range, saved: list[bytes] | None):
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = DDP(GivenGradients())
    state = gradpress.PowerSGDState(None, matrix_approximation_rank=2, start_powerSGD_iter=START,
                                    min_compression_rate=RATE,
                                    auto_rank=AutoRank(max_rank=MAX_RANK, measure_iters=MEASURED, min_rank=1,
                                                       criterion=criterion, noise_multiple=0.5))
    if saved is not None:
        state.load_state_dict(torch.load(io.BytesIO(saved[rank]), weights_only=False))
    model.register_comm_hook(state, gradpress.powerSGD_hook)
    for step in steps:
        model(*_gradients(rank, step, sigma)).backward()
        model.zero_grad(set_to_none=False)
    buffer = io.BytesIO()
    torch.save(state.state_dict(), buffer)
    return state.matrix_approximation_rank, state.auto_rank_captured(), state.auto_rank_noise_ratio(), \
        buffer.getvalue()


@pytest.mark.slow
def test_ddp_ranks_read_the_noise_from_their_own_gradients() -> None:
    """Three ranks: the decision and its R(k) are the oracle's (every worker's gradients, exact SVD), the
    same on every rank; the noisier mean (sigma 0.3) takes rank 16, the quieter (0.03, a 100x larger batch)
    24, where the energy criterion takes 32 and 16 (the noise's own energy in the tail asks it for more).
    Saved after the first measured iteration, a resume decides the same, float for float (on two ranks:
    the sum of three workers' gradients rounds by DDP's bucket layout, which its first iteration changes)."""
    chosen = {}
    for sigma in (0.3, 0.03):
        captured, ratios = _oracle(3, sigma)
        expected = AutoRank(max_rank=MAX_RANK, min_rank=1, noise_multiple=0.5)
        results = run(_train, 3, sigma, "noise", range(6), None)
        assert len({r[0] for r in results}) == 1 and all(r[2] == results[0][2] for r in results)
        rank, got_captured, got_ratios, _ = results[0]
        assert got_ratios == pytest.approx(ratios, rel=1e-4) and got_captured == pytest.approx(captured, rel=1e-6)
        assert rank == next(k for k in expected.candidates() if ratios[k - 1] <= 0.5)
        chosen[sigma] = rank
        energy = run(_train, 3, sigma, "energy", range(6), None)[0]
        assert energy[2] is None and energy[0] == AutoRank(max_rank=MAX_RANK, min_rank=1).choose(captured)
        chosen[sigma, "energy"] = energy[0]
    assert chosen == {0.3: 16, 0.03: 24, (0.3, "energy"): 32, (0.03, "energy"): 16}
    halfway = run(_train, 2, 0.3, "noise", range(3), None)
    assert [r[0] for r in halfway] == [2, 2] and halfway[0][2] is None
    resumed = run(_train, 2, 0.3, "noise", range(3, 6), [r[3] for r in halfway])
    whole = run(_train, 2, 0.3, "noise", range(6), None)
    assert whole[0][2] is not None
    assert [r[:3] for r in resumed] == [r[:3] for r in whole]


class _Collect(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def _one_worker(rank: int, world: int) -> tuple[int, list[float] | None, list[float] | None, list[str]]:
    logger = logging.getLogger("gradpress.hooks.powersgd")
    handler, level = _Collect(), logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        chosen, captured, ratios, _ = _train(rank, world, 0.3, "noise", range(6), None)
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
    return chosen, captured, ratios, handler.messages


@pytest.mark.slow
def test_one_worker_decides_by_the_energy_and_says_so() -> None:
    """On one worker there are no workers' gradients to read the noise from: the energy's threshold
    decides (the rank ``criterion="energy"`` would take), and the warning says why."""
    (rank, captured, ratios, said), = run(_one_worker, 1)
    assert ratios is None and rank == AutoRank(max_rank=MAX_RANK, min_rank=1, criterion="energy").choose(captured)
    assert any("one worker" in m and "deciding by the captured energy (threshold 0.997)" in m for m in said), said

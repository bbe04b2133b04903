"""OuterStep (the outer SGD step shared by OuterOptimizerAverager and StreamingDiLoCoAverager) and the
shared argument checks, on one process."""

from __future__ import annotations

import math

import pytest
import torch

from gradpress.averaging import OuterStep
from gradpress.validation import check_int, check_number


def _outer(momentum: float = 0.9) -> OuterStep:
    anchor = [torch.tensor([1.0, -2.0, 3.0]), torch.tensor([[0.5, 0.25]], dtype=torch.float64)]
    return OuterStep(anchor, 0.7, momentum, nesterov=True)


def _grads(scale: float) -> list[torch.Tensor]:
    return [torch.tensor([0.1, 0.2, -0.3]) * scale, torch.tensor([[1.0, -1.0]], dtype=torch.float64) * scale]


def test_step_is_nesterov_sgd_on_the_anchor():
    outer, reference = _outer(), _outer()
    sgd = torch.optim.SGD(reference.anchor, lr=0.7, momentum=0.9, nesterov=True)
    for scale in (1.0, -2.0, 0.5):
        outer.step(_grads(scale))
        for a, g in zip(reference.anchor, _grads(scale)):
            a.grad = g
        sgd.step()
    assert all(torch.equal(a, b) for a, b in zip(outer.anchor, reference.anchor))
    assert all(a.grad is None for a in outer.anchor)


def test_a_finite_flag_on_the_device_gives_the_same_step_as_none():
    plain, flagged = _outer(), _outer()
    for scale in (1.0, 3.0):
        plain.step(_grads(scale))
        flagged.step(_grads(scale), torch.tensor(True))
    assert all(torch.equal(a, b) for a, b in zip(plain.anchor, flagged.anchor))


def test_a_non_finite_flag_leaves_anchor_and_momentum_bitwise_as_before():
    outer = _outer()
    outer.step(_grads(1.0))
    before = outer.state_dict()
    bad = _grads(1.0)
    bad[0][1] = math.inf
    outer.step(bad, torch.tensor(False))
    after = outer.state_dict()
    assert all(torch.equal(a, b) for a, b in zip(before["anchor"], after["anchor"]))
    for key, state in before["outer"]["state"].items():
        assert torch.equal(state["momentum_buffer"], after["outer"]["state"][key]["momentum_buffer"])


def test_a_skipped_first_step_leaves_zero_momentum_which_the_next_step_ignores():
    skipped, fresh = _outer(), _outer()
    skipped.step([g * math.nan for g in _grads(1.0)], torch.tensor(False))
    assert all(torch.equal(a, b) for a, b in zip(skipped.anchor, fresh.anchor))
    skipped.step(_grads(2.0))
    fresh.step(_grads(2.0))
    assert all(torch.equal(a, b) for a, b in zip(skipped.anchor, fresh.anchor))


def test_state_dict_round_trip_continues_identically():
    outer = _outer()
    outer.step(_grads(1.0))
    restored = OuterStep.restore(outer.state_dict(), 0.7, 0.9, True)
    outer.step(_grads(-1.0))
    restored.step(_grads(-1.0))
    assert all(torch.equal(a, b) for a, b in zip(outer.anchor, restored.anchor))
    assert restored.matches(outer.anchor) and not restored.matches(outer.anchor[:1])


@pytest.mark.parametrize("lr, momentum, message", [
    (0, 0.9, "outer_lr must be a number > 0, got 0"),
    ("1", 0.9, "outer_lr must be a number > 0, got '1'"),
    (0.7, 1.0, r"outer_momentum must be a number in \[0, 1\), got 1.0"),
    (0.7, True, r"outer_momentum must be a number in \[0, 1\), got True"),
])
def test_check_options_names_the_argument(lr, momentum, message):
    with pytest.raises(ValueError, match=message):
        OuterStep.check_options(lr, momentum, True)
    assert OuterStep.check_options(1, 0, True) == (1.0, 0.0, False)  # no Nesterov without momentum


def test_check_int_and_check_number():
    assert check_int("period", 3, 1) == 3
    with pytest.raises(ValueError, match=r"^TopK: k must be an integer in \[1, 4\], got 5$"):
        check_int("k", 5, 1, 4, owner="TopK")
    with pytest.raises(ValueError, match=r"^period must be an integer >= 1, got True$"):
        check_int("period", True, 1)
    with pytest.raises(ValueError, match=r"^alpha must be a number in \[0, 1\], got nan$"):
        check_number("alpha", math.nan, lambda v: 0 <= v <= 1, "in [0, 1]")


def test_a_loaded_averagers_state_dict_holds_the_loaded_anchor_and_momentum():
    from gradpress import OuterOptimizerAverager

    params = [torch.nn.Parameter(torch.randn(3, 2, dtype=torch.float64)) for _ in range(2)]
    averager = OuterOptimizerAverager(period=1, outer_momentum=0.9)
    averager.anchor_parameters(params)
    for step in range(3):
        with torch.no_grad():
            params[0].add_(0.1 * (step + 1))
        averager.average_parameters(params)
    saved = averager.state_dict()
    for knows_parameters in (True, False):
        fresh = OuterOptimizerAverager(period=1, outer_momentum=0.9)
        if knows_parameters:
            fresh.anchor_parameters([torch.nn.Parameter(p.detach().clone()) for p in params])
        fresh.load_state_dict(saved)
        again = fresh.state_dict()
        assert len(again["anchor"]) == len(saved["anchor"]) == 2 and again["step"] == 3
        assert all(torch.equal(a, b) for a, b in zip(again["anchor"], saved["anchor"]))
        assert all(torch.equal(a, b) for a, b in zip(again["momentum"], saved["momentum"]))
        assert any(m.abs().sum() > 0 for m in again["momentum"])


def test_momentum_present_from_the_start_steps_as_torchs_lazily_created_one():
    """The outer momentum exists before the first step (a checkpoint template): zero, then SGD's
    ``0 * momentum + grad`` equals its first step's ``clone(grad)``, bit for bit."""
    outer = _outer()
    anchor = [a.detach().clone() for a in outer.anchor]
    plain = torch.optim.SGD(anchor, lr=0.7, momentum=0.9, nesterov=True)
    assert all(outer._momentum(a) is not None for a in outer.anchor)
    for scale in (1.0, -2.0, 0.5):
        outer.step(_grads(scale))
        for a, g in zip(anchor, _grads(scale)):
            a.grad = g.to(a.dtype)
        plain.step()
    assert all(torch.equal(a, b) for a, b in zip(outer.anchor, anchor))

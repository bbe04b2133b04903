"""The demo's inner optimizers: SGD, and AdamW as nanoGPT trains (decay on matrices only, warm-up, cosine)."""

from __future__ import annotations

import math

import pytest
import torch

from distributed import run
from gradpress.tools.workloads.config import ADAMW_BETAS, ADAMW_LR, DemoConfig
from gradpress.tools.workloads import parse_methods, train
from gradpress.tools.workloads.training import make_optimizer


def test_adamw_schedule_warms_up_linearly_then_decays_by_a_cosine_to_a_tenth():
    config = DemoConfig(task="gpt", steps=200, optimizer="adamw", lr=2e-3)
    warmup = config.lr_warmup_steps()
    assert warmup == 20
    lrs = [config.lr_at(step) for step in range(1, 201)]
    assert lrs[:warmup] == pytest.approx([2e-3 * s / warmup for s in range(1, warmup + 1)])
    assert max(lrs) == pytest.approx(2e-3) and lrs[-1] == pytest.approx(2e-4)
    decay = lrs[warmup - 1:]
    assert all(a >= b for a, b in zip(decay, decay[1:]))  # never rises after the warm-up
    middle = warmup + (200 - warmup) // 2  # half-way through the cosine: half-way between peak and floor
    assert config.lr_at(middle) == pytest.approx(2e-4 + 0.5 * (1 + math.cos(math.pi * 0.5)) * 1.8e-3)
    assert DemoConfig(task="gpt", optimizer="adamw").resolved_lr() == ADAMW_LR
    assert DemoConfig(task="gpt", lr=0.5).lr_at(7) == 0.5  # SGD: constant


def test_adamw_decays_matrices_only_with_nanogpts_betas():
    config = DemoConfig(task="gpt", optimizer="adamw", weight_decay=0.1)
    params = [torch.nn.Parameter(torch.zeros(4, 3)), torch.nn.Parameter(torch.zeros(3)),
              torch.nn.Parameter(torch.zeros(2, 2, 2))]
    optimizer = make_optimizer(params, config)
    assert isinstance(optimizer, torch.optim.AdamW)
    decayed, plain = optimizer.param_groups
    assert [p.dim() for p in decayed["params"]] == [2, 3] and decayed["weight_decay"] == 0.1
    assert [p.dim() for p in plain["params"]] == [1] and plain["weight_decay"] == 0.0
    assert decayed["betas"] == ADAMW_BETAS
    sgd = make_optimizer(params, DemoConfig(task="gpt", lr=0.3, momentum=0.5))
    assert isinstance(sgd, torch.optim.SGD) and sgd.param_groups[0]["momentum"] == 0.5


@pytest.mark.parametrize("kwargs, name", [({"optimizer": "adam"}, "optimizer"), ({"weight_decay": -1}, "weight_decay"),
                                          ({"batch_size": 0}, "batch_size")])
def test_bad_optimizer_settings_name_the_argument(kwargs, name):
    with pytest.raises(ValueError, match=name):
        DemoConfig(task="gpt", **kwargs)


def _runs(rank, world):
    """Three short runs differing in one setting each: the optimizer, then the batch size."""
    method = parse_methods("powersgd:2", [1])[0]
    out = []
    for kwargs in ({"optimizer": "sgd", "lr": 1e-3}, {"optimizer": "adamw"}, {"optimizer": "adamw", "batch_size": 5}):
        config = DemoConfig(task="gpt", steps=6, start_iter=2, evals=1, **{"batch_size": 3, **kwargs})
        result = train(rank, world, method, config)
        out.append((result["digest"], [point["test_loss"] for point in result["curve"]]))
    return out


@pytest.mark.slow
def test_a_demo_run_trains_with_adamw_and_the_batch_size_given():
    first, second = run(_runs, 2)
    assert first == second  # the ranks stayed identical
    (sgd, _), (adamw, losses), (bigger, _) = first
    assert len({sgd, adamw, bigger}) == 3  # the optimizer and the batch size each change the run
    assert all(math.isfinite(loss) for loss in losses)

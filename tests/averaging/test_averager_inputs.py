"""Every public entry point that takes parameters takes them in every form PyTorch's averagers and optimizers
accept: a list, a generator (``model.parameters()``, read once), ``named_parameters()`` pairs, parameter
groups (dicts, their ``"params"`` a list, a generator or one tensor) and a module. The oracle: each form gives
bitwise the parameters the list gives (2 gloo ranks with different parameters, so every sync averages)."""

from __future__ import annotations

from collections import OrderedDict

import torch
from torch import nn

from distributed import run
from gradpress import (HierarchicalModelAverager, OuterOptimizerAverager, PeriodicModelAverager, PostLocalSGDOptimizer,
                       StreamingDiLoCoAverager, average_parameters)

STEPS = 6

FORMS = {
    "list": lambda m: list(m.parameters()),
    "generator": lambda m: m.parameters(),
    "named": lambda m: m.named_parameters(),
    "groups": lambda m: [{"params": list(m.parameters())}],
    "groups of generators": lambda m: [{"params": m[0].parameters()}, {"params": m[2].parameters()}],
    "groups of one tensor": lambda m: [{"params": p} for p in m.parameters()],
    "generator of groups": lambda m: ({"params": [p]} for p in m.parameters()),
    "module": lambda m: m,  # no float buffers here: the same tensors as the list
}

KINDS = {
    "periodic": lambda: PeriodicModelAverager(2, warmup_steps=1),
    "hierarchical": lambda: HierarchicalModelAverager(OrderedDict([(1, 1), (2, 2)]), warmup_steps=1),
    "outer": lambda: OuterOptimizerAverager(2, outer_momentum=0.5),
    "outer with warm-up": lambda: OuterOptimizerAverager(2, warmup_steps=2, outer_momentum=0.5),
    "streaming": lambda: StreamingDiLoCoAverager(4, num_fragments=2, outer_momentum=0.5),
    "streaming with warm-up": lambda: StreamingDiLoCoAverager(4, warmup_steps=2, num_fragments=2, outer_momentum=0.5),
}


def _model(rank: int) -> nn.Sequential:
    torch.manual_seed(rank)  # different on every rank
    return nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))


def _local_step(model: nn.Module, rank: int, step: int) -> None:
    with torch.no_grad():
        for i, p in enumerate(model.parameters()):
            p.add_((rank + 1) * (step + 1) * (i + 1) / 16)


def every_form(rank, world):
    results: dict[tuple[str, str], object] = {}
    for kind, make in KINDS.items():
        for form, given in FORMS.items():
            if kind == "hierarchical" and form not in ("list", "generator", "named"):
                continue  # each construction makes its subgroups (new_group): the forms' reading is shared
            model, averager = _model(rank), make()
            try:
                averager.anchor_parameters(given(model))
                for step in range(STEPS):
                    _local_step(model, rank, step)
                    averager.average_parameters(given(model))
                results[kind, form] = [p.detach().clone() for p in model.parameters()]
            except Exception as error:  # noqa: BLE001  (reported per form by the test)
                results[kind, form] = f"{type(error).__name__}: {error}"
    for form, given in FORMS.items():
        model = _model(rank)
        try:
            average_parameters(given(model))
            results["average_parameters", form] = [p.detach().clone() for p in model.parameters()]
        except Exception as error:  # noqa: BLE001
            results["average_parameters", form] = f"{type(error).__name__}: {error}"
    return results


def test_every_entry_point_takes_every_form_of_parameters_once():
    for rank, results in enumerate(run(every_form, 2)):
        failed = {key: value for key, value in results.items() if isinstance(value, str)}
        assert not failed, (rank, failed)
        for (kind, form), got in results.items():
            want = results[kind, "list"]
            assert all(torch.equal(a, b) for a, b in zip(got, want)), (rank, kind, form)
        # Not a numerical no-op: the ranks started apart and every averager brought them together.
        assert not torch.equal(_model(0)[0].weight, _model(1)[0].weight)


def optimizer_from_a_generator(rank, world):
    """PostLocalSGDOptimizer over an inner optimizer built from a generator, and from named parameters."""
    out = []
    for named in (False, True):
        model = _model(rank)
        params = model.named_parameters() if named else model.parameters()
        optimizer = PostLocalSGDOptimizer(torch.optim.SGD(params, lr=0.1),
                                          StreamingDiLoCoAverager(2, outer_momentum=0.5))
        for step in range(3):  # syncs at steps 0 and 2
            optimizer.zero_grad()
            model(torch.full((2, 3), float(rank + step))).square().sum().backward()
            optimizer.step()
        out.append([p.detach().clone() for p in model.parameters()])
    return out


def test_post_local_sgd_optimizer_over_generators_and_named_parameters_averages_the_same():
    results = run(optimizer_from_a_generator, 2)
    for plain, named in results:
        assert all(torch.equal(a, b) for a, b in zip(plain, named))
    assert all(torch.equal(a, b) for a, b in zip(results[0][0], results[1][0]))  # synchronized at step 2

"""The demo's method registry (``gradpress.tools.workloads.methods``): each kind declared once, and everything
else (``METHOD_KINDS``, ``parse_methods``, the byte schedules, the hooks and averagers) read from it."""

from __future__ import annotations

import dataclasses

import pytest

import gradpress
from gradpress.tools.workloads import METHOD_KINDS, METHOD_REGISTRY, DemoConfig, get_task, parse_methods, training
from gradpress.tools.workloads.methods import Method, bytes_schedule, method_kind, wire_bytes

ALL = ["allreduce", "fp16", "bf16", "powersgd", "multi", "localsgd", "diloco", "streaming", "diloco-int8",
       "diloco-int4", "sparseloco", "streaming-int4"]


def test_method_kinds_is_the_registry_in_words() -> None:
    assert list(METHOD_REGISTRY) == list(METHOD_KINDS) == ALL
    assert METHOD_KINDS == {name: kind.description for name, kind in METHOD_REGISTRY.items()}
    assert all(kind.name == name and kind.description for name, kind in METHOD_REGISTRY.items())
    arguments = {name: kind.argument for name, kind in METHOD_REGISTRY.items()}
    assert [n for n, a in arguments.items() if a == "rank"] == ["powersgd", "multi"]
    assert [n for n, a in arguments.items() if a is None] == ["allreduce", "fp16", "bf16"]


def test_unknown_method_errors_name_every_kind_and_how_to_give_a_number() -> None:
    with pytest.raises(ValueError) as error:
        parse_methods("allreduce,topk", [1])
    assert str(error.value) == (
        "unknown method 'topk'; valid methods: allreduce, fp16, bf16, powersgd, multi, localsgd, diloco, streaming, "
        "diloco-int8, diloco-int4, sparseloco, streaming-int4 (powersgd and multi also as powersgd:R; localsgd, "
        "diloco, streaming, diloco-int8, diloco-int4, sparseloco, streaming-int4 as localsgd:H)")
    with pytest.raises(ValueError, match="^unknown method 'topk'; valid methods: allreduce, fp16, "):
        method_kind("topk")
    with pytest.raises(ValueError, match="unknown method 'topk'"):
        training.train(0, 1, Method("topk"), DemoConfig())


def test_one_entry_adds_a_method(monkeypatch: pytest.MonkeyPatch) -> None:
    """A kind declared once is parsed, scheduled and built like the others."""
    base = METHOD_REGISTRY["localsgd"]
    kind = dataclasses.replace(base, name="rarely", description="local SGD under another name")
    monkeypatch.setitem(METHOD_REGISTRY, "rarely", kind)
    (method,) = parse_methods("rarely:5", [1])
    assert method.label == "rarely H=5"
    with pytest.raises(ValueError, match="takes no rank"):
        parse_methods("fp16:5", [1])
    plan = gradpress.make_plan([(64, 32), (32,)], 1, 2.0)
    config = DemoConfig(steps=20, start_iter=4)
    assert bytes_schedule(method, plan, config) == bytes_schedule(parse_methods("localsgd:5", [1])[0], plan, config)
    state, hook = kind.hook(method, config)
    assert hook is gradpress.post_localSGD_hook and state.start_localSGD_iter == 4


def _plan(task: str, rank: int) -> gradpress.Plan:
    return gradpress.make_plan([p.shape for p in get_task(task).model(0).parameters()], rank, 2.0)


@pytest.mark.parametrize("wire", [2, 4, 8])
def test_powersgd_bytes_follow_the_wire_precision_after_the_warm_up(wire: int) -> None:
    plan = _plan("charlm", 22)
    options = None if wire == 4 else {"bytes_per_weight": wire}
    config = DemoConfig(task="charlm", steps=12, start_iter=3, powersgd_options=options)
    assert wire_bytes(config) == wire
    (classic, multi) = parse_methods("powersgd:22,multi:22", [])
    assert bytes_schedule(classic, plan, config) == [4 * plan.numel] * 3 + [wire * plan.numel_sent] * 9
    assert bytes_schedule(multi, plan, config) == [4 * plan.numel] * 3 + [
        wire * plan.numel_sent_per_step(1, i) for i in range(9)]
    # The other methods' bytes do not depend on PowerSGD's wire.
    for spec in ("allreduce", "fp16", "localsgd:4", "sparseloco:4"):
        (method,) = parse_methods(spec, [])
        plain = DemoConfig(task="charlm", steps=12, start_iter=3)
        assert bytes_schedule(method, plan, config) == bytes_schedule(method, plan, plain), spec


def test_bytes_per_step_of_each_kind() -> None:
    plan = _plan("digits", 2)
    config = DemoConfig(steps=20, start_iter=4)
    per_step = {}
    for spec in ("allreduce", "fp16", "powersgd:2", "multi:2", "localsgd:4", "streaming:4"):
        (method,) = parse_methods(spec, [])
        kind = METHOD_REGISTRY[method.kind]
        wire = bytes_schedule(method, plan, config)
        per_step[spec] = kind.bytes_per_step(method, plan, config, wire, 2)
        assert kind.bytes_per_step(method, plan, config, [0] * 20, 1) == 0  # one worker sends nothing
        # Every method but the plain and cast allreduces starts with allreduce steps.
        assert kind.warms_up == (method.kind not in {"allreduce", "fp16", "bf16"}), spec
    assert per_step["allreduce"] == 2 * per_step["fp16"] == 4 * plan.numel
    assert per_step["powersgd:2"] == 4 * plan.numel_sent
    assert per_step["multi:2"] == 4 * plan.mean_numel_sent(1)
    assert per_step["localsgd:4"] == per_step["streaming:4"] == plan.numel  # the whole model every 4 steps


def test_every_kind_builds_its_hook_and_averager() -> None:
    config = DemoConfig(steps=20, start_iter=4, powersgd_options={"bytes_per_weight": 2})
    hooks = {}
    for name, kind in METHOD_REGISTRY.items():
        (method,) = parse_methods(name if kind.argument is None else f"{name}:4", [])
        state, hook = kind.hook(method, config)
        hooks[name] = hook
        averager = None if kind.averager is None else kind.averager(method, config, 8)
        assert (averager is None) == (kind.argument != "period"), name
        if kind.argument == "rank":
            assert isinstance(state, gradpress.PowerSGDState) and state.bytes_per_weight == 2
            assert state.matrix_approximation_rank == 4 and state.start_powerSGD_iter == 4
    assert hooks["allreduce"] is gradpress.allreduce_hook and hooks["fp16"] is gradpress.fp16_compress_hook
    assert hooks["powersgd"] is hooks["multi"] is gradpress.powerSGD_hook

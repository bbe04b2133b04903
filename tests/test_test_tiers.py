"""The test tiers: ``pytest -m "not slow"`` is the quick subset; conftest.py names the slow tests of
modules it does not mark whole. A renamed test must not silently fall back into the quick tier."""

import importlib
import inspect

import conftest


def test_every_slow_entry_names_an_existing_test_function():
    for entry in sorted(conftest.SLOW_TESTS):
        module_name, function = entry.split("::")
        module = importlib.import_module(module_name)
        assert inspect.isfunction(getattr(module, function, None)), f"conftest.SLOW_TESTS: no test {entry}"


def test_every_slow_module_exists():
    for name in sorted(conftest.SLOW_MODULES):
        assert importlib.util.find_spec(name) is not None, f"conftest.SLOW_MODULES: no module {name}"


def test_the_slow_marker_is_registered(pytestconfig):
    assert any(line.startswith("slow:") for line in pytestconfig.getini("markers"))

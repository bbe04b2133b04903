import pytest

import distributed

#: Test modules whose every test is slow (whole multi-process runs: elastic restarts under torchrun, the
#: examples, the framework integrations' trainers). Slow tests elsewhere carry ``@pytest.mark.slow``.
SLOW_MODULES = frozenset({
    "test_elastic",
    "test_examples",
    "test_integrations_accelerate",
    "test_integrations_lightning",
    "test_integrations_transformers",
})


def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.module is not None and item.module.__name__ in SLOW_MODULES:
            item.add_marker(pytest.mark.slow)


@pytest.fixture(scope="session", autouse=True)
def _close_worker_groups():
    yield
    distributed.close_all()

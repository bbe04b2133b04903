import pytest

import distributed


@pytest.fixture(scope="session", autouse=True)
def _close_worker_groups():
    yield
    distributed.close_all()

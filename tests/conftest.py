import os

import pytest

import distributed
from gradpress.tools.processes import usable_cores


def pytest_xdist_auto_num_workers(config: pytest.Config) -> int:
    """How many test workers ``-n auto`` (in ``pyproject.toml``'s ``addopts``) starts.

    The whole suite (``pytest`` with no paths, or ``pytest tests``, with any ``-m``/``-k``) runs on one
    more worker than there are usable cores, at most 8: most of a test's time is spent waiting (for its
    gloo workers, a launcher, a timeout it must wait out), so a 2-core machine keeps both cores busy with
    3. Every worker pays for its own ``import torch`` and worker server (10-20 s on a busy 2-core machine),
    more than a folder's or a file's tests take together, so a run of named folders, files or tests stays
    in this process (``-s`` and ``--pdb`` work there). ``-n N`` or ``PYTEST_XDIST_AUTO_NUM_WORKERS``
    choose otherwise; ``-n 0`` runs everything in this process.
    """
    chosen = os.environ.get("PYTEST_XDIST_AUTO_NUM_WORKERS")
    if chosen:
        return int(chosen)
    here = os.path.dirname(os.path.abspath(__file__))
    whole = all(os.path.abspath(arg) == here for arg in config.args)
    return min(usable_cores() + 1, 8) if whole else 0


@pytest.fixture(scope="session", autouse=True)
def _close_worker_groups():
    yield
    distributed.close_all()

"""scripts/setup.sh picks the environment to install into: the active one, else the project-local .venv.

Only the choice is exercised (``setup.sh --print-env``): no network, nothing installed.
"""

import os
import pathlib
import shutil
import subprocess
import sys
import venv

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
SETUP = ROOT / "scripts" / "setup.sh"
BASH = shutil.which("bash")
pytestmark = pytest.mark.skipif(BASH is None or os.name != "posix", reason="needs bash on a POSIX system")


def _base_python():
    """An interpreter outside any virtual env (the one this test's venv, if any, was made from)."""
    return sys._base_executable if sys.prefix != sys.base_prefix else sys.executable


@pytest.fixture
def base_bin(tmp_path):
    """A directory whose python3 is a non-venv interpreter."""
    d = tmp_path / "base-bin"
    d.mkdir()
    (d / "python3").symlink_to(os.path.realpath(_base_python()))
    return d


@pytest.fixture
def active_venv(tmp_path):
    path = tmp_path / "venv"
    venv.EnvBuilder(with_pip=False, symlinks=True).create(path)
    return path


def _run(args, first_on_path, **env):
    """Runs ``bash scripts/<args>`` with only ``env`` set and ``first_on_path`` ahead of the system's."""
    environ = {"HOME": os.environ.get("HOME", "/"), "PATH": f"{first_on_path}:/usr/bin:/bin", **env}
    return subprocess.run([BASH, *args], env=environ, capture_output=True, text=True, timeout=60)


def _chosen(first_on_path, **env):
    done = _run([str(SETUP), "--print-env"], first_on_path, **env)
    assert done.returncode == 0, done.stderr
    return pathlib.Path(done.stdout.strip())


def _same(a, b):
    return os.path.realpath(a) == os.path.realpath(b)


def test_no_active_environment_chooses_the_project_local_venv(base_bin, tmp_path):
    assert _chosen(base_bin) == ROOT / ".venv"
    # a CONDA_PREFIX that python3 does not come from is not an active environment
    assert _chosen(base_bin, CONDA_PREFIX=str(tmp_path)) == ROOT / ".venv"


def test_an_activated_venv_is_chosen(active_venv):
    assert _same(_chosen(active_venv / "bin", VIRTUAL_ENV=str(active_venv)), active_venv)


def test_a_venv_python_first_on_path_is_chosen_without_virtual_env_set(active_venv):
    assert _same(_chosen(active_venv / "bin"), active_venv)


def test_virtual_env_is_chosen_even_when_its_python_is_not_first_on_path(base_bin, active_venv):
    assert _same(_chosen(base_bin, VIRTUAL_ENV=str(active_venv)), active_venv)


def test_the_active_conda_env_is_chosen_when_python3_is_its(base_bin):
    prefix = sys.base_prefix        # stands in for a conda env: python3 runs from it, CONDA_PREFIX names it
    assert _same(_chosen(base_bin, CONDA_PREFIX=prefix), prefix)


def test_run_without_a_command_prints_its_usage(base_bin):
    done = _run([str(ROOT / "scripts" / "run")], base_bin)
    assert done.returncode == 2
    assert "bash scripts/run gradpress demo" in done.stderr
    assert "bash scripts/run python3 -m pytest" in done.stderr

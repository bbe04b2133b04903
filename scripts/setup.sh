#!/usr/bin/env bash
# Install gradpress (editable) and its test and demo tools. Idempotent; safe to run twice.
#
#   bash scripts/setup.sh               set up (or check) the environment
#   bash scripts/setup.sh --print-env   print the environment it would use; install nothing
#
# The environment: the active one if there is one (a virtual env, i.e. `python3` is a venv's, or
# VIRTUAL_ENV is set; or the conda env of CONDA_PREFIX when `python3` is that env's), else a
# project-local `.venv` at the repository root, created with `python3 -m venv`. Installing into the
# system Python is never attempted (Debian's is "externally managed", PEP 668).
# torch is pinned: an unpinned `torch` can pull a multi-GB CUDA build where a CPU wheel is wanted.
# pip runs only when this file, pyproject.toml or the torch version changed since the last set-up of
# that environment (stamp: <env>/.gradpress-setup), or when something it installed is missing.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd -P)"
cd "$ROOT"
TORCH_VERSION="${GRADPRESS_TORCH_VERSION:-2.13.0}"
LOCAL_ENV="$ROOT/.venv"
STAMP_NAME=".gradpress-setup"

say() { echo "setup: $*" >&2; }
die() { echo "setup: error: $*" >&2; exit 1; }

# The active environment's directory, or nothing when none is active (asks python3 itself).
active_env() {
    python3 - <<'EOF'
import os, sys

def real(path):
    return os.path.realpath(path) if path else ""

venv = os.environ.get("VIRTUAL_ENV", "")
conda = os.environ.get("CONDA_PREFIX", "")
if sys.prefix != sys.base_prefix:                       # python3 is a virtual env's
    print(sys.prefix)
elif venv and any(os.access(os.path.join(venv, "bin", exe), os.X_OK) for exe in ("python3", "python")):
    print(venv)                                         # VIRTUAL_ENV set, its python not first on PATH
elif conda and real(conda) == real(sys.prefix):         # python3 is the active conda env's
    print(conda)
EOF
}

# Prints the environment to use: the active one, else <repo>/.venv.
choose_env() {
    command -v python3 >/dev/null 2>&1 \
        || die "python3 not found on PATH; gradpress needs Python >= 3.10 (Debian/Ubuntu: sudo apt-get install python3 python3-venv)"
    local active
    active="$(active_env)" || die "python3 ($(command -v python3)) does not run"
    echo "${active:-$LOCAL_ENV}"
}

# Dies unless interpreter $1 is Python >= 3.10; $2 says where it comes from, $3 what to do instead.
require_python_310() {
    "$1" -c 'import sys; sys.exit(sys.version_info < (3, 10))' 2>/dev/null && return 0
    local version
    version="$("$1" -c 'import sys; print("%d.%d.%d" % sys.version_info[:3])' 2>/dev/null || echo "unknown")"
    die "gradpress needs Python >= 3.10, but $2 is Python $version ($1); $3"
}

# True when `python3 -m venv` can make a venv with pip (Debian/Ubuntu ship ensurepip as python3-venv).
can_make_venv() {
    python3 -c 'import importlib.util, sys, venv; sys.exit(importlib.util.find_spec("ensurepip.__main__") is None)' \
        >/dev/null 2>&1
}

# Creates the virtual env $1 with python3. Without ensurepip (a Debian/Ubuntu python3 lacking the
# python3-venv package), installs that package first when root with apt-get, else says how to.
make_venv() {
    if ! can_make_venv; then
        local py
        py="$(command -v python3)"
        if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null 2>&1; then
            die "$py cannot create virtual envs (no ensurepip); fix: sudo apt-get install python3-venv (or activate a virtual env first)"
        fi
        say "$py cannot create virtual envs (no ensurepip): installing python3-venv with apt-get"
        export DEBIAN_FRONTEND=noninteractive
        { apt-get update -qq && apt-get install -y -qq python3-venv; } >&2 \
            || die "apt-get install python3-venv failed (see above); install it, then run this again"
        can_make_venv || die "$py still cannot create virtual envs after installing python3-venv (no ensurepip)"
    fi
    python3 -m venv --clear "$1" >&2 || die "python3 -m venv $1 failed (see above)"
}

# True when $1 is a usable virtual env: a python >= 3.10 with pip.
venv_usable() {
    "$1/bin/python3" -c 'import sys, pip; sys.exit(sys.version_info < (3, 10))' >/dev/null 2>&1
}

# Prints the stamp's hash for env interpreter $1; succeeds only when the stamp matches and everything
# set-up installs is there (checked without importing anything heavy).
check_stamp() {
    "$1" - "$ROOT" "$TORCH_VERSION" "$STAMP_NAME" <<'EOF'
import hashlib, os, sys, sysconfig
import importlib.metadata as metadata
import importlib.util

root, torch_version, stamp_name = sys.argv[1:4]
h = hashlib.sha256()
for name in ("pyproject.toml", "scripts/setup.sh"):
    with open(os.path.join(root, name), "rb") as f:
        h.update(f.read())
h.update(f"\0torch=={torch_version}\0{root}".encode())
digest = h.hexdigest()
print(digest)


def up_to_date():
    try:
        with open(os.path.join(sys.prefix, stamp_name)) as f:
            if f.read().split()[:1] != [digest]:
                return False
        spec = importlib.util.find_spec("gradpress")
        src = os.path.join(os.path.realpath(root), "src") + os.sep
        if spec is None or not os.path.realpath(spec.origin).startswith(src):
            return False                                 # not installed, or another clone's
        if metadata.version("torch").split("+")[0] != torch_version:
            return False
        tools = ("pytest", "hypothesis", "sklearn", "matplotlib", "ruff", "mypy")
        if not all(importlib.util.find_spec(m) for m in tools):
            return False
        return os.path.exists(os.path.join(sysconfig.get_path("scripts"), "gradpress"))
    except Exception:
        return False


sys.exit(0 if up_to_date() else 1)
EOF
}

case "${1:-}" in
    "") ;;
    --print-env) choose_env; exit 0 ;;
    *) echo "usage: bash scripts/setup.sh [--print-env]" >&2; exit 2 ;;
esac

ENV_DIR="$(choose_env)"
created=""
if [ "$ENV_DIR" = "$LOCAL_ENV" ]; then
    if ! venv_usable "$ENV_DIR"; then
        require_python_310 "$(command -v python3)" "python3" \
            "put a newer python3 first on PATH, or activate a virtual env or conda env that has one"
        [ -e "$ENV_DIR" ] && say "recreating $ENV_DIR (it has no working Python with pip)"
        make_venv "$ENV_DIR"
        created=1
    fi
    where="the project-local virtual env $ENV_DIR"
else
    where="the active environment $ENV_DIR"
fi
PY="$ENV_DIR/bin/python3"
[ -x "$PY" ] || PY="$ENV_DIR/bin/python"
[ -x "$PY" ] || die "no python3 in $ENV_DIR/bin"
require_python_310 "$PY" "$where" "deactivate it, or activate one with a newer Python"

if digest="$(check_stamp "$PY")"; then
    say "using $where (up to date)"
    exit 0
fi
[ -n "$digest" ] || die "$PY could not check $ENV_DIR"
if [ -n "$created" ]; then
    say "using $where (created now; to use it in your shell: source .venv/bin/activate)"
else
    say "using $where"
fi
# torchft (the [torchft] extra, its tests in tests/integrations/test_torchft.py) ships one wheel per Python
# version; 0.2.0's is measured on CPython 3.11 (cp311 manylinux): elsewhere its tests skip, saying so.
extras="dev,demo,integrations"
if "$PY" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 11))'; then
    extras="$extras,torchft"
fi
say "installing torch==${TORCH_VERSION} and gradpress[$extras] (editable; dev brings pytest, ruff, mypy) with pip"
pip_install() { "$PY" -m pip install --quiet --disable-pip-version-check "$@"; }
pip_install "torch==${TORCH_VERSION}" || die "pip could not install torch==${TORCH_VERSION} into $ENV_DIR"
# torch pinned again in the same command, so that no extra (Lightning, transformers) can move it.
pip_install "torch==${TORCH_VERSION}" -e ".[$extras]" || die "pip could not install gradpress into $ENV_DIR"
printf '%s\n' "$digest" > "$ENV_DIR/$STAMP_NAME"
if [ "$ENV_DIR" != "$LOCAL_ENV" ] && command -v pyenv >/dev/null 2>&1; then
    pyenv rehash 2>/dev/null || true      # a pyenv-virtualenv env: shims for the new `gradpress` command
fi

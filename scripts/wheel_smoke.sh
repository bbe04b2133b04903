#!/usr/bin/env bash
# Build gradpress's wheel and check it works without the repository: a fresh virtual env gets
# torch==2.13.0 and the wheel (nothing editable, no extras), then, from a temporary folder outside the
# repository, `gradpress --version` and a two-rank demo run (gloo on CPU, a few steps). The wheel must
# hold gradpress/py.typed (the typing marker).
#
#   bash scripts/wheel_smoke.sh          (what CI runs after the tests)
#
# The venv is made with `python3 -m venv` (Debian's python3 is "externally managed", PEP 668; nothing is
# installed into it). torch is pinned: an unpinned `torch` can pull a multi-GB CUDA build.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd -P)"
TORCH_VERSION="${GRADPRESS_TORCH_VERSION:-2.13.0}"
PYTHON="${GRADPRESS_BASE_PYTHON:-python3}"
work="$(mktemp -d "${TMPDIR:-/tmp}/gradpress-wheel.XXXXXX")"
trap 'rm -rf "$work"' EXIT
say() { echo "wheel-smoke: $*" >&2; }
pip_install() { "$work/venv/bin/python" -m pip install --quiet --disable-pip-version-check "$@"; }

"$PYTHON" -m venv "$work/venv"
say "building the wheel"
"$work/venv/bin/python" -m pip wheel --quiet --disable-pip-version-check --no-deps -w "$work/dist" "$ROOT" >&2
wheel="$(ls "$work"/dist/gradpress-*.whl)"
# PEP 561: without the py.typed marker in the wheel, type checkers ignore gradpress's annotations.
"$work/venv/bin/python" -c 'import sys, zipfile; sys.exit("gradpress/py.typed" not in zipfile.ZipFile(sys.argv[1]).namelist())' \
    "$wheel" || { say "$(basename "$wheel") has no gradpress/py.typed"; exit 1; }
say "installing torch==$TORCH_VERSION and $(basename "$wheel") into a fresh venv"
pip_install "torch==$TORCH_VERSION"
pip_install "torch==$TORCH_VERSION" "$wheel"

mkdir "$work/run"
cd "$work/run"                      # outside the repository: only the installed wheel can be imported
version="$("$work/venv/bin/gradpress" --version)"
say "$version"
expected="$(sed -n 's/^version = "\(.*\)"/\1/p' "$ROOT/pyproject.toml")"
[ "$version" = "gradpress $expected" ] || { say "expected 'gradpress $expected'"; exit 1; }
where="$("$work/venv/bin/python" -c 'import gradpress, os; print(os.path.realpath(gradpress.__file__))')"
case "$where" in
    "$ROOT"/*) say "gradpress was imported from the repository ($where), not the wheel"; exit 1 ;;
esac
say "two-rank demo from $work/run"
"$work/venv/bin/gradpress" demo --task charlm --workers 2 --steps 4 --methods allreduce,powersgd \
    --out "$work/run/demo" --timeout 300
[ -s "$work/run/demo/demo.json" ] || { say "the demo wrote no demo.json"; exit 1; }
say "ok"

#!/usr/bin/env bash
# Install gradpress and its test tools on a fresh machine. Idempotent; safe to run twice.
# torch is pinned: an unpinned `torch` can pull a multi-GB CUDA build where a CPU wheel is wanted.
set -euo pipefail
cd "$(dirname "$0")/.."
TORCH_VERSION="${GRADPRESS_TORCH_VERSION:-2.13.0}"
python3 -m pip install --quiet --disable-pip-version-check "torch==${TORCH_VERSION}"
python3 -m pip install --quiet --disable-pip-version-check -e ".[dev,demo]"
command -v pyenv >/dev/null 2>&1 && pyenv rehash || true

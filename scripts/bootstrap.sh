#!/usr/bin/env bash
# Makes the project runnable on a fresh machine: system packages (bubblewrap), a virtual environment
# in .venv with the CPU build of torch first (so the resolver never fetches a CUDA build), then the
# project with its dev extra. Idempotent: a second run with an unchanged pyproject.toml takes a second.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
TORCH_VERSION=2.13.0
STAMP=.venv/.installed-$(sha256sum pyproject.toml | cut -c1-16)

bash scripts/install_system_deps.sh

if [ ! -x .venv/bin/python ]; then
    echo "bootstrap: creating .venv with $($PYTHON --version)"
    "$PYTHON" -m venv .venv
fi
if [ ! -f "$STAMP" ]; then
    echo "bootstrap: installing torch==$TORCH_VERSION (CPU) and the project (this takes a few minutes once)"
    .venv/bin/python -m pip install --quiet --upgrade pip
    .venv/bin/python -m pip install --quiet "torch==$TORCH_VERSION"
    .venv/bin/python -m pip install --quiet -e '.[dev]'
    rm -f .venv/.installed-*
    touch "$STAMP"
fi

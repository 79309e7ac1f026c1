#!/usr/bin/env bash
# The main job: bootstrap if needed, then start a run (all arguments go to python -m runtime.up).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/bootstrap.sh >&2
exec .venv/bin/python -m runtime.up "$@"

#!/usr/bin/env bash
# The main job: bootstrap if needed, then start a run (all arguments go to python -m actors: runtime.up with
# the default run, actors/run.toml).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/bootstrap.sh >&2
exec .venv/bin/python -m actors "$@"

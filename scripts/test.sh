#!/usr/bin/env bash
# The test suite: bootstrap if needed, lint, then every test (all arguments go to pytest).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/bootstrap.sh
.venv/bin/ruff check .
exec .venv/bin/python -m pytest -q -p no:cacheprovider "$@"

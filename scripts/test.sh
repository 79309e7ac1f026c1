#!/usr/bin/env bash
# The test suite: bootstrap if needed, lint, then every test; the 20 slowest are listed at the end.
#   scripts/test.sh           everything (CI and the README's command)
#   scripts/test.sh --fast    unit and property tests only: no test that runs the whole system (marker `system`)
# Other arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
selection=()
if [ "${1:-}" = "--fast" ]; then
    shift
    selection=(-m "not system")
fi
bash scripts/bootstrap.sh
.venv/bin/ruff check .
exec .venv/bin/python -m pytest -q -p no:cacheprovider --durations=20 "${selection[@]}" "$@"

#!/usr/bin/env bash
# The test suite: bootstrap if needed, lint, then every test; the 20 slowest and the 20 costliest in CPU are listed at the end.
#   scripts/test.sh           everything (CI and the README's command)
#   scripts/test.sh --fast    unit and property tests only: no test that runs the whole system (marker `system`)
#                             and none of half a minute or more (marker `slow`)
# Tests run on parallel workers (pytest-xdist, one per core and one more; TEST_WORKERS overrides, 0 runs them in this
# process), fed in the order tests/conftest.py gives (the longest first), the tests of one `xdist_group` on one
# worker. Other arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
selection=()
if [ "${1:-}" = "--fast" ]; then
    shift
    selection=(-m "not system and not slow")
fi
bash scripts/bootstrap.sh
.venv/bin/ruff check .
workers=${TEST_WORKERS:-$(($(nproc) + 1))}  # one more than the cores: most system tests wait on processes
parallel=()
if [ "$workers" != 0 ]; then
    # loadgroup: the tests of one xdist_group (those sharing a cluster or a converted model) on one worker;
    # the order is tests/conftest.py's (the longest first), not the groups' sizes
    parallel=(-n "$workers" --dist loadgroup --no-loadscope-reorder)
fi
exec .venv/bin/python -m pytest -q -p no:cacheprovider --durations=20 "${parallel[@]}" "${selection[@]}" "$@"

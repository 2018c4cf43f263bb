#!/usr/bin/env bash
# Sets up (if needed) and runs the whole test suite.
#   bash scripts/test.sh          everything
#   bash scripts/test.sh --fast   the fast lane: exactness and unit tests (not the `slow` ones)
# Other arguments go to pytest (e.g. a test file, -k EXPR, -x).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
if [ "${1:-}" = "--fast" ]; then
    shift
    set -- -m "not slow" "$@"
fi
# --durations: the slowest tests in every run's log (CI time is a budget).
exec .venv/bin/python -m pytest -q --durations=20 "$@"

#!/usr/bin/env bash
# Quickstart command 2: set up (first run only) and run the test suite. .ci/run calls this same script.
#   scripts/test.sh           the full run (what CI runs)
#   scripts/test.sh --fast    the package's unit and equivalence tests only (-m "not slow"), for a change's first check
# Other arguments go to pytest (a file, -k EXPR, ...).
#   HF_KVCACHE_VENV=DIR scripts/test.sh   the suite in another venv, set up as scripts/setup.sh sets it up
set -euo pipefail
cd "$(dirname "$0")/.."
venv=${HF_KVCACHE_VENV:-.venv}
scripts/setup.sh
export HF_HUB_OFFLINE=1
args=()
for arg in "$@"; do
  if [ "$arg" = "--fast" ]; then args+=(-m "not slow"); else args+=("$arg"); fi
done
# One worker per core (pytest-xdist); each worker runs torch with one thread (tests/conftest.py). loadgroup: the tests
# of a module in conftest's ONE_WORKER_MODULES (costly module fixtures: the docs site, the GPU report and run, the
# examples) run on one worker, so each such fixture is built once.
exec "$venv/bin/python" -m pytest -q -p no:cacheprovider -n auto --dist loadgroup "${args[@]}"

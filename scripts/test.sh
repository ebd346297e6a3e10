#!/usr/bin/env bash
# Quickstart command 2: set up (first run only) and run the test suite. .ci/run calls this same script.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
export HF_HUB_OFFLINE=1
# One worker per core (pytest-xdist); each worker runs torch with one thread (tests/conftest.py).
exec .venv/bin/python -m pytest -q -p no:cacheprovider -n auto "$@"

#!/usr/bin/env bash
# Quickstart command 2: set up (first run only) and run the test suite. .ci/run calls this same script.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
export HF_HUB_OFFLINE=1
exec .venv/bin/python -m pytest -q -p no:cacheprovider "$@"

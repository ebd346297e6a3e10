#!/usr/bin/env bash
# Quickstart command 1: set up (first run only) and run the main job on the embedded default, offline.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
export HF_HUB_OFFLINE=1
exec .venv/bin/hf-kvcache demo "$@"

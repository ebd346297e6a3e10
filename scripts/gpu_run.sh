#!/usr/bin/env bash
# The GPU run (benchmarks/gpu_run.py) into $OUT (the device tool's output folder) or results/gpu-run, with any
# extra flags passed on (--budget-s, --stages). Run from the project's root on the GPU machine, after its set-up
# (a user's: `pip install -e .[gpu]`; a lent machine without package access: ../shared/gpu's prefix first).
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-results/gpu-run}
mkdir -p "$out"
python3 benchmarks/gpu_run.py --output "$out" "$@"

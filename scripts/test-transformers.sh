#!/usr/bin/env bash
# The test suite on another transformers release of the supported range (pyproject.toml), leaving .venv as it is:
# that release is installed without dependencies (the releases of the range share them) into
# .transformers/<version>/ and put first on PYTHONPATH. CI tests the newest release (what a fresh install gets);
# this checks an older one.
#   scripts/test-transformers.sh 5.23.0           the full run on transformers 5.23.0
#   scripts/test-transformers.sh 5.23.0 --fast    other arguments as scripts/test.sh takes them
set -euo pipefail
cd "$(dirname "$0")/.."
version=${1:?usage: scripts/test-transformers.sh VERSION [scripts/test.sh arguments]}
shift
scripts/setup.sh
target=.transformers/$version
if [ ! -d "$target/transformers" ]; then
  .venv/bin/python -m pip install -q --disable-pip-version-check --no-deps --target "$target" "transformers==$version"
fi
export PYTHONPATH="$PWD/$target${PYTHONPATH:+:$PYTHONPATH}"
.venv/bin/python -c "import transformers; print('transformers', transformers.__version__, 'from', transformers.__file__)"
exec scripts/test.sh "$@"

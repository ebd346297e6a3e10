"""The supported-models matrix: every causal-LM type of transformers, built tiny, under every cache.

Thin entry point: the logic is ``hf_kvcache.tools.supported_models`` (importable, typed and tested with the package).
"""

import sys

from hf_kvcache.tools.supported_models import main

if __name__ == "__main__":
    sys.exit(main())

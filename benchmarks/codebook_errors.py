"""Reconstruction error of each KIVI codebook on a model's stored keys and values (all elements and the extremes).

Thin entry point: the logic is ``hf_kvcache.tools.codebook_errors`` (importable, typed and tested with the package).
"""

import sys

from hf_kvcache.tools.codebook_errors import main

if __name__ == "__main__":
    sys.exit(main())

"""Scoring through each cache in merged forwards against one token per forward, side by side (seconds, forwards,
perplexities).

Thin entry point: the logic is ``hf_kvcache.tools.bench_scoring`` (importable, typed and tested with the package).
"""

import sys

from hf_kvcache.tools.bench_scoring import main

if __name__ == "__main__":
    sys.exit(main())

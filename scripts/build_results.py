"""Produce the docs' results from the harness and keep the pages in step with them.

Thin entry point: the logic is ``hf_kvcache.tools.results`` (importable, typed and tested with the package).
"""

import sys

from hf_kvcache.tools.results import main

if __name__ == "__main__":
    sys.exit(main())

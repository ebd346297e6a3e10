"""What a saved cache costs and saves: file bytes, save / load time against the prefill, the loaded cache continuing.

Thin entry point: the logic is ``hf_kvcache.tools.saved_cache`` (importable, typed and tested with the package).
"""

import sys

from hf_kvcache.tools.saved_cache import main

if __name__ == "__main__":
    sys.exit(main())

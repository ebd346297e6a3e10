"""CPU speed of every cache on the real model, side by side, next to transformers' quanto and HQQ caches.

Thin entry point: the logic is ``hf_kvcache.tools.bench_cpu`` (importable, typed and tested with the package).
"""

import sys

from hf_kvcache.tools.bench_cpu import main

if __name__ == "__main__":
    sys.exit(main())

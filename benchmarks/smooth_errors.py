"""What smoothed keys change in attention, layer by layer, against scales fitted to the queries.

Thin entry point: the logic is ``hf_kvcache.tools.smooth_errors`` (importable, typed and tested with the package).
"""

import sys

from hf_kvcache.tools.smooth_errors import main

if __name__ == "__main__":
    sys.exit(main())

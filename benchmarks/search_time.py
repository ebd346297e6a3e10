"""How long key_bits="auto"'s search takes, replaying the layers a configuration cannot change and running every one.

Thin entry point: the logic is ``hf_kvcache.tools.search_time`` (importable, typed and tested with the package).
"""

import sys

from hf_kvcache.tools.search_time import main

if __name__ == "__main__":
    sys.exit(main())

"""How far each cache moves the model's next-token distributions from DynamicCache's, over several windows.

Thin entry point: the logic is ``hf_kvcache.tools.window_kl`` (importable, typed and tested with the package).
"""

import sys

from hf_kvcache.tools.window_kl import main

if __name__ == "__main__":
    sys.exit(main())

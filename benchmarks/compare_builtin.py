"""transformers' built-in caches versus hf_kvcache, checked live (a markdown table of what happened).

Thin entry point: the logic is ``hf_kvcache.tools.peers`` (importable, typed and tested with the package).
"""

from hf_kvcache.tools.peers import main

if __name__ == "__main__":
    main()

"""KIVI's ablation (keys per channel or per token at 4 and 2 bits) on the real model.

Thin entry point: the logic is ``hf_kvcache.tools.kivi_ablation`` (importable, typed and tested with the package).
"""

from hf_kvcache.tools.kivi_ablation import main

if __name__ == "__main__":
    main()

"""The GPU decode path measured without a GPU (kernels compiled for sm_80 / sm_90 on CPU; times are estimates).

Thin entry point: the logic is ``hf_kvcache.tools.gpu_report.report`` (importable, typed and tested with the package).
"""

import sys

from hf_kvcache.tools.gpu_report.report import main

if __name__ == "__main__":
    sys.exit(main())

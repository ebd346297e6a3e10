"""The GPU run, one command: environment, CUDA correctness, decode kernels, generate() end to end and quality, each
stage time-boxed and writing its JSON as it goes (:mod:`hf_kvcache.tools.gpu_run`).

    python benchmarks/gpu_run.py --output results/gpu-run                 # on a GPU machine, ~7.5 minutes
    python benchmarks/gpu_run.py --output /tmp/smoke --smoke --device cpu  # every stage at tiny shapes, on CPU
"""

import sys

from hf_kvcache.tools.gpu_run import main

if __name__ == "__main__":
    sys.exit(main())

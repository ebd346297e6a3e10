import os

import pytest
import torch

# Without a GPU the Triton kernels run in Triton's interpreter on CPU tensors; it must be chosen before any kernel is
# decorated, so before hf_kvcache.kernels.triton_decode is imported.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
# Off CUDA the layers hand the hf_kvcache attention their storage only for long histories (where the reference
# kernels beat sdpa); the tests' short sequences must still go through the kernels.
os.environ.setdefault("HF_KVCACHE_CPU_HANDLES", "always")

# Two threads on two cores made tiny-model generation ~100x slower (thread contention).
torch.set_num_threads(1)


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)

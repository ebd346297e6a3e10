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


# The fast tier (``scripts/test.sh --fast``, ``-m "not slow"``) runs the package's unit and equivalence tests; the
# full run (CI) adds what is marked slow: these end-to-end modules whole (subprocesses, the docs site, the real model,
# ahead-of-time compiles, lm-eval, accelerate), tests marked one by one, the matrix's other families in the other
# modes and attention (tests/matrix.py), and the interpreted kernels in 16-bit dtypes (float32 in the fast tier).
SLOW_MODULES = {
    "test_builtin_comparison",
    "test_compile",
    "test_docs",
    "test_examples",
    "test_gpu_report",
    "test_gpu_run",
    "test_kivi_ablation",
    "test_lmeval",
    "test_real_model",
    "test_reference_model",
    "test_supported_models",
    "test_tensor_parallel",
}


def _slow(item) -> bool:
    module = item.module.__name__ if item.module else ""
    if module in SLOW_MODULES:
        return True
    params = item.callspec.params if hasattr(item, "callspec") else {}
    return module == "test_kernels" and params.get("dtype", torch.float32) != torch.float32


def pytest_collection_modifyitems(config, items):
    slow = pytest.mark.slow
    for item in items:
        if _slow(item):
            item.add_marker(slow)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="module")
def reference():
    """The embedded reference model and its tokenizer (``hf_kvcache.reference``)."""
    from hf_kvcache import load_reference_model

    return load_reference_model()


@pytest.fixture(scope="module")
def ids(reference):
    """The reference text's token ids, as one 1-D tensor."""
    from hf_kvcache.reference import reference_text

    _, tokenizer = reference
    return torch.tensor(tokenizer(reference_text(), add_special_tokens=False)["input_ids"])

import os
from pathlib import Path

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
# modes and attention (tests/matrix.py), the interpreted kernels in 16-bit dtypes (float32 in the fast tier), and the
# parameter sets outside each test function's each-choice sample (:func:`_each_choice`).
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


# Modules whose module-scoped fixtures are costly (the docs site, the GPU report's compiles, the GPU run's smoke run, a
# model load, worker processes): each runs whole on one xdist worker, so each fixture is built once per run.
ONE_WORKER_MODULES = {
    "test_docs",
    "test_examples",
    "test_gpu_report",
    "test_gpu_run",
    "test_lmeval",
    "test_real_model",
    "test_tensor_parallel",
}


@pytest.hookimpl(optionalhook=True)  # xdist's hook: pytest without xdist (-p no:xdist) must still load this file
def pytest_xdist_make_scheduler(config, log):
    """Under ``--dist loadgroup`` (scripts/test.sh): every other test is its own unit of work, the modules of
    ``ONE_WORKER_MODULES`` one unit each.

    xdist's own loadgroup groups the tests marked ``xdist_group`` by a suffix it writes into each test's node id; pytest
    9.2 computes node ids and ignores what xdist 3.8 writes, so marked modules are split over both workers and their
    module fixtures built on each. Grouping by module name here depends on neither library's node-id internals, only
    on the scheduler class."""
    if config.getvalue("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class ModuleGroups(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            path = nodeid.split("::", 1)[0]
            return path if Path(path).stem in ONE_WORKER_MODULES else nodeid

    return ModuleGroups(config, log)


def _slow(item) -> bool:
    module = item.module.__name__ if item.module else ""
    if module in SLOW_MODULES:
        return True
    params = item.callspec.params if hasattr(item, "callspec") else {}
    return module == "test_kernels" and params.get("dtype", torch.float32) != torch.float32


# Modules whose tests are each a few seconds of interpreted kernels: their fast-tier sample is drawn per module, not
# per function (:func:`_each_choice`), so a storage kind read by one kernel test is not read again by the next one.
SAMPLED_PER_MODULE = {"test_kernels"}


def _each_choice(items, per_module=frozenset()) -> set[str]:
    """Node ids of a sample of each test function's parameter sets in which every value of every parameter appears at
    least once: in collection order, a set is kept when it brings a value its function has not had yet. A grid of
    5 x 4 x 3 values, collected in order, keeps 1 + 4 + 3 + 2 = 10 of its 60 sets; a one-parameter list keeps all.
    In a module of ``per_module`` a value counts as had once any function of the module had it (each function still
    keeps its first set), so each value appears once in the module. Values are told apart by parameter name and
    ``repr`` (the same choice on every xdist worker: each collects the same sets in the same order)."""
    seen: dict[tuple[str, str], set[tuple[str, str]]] = {}
    functions = set()
    kept = set()
    for item in items:
        callspec = getattr(item, "callspec", None)
        if callspec is None:
            continue
        module, function = item.module.__name__, item.originalname
        values = {(name, repr(value)) for name, value in callspec.params.items()}
        had = seen.setdefault((module, "" if module in per_module else function), set())
        if not values <= had or (module, function) not in functions:
            had |= values
            kept.add(item.nodeid)
        functions.add((module, function))
    return kept


def pytest_collection_modifyitems(config, items):
    slow = pytest.mark.slow
    for item in items:
        if _slow(item):
            item.add_marker(slow)
    # The fast tier's share of each grid, chosen among the sets it would otherwise run; the rest run in the full run.
    sample = _each_choice([item for item in items if "slow" not in item.keywords], SAMPLED_PER_MODULE)
    for item in items:
        if hasattr(item, "callspec") and "slow" not in item.keywords and item.nodeid not in sample:
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


@pytest.fixture
def native_cpu():
    """The CPU kernel of :mod:`hf_kvcache.kernels.cpu_native`, built: skips where this machine has no C compiler,
    unless ``HF_KVCACHE_REQUIRE_NATIVE=1`` (CI sets it), which fails instead."""
    from hf_kvcache.kernels import cpu_native

    state = cpu_native.status()
    if not state.startswith("built"):
        if os.environ.get("HF_KVCACHE_REQUIRE_NATIVE") == "1":
            pytest.fail(f"HF_KVCACHE_REQUIRE_NATIVE=1 but the CPU kernel is {state}")
        pytest.skip(f"the CPU kernel is {state}")
    return cpu_native

"""Which path a forward under the ``hf_kvcache`` attention takes off CUDA: the layers hand over their storage (the
reference kernels) only where that beats sdpa, unless told otherwise (``HF_KVCACHE_CPU_HANDLES``)."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig

from hf_kvcache import make_cache
from hf_kvcache.formats import KVHandle
from hf_kvcache.kernels import cpu_native
from hf_kvcache.layers import _common
from hf_kvcache.prefill import store_prefill

CONFIG = dict(num_hidden_layers=1, hidden_size=64, num_attention_heads=4, num_key_value_heads=2)


def _step(spec: str, tokens: int, rows: int = 1):
    config = LlamaConfig(**CONFIG)
    kv = [(torch.randn(rows, 2, tokens, 16), torch.randn(rows, 2, tokens, 16))]
    cache = store_prefill(make_cache(spec, config), kv)
    config._attn_implementation = "hf_kvcache"
    keys, _ = cache.update(torch.randn(rows, 2, 1, 16), torch.randn(rows, 2, 1, 16), 0)
    return keys


@pytest.mark.parametrize(
    "spec, short, long",
    [("int4:residual_length=16", (200, 1), (4200, 2)), ("int8", (8000, 1), (8192, 1))],
)  # fmt: skip
def test_off_cuda_the_storage_is_handed_over_from_the_measured_length(monkeypatch, spec, short, long):
    monkeypatch.setattr(_common, "CPU_HANDLES", "auto")
    monkeypatch.setattr(cpu_native, "NATIVE_CPU", "never")  # KIVI's codes then read by the torch decode
    assert isinstance(_step(spec, *short), torch.Tensor)  # below the layer's CPU_HANDLE_TOKENS: sdpa's path
    assert isinstance(_step(spec, *long), KVHandle)


@pytest.mark.parametrize("spec", ["int4:residual_length=16", "int3:residual_length=16", "int2:residual_length=16"])
def test_codes_the_cpu_kernel_decodes_keep_sdpas_path_at_any_length(native_cpu, monkeypatch, spec):
    monkeypatch.setattr(_common, "CPU_HANDLES", "auto")
    assert isinstance(_step(spec, 4200, 2), torch.Tensor)
    assert isinstance(_step("int3:residual_length=16:codebook=lloyd", 4200, 2), KVHandle)  # a codebook: torch's


@pytest.mark.parametrize("spec", ["sink:window=64:sinks=4", "paged", "paged:bits=8"])
def test_windows_and_pages_keep_sdpas_path_off_cuda_and_the_choice_can_be_forced(monkeypatch, spec):
    monkeypatch.setattr(_common, "CPU_HANDLES", "auto")
    assert isinstance(_step(spec, 5000, 4), torch.Tensor)
    monkeypatch.setattr(_common, "CPU_HANDLES", "always")
    assert isinstance(_step(spec, 100), KVHandle)
    assert isinstance(_step("int8", 10), KVHandle)
    monkeypatch.setattr(_common, "CPU_HANDLES", "never")
    assert isinstance(_step("int8", 9000, 2), torch.Tensor)
    monkeypatch.setattr(_common, "CPU_HANDLES", "sometimes")
    with pytest.raises(ValueError, match="HF_KVCACHE_CPU_HANDLES must be one of auto, always, never, got 'sometimes'"):
        _step("int8", 10)

"""The differences from transformers' built-in caches that the docs claim, asserted live.

Each test pins one row of ``benchmarks/compare_builtin.py``'s table: what transformers' ``QuantizedCache`` (quanto,
hqq, fp8), ``SinkCache`` and ``PagedAttentionCache`` do today, next to what our caches do. When a transformers release
fixes or changes one of these, the test fails and the comparison page needs updating. Where the built-in works (beam
search, sampling, continuation, continuous batching), the test asserts that too, so the page cannot claim otherwise.
"""

from __future__ import annotations

import copy

import pytest
import torch
import transformers
from models import FAMILIES, PAD, prompt, tiny_model
from transformers import AutoModelForCausalLM, DynamicCache, QuantizedCache
from transformers.cache_utils import Cache

from hf_kvcache import PagedKVCache, QuantizedKVCache, SlidingWindowKVCache
from hf_kvcache._compat import with_cache

# The observations are the ones benchmarks/compare_builtin.py prints, so the table and these assertions cannot differ.
from hf_kvcache.tools.peers import count_quantized, crop_observables, random_kv, row0_error

GROUP, RESIDUAL = 16, 16  # head_dim 16: one group spans a head; the residual fills several times in 64 tokens
NEW = 24
MODULES = {"quanto": "optimum.quanto", "hqq": "hqq", "fp8": None}  # fp8 needs no extra package
GROUPED = ("quanto", "hqq")  # the backends built on QuantizedLayer (residual + group-wise re-quantization)


def builtin(backend: str, model, nbits: int = 4) -> QuantizedCache:
    """transformers' QuantizedCache; skips when the backend's package is missing."""
    if MODULES[backend]:
        pytest.importorskip(MODULES[backend])
    if backend == "fp8":  # per-tensor, takes no group-wise options
        return QuantizedCache(backend="fp8", config=model.config)
    return QuantizedCache(
        backend=backend, config=model.config, nbits=nbits, q_group_size=GROUP, residual_length=RESIDUAL
    )


def ours(kind: str, model) -> QuantizedKVCache:
    if kind == "int4":
        return QuantizedKVCache(model, bits=4, group_size=GROUP, residual_length=RESIDUAL)
    return QuantizedKVCache(model, bits=8)


def generate(model, inputs, cache, new_tokens: int = NEW, **kwargs) -> torch.Tensor:
    kwargs.setdefault("do_sample", False)
    with torch.inference_mode():
        return model.generate(**inputs, past_key_values=cache, max_new_tokens=new_tokens, **kwargs)


def reference(model, inputs, new_tokens: int = NEW, **kwargs) -> torch.Tensor:
    return generate(model, inputs, DynamicCache(config=model.config), new_tokens, **kwargs)


def repetitive_prompt() -> dict[str, torch.Tensor]:
    """A prompt that repeats itself, so prompt lookup proposes candidates and some get rejected (a crop)."""
    ids = prompt("single", length=6)["input_ids"].repeat(1, 3)
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}


# -- hybrid models ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("backend", MODULES)
@pytest.mark.parametrize("family", ["gemma3", "mistral"])
def test_builtin_refuses_models_with_sliding_layers(family, backend):
    with pytest.raises(ValueError, match="only supported for models with only full attention layers"):
        builtin(backend, tiny_model(family))


@pytest.mark.parametrize("family", ["gemma3", "mistral"])
def test_ours_generates_on_models_with_sliding_layers(family):
    model, inputs = tiny_model(family), prompt("single")
    ref = reference(model, inputs, 40)
    assert torch.equal(generate(model, inputs, ours("int8", model), 40), ref)
    assert generate(model, inputs, ours("int4", model), 40).shape == ref.shape  # 4-bit rounding may change tokens


# -- crop: prompt lookup, assisted decoding ---------------------------------------------------------------------------

SPECULATIVE = {
    "prompt_lookup": lambda: {"prompt_lookup_num_tokens": 3},
    "assisted": lambda: {"assistant_model": tiny_model("llama", seed=1)},
}


@pytest.mark.parametrize("backend", MODULES)
@pytest.mark.parametrize("mode", SPECULATIVE)
def test_builtin_breaks_speculative_decoding_in_crop(mode, backend):
    """transformers 5.23 lets speculative decoding crop a quantized cache and fails inside ``crop``; 5.24 asks the
    cache first (``is_croppable``, False for its quantized layers) and refuses before the first draft."""
    model = tiny_model("llama")
    probe = builtin(backend, model)
    with torch.no_grad():
        model(**repetitive_prompt(), **with_cache(model, probe))
    if not probe.is_croppable:
        with pytest.raises(ValueError, match="requires a cache that can be cropped"):
            generate(model, repetitive_prompt(), builtin(backend, model), **SPECULATIVE[mode]())
        return
    with pytest.raises(IndexError, match="too many indices") as info:
        generate(model, repetitive_prompt(), builtin(backend, model), **SPECULATIVE[mode]())
    assert info.traceback[-1].name == "crop"  # rejected candidates: DynamicLayer.crop on an empty residual


@pytest.mark.parametrize("kind", ["int4", "int8"])
@pytest.mark.parametrize("mode", SPECULATIVE)
def test_ours_speculative_decoding_equals_dynamic_cache(mode, kind):
    model, inputs = tiny_model("llama"), repetitive_prompt()
    cache, crops = ours(kind, model), []
    crop = cache.crop
    cache.crop = lambda n: crops.append(n) or crop(n)
    assert torch.equal(generate(model, inputs, cache, **SPECULATIVE[mode]()), reference(model, inputs))
    assert any(crops), "no candidate was rejected, so crop() was not exercised"


def _crop_observables(cache: Cache) -> tuple[int, int, int, int]:
    """(length before crop, after, next mask's kv length, keys returned): see compare_builtin.crop_observables."""
    return crop_observables(cache, *random_kv(tiny_model("llama"), 24))


@pytest.mark.parametrize("backend", GROUPED)
def test_builtin_crop_with_a_residual_leaves_the_length_stale(backend):
    model = tiny_model("llama")
    assert _crop_observables(DynamicCache(config=model.config)) == (23, 21, 22, 22)
    # Only the full-precision residual is cut; cumulative_length still counts the removed tokens, so the next
    # step's mask is built for 24 keys while update returns 22.
    assert _crop_observables(builtin(backend, model)) == (23, 23, 24, 22)


def test_builtin_fp8_crop_raises():
    with pytest.raises(IndexError, match="too many indices"):
        _crop_observables(builtin("fp8", tiny_model("llama")))


@pytest.mark.parametrize("kind", ["int4", "int8"])
def test_ours_crop_equals_dynamic_cache(kind):
    assert _crop_observables(ours(kind, tiny_model("llama"))) == (23, 21, 22, 22)


# -- beam search, sampling, continuation: the built-in works ----------------------------------------------------------


@pytest.mark.parametrize("backend", GROUPED)
def test_builtin_beam_search_bookkeeping_is_exact(backend):
    """With rounding taken out (identity quantizer), the built-in's beam search equals DynamicCache's: its deferred
    reordering is right, and any difference with quantization on is rounding error."""
    model, inputs = tiny_model("llama"), prompt("padded")
    cache = builtin(backend, model)
    for layer in cache.layers:
        layer._quantize = lambda tensor, *args, **kwargs: tensor.clone()
        layer._dequantize = lambda stored: stored
    assert torch.equal(generate(model, inputs, cache, num_beams=3), reference(model, inputs, num_beams=3))


@pytest.mark.parametrize("backend", MODULES)
def test_builtin_runs_beam_search_sampling_and_continuation(backend):
    model, inputs = tiny_model("llama"), prompt("padded")
    assert generate(model, inputs, builtin(backend, model), num_beams=3).shape == (2, 12 + NEW)
    out = generate(model, inputs, builtin(backend, model), do_sample=True, num_return_sequences=3)
    assert out.shape == (6, 12 + NEW)
    cache, single = builtin(backend, model), prompt("single")
    first = generate(model, single, cache, 12)
    second = generate(model, {"input_ids": first, "attention_mask": torch.ones_like(first)}, cache, 12)
    assert second.shape == (1, 36) and cache.get_seq_length() == 35


@pytest.mark.parametrize("kind", ["int4", "int8"])
def test_ours_beam_search_sampling_and_continuation_equal_dynamic_cache(kind):
    model, inputs = tiny_model("llama"), prompt("padded")
    assert torch.equal(generate(model, inputs, ours(kind, model), num_beams=3), reference(model, inputs, num_beams=3))
    sampling = dict(do_sample=True, num_return_sequences=3)
    torch.manual_seed(0)
    ref = reference(model, inputs, **sampling)
    torch.manual_seed(0)
    assert torch.equal(generate(model, inputs, ours(kind, model), **sampling), ref)
    cache, single = ours(kind, model), prompt("single")
    first = generate(model, single, cache, 12)
    second = generate(model, {"input_ids": first, "attention_mask": torch.ones_like(first)}, cache, 12)
    assert torch.equal(second, reference(model, single))


# -- what gets quantized, and how often -------------------------------------------------------------------------------


@pytest.mark.parametrize("backend", GROUPED)
def test_builtin_re_quantizes_the_whole_history_each_time_the_residual_fills(backend):
    model = tiny_model("llama")
    cache = builtin(backend, model)
    calls = count_quantized(cache)
    generate(model, prompt("single"), cache, 64)  # 12-token prompt
    assert cache.get_seq_length() == 12 + 63
    # Prefill quantizes the prompt; then every RESIDUAL-th decode step re-quantizes everything from token 0.
    assert calls == [(0, 12)] + [(0, 12 + RESIDUAL * i) for i in range(1, 63 // RESIDUAL + 1)]
    assert sum(n for _, n in calls) == 144  # token quantizations, for 75 tokens cached


def test_builtin_fp8_quantizes_each_token_once():
    """The fp8 backend appends with a frozen per-tensor scale: no residual, no re-quantization."""
    model = tiny_model("llama")
    cache = builtin("fp8", model)
    calls = count_quantized(cache)
    generate(model, prompt("single"), cache, 64)
    assert calls == [(0, 12)] + [(t, 1) for t in range(12, 75)]


@pytest.mark.parametrize("kind", ["int4", "int8"])
def test_ours_quantizes_each_token_once(kind):
    model = tiny_model("llama")
    cache = ours(kind, model)
    calls = count_quantized(cache)
    generate(model, prompt("single"), cache, 64)
    layer = cache.layers[0]
    starts = [start for start, _ in calls]
    assert starts == sorted(set(starts)) and starts[0] == 0  # in order, never from the start again
    assert sum(n for _, n in calls) == layer.quantized_tokens
    assert layer.quantized_tokens + layer.residual.length == cache.get_seq_length() == 75


def _prefill(cache, model):
    with torch.inference_mode():
        model(**prompt("single"), past_key_values=cache, use_cache=True)  # 12 tokens, fewer than the residual of 16
    return cache.layers[0]


@pytest.mark.parametrize("backend", MODULES)
def test_builtin_quantizes_the_whole_prompt_at_prefill(backend):
    model = tiny_model("llama")
    layer = _prefill(builtin(backend, model), model)
    assert layer.keys.numel() == 0  # no full-precision residual: all 12 prompt tokens went through the quantizer


def test_ours_keeps_the_prompt_tail_in_full_precision():
    model = tiny_model("llama")
    layer = _prefill(ours("int4", model), model)
    assert layer.residual.length == 12 and layer.quantized_tokens == 0


# hqq: its optimizer stops on an error taken over the whole tensor; fp8: one scale for the whole tensor.
@pytest.mark.parametrize(("backend", "depends"), [("quanto", False), ("hqq", True), ("fp8", True)])
def test_builtin_row_depends_on_the_other_rows_with_hqq_and_fp8(backend, depends):
    """A row's cached keys should not depend on what else is in the batch (beams, other prompts)."""
    model = tiny_model("llama")
    error = row0_error(lambda m: builtin(backend, m), model)
    assert error > 0.05 if depends else error == 0


@pytest.mark.parametrize("kind", ["int4", "int8"])
def test_ours_row_does_not_depend_on_the_other_rows(kind):
    model = tiny_model("llama")
    assert row0_error(lambda m: ours(kind, m), model) == 0


# -- attention sinks, paged -------------------------------------------------------------------------------------------


def test_sink_cache_is_gone_from_transformers_ours_keeps_sinks_and_window():
    assert not hasattr(transformers, "SinkCache")
    assert not hasattr(transformers.cache_utils, "SinkCache")
    model, inputs = tiny_model("llama"), prompt("single")
    with pytest.raises(ValueError, match="Invalid `cache_implementation` \\(sink\\)"):
        generate(model, inputs, None, 4, cache_implementation="sink")
    cache = SlidingWindowKVCache(model, window=16, sinks=4)
    assert generate(model, inputs, cache, 64).shape == (1, 76)
    assert cache.get_seq_length() == 75 and cache.layers[0].stored_tokens == 4 + 16


def _cb_config():
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    return ContinuousBatchingConfig(
        page_size=16, num_blocks=16, max_batch_tokens=64, max_memory_percent=0.1, use_cuda_graph=False
    )


def test_builtin_paged_cache_is_not_a_cache_for_generate_ours_is():
    from transformers.generation.continuous_batching.cache import PagedAttentionCache
    from transformers.generation.continuous_batching.distributed import DistributedHelper

    assert not issubclass(PagedAttentionCache, Cache)
    model, inputs = tiny_model("llama"), prompt("padded")
    paged = PagedAttentionCache(model.config, _cb_config(), "cpu", DistributedHelper(None, None), dtype=torch.float32)
    with pytest.raises(AttributeError, match="is_compileable"):
        generate(model, inputs, paged, 4)
    ours_paged = PagedKVCache(model, block_size=4)
    assert isinstance(ours_paged, Cache)
    assert torch.equal(generate(model, inputs, ours_paged), reference(model, inputs))


def test_builtin_paged_cache_works_through_generate_batch():
    torch.manual_seed(0)  # the same weights as tiny_model("llama"), in a model of its own: generate_batch edits state
    model = AutoModelForCausalLM.from_config(FAMILIES["llama"](), attn_implementation="sdpa").eval()
    model.generation_config.pad_token_id, model.generation_config.eos_token_id = PAD, None
    inputs = prompt("single")
    gen_config = copy.deepcopy(model.generation_config)
    gen_config.max_new_tokens, gen_config.do_sample = 8, False
    out = model.generate_batch(
        [inputs["input_ids"][0].tolist()], generation_config=gen_config, continuous_batching_config=_cb_config()
    )
    tokens = next(iter(out.values())).generated_tokens
    assert tokens == reference(model, inputs, 8)[0, 12:].tolist()

"""Model families beyond the shared matrix: each cache kind either works (lossless kinds exactly, lossy ones within
the matrix's bounds, evicting windows without a shape error) or is refused at construction with a ValueError that
names the model type and the reason. Never a shape error mid-generation, never a silently dropped option."""

from __future__ import annotations

import warnings

import pytest
import torch
from models import EXTRA_FAMILIES, VOCAB, extra_model, prompt, tiny_model
from transformers import AutoModelForCausalLM, DynamicCache

from hf_kvcache import PagedKVCache, QuantizedKVCache, SlidingWindowKVCache, make_cache
from hf_kvcache.rope import rerotate

NEW_TOKENS = 10
ALIBI = ("falcon_alibi", "bloom")
LATENT = ("deepseek_v3", "deepseek_v2")

# (spec, lossless, logit bound): the matrix's cases, with windows that evict within the test for the sink kinds.
KINDS = [
    ("int8", False, 0.06),
    ("int4:group_size=4:residual_length=2", False, 0.35),
    ("sink:window=256:sinks=4", True, 0.0),  # larger than the text: nothing evicted, must be exact
    ("sink:window=6:sinks=2", None, None),  # evicts: must run; exactness of eviction is tested in test_sliding_cache
    ("sink:window=6:sinks=2:rerotate=false", None, None),
    ("paged:block_size=4", True, 0.0),
]


def _refusal(family: str, spec: str) -> str | None:
    """The ValueError text a combination must raise, or None if it must work."""
    if spec.startswith("sink") and family in ALIBI:
        return "ALiBi"
    if spec.startswith("sink") and family in LATENT and "rerotate=false" not in spec:
        return "rerotate=False"
    return None


def _generate(model, cache, batch):
    return model.generate(
        **prompt(batch),
        past_key_values=cache,
        max_new_tokens=NEW_TOKENS,
        min_new_tokens=NEW_TOKENS,
        do_sample=False,
        output_logits=True,
        return_dict_in_generate=True,
    )


@pytest.mark.slow  # breadth over more families: the full run (the matrix's own families are in the fast tier)
@pytest.mark.parametrize("batch", ["single", "padded"])
@pytest.mark.parametrize("spec, lossless, bound", KINDS, ids=[k[0] for k in KINDS])
@pytest.mark.parametrize("family", list(EXTRA_FAMILIES))
def test_extra_family_works_or_is_refused_by_name(family, spec, lossless, bound, batch):
    model = extra_model(family)
    refusal = _refusal(family, spec)
    if refusal:
        with pytest.raises(ValueError, match=rf"model_type '\w+'.*{refusal}"):
            make_cache(spec, model)
        return
    ref = _generate(model, DynamicCache(config=model.config), batch)
    out = _generate(model, make_cache(spec, model), batch)
    assert out.sequences.shape == ref.sequences.shape
    if lossless:
        torch.testing.assert_close(out.sequences, ref.sequences, rtol=0, atol=0)
        for got, want in zip(out.logits, ref.logits):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    elif bound is not None:
        # Teacher-forced prefix: logits agree within the bound while the sequences agree.
        diff = (out.sequences != ref.sequences).any(0).nonzero()
        prompt_len = ref.sequences.shape[1] - NEW_TOKENS
        last = int(diff[0]) - prompt_len if len(diff) else NEW_TOKENS - 1
        for step in range(last + 1):
            error = (out.logits[step] - ref.logits[step]).abs().amax(-1)
            assert (error <= bound * ref.logits[step].std(-1)).all(), f"step {step}: logit error {error.tolist()}"


def _keys_at(model, ids, offset, layer_idx):
    """Layer ``layer_idx``'s cached keys for ``ids`` placed at positions ``offset .. offset + n - 1``."""
    cache = DynamicCache(config=model.config)
    positions = torch.arange(ids.shape[1]).unsqueeze(0) + offset
    with torch.no_grad():
        model(input_ids=ids, position_ids=positions, past_key_values=cache)
    return cache.layers[layer_idx].keys


ROTARY = ["gptj", "codegen", "gemma2", "gpt_oss", "smollm3"]


@pytest.mark.parametrize("family", ROTARY)
def test_sink_rerotation_equals_the_model_rotating_at_the_shifted_position(family):
    """The rotation read from each model (its rotary module, or GPT-J / CodeGen's sinusoidal table) moves a cached
    key to the key the model itself computes ``delta`` positions later."""
    model = extra_model(family)
    cache = SlidingWindowKVCache(model, window=4, sinks=2)
    assert cache.rotary is not None, "rerotate=True must find the model's rotation, never drop it silently"
    full = [i for i, s in enumerate(cache.layer_specs) if s.layer_type == "full_attention" and s.uses_rope][0]
    ids = torch.randint(3, 100, (1, 6), generator=torch.Generator().manual_seed(0))
    for delta in (1, 37):
        moved = rerotate(_keys_at(model, ids, 0, full), delta, cache.rotary)
        torch.testing.assert_close(moved, _keys_at(model, ids, delta, full), rtol=1e-4, atol=1e-5)


def test_config_only_gptj_rotation_matches_the_model_table():
    model = extra_model("gptj")
    from_config = SlidingWindowKVCache(model.config, window=4, sinks=2).rotary
    from_model = SlidingWindowKVCache(model, window=4, sinks=2).rotary
    assert from_config.rotary_dim == from_model.rotary_dim == 8 and from_config.interleaved
    torch.testing.assert_close(from_config.inv_freq, from_model.inv_freq)


def test_nope_layers_are_not_rerotated():
    """SmolLM3's NoPE layers carry no rotation: an all-NoPE model scores the same with and without re-rotation."""
    model = extra_model("smollm3_nope")
    outs = [
        _generate(model, SlidingWindowKVCache(model, window=6, sinks=2, rerotate=flag), "single")
        for flag in (True, False)
    ]
    torch.testing.assert_close(outs[0].sequences, outs[1].sequences, rtol=0, atol=0)
    for a, b in zip(outs[0].logits, outs[1].logits):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    mixed = SlidingWindowKVCache(extra_model("smollm3"), window=6, sinks=2)
    assert [layer.rotary is not None for layer in mixed.layers] == [True, False, True]


def test_llama4_full_layers_are_nope_and_need_no_rotation():
    cache = SlidingWindowKVCache(extra_model("llama4"), window=6, sinks=2)
    assert cache.rotary is None  # its full-attention layers are the NoPE ones; chunked layers keep their own window


def test_latent_attention_widths_come_from_the_config():
    model = extra_model("deepseek_v3")
    cache = QuantizedKVCache(model)
    spec = cache.layer_specs[0]
    assert (spec.num_kv_heads, spec.key_dim, spec.value_dim) == (1, 32, 8)
    from hf_kvcache import dynamic_bytes_per_token

    with torch.no_grad():
        paged, dynamic = PagedKVCache(model), DynamicCache(config=model.config)
        for c in (paged, dynamic):
            model(**prompt("single"), past_key_values=c)
    assert dynamic_bytes_per_token(model.config, torch.float32) * 12 == sum(
        layer.keys.nbytes + layer.values.nbytes for layer in dynamic.layers
    )


def test_a_model_that_passes_other_widths_than_its_config_is_a_clear_error():
    cache = QuantizedKVCache(tiny_model("llama").config)
    with pytest.raises(ValueError, match=r"built from a config whose layer passes keys \(B, 2, T, 16\)"):
        cache.update(torch.randn(1, 2, 3, 8), torch.randn(1, 2, 3, 8), 0)


@pytest.mark.parametrize(
    "spec", ["int8", "int4:group_size=8:residual_length=4", "sink:window=64:sinks=2", "paged:block_size=4"]
)
@pytest.mark.parametrize("indices", [(0, 2), [2], torch.tensor([1, 2]), torch.tensor([True, False, True])])
def test_batch_select_indices_accepts_what_dynamic_cache_accepts(spec, indices):
    model = tiny_model("llama")
    ids = torch.randint(3, 100, (3, 12), generator=torch.Generator().manual_seed(0))
    nxt = torch.randint(3, 100, (3, 1), generator=torch.Generator().manual_seed(1))
    logits = []
    for cache in (DynamicCache(config=model.config), make_cache(spec, model)):
        with torch.no_grad():
            model(input_ids=ids, past_key_values=cache)
            cache.batch_select_indices(indices)
            keep = torch.as_tensor(indices)
            keep = keep.nonzero().flatten() if keep.dtype == torch.bool else keep
            logits.append(model(input_ids=nxt[keep], past_key_values=cache).logits)
    tolerance = {"int8": 0.06, "int4": 0.25}.get(spec[:4], 1e-5 / logits[0].std()) * logits[0].std()
    assert (logits[1] - logits[0]).abs().max() <= tolerance


@pytest.mark.parametrize("family", ["gemma2", "gpt_oss"])
@pytest.mark.parametrize("spec", ["dynamic", "int8", "sink:window=256:sinks=4", "paged:block_size=4"])
def test_softcap_and_learned_sinks_are_honoured_under_hf_kvcache(family, spec):
    """Gemma 2's logit softcapping and GPT-OSS's learned attention sinks (``s_aux``) under the hf_kvcache attention
    equal eager attention (which implements both), whether a layer hands over storage or plain tensors."""
    eager, ours = extra_model(family, "eager"), extra_model(family, "hf_kvcache")
    ref = _generate(eager, make_cache(spec, eager), "padded")
    out = _generate(ours, make_cache(spec, ours), "padded")
    torch.testing.assert_close(out.sequences, ref.sequences, rtol=0, atol=0)
    for got, want in zip(out.logits, ref.logits):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("family, attribute", [("gemma2", "attn_logit_softcapping"), ("gpt_oss", "sinks")])
def test_softcap_and_sinks_change_the_outputs_of_these_models(family, attribute):
    """The previous test can fail: without softcapping / with the sinks zeroed the model scores differently."""
    import copy

    model = extra_model(family, "eager")
    other = copy.deepcopy(model)
    if attribute == "sinks":
        for module in other.modules():
            if hasattr(module, "sinks"):
                module.sinks.data.fill_(-1e4)
    else:
        other.config.attn_logit_softcapping = None
        for module in other.modules():
            if hasattr(module, "attn_logit_softcapping"):
                module.attn_logit_softcapping = None
    ids = prompt("single")["input_ids"]
    with torch.no_grad():
        assert (model(ids).logits - other(ids).logits).abs().max() > 1e-3


@pytest.mark.parametrize(
    "family,spec",
    # (the sliding cache refuses BLOOM for its ALiBi biases before it looks at the attention)
    [("bloom", "int8"), ("bloom", "paged:block_size=4"), ("codegen", "int4"), ("codegen", "sink:window=8:sinks=2")],
)
def test_hf_kvcache_attention_is_refused_where_the_model_bypasses_attention_interface(family, spec):
    """BLOOM and CodeGen run their own attention code (``_supports_attention_backend = False``): loaded with the
    ``hf_kvcache`` attention (transformers accepts it), they would be handed a storage handle they cannot read.
    Every cache built from such a model refuses it in one line; under eager the same model is served. CodeGen calls
    the AttentionInterface since transformers 5.24: there the hf_kvcache attention serves it, as eager does."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        # its own model (extra_model's are shared): the refusal branch below switches its attention
        model = extra_model.__wrapped__(family, "hf_kvcache")
    assert model.config._attn_implementation == "hf_kvcache"
    if getattr(type(model), "_supports_attention_backend", False):
        out = _generate(model, make_cache(spec, model), "padded")
        eager = extra_model(family, "eager")  # the same seed: the same weights
        ref = _generate(eager, make_cache(spec, eager), "padded")
        torch.testing.assert_close(out.sequences, ref.sequences, rtol=0, atol=0)
        for got, want in zip(out.logits, ref.logits):
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
        return
    with pytest.raises(ValueError, match=rf"model_type '{family}'.*AttentionInterface.*'sdpa' or 'eager'") as err:
        make_cache(spec, model)
    assert "\n" not in str(err.value)
    model.config._attn_implementation = "eager"  # what loading it with attn_implementation="eager" gives
    cache = make_cache(spec, model)
    with torch.no_grad():
        model(torch.randint(3, 100, (1, 6)), past_key_values=cache)
        model(torch.randint(3, 100, (1, 1)), past_key_values=cache)


def test_a_model_that_works_on_the_cached_values_itself_is_refused_by_name_under_hf_kvcache():
    """DiffLlama splits the values it gets back from the cache before calling attention: under the hf_kvcache
    attention it would be handed our storage handle. A one-line ValueError naming the model type, never a TypeError
    from inside the model; with sdpa the same cache serves it."""
    from transformers import DiffLlamaConfig

    config = DiffLlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, pad_token_id=0,
    )  # fmt: skip
    for attn, refused in (("hf_kvcache", True), ("sdpa", False)):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config, attn_implementation=attn).eval()
        model.generation_config.pad_token_id, model.generation_config.eos_token_id = 0, None
        run = lambda: _generate(model, make_cache("int8", model), "padded")  # noqa: E731
        if refused:
            with pytest.raises(ValueError, match=r"^model_type 'diffllama' works on the cached keys or values") as err:
                run()
            assert "\n" not in str(err.value)
        else:
            run()


def test_paged_materialized_keys_are_contiguous_like_dynamic_caches():
    """GPT-NeoX-Japanese .view()s the keys it gets back; DynamicCache's are contiguous and so are the paged ones."""
    model = tiny_model("llama")
    cache = PagedKVCache(model, block_size=4)
    with torch.no_grad():
        model(**prompt("padded"), past_key_values=cache)
    keys, values = cache.layers[0].update(torch.randn(2, 2, 1, 16), torch.randn(2, 2, 1, 16))
    assert keys.is_contiguous() and values.is_contiguous()


def test_models_without_a_kv_cache_are_refused_by_name():
    """RWKV keeps a recurrent state (its config names no attention heads); OpenAI GPT takes no past_key_values."""
    from transformers import OpenAIGPTConfig, OpenAIGPTLMHeadModel, RwkvConfig

    with pytest.raises(ValueError, match=r"model_type 'rwkv'.*no attention heads"):
        make_cache("int8", RwkvConfig(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2))
    model = OpenAIGPTLMHeadModel(OpenAIGPTConfig(vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4))
    for spec in ("int8", "paged", "sink:window=64"):
        with pytest.raises(ValueError, match=r"model_type 'openai-gpt'\) takes no cache argument"):
            make_cache(spec, model)


def test_caches_size_each_layer_from_what_its_attention_module_projects():
    """MiMo-V2-Flash's modeling file doubles the KV heads of its sliding layers, which its config does not say: the
    caches read the attention modules (k_proj / v_proj and head_dim) and serve it, lossless ones exactly, and the
    plan counts what a DynamicCache holds. Built from the config alone, the first forward is refused by name."""
    from transformers import MiMoV2FlashConfig

    from hf_kvcache.plan import kv_bytes

    config = MiMoV2FlashConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, v_head_dim=16, layer_types=["full_attention", "sliding_attention"],
        mlp_layer_types=["dense", "dense"], sliding_window=8, pad_token_id=0,
    )  # fmt: skip
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval()
    model.generation_config.pad_token_id, model.generation_config.eos_token_id = 0, None
    paged = make_cache("paged:block_size=4", model)
    assert [s.num_kv_heads for s in paged.layer_specs] == [2, 4]
    ref, out = _generate(model, DynamicCache(config=config), "padded"), _generate(model, paged, "padded")
    torch.testing.assert_close(out.sequences, ref.sequences, rtol=0, atol=0)
    dynamic = DynamicCache(config=config)
    with torch.no_grad():
        model(**prompt("padded"), past_key_values=dynamic)
    held = sum(layer.keys.nbytes + layer.values.nbytes for layer in dynamic.layers)
    assert kv_bytes("dynamic", model, tokens=12, batch=2, dtype=torch.float32) == held
    built = r"layer 1 \(model_type 'mimo_v2_flash'\) was built from a config.*from the model itself \(make_cache"
    with pytest.raises(ValueError, match=built):
        _generate(model, make_cache("int8", config), "padded")

"""Hybrid models (attention layers beside Mamba, gated DeltaNet or convolution layers, MLP-only blocks, and layers
holding both a Mamba state and attention): every cache keeps the recurrent states as transformers does and its own
kind of storage for the attention, so lossless caches reproduce DynamicCache exactly and lossy ones stay within
their stated bounds, under every attention implementation, batch shape and the generate() modes transformers allows
such models; the lifecycle contract holds on the recurrent layers too; one prefill hands its recurrent states to
every cache; memory reports and plans count what the caches hold."""

from __future__ import annotations

import pytest
import torch
from models import (
    PAD,
    VOCAB,
    assert_generation_matches,
    config_model,
    generate,
    handed_prefill_continues_alike,
    prefilled,
)
from models import prompt as _prompt
from transformers import AutoModelForCausalLM, DynamicCache
from transformers.cache_utils import LinearAttentionCacheLayerMixin

from hf_kvcache import QuantizedKVCache, make_cache
from hf_kvcache.compare import LOGIT_BOUNDS
from hf_kvcache.layers.state import AttentionWithStates, EmptyLayer, StateLayer
from hf_kvcache.memory import recurrent_state_bytes
from hf_kvcache.plan import kv_bytes, plan_memory, state_bytes
from hf_kvcache.tools.supported_models import tiny_config

# Gated DeltaNet + attention with partial RoPE (Qwen3-Next), Mamba + MoE + attention without RoPE (Jamba),
# convolutions + attention (LFM2), Mamba + MLP-only blocks + attention (Nemotron-H), Mamba and attention in the same
# layers (Falcon-H1: transformers' "hybrid" layer type).
FAMILIES = ("qwen3_next", "jamba", "lfm2_moe", "nemotron_h", "falcon_h1")
ATTENTION = ("eager", "sdpa", "hf_kvcache")
NEW = 8
# spec, lossless, logit bound (lossy): small residuals and groups so that tokens really are quantized.
CASES = {
    "paged": ("paged:block_size=4", True, 0.0),
    "sink": ("sink:window=256:sinks=4", True, 0.0),  # nothing evicted: DynamicCache exactly
    "int8": ("int8", False, LOGIT_BOUNDS["int8"]),
    "int4": ("int4:residual_length=2:group_size=8", False, LOGIT_BOUNDS["int4"]),
    "int2": ("int2:residual_length=2:group_size=8", False, LOGIT_BOUNDS["int2"]),
    "paged-int8": ("paged:block_size=4:bits=8", False, LOGIT_BOUNDS["int8"]),
}


def _model(family: str, attn: str):
    return config_model(family, attn)


def _generate(model, cache, inputs, **kwargs):
    return generate(model, cache, inputs, NEW, **kwargs)


@torch.no_grad()
def _teacher_forced(model, cache, ids: torch.Tensor, prefill: int = 8) -> torch.Tensor:
    logits = [model(ids[:, :prefill], past_key_values=cache).logits[:, -1]]
    for t in range(prefill, ids.shape[1]):
        logits.append(model(ids[:, t : t + 1], past_key_values=cache).logits[:, -1])
    return torch.stack(logits, 1)


def _params():
    for family in FAMILIES:
        for name in CASES:
            for attn in ATTENTION:
                for batch in ("single", "padded"):
                    fast = attn == "sdpa" and batch == "padded" and (family == FAMILIES[0] or name in ("paged", "int8"))
                    marks = () if fast else (pytest.mark.slow,)
                    yield pytest.param(family, name, attn, batch, id=f"{family}-{name}-{attn}-{batch}", marks=marks)


@pytest.mark.parametrize("family, name, attn, batch", list(_params()))
def test_greedy_matches_dynamic_cache(family, name, attn, batch):
    """Lossless caches: DynamicCache's tokens and logits. Lossy: every step's logits within the kind's bound until
    the first token that differs (the matrix's rule)."""
    spec, lossless, bound = CASES[name]
    model = _model(family, attn)
    inputs = _prompt(batch)
    ref = _generate(_model(family, "sdpa"), DynamicCache(config=model.config), inputs)
    cache = make_cache(spec, model)
    out = _generate(model, cache, inputs)
    assert any(isinstance(layer, StateLayer) for layer in cache.layers)  # AttentionWithStates is one too
    assert_generation_matches(out, ref, lossless, bound)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("name", [n for n, (_, lossless, _) in CASES.items() if not lossless])
def test_teacher_forced_error_within_bound(family, name):
    """40 tokens, one decode step at a time after an 8-token prefill, against DynamicCache."""
    spec, _, bound = CASES[name]
    model = _model(family, "sdpa")
    ids = torch.randint(3, VOCAB, (1, 40), generator=torch.Generator().manual_seed(3))
    ref = _teacher_forced(model, DynamicCache(config=model.config), ids)
    got = _teacher_forced(model, make_cache(spec, model), ids)
    assert float((got - ref).abs().max() / ref.std()) <= bound


# Speculative modes (assisted, prompt lookup) are refused by transformers itself for stateful models.
MODES = {
    "beam": dict(num_beams=3),
    "beam-nrs": dict(num_beams=3, num_return_sequences=2),
    "sample-nrs": dict(do_sample=True, num_return_sequences=2),
}


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", ["paged", "sink"])
def test_generate_modes_match_dynamic_cache(name, mode):
    """Beam search reorders the recurrent states with the attention layers' storage, sampling repeats them per
    sequence: tokens as DynamicCache's."""
    model = _model(FAMILIES[0], "sdpa")
    ref = _generate(model, DynamicCache(config=model.config), _prompt("padded"), **MODES[mode])
    out = _generate(model, make_cache(CASES[name][0], model), _prompt("padded"), **MODES[mode])
    torch.testing.assert_close(out.sequences, ref.sequences, rtol=0, atol=0)


def test_evicting_window_bounds_attention_and_keeps_recurrent_states():
    """A window that evicts keeps its attention layers to ``sinks + window`` tokens while the recurrent layers keep
    summarizing every token (their states do not grow)."""
    model = _model("qwen3_next", "sdpa")
    cache = make_cache("sink:window=6:sinks=2", model)
    out = _generate(model, cache, _prompt("padded"))
    assert out.sequences.shape[1] == 12 + NEW
    assert cache.stored_tokens == 8
    assert cache.get_seq_length() == 12 + NEW - 1
    states = [layer for layer in cache.layers if isinstance(layer, StateLayer)]
    assert states and all(layer.nbytes > 0 and layer.stored_tokens == 0 for layer in states)


@pytest.mark.parametrize("name", ["int8", "paged"])
def test_recurrent_layer_refuses_another_batch_until_reset(name):
    model = _model("qwen3_next", "sdpa")
    cache = make_cache(CASES[name][0], model)
    _generate(model, cache, _prompt("single"))
    with pytest.raises(ValueError, match=r"layer \d+ \(linear_attention\) holds .* batch 1"):
        _generate(model, cache, _prompt("padded"))
    cache.reset()
    assert cache.nbytes == 0
    again = _generate(model, cache, _prompt("padded"))
    fresh = _generate(model, make_cache(CASES[name][0], model), _prompt("padded"))
    torch.testing.assert_close(again.sequences, fresh.sequences, rtol=0, atol=0)


@pytest.mark.parametrize("family", (*FAMILIES, "inkling_text"))
@pytest.mark.parametrize("name", ["paged", "int8", "int2", "sink"])
def test_shared_prefill_hands_over_recurrent_states(family, name):
    """One prefill stored in a cache (attention K/V written, recurrent states copied) leaves the state a prefill
    through the cache leaves: the same continuation, token for token and logit for logit."""
    model = _model(family, "sdpa")
    inputs = _prompt("padded")
    shared, handed = handed_prefill_continues_alike(model, lambda: make_cache(CASES[name][0], model), inputs)
    # the states were copied, not shared: the prefill's own layers are untouched by the caches' updates
    for entry, layer in zip(shared.key_values, handed.layers):
        if isinstance(entry, LinearAttentionCacheLayerMixin):
            assert all(entry.conv_states[i] is not layer.conv_states[i] for i in entry.conv_states)


def test_memory_report_and_plan_count_what_the_caches_hold():
    """State layers report their states' bytes (in ``nbytes``, and apart as ``state_nbytes``); ``kv_bytes`` counts
    the per-token K/V of the attention layers, as DynamicCache stores them, and the paged cache holds that."""
    model = _model("nemotron_h", "sdpa")
    inputs = _prompt("single", length=20)
    dynamic, cache = prefilled(
        model, inputs, DynamicCache(config=model.config), make_cache("paged:block_size=4", model)
    )
    report = cache.memory_report()
    states = sum(layer.nbytes for layer in cache.layers if isinstance(layer, StateLayer))
    assert report["state_nbytes"] == cache.state_nbytes == states > 0
    assert (
        report["nbytes"]
        == cache.nbytes
        == states + sum(layer.nbytes for layer in cache.layers if not isinstance(layer, (StateLayer, EmptyLayer)))
    )
    kinds = {type(layer) for layer in cache.layers}
    assert StateLayer in kinds and EmptyLayer in kinds  # Mamba layers and MLP-only blocks
    for row, layer in zip(cache.memory_report()["layers"], cache.layers):
        if isinstance(layer, StateLayer):
            held = [*layer.conv_states.values(), *layer.recurrent_states.values()]
            assert row["nbytes"] == sum(t.numel() * t.element_size() for t in held if t is not None) > 0
            assert row["stored_tokens"] == 0
        elif isinstance(layer, EmptyLayer):
            assert row["nbytes"] == 0
    attention = sum(
        layer.keys.numel() * layer.keys.element_size() * 2
        for layer in dynamic.layers
        if getattr(layer, "keys", None) is not None and not isinstance(layer, LinearAttentionCacheLayerMixin)
    )
    assert attention > 0
    assert kv_bytes("dynamic", model, tokens=20, dtype=torch.float32) == attention
    assert kv_bytes("paged:block_size=4", model, tokens=20, dtype=torch.float32) == cache.nbytes - cache.state_nbytes


@pytest.mark.parametrize("family", FAMILIES)
def test_plan_measures_the_recurrent_states_a_row_holds(family):
    """``state_bytes`` (a forward on the meta device, experts routing nothing) equals the states DynamicCache holds
    after a real forward, and what our caches hold beside their K/V, for every family: gated DeltaNet, Mamba with
    mixture-of-experts blocks, convolutions, Mamba in the same layers as attention; in float32 and bfloat16 (some
    mixers keep float32 states under bfloat16 weights)."""
    model = _model(family, "sdpa")
    inputs = _prompt("single", length=20)
    dynamic, cache = prefilled(
        model, inputs, DynamicCache(config=model.config), make_cache("paged:block_size=4", model)
    )
    assert state_bytes(model.config, torch.float32) == recurrent_state_bytes(dynamic) == cache.state_nbytes > 0
    half = AutoModelForCausalLM.from_config(tiny_config(family), dtype=torch.bfloat16).eval()
    (dynamic,) = prefilled(half, inputs, DynamicCache(config=half.config))
    assert state_bytes(half.config, torch.bfloat16) == recurrent_state_bytes(dynamic) > 0


def test_plan_counts_every_rows_states_in_what_fits():
    """The largest batch a plan finds is the budget over one row's K/V plus its recurrent states, and the plan says
    how much a row's states take; an attention-only model has none."""
    config = _model("nemotron_h", "sdpa").config
    per_row = kv_bytes("dynamic", config, tokens=64, dtype=torch.float32) + state_bytes(config, torch.float32)
    plan = plan_memory(config, "96MiB", context=64, dtype="float32", caches=("dynamic",), reserve="1MiB")
    assert plan.state_bytes_per_row == state_bytes(config, torch.float32)
    assert plan.row("dynamic").max_batch == plan.budget_bytes // per_row
    assert any("recurrent states" in line for line in plan.assumptions)
    llama = plan_memory(tiny_config("llama"), "96MiB", context=64, caches=("dynamic",), reserve="1MiB")
    assert llama.state_bytes_per_row == 0 and not any("recurrent states" in a for a in llama.assumptions)


def test_plan_says_when_it_cannot_measure_the_states(monkeypatch):
    """A mixer the meta device cannot run is a ValueError naming the model type, not a plan without its states."""
    import hf_kvcache.plan as plan_module

    def fails(config, dtype):
        raise NotImplementedError("no meta kernel for this op")

    with pytest.raises(ValueError, match=r"tp must be"):
        state_bytes(tiny_config("jamba"), tp=0)
    monkeypatch.setattr(plan_module, "_measure_states", fails)
    monkeypatch.setattr(plan_module, "_STATE_BYTES", {})
    with pytest.raises(ValueError, match=r"recurrent states of model_type 'jamba' on the meta device"):
        state_bytes(tiny_config("jamba"))


@pytest.mark.parametrize("name", ["int8", "paged", "sink"])
def test_layers_with_states_and_attention_keep_both(name):
    """Falcon-H1's layers hold a Mamba state and attention K/V in one layer: the cache's own attention layer beside
    the states, reporting both; beam search reorders both (tokens as DynamicCache's for the lossless kinds)."""
    model = _model("falcon_h1", "sdpa")
    cache = make_cache(CASES[name][0], model)
    out = _generate(model, cache, _prompt("padded"), num_beams=3)
    assert all(isinstance(layer, AttentionWithStates) for layer in cache.layers)
    layer = cache.layers[0]
    assert layer.get_seq_length() == cache.get_seq_length() == 12 + NEW - 1
    assert 0 < layer.state_nbytes < layer.nbytes == layer.state_nbytes + layer.attention.nbytes
    if CASES[name][1]:
        ref = _generate(model, DynamicCache(config=model.config), _prompt("padded"), num_beams=3)
        torch.testing.assert_close(out.sequences, ref.sequences, rtol=0, atol=0)
    cache.reset()
    assert cache.nbytes == 0 and cache.get_seq_length() == 0


def test_plan_counts_the_smoothed_keys_scales_beside_states():
    """int2's smoothed keys keep one scale tensor per layer (not per row) inside a layer with states: ``kv_bytes``
    counts it once, as the layer holds it (the planned bytes equal what a padded batch holds, its states apart)."""
    model = _model("falcon_h1", "sdpa")
    spec = "int2:residual_length=4:group_size=4"
    cache = make_cache(spec, model)
    _generate(model, cache, _prompt("padded"))
    assert all(layer.attention.key_scale is not None for layer in cache.layers)
    tokens = cache.get_seq_length()
    planned = kv_bytes(spec, model, tokens=tokens, batch=2, dtype=torch.float32, prompt=12)
    assert planned == cache.nbytes - cache.state_nbytes


def _inkling(attn: str = "sdpa"):
    """Inkling: ``hybrid_sliding`` layers (convolution states beside an 8-token sliding window, of their own widths:
    ``swa_*``) and ``hybrid`` full-attention layers, both adding relative-position logits to their scores from the
    cache's mask sizes and query offset; the logits' profiles drawn wider than a random model's (std 0.02), so a
    cache whose positions were off would show."""
    model = _model("inkling_text", attn)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for module in model.modules():
            if type(module).__name__ == "InklingRelativeLogits":
                module.proj.normal_(0, 2.0, generator=g)
    return model


def _inkling_params():
    for name in CASES:
        for attn in ("eager", "sdpa"):
            for batch in ("single", "padded"):
                fast = attn == "sdpa" and batch == "padded" and name in ("paged", "int2", "sink")
                marks = () if fast else (pytest.mark.slow,)
                yield pytest.param(name, attn, batch, id=f"{name}-{attn}-{batch}", marks=marks)


@pytest.mark.parametrize("name, attn, batch", list(_inkling_params()))
def test_sliding_layers_with_states_match_dynamic_cache(name, attn, batch):
    """Inkling's sliding layers with states (its 12-token prompts and 8 new tokens slide its 8-token window) and
    full layers with states: every cache keeps the states beside its own attention layer; lossless kinds give
    DynamicCache's tokens and logits, lossy ones stay within their bounds."""
    spec, lossless, bound = CASES[name]
    model = _inkling(attn)
    inputs = _prompt(batch)
    ref = _generate(_inkling("sdpa"), DynamicCache(config=model.config), inputs)
    cache = make_cache(spec, model)
    out = _generate(model, cache, inputs)
    assert [type(layer) for layer in cache.layers] == [AttentionWithStates] * 2
    assert [layer.spec.layer_type for layer in cache.layers] == ["sliding_attention", "full_attention"]
    assert_generation_matches(out, ref, lossless, bound)


def test_sliding_layers_widths_come_from_the_config():
    """Inkling's sliding layers pass ``swa_num_key_value_heads`` heads of ``swa_head_dim`` channels, not the global
    widths: a cache built from the config alone reads them as one built from the model does, and serves the model."""
    from hf_kvcache._config import layer_specs

    model = _inkling()
    config = model.config
    specs = layer_specs(config, "QuantizedKVCache")
    assert specs == layer_specs(config, "QuantizedKVCache", model=model)
    assert (specs[0].num_kv_heads, specs[0].key_dim) == (config.swa_num_key_value_heads, config.swa_head_dim)
    assert (specs[1].num_kv_heads, specs[1].key_dim) == (config.num_key_value_heads, config.head_dim)
    inputs = _prompt("padded")
    spec = CASES["int4"][0]
    out = _generate(model, make_cache(spec, config), inputs)
    want = _generate(model, make_cache(spec, model), inputs)
    torch.testing.assert_close(out.sequences, want.sequences, rtol=0, atol=0)


@pytest.mark.parametrize("name", ["int8", "paged", "sink"])
def test_position_bias_is_refused_under_the_hf_kvcache_attention(name):
    """The kernels add no score bias: a cache built from a model that passes ``position_bias`` to its attention is
    refused under the hf_kvcache attention (at construction, or at the first forward after a switch to it), and one
    built from its config alone at the first decode step, never a wrong answer. Under sdpa the same cache serves."""
    spec = CASES[name][0]
    refusal = r"model_type 'inkling_text' adds a position bias to its attention scores \(position_bias\)"
    with pytest.raises(ValueError, match=refusal):
        make_cache(spec, _inkling("hf_kvcache"))
    model = _inkling("sdpa")
    cache = make_cache(spec, model)
    model.set_attn_implementation("hf_kvcache")
    with pytest.raises(ValueError, match=refusal):
        _generate(model, cache, _prompt("padded"))
    with pytest.raises(ValueError, match=refusal):
        _generate(model, make_cache(spec, model.config), _prompt("padded"))
    model.set_attn_implementation("sdpa")
    cache.reset()
    ref = _generate(model, DynamicCache(config=model.config), _prompt("padded"))
    assert_generation_matches(_generate(model, cache, _prompt("padded")), ref, *CASES[name][1:])


def test_plain_tensors_with_a_position_bias_go_to_sdpa():
    """DynamicCache under the hf_kvcache attention hands it plain tensors: sdpa adds Inkling's bias (DynamicCache
    under sdpa's tokens and logits); beside softcapping, which sdpa lacks and the reference kernel's path would take
    without the bias, it is refused."""
    model = _inkling("hf_kvcache")
    out = _generate(model, DynamicCache(config=model.config), _prompt("padded"))
    sdpa = _inkling("sdpa")
    assert_generation_matches(out, _generate(sdpa, DynamicCache(config=sdpa.config), _prompt("padded")), True, 0.0)
    from hf_kvcache.attention import hf_kvcache_attention

    module = next(m for m in model.modules() if type(m).__name__ == "InklingAttention")
    query = torch.zeros(1, 2, 3, 8)
    with pytest.raises(ValueError, match=r"'inkling_text' adds a position bias"):
        hf_kvcache_attention(module, query, query, query, None, softcap=30.0, position_bias=torch.zeros(1, 2, 3, 3))


@pytest.mark.parametrize(
    "family, rope", [("zamba2", {"use_mem_rope": True}), ("granitemoehybrid", {"position_embedding_type": "rope"})]
)
def test_sink_window_on_hybrids_that_switch_rope_off_or_on(family, rope):
    """Zamba2 and Granite 4's hybrids carry RoPE parameters that a flag switches off (their default) or on: off, no
    rotary embedding exists and none is needed; on, the window re-rotates with the model's own. A window that keeps
    every token equals DynamicCache either way, and one that evicts keeps sinks + window tokens."""
    for variant in ({}, rope):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(tiny_config(family, variant), attn_implementation="sdpa").eval()
        model.generation_config.pad_token_id, model.generation_config.eos_token_id = PAD, None
        ref = _generate(model, DynamicCache(config=model.config), _prompt("padded"))
        out = _generate(model, make_cache("sink:window=256:sinks=4", model), _prompt("padded"))
        torch.testing.assert_close(out.sequences, ref.sequences, rtol=0, atol=0)
        evicting = make_cache("sink:window=6:sinks=2", model)
        _generate(model, evicting, _prompt("padded"))
        assert evicting.stored_tokens == 8
        assert (evicting.rotary is not None) == bool(variant)


@pytest.mark.parametrize("family", ["qwen3_next", "falcon_h1"])
def test_key_width_search_measures_the_attention_layers(family):
    """``search_key_bits`` on a hybrid: the exact baseline keeps the recurrent states, the layers without keys are
    not measured (every width is the same cache there), and the widths it returns build a cache that generates."""
    from hf_kvcache.calibrate import search_key_bits

    model = _model(family, "sdpa")
    ids = torch.randint(3, VOCAB, (2, 48), generator=torch.Generator().manual_seed(0))
    options = dict(residual_length=4, group_size=8)
    with torch.no_grad():
        widths = search_key_bits(model, ids, bits=2, budget=2.5, scored_tokens=16, **options)
    specs = make_cache("int2", model).layer_specs
    assert len(widths.key_bits) == len(specs)
    for spec, row in zip(specs, widths.sensitivity):
        if not spec.holds_kv:
            assert set(row.values()) == {widths.baseline}
    cache = QuantizedKVCache(model, bits=2, key_bits=list(widths.key_bits), **options)
    out = _generate(model, cache, _prompt("padded"))
    assert out.sequences.shape[1] == 12 + NEW

"""Recurrent-depth models (Dory): the recurrent section runs several loops per forward. With its default
``recurrent_kv_cache_mode="per_loop"`` each loop after the first writes to cache layers of its own, which the model
appends to ``cache.layers`` at its first forward and every hf_kvcache cache builds up front; with ``"last_loop"`` the
earlier loops read the one layer's stored tensors in place, which a cache that keeps its own layout refuses."""

from __future__ import annotations

import pytest
import torch
from models import assert_generation_matches, config_model, generate, handed_prefill_continues_alike, prompt
from transformers import AutoModelForCausalLM, DynamicCache

from hf_kvcache import QuantizedKVCache, make_cache
from hf_kvcache._compat import with_cache
from hf_kvcache._config import layer_specs, loop_layers
from hf_kvcache.calibrate import _LayerReplay
from hf_kvcache.plan import kv_bytes
from hf_kvcache.tools.supported_models import tiny_config

pytest.importorskip("transformers.models.dory", reason="Dory joined transformers in 5.24")

CASES = [  # (spec, lossless, bound: the matrix's)
    ("paged:block_size=4", True, 0.0),
    ("sink:window=64:sinks=2", True, 0.0),
    ("int8", False, 0.06),
    ("int4:residual_length=4:group_size=8", False, 0.35),
    ("int2:residual_length=4:group_size=8", False, 1.0),
]


@pytest.fixture(autouse=True)
def _one_thread():
    torch.set_num_threads(1)


def test_each_loop_after_the_first_has_cache_layers_of_its_own_in_the_models_order():
    model = config_model("dory", "eager")  # layers: input 0, recurrent 1 (full) and 2 (sliding), output 3; 2 loops
    specs = layer_specs(model.config, "test")
    assert loop_layers(model.config) == [1, 2]
    assert [s.source for s in specs] == [None, None, None, None, 1, 2]
    assert [s.layer_type for s in specs[4:]] == [specs[1].layer_type, specs[2].layer_type]
    reference = DynamicCache(config=model.config)
    with torch.no_grad():
        model(**prompt("padded"), **with_cache(model, reference))
    assert len(reference.layers) == len(specs)  # the copies the model appended to DynamicCache's


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
@pytest.mark.parametrize("batch", ["single", "padded"])
@pytest.mark.parametrize("spec, lossless, bound", CASES)
def test_every_cache_serves_a_layer_per_loop_and_plans_its_bytes(attn, batch, spec, lossless, bound):
    model = config_model("dory", attn)
    inputs = prompt(batch)
    reference = generate(model, DynamicCache(config=model.config), inputs)
    cache = make_cache(spec, model)
    layers = len(cache.layers)
    assert_generation_matches(generate(model, cache, inputs), reference, lossless, bound)
    assert len(cache.layers) == layers == 6  # built up front: the model found them and appended none
    if batch == "single":
        tokens, prompt_tokens = cache.get_seq_length(), inputs["input_ids"].shape[1]
        planned = kv_bytes(spec, model, tokens=tokens, dtype=model.dtype, prompt=prompt_tokens)
        assert cache.nbytes == planned


@pytest.mark.parametrize("spec", ["int4:residual_length=4:group_size=8", "paged:block_size=4"])
def test_a_handed_prefill_fills_every_loops_layers(spec):
    model = config_model("dory", "eager")
    handed_prefill_continues_alike(model, lambda: make_cache(spec, model), prompt("padded"))


def test_a_loop_copy_takes_its_decoder_layers_key_width_and_boundary():
    model = config_model("dory", "eager")
    cache = QuantizedKVCache(model, bits=2, key_bits=[2, 3, 4, 2], residual_length=4, group_size=8)
    assert [cache.layer_key_bits(i) for i in range(6)] == [2, 3, 4, 2, 3, 4]
    with pytest.raises(ValueError, match="key_bits"):  # a width per decoder layer, not per cache layer
        QuantizedKVCache(model, bits=2, key_bits=[2, 3, 4, 2, 3, 4])
    edges = QuantizedKVCache(model, bits=2, boundary_layers=1, residual_length=4, group_size=8)
    assert [edges.is_boundary(i) for i in range(6)] == [True, False, False, True, False, False]
    assert _LayerReplay.of(model, 4).layers is None  # a module run once per loop: the search runs every layer


@pytest.mark.parametrize("spec", ["int8", "int2", "paged", "sink:window=64:sinks=2"])
def test_a_cache_the_other_loops_read_in_place_is_refused_where_its_layers_keep_their_own_layout(spec):
    model = config_model("dory", "eager", recurrent_kv_cache_mode="last_loop")
    assert loop_layers(model.config) == []
    with pytest.raises(ValueError, match=r"model_type 'dory' with recurrent_kv_cache_mode='last_loop'.*'per_loop'"):
        make_cache(spec, model)


@pytest.mark.parametrize("spec", ["paged:block_size=4", "sink:window=64:sinks=2"])
def test_a_cache_the_other_loops_read_in_place_is_served_where_those_layers_keep_plain_tensors(spec):
    """The recurrent section's layers all sliding: the paged and window caches keep the model's own sliding layers as
    DynamicCache does (plain tensors), which the earlier loops read."""
    sliding = ["sliding_attention", "sliding_attention", "sliding_attention", "full_attention"]
    config = tiny_config("dory", {"recurrent_kv_cache_mode": "last_loop", "layer_types": sliding})
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval()
    model.generation_config.pad_token_id, model.generation_config.eos_token_id = 0, None
    inputs = prompt("padded")
    reference = generate(model, DynamicCache(config=model.config), inputs)
    assert_generation_matches(generate(model, make_cache(spec, model), inputs), reference, True, 0.0)


def test_the_key_width_search_counts_a_recurrent_layers_keys_once_per_loop():
    """The budget is over the key elements the cache stores: a recurrent layer's width applies to its loop copies."""
    from hf_kvcache.calibrate import search_key_bits

    model = config_model("dory", "eager")
    ids = torch.randint(3, 100, (1, 28), generator=torch.Generator().manual_seed(0))
    found = search_key_bits(model, ids, bits=2, budget=3.0, scored_tokens=4, residual_length=4, group_size=8)
    one = model.config.num_key_value_heads * model.config.head_dim
    assert found.key_elements == (one, 2 * one, 2 * one, one)  # layers 1 and 2 stored by both loops
    stored = sum(b * e for b, e in zip(found.key_bits, found.key_elements)) / sum(found.key_elements)
    assert stored <= 3.0 and len(found.key_bits) == model.config.num_hidden_layers

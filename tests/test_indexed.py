"""Sparse attention (transformers' ``indexed_attention`` layers: DeepSeek-V3.2, GLM-5's ``glm_moe_dsa``; Qwen4-Exp's
compressed-block indexer beside gated DeltaNet layers; Dots 3 Note's, beside latent sliding layers twice as wide): the
caches keep the latent K/V their own way and the indexer's keys beside them as ``DynamicCache`` does, so
lossless caches reproduce DynamicCache exactly and lossy ones stay within their bounds, under every attention
implementation, batch 1 and left-padded, through beams and sampling; the indexer keys follow crop, reorder, batch
selection and reset; a handed-over prefill carries them; plan and nbytes count them; the evicting window refuses."""

from __future__ import annotations

import pytest
import torch
from models import (
    assert_generation_matches,
    config_model,
    generate,
    handed_prefill_continues_alike,
    prefilled,
    tiny_model,
)
from models import prompt as _prompt
from transformers import DynamicCache

from hf_kvcache import make_cache
from hf_kvcache.attention import hf_kvcache_attention
from hf_kvcache.compare import LOGIT_BOUNDS
from hf_kvcache.formats.handle import KVHandle
from hf_kvcache.layers.indexed import IndexedAttention
from hf_kvcache.layers.inside import SplitKeys
from hf_kvcache.memory import recurrent_state_bytes
from hf_kvcache.plan import kv_bytes, state_bytes

FAMILIES = ("deepseek_v32", "glm_moe_dsa")
# Indexed layers among other kinds: Qwen4-Exp (gated DeltaNet, an indexer width named indexer_head_dim), Dots 3 Note
# (latent attention whose widths vary by layer). Fewer cells: sdpa and hf_kvcache, left-padded.
# GLM-5-Next: NoPE latent attention (an empty value; the cache splits the latent over both slots) whose indexer
# reads the tokens held from the layer's keys, beside KDA layers; image-text-to-text, run on text.
MIXED = ("qwen4_exp_text", "dots3_note_text", "glm5_next")
ATTENTION = ("eager", "sdpa", "hf_kvcache")
VOCAB, NEW = 128, 8
CASES = {  # spec, lossless, logit bound (lossy): small residuals and groups so that tokens really are quantized
    "paged": ("paged:block_size=4", True, 0.0),
    "int8": ("int8", False, LOGIT_BOUNDS["int8"]),
    "int4": ("int4:residual_length=2:group_size=8", False, LOGIT_BOUNDS["int4"]),
    "int2": ("int2:residual_length=2:group_size=8", False, LOGIT_BOUNDS["int2"]),
    "paged-int8": ("paged:block_size=4:bits=8", False, LOGIT_BOUNDS["int8"]),
}


@pytest.fixture(autouse=True)
def _one_thread():
    torch.set_num_threads(1)


# Indexers that pick 4 of the prompt's 10+ tokens (the tiny configs' defaults pick every token of a short prompt).
SPARSE = {
    "deepseek_v32": {"index_topk": 4},
    "glm_moe_dsa": {"index_topk": 4},
    "dots3_note_text": {"index_topk": 4},
    "qwen4_exp_text": {"indexer_budget": 4},  # one block of 4 tokens, and the tail
    "glm5_next": {"index_topk": 4},  # two pools of 2 tokens, and the tail
}


def _model(family: str, attn: str, sparse: bool = False):
    return config_model(family, attn, **(SPARSE[family] if sparse else {}))


def _generate(model, cache, inputs, **kwargs):
    return generate(model, cache, inputs, NEW, **kwargs)


def _params():
    for family in FAMILIES + MIXED:
        for name in CASES:
            for attn in ATTENTION if family in FAMILIES else ("sdpa", "hf_kvcache"):
                for batch in ("single", "padded") if family in FAMILIES else ("padded",):
                    fast = attn == "sdpa" and batch == "padded" and (family == FAMILIES[0] or name == "paged")
                    marks = () if fast else (pytest.mark.slow,)
                    yield pytest.param(family, name, attn, batch, id=f"{family}-{name}-{attn}-{batch}", marks=marks)


@pytest.mark.parametrize("family, name, attn, batch", list(_params()))
def test_greedy_matches_dynamic_cache(family, name, attn, batch):
    """Lossless caches: DynamicCache's tokens and logits, with the indexer picking 4 tokens. Lossy: every step's
    logits within the kind's bound until the first token that differs (the matrix's rule), with the indexer picking
    every token: a top-k selection is discontinuous, and a quantized layer's output flips it (int4 on DeepSeek-V3.2,
    4 of 15 tokens: layer 1 picked token 6 for token 1 at the fourth step, the logit error 0.052 against 0.005-0.007
    at every other step). Every indexed layer keeps one indexer key per token."""
    spec, lossless, bound = CASES[name]
    model = _model(family, attn, sparse=lossless)
    inputs = _prompt(batch)
    dynamic = DynamicCache(config=model.config)
    ref = _generate(_model(family, "sdpa", sparse=lossless), dynamic, inputs)
    cache = make_cache(spec, model)
    out = _generate(model, cache, inputs)
    indexed = [hasattr(layer, "indexer_keys") for layer in dynamic.layers]
    assert any(indexed) and indexed == [isinstance(layer, IndexedAttention) for layer in cache.layers]
    # every real token's indexer key as DynamicCache's (lossy caches: the prompt's, which no quantized read fed;
    # left padding's keys follow each attention implementation's own masking)
    real = torch.cat([inputs["attention_mask"], torch.full((len(inputs["attention_mask"]), NEW - 1), lossless)], 1)
    for ours, theirs in zip(cache.layers, dynamic.layers):
        if not isinstance(ours, IndexedAttention):
            continue
        assert ours.indexer_keys.shape == theirs.indexer_keys.shape
        keep = real.bool()
        torch.testing.assert_close(ours.indexer_keys[keep], theirs.indexer_keys[keep], rtol=1e-4, atol=1e-4)
    assert_generation_matches(out, ref, lossless, bound)


@pytest.mark.parametrize("family", FAMILIES + MIXED)
def test_the_hf_kvcache_attention_applies_the_indexers_selection(family):
    """The models fold the indexer's picks into eager's and sdpa's masks themselves and pass them to any other
    implementation as ``indices`` (Qwen4-Exp folds them into every mask): under ``hf_kvcache`` ``DynamicCache`` gives
    sdpa's tokens and logits, and the selection changes them (it is exercised)."""
    inputs = _prompt("padded")
    runs = {}
    for attn, sparse in (("sdpa", True), ("hf_kvcache", True), ("sdpa", False)):
        model = _model(family, attn, sparse)
        runs[attn, sparse] = _generate(model, DynamicCache(config=model.config), inputs)
    ours, sdpa, every = runs["hf_kvcache", True], runs["sdpa", True], runs["sdpa", False]
    assert_generation_matches(ours, sdpa, True, 0.0)
    assert any((a - b).abs().amax() > 1e-3 for a, b in zip(sdpa.logits, every.logits))


@pytest.mark.parametrize("spec", ["int4:residual_length=2:group_size=8", "int2:residual_length=2:group_size=8"])
def test_a_selection_that_skips_a_padded_rows_sinks_skips_their_exact_copies(spec):
    """A padded row's exact sinks reach the hf_kvcache attention as a segment outside the mask's columns (their codes'
    copies masked out). An indexer that does not pick a sink's position hides that sink there too: attention over the
    storage handle equals sdpa over the same cache state's materialized keys and values with the same picks."""
    from hf_kvcache.prefill import store_prefill

    model = tiny_model("llama")
    heads, dim = model.config.num_key_value_heads, model.config.head_dim
    g = torch.Generator().manual_seed(0)
    kv = [(torch.randn(2, heads, 40, dim, generator=g), torch.randn(2, heads, 40, dim, generator=g))
          for _ in range(model.config.num_hidden_layers)]  # fmt: skip
    mask = torch.ones(2, 40, dtype=torch.long)
    mask[1, :5] = 0  # row 1 is left-padded: its sinks are positions 5 .. 8
    new = (torch.randn(2, heads, 1, dim, generator=g), torch.randn(2, heads, 1, dim, generator=g))
    read = {}
    for implementation in ("hf_kvcache", "sdpa"):
        cache = store_prefill(make_cache(spec, model), kv, mask)
        assert cache.sinks == 4
        model.set_attn_implementation(implementation)
        read[implementation] = cache.update(*new, 0)
    model.set_attn_implementation("sdpa")
    assert isinstance(read["hf_kvcache"][0], KVHandle) and read["hf_kvcache"][0].extra  # the sinks outside the columns
    query = torch.randn(2, model.config.num_attention_heads, 1, dim, generator=g)
    visible = torch.cat([mask, torch.ones(2, 1, dtype=torch.long)], 1).bool()[:, None, None, :]
    left_out = (0, 2, 5, 7)  # row 0's sinks 0 and 2, row 1's first and third
    indices = torch.tensor([p for p in range(41) if p not in left_out])[None, None, :].expand(2, 1, -1)
    attn = model.model.layers[0].self_attn
    outs = {
        name: hf_kvcache_attention(attn, query, k, v, visible, scaling=dim**-0.5, indices=indices)[0]
        for name, (k, v) in read.items()
    }
    torch.testing.assert_close(outs["hf_kvcache"], outs["sdpa"], rtol=1e-5, atol=1e-5)
    every = hf_kvcache_attention(attn, query, *read["sdpa"], visible, scaling=dim**-0.5)[0]
    assert (every - outs["sdpa"]).abs().amax() > 1e-3  # the picks change the output: the sinks' exclusion is seen


def test_a_block_sparse_selection_the_attention_cannot_apply_is_refused():
    query = torch.zeros(1, 2, 1, 8)
    with pytest.raises(ValueError, match=r"does not apply Linear's block-sparse selection \(block_indices\)"):
        hf_kvcache_attention(torch.nn.Linear(1, 1), query, query, query, None, block_indices=torch.zeros(1))


MODES = {
    "beam": dict(num_beams=3),
    "beam-nrs": dict(num_beams=3, num_return_sequences=2),
    "sample-nrs": dict(do_sample=True, num_return_sequences=2),
    "prompt-lookup": dict(prompt_lookup_num_tokens=3),  # crops the cache where drafts are rejected
}


@pytest.mark.parametrize("mode", MODES)
def test_generate_modes_match_dynamic_cache(mode):
    """Beam search reorders the indexer keys with the pages, sampling repeats them per sequence, prompt lookup crops
    them: tokens as DynamicCache's."""
    model = _model(FAMILIES[0], "sdpa")
    inputs = _prompt("single" if mode == "prompt-lookup" else "padded")
    dynamic = DynamicCache(config=model.config)
    ref = _generate(model, dynamic, inputs, **MODES[mode])
    cache = make_cache(CASES["paged"][0], model)
    out = _generate(model, cache, inputs, **MODES[mode])
    torch.testing.assert_close(out.sequences, ref.sequences, rtol=0, atol=0)
    for ours, theirs in zip(cache.layers, dynamic.layers):
        assert ours.indexer_keys.shape == theirs.indexer_keys.shape
        assert ours.indexer_keys.shape[1] == ours.attention.get_seq_length()


def test_crop_and_batch_operations_keep_the_indexer_keys_with_the_tokens():
    model = _model(FAMILIES[0], "sdpa")
    (cache,) = prefilled(model, _prompt("padded"), make_cache("int8", model))
    layer = cache.layers[0]
    keys = layer.indexer_keys.clone()
    cache.crop(-3)  # generate()'s way: minus the tokens to remove
    assert layer.indexer_keys.shape[1] == cache.get_seq_length() == 9
    torch.testing.assert_close(layer.indexer_keys, keys[:, :9], rtol=0, atol=0)
    cache.crop(-2)
    assert layer.indexer_keys.shape[1] == cache.get_seq_length() == 7
    cache.batch_repeat_interleave(2)
    torch.testing.assert_close(layer.indexer_keys, keys[:, :7].repeat_interleave(2, 0), rtol=0, atol=0)
    cache.batch_select_indices(torch.tensor([3, 0]))
    torch.testing.assert_close(layer.indexer_keys, keys[[1, 0], :7], rtol=0, atol=0)
    cache.reorder_cache(torch.tensor([1, 1]))
    torch.testing.assert_close(layer.indexer_keys, keys[[0, 0], :7], rtol=0, atol=0)


def test_indexer_keys_grow_in_amortized_buffers():
    """Decode steps append in place (DynamicIndexedLayer copies every key held at every step): one allocation across
    the steps after the prompt's, and the bytes held are the live keys'."""
    model = _model(FAMILIES[0], "sdpa")
    cache = make_cache("paged:block_size=4", model)
    inputs = _prompt("padded")
    with torch.no_grad():
        out = model(**inputs, past_key_values=cache)
        layer = cache.layers[0]
        storage = layer.indexer_keys.untyped_storage().data_ptr()
        mask = inputs["attention_mask"]
        for _ in range(6):
            token = out.logits[:, -1:].argmax(-1)
            mask = torch.cat([mask, torch.ones_like(token)], 1)
            out = model(input_ids=token, attention_mask=mask, past_key_values=cache)
            assert layer.indexer_keys.untyped_storage().data_ptr() == storage
    assert layer.indexer_keys.shape[1] == cache.get_seq_length() == inputs["input_ids"].shape[1] + 6
    assert layer._beside_nbytes() == layer.indexer_keys.numel() * layer.indexer_keys.element_size()
    assert layer._beside_nbytes(reserved=True) > layer._beside_nbytes()


@pytest.mark.parametrize("name", ["int8", "paged"])
def test_another_batch_is_refused_until_reset(name):
    model = _model(FAMILIES[0], "sdpa")
    cache = make_cache(CASES[name][0], model)
    _generate(model, cache, _prompt("single"))
    with pytest.raises(ValueError, match=r"layer 0 .*holds .*\b1\b"):  # the K/V's check or the indexer's
        _generate(model, cache, _prompt("padded"))
    with pytest.raises(ValueError, match=r"layer 0 \(indexed_attention\) holds indexer keys of batch 1"):
        cache.layers[0].update_indexer(torch.zeros(2, 1, model.config.index_head_dim))
    cache.reset()
    assert cache.nbytes == 0 and all(layer.indexer_keys is None for layer in cache.layers)
    again = _generate(model, cache, _prompt("padded"))
    fresh = _generate(model, make_cache(CASES[name][0], model), _prompt("padded"))
    torch.testing.assert_close(again.sequences, fresh.sequences, rtol=0, atol=0)


@pytest.mark.parametrize("name", ["paged", "int8", "int2"])
def test_shared_prefill_hands_over_the_indexer_keys(name):
    """One prefill stored in a cache (the K/V written, the indexer keys copied) leaves the state a prefill through
    the cache leaves: the same continuation, logit for logit."""
    model = _model(FAMILIES[0], "sdpa")
    inputs = _prompt("padded")
    shared, handed = handed_prefill_continues_alike(model, lambda: make_cache(CASES[name][0], model), inputs)
    for entry, layer in zip(shared.key_values, handed.layers):
        assert entry.indexer_keys.data_ptr() != layer.indexer_keys.data_ptr()  # copied: each cache appends to its own


@pytest.mark.parametrize("family", (FAMILIES[0], *MIXED))
def test_plan_and_nbytes_count_the_indexer_keys(family):
    """``kv_bytes`` counts every token's indexer key as DynamicCache stores it (the recurrent states apart); the
    paged cache holds what it plans, its indexer keys included; plan's state count is a real forward's."""
    model = _model(family, "sdpa")
    inputs = _prompt("single", length=20)
    dynamic, paged = prefilled(
        model, inputs, DynamicCache(config=model.config), make_cache("paged:block_size=4", model)
    )
    attention = [layer for layer in dynamic.layers if getattr(layer, "keys", None) is not None]
    held = sum(layer.keys.nbytes + layer.values.nbytes + getattr(layer, "indexer_keys", layer.keys[:0]).nbytes
               for layer in attention)  # fmt: skip
    indexer = sum(layer.indexer_keys.nbytes for layer in attention if hasattr(layer, "indexer_keys"))
    assert indexer > 0
    assert kv_bytes("dynamic", model, tokens=20, dtype=torch.float32) == held
    report = paged.memory_report()
    assert kv_bytes("paged:block_size=4", model, tokens=20, dtype=torch.float32) == paged.nbytes - paged.state_nbytes
    assert state_bytes(model.config, torch.float32) == recurrent_state_bytes(dynamic) == paged.state_nbytes
    assert report["nbytes"] == paged.nbytes


@pytest.mark.parametrize("family", FAMILIES + MIXED)
def test_evicting_window_is_refused_by_name(family):
    with pytest.raises(
        ValueError, match=rf"SlidingWindowKVCache cannot serve model_type '{family}(_text)?': its sparse"
    ):
        make_cache("sink:window=6:sinks=2:rerotate=false", _model(family, "sdpa"))  # (rerotate: MLA's refusal)


@pytest.mark.parametrize("name", ["paged", "int4"])
def test_a_nope_latent_is_stored_over_both_slots(name):
    """GLM-5-Next's sparse layers pass a latent and an empty value: the cache stores the latent's halves in its key
    and value slots (paged: exactly DynamicCache's latent), the layer's ``keys`` tell the indexer the tokens held (a
    meta tensor of DynamicCache's keys' shape), and a forward of another layout is refused by name."""
    model = _model("glm5_next", "sdpa")
    inputs = _prompt("padded")
    dynamic, cache = prefilled(model, inputs, DynamicCache(config=model.config), make_cache(CASES[name][0], model))
    for ours, theirs in zip(cache.layers, dynamic.layers):
        if not isinstance(ours, IndexedAttention):
            continue
        split = ours.attention
        assert isinstance(split, SplitKeys) and split.spec.key_dim + split.spec.value_dim == theirs.keys.shape[-1]
        assert ours.keys.device.type == "meta" and ours.keys.shape == theirs.keys.shape and theirs.values.shape[-1] == 0
        latent = theirs.keys.new_zeros(*theirs.keys.shape[:2], 1, theirs.keys.shape[-1])
        keys, values = ours.update(latent, latent[..., :0])  # one more token, read back as the model reads it
        assert keys.shape == (*theirs.keys.shape[:2], theirs.keys.shape[2] + 1, theirs.keys.shape[-1])
        assert values.shape[-1] == 0
        if CASES[name][1]:  # every real token's latent (pages store nothing under left padding)
            real = inputs["attention_mask"].bool()
            torch.testing.assert_close(keys[:, 0, :-1][real], theirs.keys[:, 0][real], rtol=0, atol=0)
        with pytest.raises(ValueError, match=r"latent attention passes keys of \d+ channels and values of none"):
            split.update(latent, latent)

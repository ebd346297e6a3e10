"""SlidingWindowKVCache once eviction has begun: explicit-mask references, re-rotation, padding, crop, memory.

Without eviction the cache is in the shared matrix (``tests/matrix.py``), where it must equal DynamicCache.
"""

from __future__ import annotations

import copy

import pytest
import torch
from models import PAD, VOCAB, prompt, tiny_model
from transformers import (
    AutoModelForCausalLM,
    CohereConfig,
    LlamaConfig,
    LogitsProcessor,
    LogitsProcessorList,
    PhiConfig,
)

from hf_kvcache import SlidingWindowKVCache, make_cache
from hf_kvcache.rope import rerotate, rotary_spec

WINDOW, SINKS = 6, 2
NEW = 16
EVICTING = ("llama", "qwen2", "phi3", "gpt2")  # full-attention families: one mask rule for every layer


def _explicit_mask(mask2d: torch.Tensor, prefill: int, window: int, sinks: int, dtype) -> torch.Tensor:
    """Additive (B, 1, T, T) mask of the sink cache's semantics over a whole sequence.

    Query t sees key c <= t of its row's real tokens if t is a prefill token, or if c is one of the row's first
    ``sinks`` real tokens, one of the ``window`` tokens before t, or t itself.
    """
    b, t = mask2d.shape
    pad = (mask2d.cumsum(-1) == 0).sum(-1).view(b, 1, 1)
    q = torch.arange(t).view(1, t, 1)
    c = torch.arange(t).view(1, 1, t)
    allowed = (c <= q) & (c >= pad) & ((q < prefill) | (c < pad + sinks) | (c >= q - window))
    return torch.where(allowed, 0.0, torch.finfo(dtype).min).to(dtype).unsqueeze(1)


def _positions(mask2d: torch.Tensor) -> torch.Tensor:
    return (mask2d.cumsum(-1) - 1).clamp(min=0)


@torch.no_grad()
def _reference_logits(model, sequences, mask2d, prefill, window=WINDOW, sinks=SINKS):
    mask4d = _explicit_mask(mask2d, prefill, window, sinks, model.dtype)
    return model(input_ids=sequences, attention_mask=mask4d, position_ids=_positions(mask2d)).logits


def _generate(model, inputs, cache, **kwargs):
    kwargs.setdefault("do_sample", False)
    return model.generate(
        **inputs,
        past_key_values=cache,
        max_new_tokens=NEW,
        min_new_tokens=NEW,
        output_logits=True,
        return_dict_in_generate=True,
        **kwargs,
    )


def _full_mask(inputs, sequences):
    extra = sequences.shape[1] - inputs["attention_mask"].shape[1]
    rows = sequences.shape[0] // inputs["attention_mask"].shape[0]
    base = inputs["attention_mask"].repeat_interleave(rows, 0)
    return torch.cat([base, torch.ones(sequences.shape[0], extra, dtype=base.dtype)], 1)


@pytest.mark.parametrize("batch", ["single", "padded"])
@pytest.mark.parametrize("attn", ["eager", "sdpa", "hf_kvcache"])
@pytest.mark.parametrize("family", EVICTING)
@pytest.mark.parametrize("mode", ["greedy", "sample", "sample-nrs"])
def test_eviction_matches_explicit_mask(family, attn, batch, mode):
    """rerotate=False: every generated step's logits equal a no-cache forward under the sinks + window mask (under
    hf_kvcache, decode steps read the window through the kernels)."""
    model = tiny_model(family, attn)
    inputs = prompt(batch)
    kwargs = {"greedy": {}, "sample": {"do_sample": True}, "sample-nrs": {"do_sample": True, "num_return_sequences": 2}}
    torch.manual_seed(0)
    cache = SlidingWindowKVCache(model, window=WINDOW, sinks=SINKS, rerotate=False)
    out = _generate(model, inputs, cache, **kwargs[mode])
    assert max(layer.stored_tokens for layer in cache.layers) == WINDOW + SINKS
    prefill = inputs["input_ids"].shape[1]
    reference = tiny_model(family, "sdpa") if attn == "hf_kvcache" else model
    ref = _reference_logits(reference, out.sequences[:, :-1], _full_mask(inputs, out.sequences)[:, :-1], prefill)
    for step, logits in enumerate(out.logits):
        torch.testing.assert_close(logits, ref[:, prefill - 1 + step], rtol=1e-4, atol=1e-4)


def test_padded_rows_match_their_unpadded_runs():
    """A left-padded row keeps its first real tokens as sinks: it decodes exactly as the same prompt alone."""
    model = tiny_model("llama", "eager")
    inputs = prompt("padded")
    batched = _generate(model, inputs, SlidingWindowKVCache(model, window=WINDOW, sinks=SINKS))
    alone = {"input_ids": inputs["input_ids"][1:, 5:], "attention_mask": inputs["attention_mask"][1:, 5:]}
    single = _generate(model, alone, SlidingWindowKVCache(model, window=WINDOW, sinks=SINKS))
    torch.testing.assert_close(batched.sequences[1, 5:], single.sequences[0], rtol=0, atol=0)
    for got, want in zip(batched.logits, single.logits):
        torch.testing.assert_close(got[1], want[0], rtol=1e-4, atol=1e-4)


def test_config_built_cache_learns_padding_from_observe():
    model = tiny_model("llama", "eager")
    inputs = prompt("padded")
    from_model = _generate(model, inputs, SlidingWindowKVCache(model, window=WINDOW, sinks=SINKS))
    cache = SlidingWindowKVCache(model.config, window=WINDOW, sinks=SINKS)
    cache.padding.observe(inputs["attention_mask"])
    from_config = _generate(model, inputs, cache)
    torch.testing.assert_close(from_config.sequences, from_model.sequences, rtol=0, atol=0)


def test_beam_search_scores_match_explicit_mask():
    model = tiny_model("qwen2", "eager")
    inputs = prompt("single")
    cache = SlidingWindowKVCache(model, window=WINDOW, sinks=SINKS, rerotate=False)
    out = model.generate(
        **inputs,
        past_key_values=cache,
        max_new_tokens=NEW,
        min_new_tokens=NEW,
        num_beams=3,
        num_return_sequences=2,
        length_penalty=0.0,
        return_dict_in_generate=True,
        output_scores=True,
    )
    prefill = inputs["input_ids"].shape[1]
    seqs = out.sequences
    logits = _reference_logits(model, seqs[:, :-1], _full_mask(inputs, seqs)[:, :-1], prefill)
    logprobs = logits[:, prefill - 1 :].log_softmax(-1).gather(-1, seqs[:, prefill:, None]).squeeze(-1).sum(-1)
    torch.testing.assert_close(out.sequences_scores, logprobs, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("mode", ["prompt-lookup", "assisted"])
def test_assisted_decoding_after_eviction_equals_greedy(mode):
    """Greedy assisted decoding is exact, so it must reproduce plain greedy through crop() after eviction."""
    model = tiny_model("llama", "eager")
    ids = torch.tensor([[5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 5, 6]])
    inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    plain = _generate(model, inputs, SlidingWindowKVCache(model, window=WINDOW, sinks=SINKS))
    extra = (
        {"prompt_lookup_num_tokens": 3}
        if mode == "prompt-lookup"
        else {"assistant_model": tiny_model("llama", "eager", seed=1)}
    )
    cache = SlidingWindowKVCache(model, window=WINDOW, sinks=SINKS)
    out = _generate(model, inputs, cache, **extra)
    torch.testing.assert_close(out.sequences, plain.sequences, rtol=0, atol=0)
    assert max(layer.stored_tokens for layer in cache.layers) <= WINDOW + SINKS


def test_continuation_after_eviction_reproduces_single_call():
    model = tiny_model("phi3", "sdpa")
    inputs = prompt("padded")
    whole = model.generate(
        **inputs,
        past_key_values=SlidingWindowKVCache(model, window=WINDOW, sinks=SINKS),
        max_new_tokens=20,
        do_sample=False,
    )
    cache = SlidingWindowKVCache(model, window=WINDOW, sinks=SINKS)
    first = model.generate(**inputs, past_key_values=cache, max_new_tokens=12, do_sample=False)
    mask = _full_mask(inputs, first)
    second = model.generate(
        input_ids=first, attention_mask=mask, past_key_values=cache, max_new_tokens=8, do_sample=False
    )
    torch.testing.assert_close(second, whole, rtol=0, atol=0)


def test_crop_after_eviction_needs_past_recording():
    model = tiny_model("llama", "eager")
    ids = torch.randint(3, VOCAB, (1, 20), generator=torch.Generator().manual_seed(0))
    cache = SlidingWindowKVCache(model, window=WINDOW, sinks=SINKS)
    with torch.no_grad():
        model(ids, past_key_values=cache, use_cache=True)
    with pytest.raises(ValueError, match="activate_past_recording"):
        cache.crop(-2)
    assert cache.get_seq_length() == 20  # unchanged by the refused crop
    with pytest.raises(ValueError, match="negative"):
        cache.crop(3)
    cache.crop(0)

    # Recorded: the forward of a rejected draft can be undone exactly.
    recorded = SlidingWindowKVCache(model, window=WINDOW, sinks=SINKS)
    recorded.activate_past_recording()
    with torch.no_grad():
        model(ids[:, :16], past_key_values=recorded, use_cache=True)
        recorded.crop(0)
        model(ids[:, 16:], past_key_values=recorded, use_cache=True)  # 4 draft tokens
        recorded.crop(-3)
        got = model(ids[:, 17:18], past_key_values=recorded, use_cache=True).logits
    fresh = SlidingWindowKVCache(model, window=WINDOW, sinks=SINKS)
    with torch.no_grad():
        model(ids[:, :16], past_key_values=fresh, use_cache=True)
        model(ids[:, 16:17], past_key_values=fresh, use_cache=True)
        want = model(ids[:, 17:18], past_key_values=fresh, use_cache=True).logits
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


# -- re-rotation -------------------------------------------------------------------------------------------------

ONE_LAYER = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=1,
    num_attention_heads=4,
    num_key_value_heads=2,
    pad_token_id=PAD,
    bos_token_id=1,
    eos_token_id=2,
)
ROTARY = {
    "standard": lambda: LlamaConfig(**ONE_LAYER),
    "partial": lambda: PhiConfig(partial_rotary_factor=0.5, **ONE_LAYER),
    "interleaved": lambda: CohereConfig(**ONE_LAYER),
    "linear-scaled": lambda: LlamaConfig(
        rope_parameters={"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0}, **ONE_LAYER
    ),
    "llama3-scaled": lambda: LlamaConfig(
        rope_parameters={
            "rope_type": "llama3",
            "rope_theta": 10000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 16,
        },
        **ONE_LAYER,
    ),
    "yarn": lambda: LlamaConfig(
        rope_parameters={
            "rope_type": "yarn",
            "rope_theta": 10000.0,
            "factor": 4.0,
            "original_max_position_embeddings": 16,
        },
        **ONE_LAYER,
    ),
}


@pytest.mark.parametrize("rotary", list(ROTARY))
@pytest.mark.parametrize("batch", ["single", "padded"])
@pytest.mark.parametrize("attn", ["eager", "hf_kvcache"])
def test_rerotated_sinks_equal_shifted_positions(rotary, batch, attn):
    """One layer: K/V depend only on token and position, so a decode step with re-rotated sinks equals a fresh
    forward over [sinks, window, query] with the sinks placed right before the window."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(ROTARY[rotary](), attn_implementation="eager").eval()
    cached = copy.deepcopy(model)
    cached.set_attn_implementation(attn)
    inputs = prompt(batch)
    ids, mask = inputs["input_ids"], inputs["attention_mask"]
    steps = torch.randint(3, VOCAB, (ids.shape[0], 14), generator=torch.Generator().manual_seed(5))
    cache = SlidingWindowKVCache(cached, window=WINDOW, sinks=SINKS, rerotate=True)
    with torch.no_grad():
        cached(ids, attention_mask=mask, position_ids=_positions(mask), past_key_values=cache, use_cache=True)
        for t in range(steps.shape[1]):
            seq = torch.cat([ids, steps[:, :t]], 1)
            full_mask = torch.cat([mask, torch.ones(ids.shape[0], t + 1, dtype=mask.dtype)], 1)
            pos = _positions(full_mask)[:, -1:]
            got = cached(
                steps[:, t : t + 1], attention_mask=full_mask, position_ids=pos, past_key_values=cache, use_cache=True
            ).logits[:, -1]
            for r in range(ids.shape[0]):
                real = seq[r][mask[r].bool().tolist() + [True] * t]
                n = real.numel()  # real tokens before the query, which sits at position n
                if n > SINKS + WINDOW:
                    toks = torch.cat([real[:SINKS], real[n - WINDOW :], steps[r, t : t + 1]])
                    pos_r = torch.arange(n - WINDOW - SINKS, n + 1)
                else:
                    toks = torch.cat([real, steps[r, t : t + 1]])
                    pos_r = torch.arange(n + 1)
                want = model(toks[None], position_ids=pos_r[None]).logits[0, -1]
                torch.testing.assert_close(got[r], want, rtol=1e-4, atol=1e-4)


def test_rerotate_composes_rotations():
    config = CohereConfig(**ONE_LAYER)
    spec = rotary_spec(config, config)
    x = torch.randn(2, 2, 3, config.hidden_size // config.num_attention_heads)
    torch.testing.assert_close(rerotate(rerotate(x, 5, spec), 7, spec), rerotate(x, 12, spec), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(rerotate(x, torch.tensor([3, 0]), spec)[1], x[1])


def test_length_dependent_rope_is_refused():
    config = LlamaConfig(rope_parameters={"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0}, **ONE_LAYER)
    with pytest.raises(ValueError, match="dynamic"):
        SlidingWindowKVCache(config, window=8, sinks=2)
    assert SlidingWindowKVCache(config, window=8, sinks=2, rerotate=False).rotary is None


def test_model_without_rope_has_nothing_to_rerotate():
    cache = SlidingWindowKVCache(tiny_model("gpt2"), window=8, sinks=2, rerotate=True)
    assert cache.rotary is None


# -- memory, hybrid models, composition, validation --------------------------------------------------------------


class _RecordBytes(LogitsProcessor):
    def __init__(self, cache):
        self.cache, self.nbytes, self.reserved = cache, [], []

    def __call__(self, input_ids, scores):
        self.nbytes.append(self.cache.nbytes)
        self.reserved.append(self.cache.reserved_nbytes)
        return scores


@pytest.mark.slow
def test_memory_is_flat_from_100_to_2500_tokens():
    """Past the window's first fill, stored and reserved bytes never change: over 2,500 tokens each layer's buffers
    compact about 30 times (the 68-token window turned over)."""
    model = tiny_model("llama", "sdpa")
    cache = SlidingWindowKVCache(model, window=64, sinks=4)
    record = _RecordBytes(cache)
    ids = torch.randint(3, VOCAB, (1, 8), generator=torch.Generator().manual_seed(0))
    model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        past_key_values=cache,
        max_new_tokens=2_500,
        min_new_tokens=2_500,
        do_sample=True,
        logits_processor=LogitsProcessorList([record]),
    )
    assert cache.get_seq_length() == 8 + 2_500 - 1
    assert len(set(record.nbytes[100:])) == 1, "nbytes changed after the window filled"
    assert max(record.reserved[100:]) == record.reserved[100]
    layer = cache.layers[0]
    per_token = 2 * model.config.num_key_value_heads * model.config.head_dim * 4
    assert record.nbytes[-1] == len(cache.layers) * 68 * per_token == cache.nbytes
    assert layer.stored_tokens == 68 == cache.stored_tokens == cache.max_stored_tokens


def test_chunked_prefill_bounds_the_keys_each_forward_attends():
    """The cap holds between forwards; prefill_chunk_size bounds what a prefill forward holds to cap + chunk."""
    model = tiny_model("llama", "sdpa")
    cache = SlidingWindowKVCache(model, window=WINDOW, sinks=SINKS)
    attended = []
    layer = cache.layers[0]
    update = layer.update
    layer.update = lambda k, v, *a, **kw: attended.append(update(k, v, *a, **kw)) or attended[-1]
    ids = torch.randint(3, VOCAB, (1, 40), generator=torch.Generator().manual_seed(0))
    out = model.generate(
        ids, attention_mask=torch.ones_like(ids), past_key_values=cache, max_new_tokens=4, prefill_chunk_size=4
    )
    assert out.shape == (1, 44)
    assert len(attended) >= 10, "the prompt was not prefilled in chunks"
    assert max(k.shape[-2] for k, _ in attended) <= SINKS + WINDOW + 4
    assert cache.stored_tokens == SINKS + WINDOW


def test_hybrid_model_keeps_its_own_sliding_window():
    model = tiny_model("gemma3", "eager")
    cache = SlidingWindowKVCache(model, window=WINDOW, sinks=SINKS)
    _generate(model, prompt("single"), cache)
    sliding_window = model.config.sliding_window
    for layer, layer_type in zip(cache.layers, model.config.layer_types):
        if layer_type == "sliding_attention":
            assert layer.is_sliding and layer.stored_tokens == sliding_window - 1
        else:
            assert not layer.is_sliding and layer.stored_tokens == WINDOW + SINKS
    assert cache.stored_tokens == WINDOW + SINKS  # the full-attention layers' count, not the model's own window


def test_int8_window_halves_bytes_and_stays_bounded():
    model = tiny_model("llama", "sdpa")
    full = SlidingWindowKVCache(model, window=WINDOW, sinks=SINKS)
    int8 = make_cache(f"sink:window={WINDOW}:sinks={SINKS}:bits=8", model)
    a = _generate(model, prompt("single"), full)
    b = _generate(model, prompt("single"), int8)
    assert int8.nbytes / full.nbytes == pytest.approx((16 + 4) / (16 * 4))  # int8 codes + fp32 scale vs fp32
    assert all(layer.quantized_tokens == WINDOW + SINKS for layer in int8.layers)
    error = max(float((x - y).abs().max()) for x, y in zip(a.logits, b.logits))
    assert 0 < error <= 0.06 * float(torch.stack(a.logits).std())


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(window=0), "window"),
        (dict(window=2.5), "window"),
        (dict(sinks=-1), "sinks"),
        (dict(rerotate="yes"), "rerotate"),
        (dict(bits=4), "bits"),
        (dict(bits=True), "bits"),
    ],
)
def test_bad_arguments_raise_value_error(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SlidingWindowKVCache(tiny_model("llama").config, **kwargs)


def test_registry_spec_and_repr():
    cache = make_cache("sink:window=32:sinks=0:rerotate=false", tiny_model("llama"))
    assert (cache.window, cache.sinks, cache.rerotate) == (32, 0, False)
    assert "window=32" in repr(cache)

"""Scoring through a cache in the forwards :func:`hf_kvcache.scoring.decode_equivalent_tokens` allows: every token's
logits equal one-token-per-forward decoding's (to float rounding) and the cache ends in the same state, for every
cache case of the matrix, on full-attention, sliding-window and hybrid models; a forward one token longer than allowed
is caught; the harness's tasks give the same numbers either way."""

from __future__ import annotations

import pytest
import torch
from matrix import CACHE_CASES
from models import VOCAB, config_model, tiny_model
from transformers import DynamicCache

from hf_kvcache import make_cache
from hf_kvcache.scoring import decode_equivalent_tokens, teacher_forced

PREFILL, SCORED = 20, 44
# Float rounding between one forward of n tokens and n forwards of one: at most 1e-6 seen on tiny models'
# log-probabilities (~5); a forward one token past what a cache allows moves them by 1e-3 and more (the negative test
# below, on Gemma 3, whose tiny K/V quantize coarsest).
ROUNDING = 1e-5

CASES = [pytest.param(case.spec, case.attn, case.families, id=case.id) for case in CACHE_CASES] + [
    pytest.param("dynamic", None, None, id="dynamic"),
    pytest.param("sink:window=30:sinks=2", None, None, id="sink-filling"),  # longer forwards until it evicts
    pytest.param("int4:residual_length=2:group_size=4:sinks=2", None, None, id="int4-sinks"),
]


def _rows(n: int = PREFILL + SCORED, seed: int = 3) -> torch.Tensor:
    return torch.randint(3, VOCAB, (2, n), generator=torch.Generator().manual_seed(seed))


def _score(model, spec: str, ids: torch.Tensor, chunk: int | None):
    """Per-token log-probabilities of ``ids``' scored part, the forwards' sizes and the cache."""
    cache = DynamicCache(config=model.config) if spec == "dynamic" else make_cache(spec, model)
    with torch.inference_mode():
        model(input_ids=ids[:, :PREFILL], past_key_values=cache)
        parts, sizes = [], []
        for _, logits in teacher_forced(model, cache, ids[:, PREFILL:], PREFILL, chunk):
            parts.append(logits.float().log_softmax(-1))
            sizes.append(logits.shape[1])
    return torch.cat(parts, 1), sizes, cache


def _state(cache) -> list:
    layers = getattr(cache, "layers", [])
    return [(getattr(layer, "stored_tokens", None), getattr(layer, "quantized_tokens", None)) for layer in layers]


@pytest.mark.parametrize("family", ["llama", "gemma3", "mistral"])
@pytest.mark.parametrize("spec, attn, families", CASES)
def test_longer_forwards_give_decodings_logits_and_state(spec, attn, families, family):
    if families and family not in families:
        pytest.skip(f"runs on {families}")
    model = tiny_model(family, attn or "sdpa")
    ids = _rows()
    stepwise, steps, one = _score(model, spec, ids, 1)
    merged, sizes, other = _score(model, spec, ids, None)
    assert steps == [1] * SCORED and sum(sizes) == SCORED
    torch.testing.assert_close(merged, stepwise, rtol=0, atol=ROUNDING)
    assert _state(other) == _state(one)
    if hasattr(one, "nbytes"):
        assert other.nbytes == one.nbytes
    if spec in ("dynamic", "paged:block_size=4") and family == "llama":
        assert sizes == [SCORED]  # lossless: one forward


@pytest.mark.parametrize(
    "spec, expected",
    [
        ("dynamic", 64),
        ("paged:block_size=4", 64),
        ("paged:block_size=4:bits=8", 1),
        ("int8", 1),
        ("int2:residual_length=4:group_size=8:residual_bits=8", 1),
        # 20 tokens: 16 encoded, 4 in the residual; the residual encodes its next 8 after 4 + 8 tokens
        ("int4:residual_length=4:group_size=8", 8),
        ("int4:residual_length=4:group_size=8:key_axis=token", 1),  # a unit of one token: it encodes after each
        ("sink:window=30:sinks=2", 13),  # 32 slots, 20 held: evicts after the 13th token
        ("sink:window=8:sinks=2", 1),
        ("sink:window=30:sinks=2:bits=8", 1),
    ],
)
def test_how_many_tokens_each_kind_allows_after_a_prefill(spec, expected):
    model = tiny_model("llama")
    cache = DynamicCache(config=model.config) if spec == "dynamic" else make_cache(spec, model)
    with torch.inference_mode():
        model(input_ids=_rows()[:, :PREFILL], past_key_values=cache)
    assert decode_equivalent_tokens(cache, 64) == expected
    assert decode_equivalent_tokens(cache, 1) == 1


@pytest.mark.parametrize(
    "family, spec",
    [
        ("llama", "int4:residual_length=4:group_size=8"),
        ("gemma3", "int8"),
        ("gemma3", "sink:window=8:sinks=2"),
    ],
)
def test_a_forward_one_token_longer_than_allowed_is_caught(family, spec):
    """The equivalence test above can fail: one token past the allowance reads a token in a form decoding never
    saw at that step (unencoded, unrounded, not yet evicted), and the logits move far past rounding. (Gemma 3's
    sliding layers stop a KIVI forward where decoding would encode tokens it evicts at once: one more is still equal
    there, so int4's case runs on Llama.)"""
    model = tiny_model(family)
    ids = _rows()
    stepwise, _, _ = _score(model, spec, ids, 1)
    cache = make_cache(spec, model)
    with torch.inference_mode():
        model(input_ids=ids[:, :PREFILL], past_key_values=cache)
        n = decode_equivalent_tokens(cache, SCORED) + 1
        mask = torch.ones(2, PREFILL + n, dtype=torch.long)
        logits = model(input_ids=ids[:, PREFILL : PREFILL + n], attention_mask=mask, past_key_values=cache).logits
    error = (logits.float().log_softmax(-1) - stepwise[:, :n]).abs().amax()
    assert error > 20 * ROUNDING


def test_an_int8_residual_reads_its_prompt_exactly_and_later_tokens_as_stored():
    """An int8 residual's first forward (the prompt) reads itself exactly, so its logits are ``DynamicCache``'s; a
    later forward reads its own tokens int8-rounded, as every later forward reads them. Scoring takes one token per
    forward (the numbers are coded as they come: a longer forward's float order would move some a step)."""
    spec = "int2:residual_length=4:group_size=8:residual_bits=8:sinks=2"
    model = tiny_model("llama")
    ids = _rows()
    cache = make_cache(spec, model)
    assert decode_equivalent_tokens(cache, 64) == 1
    with torch.inference_mode():
        got = model(input_ids=ids[:, :PREFILL], past_key_values=cache).logits
        want = model(input_ids=ids[:, :PREFILL], past_key_values=DynamicCache(config=model.config)).logits
        assert torch.equal(got, want) and decode_equivalent_tokens(cache, 64) == 1
        layer = cache.layers[0]
        k, v = (torch.randn(2, layer.spec.num_kv_heads, 1, layer.spec.key_dim) for _ in range(2))
        keys, _ = layer.update(k, v)
    codec = layer.residual_codec
    rounded = torch.empty_like(k), torch.empty_like(v)
    codec.decode(codec.encode(k, v), *rounded)
    assert torch.equal(keys[:, :, -1:], rounded[0]) and not torch.equal(rounded[0], k)


@pytest.mark.parametrize("spec", ["dynamic", "int4:residual_length=4:group_size=8", "paged:block_size=4"])
@pytest.mark.parametrize("model_type", ["qwen3_next", "falcon_h1"])
def test_hybrid_recurrent_layers_score_alike(model_type, spec):
    model = config_model(model_type)
    ids = _rows()
    stepwise, _, one = _score(model, spec, ids, 1)
    merged, sizes, other = _score(model, spec, ids, None)
    assert len(sizes) < SCORED
    torch.testing.assert_close(merged, stepwise, rtol=0, atol=ROUNDING)
    assert _state(other) == _state(one)


def test_bad_arguments_are_refused():
    model = tiny_model("llama")
    with pytest.raises(ValueError, match="limit"):
        decode_equivalent_tokens(DynamicCache(), 0)
    with pytest.raises(ValueError, match="chunk"):
        next(teacher_forced(model, DynamicCache(), _rows()[:, :4], 0, chunk=0))


def test_a_cache_we_cannot_read_takes_one_token_per_forward():
    from transformers import StaticCache

    model = tiny_model("llama")
    cache = StaticCache(config=model.config, max_cache_len=128)
    assert decode_equivalent_tokens(cache, 64) == 1


@pytest.mark.parametrize("model_type, longer", [("falcon_h1", True), ("deepseek_v32", False)])
def test_layers_beside_attention_answer_for_their_attention_layer(model_type, longer):
    """Falcon-H1's layers keep recurrent states beside attention (the attention layer answers); DeepSeek-V3.2's keep
    an indexer whose top-k over a longer forward is not checked against decoding's (one token per forward)."""
    model = config_model(model_type)
    cache = make_cache("int4", model)
    with torch.inference_mode():
        model(input_ids=_rows()[:, :PREFILL], past_key_values=cache)
    assert (decode_equivalent_tokens(cache, 64) > 1) is longer

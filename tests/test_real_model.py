"""The real tier: SmolLM2-135M-Instruct (``load_model("smollm2")``), the model every published table comes from.

Skipped, with the install command as the reason, only where its package is absent; CI sets
``HF_KVCACHE_REQUIRE_REAL_MODEL=1`` so that there it fails instead. Documents are short and samples few: the tier
adds about a minute and a half of one worker to the suite.
"""

from __future__ import annotations

import math
import os

import pytest
import torch

from hf_kvcache import load_model, make_cache
from hf_kvcache.eval import EvalConfig, run_eval, window_perplexity
from hf_kvcache.eval.runner import tokenize
from hf_kvcache.models import SMOLLM2, real_model_available
from hf_kvcache.reference import full_forward_nll, reference_text

if not real_model_available():
    if os.environ.get("HF_KVCACHE_REQUIRE_REAL_MODEL") == "1":
        raise RuntimeError(f"the real model is required here; install it: {SMOLLM2.install_command}")
    pytest.skip(f"the real model is not installed ({SMOLLM2.install_command})", allow_module_level=True)


@pytest.fixture(scope="module")
def smollm2():
    return load_model("smollm2")


@pytest.fixture(scope="module")
def text_ids(smollm2):
    return tokenize(smollm2[1], reference_text()[:20_000])


def test_it_is_the_model_the_card_describes(smollm2):
    model, tokenizer = smollm2
    c = model.config
    shape = (c.model_type, c.num_hidden_layers, c.num_attention_heads, c.num_key_value_heads, c.head_dim)
    assert shape == ("llama", 30, 9, 3, 64)
    assert c.max_position_embeddings == 8192 and c.vocab_size == 49152
    assert sum(p.numel() for p in model.parameters()) == 134_515_008
    assert not hasattr(c, "quantization_config")  # a plain float model: save_pretrained, any cache, any dtype
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    inputs = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    out = model.generate(**inputs, max_new_tokens=12, do_sample=False)
    assert "Paris" in tokenizer.decode(out[0, inputs["input_ids"].shape[1] :])


def test_dynamic_cache_perplexity_equals_a_full_forward(smollm2, text_ids):
    model, _ = smollm2
    ids = text_ids[:512]
    result = window_perplexity(
        model, ids, lambda: make_cache("dynamic", model), context=256, prefill=128, chunk=16, batch_size=2
    )
    total, count = 0.0, 0
    with torch.no_grad():
        for window in ids.view(2, 256):
            logits = model(window[None]).logits[0, 127:-1]
            total += torch.nn.functional.cross_entropy(logits, window[128:], reduction="sum").item()
            count += 128
    assert result.tokens_scored == count
    assert result.nll == pytest.approx(total, rel=1e-4)
    # and the model card's protocol (whole windows, no cache) gives a real model's perplexity on the novel
    nll, tokens = full_forward_nll(model, ids, context=256)
    assert 10 < math.exp(nll / tokens) < 80


KIVI_INT2 = "int2:rotate=none:sinks=0:pre_rope=false"


def test_quantization_costs_in_order_and_int8_stays_within_its_bound(smollm2):
    model, tokenizer = smollm2
    config = EvalConfig(
        task=("perplexity",),
        caches=("dynamic", "int8", "int4", "int2", KIVI_INT2),
        max_tokens=1024,
        context=512,
        prefill=384,
        chunk=16,
        batch_size=2,
        quiet=True,
    )
    ppl = {r["cache"]: r["perplexity"]["perplexity"] for r in run_eval(config, model, tokenizer)["results"]}
    assert abs(ppl["int8"] / ppl["dynamic"] - 1) < 0.01  # the stated bound: int8 within 1% of DynamicCache
    assert ppl[KIVI_INT2] > ppl["int2"] > ppl["int4"] > ppl["int8"] * 0.999
    # KIVI's 2-bit layout costs this model several percent; the default int2 (rotation, sinks, pre-RoPE keys) less.
    assert ppl[KIVI_INT2] > ppl["dynamic"] * 1.03


def test_it_copies_and_finds_passkeys_and_a_short_window_loses_them(smollm2):
    model, tokenizer = smollm2
    config = EvalConfig(
        task=("repeat", "passkey"),
        caches=("dynamic", "sink:window=256:sinks=4"),
        distances=(200,),
        passage=64,
        repeat_chunk=4,  # the second copy through the cache 4 tokens per forward: a quarter of the forwards
        lengths=(640,),
        depths=(0.0, 0.25),  # the key is ~450 to 640 tokens before the question: outside a 256-token window
        samples=2,
        quiet=True,
    )
    results = {r["cache"]: r for r in run_eval(config, model, tokenizer)["results"]}
    dynamic, sink = results["dynamic"], results["sink:window=256:sinks=4"]
    assert dynamic["repeat"]["summary"]["ratio"] < 0.2  # the second copy is far easier than the first: it copies
    assert dynamic["passkey"]["summary"]["accuracy"] >= 3 / 4
    assert sink["passkey"]["summary"]["accuracy"] <= 1 / 4


def test_a_passkey_document_in_the_chat_template(smollm2, text_ids):
    from hf_kvcache.eval.tasks.passkey import build_passkey_document

    _, tokenizer = smollm2
    doc = build_passkey_document(tokenizer, text_ids, 400, 0.5, "12345", chat=True)
    assert len(doc.context) + len(doc.question) == 400
    assert tokenizer.decode(doc.context).startswith("<|im_start|>system")
    assert tokenizer.decode(doc.question).endswith("<|im_end|>\n<|im_start|>assistant\nThe pass key is")
    assert "12345" in tokenizer.decode(doc.context[doc.needle_start :])


def test_chat_template_refused_where_the_tokenizer_has_none():
    from hf_kvcache.eval.tasks.passkey import build_passkey_document

    _, tokenizer = load_model("reference")
    with pytest.raises(ValueError, match="--chat-template"):
        build_passkey_document(tokenizer, torch.arange(5, 600), 300, 0.5, "1", chat=True)

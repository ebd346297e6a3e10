"""One prefill, several caches: K/V stored with ``store_prefill`` leave a cache in the state a prefill through it
leaves (bytes, stored tokens, and the next forwards' logits, exactly), for every cache case of the matrix, padded
batches, sliding eviction inside the prompt, and pages."""

from __future__ import annotations

import pytest
import torch
from matrix import CACHE_CASES
from models import prompt, tiny_model
from transformers import DynamicCache

from hf_kvcache import make_cache
from hf_kvcache.prefill import store_prefill, write_tokens

CASES = [pytest.param(case, id=case.id) for case in CACHE_CASES] + [
    pytest.param(None, id="dynamic"),
    # windows shorter than the prompt: eviction inside the prefill
    pytest.param("sink:window=6:sinks=2", id="sink-evicting"),
    pytest.param("int4:residual_length=2:group_size=4:sinks=2", id="int4-sinks"),
]


def _spec(case) -> str:
    return case if isinstance(case, str) else "dynamic" if case is None else case.spec


@pytest.mark.parametrize("family", ["llama", pytest.param("gemma3", marks=pytest.mark.slow)])
@pytest.mark.parametrize("batch", ["single", "padded"])
@pytest.mark.parametrize("case", CASES)
def test_stored_prefill_equals_prefill_through_the_cache(case, batch, family):
    attn = getattr(case, "attn", None) or "sdpa"
    if getattr(case, "families", None) and family not in case.families:
        pytest.skip(f"{case.id} runs on {case.families}")
    model = tiny_model(family, attn)
    inputs = prompt(batch, length=20)
    spec = _spec(case)
    with torch.inference_mode():
        through = make_cache(spec, model)
        prefill = model(**inputs, past_key_values=through).logits
        once = DynamicCache()  # no config: every layer keeps the whole prompt, sliding ones too
        model(**inputs, past_key_values=once)
        stored = store_prefill(
            make_cache(spec, model), [(layer.keys, layer.values) for layer in once.layers], inputs["attention_mask"]
        )
        assert stored.get_seq_length() == through.get_seq_length() == 20
        nbytes = getattr(through, "nbytes", None)
        if nbytes is not None:
            assert stored.nbytes == nbytes
            assert [layer.stored_tokens for layer in stored.layers] == [layer.stored_tokens for layer in through.layers]
        mask, new = inputs["attention_mask"], prefill[:, -1:].argmax(-1)
        for _ in range(3):  # decode steps read what each cache holds: the same logits, bit for bit
            mask = torch.cat([mask, torch.ones_like(new)], 1)
            a = model(input_ids=new, attention_mask=mask, past_key_values=through).logits
            b = model(input_ids=new, attention_mask=mask, past_key_values=stored).logits
            torch.testing.assert_close(b, a, rtol=0, atol=0)
            new = a[:, -1:].argmax(-1)


def test_store_prefill_refuses_a_cache_that_holds_tokens_and_a_wrong_layer_count():
    model = tiny_model("llama")
    inputs = prompt("single")
    with torch.inference_mode():
        once = DynamicCache(config=model.config)
        model(**inputs, past_key_values=once)
        windowed = DynamicCache(config=tiny_model("gemma3").config)
        tiny_model("gemma3")(**prompt("single", length=20), past_key_values=windowed)
    kv = [(layer.keys, layer.values) for layer in once.layers]
    with pytest.raises(ValueError, match="needs an empty cache; this one holds 12 tokens"):
        store_prefill(once, kv)
    with pytest.raises(ValueError, match="got the K/V of 1 layers for a cache of 2 layers"):
        store_prefill(make_cache("int8", model), kv[:1])
    with pytest.raises(ValueError, match="layer 1 got 20 tokens, layer 0 got 9: every layer needs the whole prompt"):
        store_prefill(make_cache("int8", tiny_model("gemma3")), [(x.keys, x.values) for x in windowed.layers])


@pytest.mark.parametrize(
    "spec, lossless",
    [("int4:residual_length=2:group_size=4:sinks=2", False), ("int8", False), ("int4:residual_length=64", True),
     ("paged:block_size=4", True), ("sink:window=6:sinks=2", False)],
)  # fmt: skip
@pytest.mark.parametrize("batch", ["single", "padded"])
def test_chunked_writes_store_what_a_chunked_prefill_stores(spec, lossless, batch):
    """Chunk by chunk, every layer in order per chunk (a model's chunked prefill): ``write_tokens`` stores what
    forwards through the cache store. Exactly so where the cache is lossless; a lossy cache's second chunk attends to
    the first one's codes (or, evicting, its window only), so its deeper layers' K/V differ from an exact
    prefill's: the same bytes and tokens."""
    model = tiny_model("llama")
    inputs = prompt(batch, length=20)
    ids, mask = inputs["input_ids"], inputs["attention_mask"]
    with torch.inference_mode():
        through, every = make_cache(spec, model), DynamicCache()
        for a, b in ((0, 12), (12, 20)):
            for cache in (through, every):
                model(input_ids=ids[:, a:b], attention_mask=mask[:, :b], past_key_values=cache)
        written = make_cache(spec, model)
        written.before_forward({"attention_mask": mask[:, :12]})
        for a, b in ((0, 12), (12, 20)):
            for i, layer in enumerate(every.layers):
                write_tokens(written, i, layer.keys[:, :, a:b], layer.values[:, :, a:b])
        assert written.nbytes == through.nbytes
        assert [x.stored_tokens for x in written.layers] == [x.stored_tokens for x in through.layers]
        if lossless:
            step = torch.full((ids.shape[0], 1), 7)
            mask = torch.cat([mask, torch.ones_like(step)], 1)
            a = model(input_ids=step, attention_mask=mask, past_key_values=through).logits
            b = model(input_ids=step, attention_mask=mask, past_key_values=written).logits
            torch.testing.assert_close(b, a, rtol=0, atol=0)


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_a_left_padded_shared_prefill_is_continued_by_generate_as_its_own_prompt(family):
    """A left-padded batch's prefill runs at generate's positions (each row counted from its first real token), so
    generate continuing it from a cache it was stored in computes what it computes on the whole prompt at once."""
    from hf_kvcache.prefill import SharedPrefill

    model = tiny_model(family)
    inputs = prompt("padded", length=20)
    ids, mask = inputs["input_ids"], inputs["attention_mask"]
    settings = {"max_new_tokens": 4, "do_sample": False, "output_logits": True, "return_dict_in_generate": True}
    with torch.inference_mode():
        whole = model.generate(**inputs, past_key_values=DynamicCache(), **settings)
        cache = SharedPrefill(model, ids[:, :16], mask[:, :16]).into(make_cache("dynamic", model))
        continued = model.generate(**inputs, past_key_values=cache, **settings)
    assert torch.equal(continued.sequences, whole.sequences)
    for a, b in zip(continued.logits, whole.logits, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)

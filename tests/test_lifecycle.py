"""The cache lifecycle contract, for every cache kind of the shared matrix: reset() gives a fresh cache (any batch,
dtype); without reset a forward that does not match the stored state is a ValueError; a dropped cache frees its
storage at once (no reference cycles); one hook per model however many caches live."""

from __future__ import annotations

import copy
import gc
import weakref

import pytest
import torch
from matrix import CACHE_CASES
from models import tiny_model
from transformers import DynamicCache

from hf_kvcache import make_cache
from hf_kvcache._hooks import hook_count

# Every kind once on a full-attention family, variants on their own families, the paged attention under its own
# implementation: (case, family).
CASES = [
    pytest.param(case, family, id=f"{case.id}-{family}")
    for case in CACHE_CASES
    for family in (case.families or ("llama", "gemma3"))
]


def _ids(batch: int, length: int = 10, seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 100, (batch, length), generator=g)
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}


def _generate(model, cache, inputs, new=6):
    return model.generate(
        **inputs,
        past_key_values=cache,
        max_new_tokens=new,
        min_new_tokens=new,
        do_sample=False,
        output_logits=True,
        return_dict_in_generate=True,
    )


def _same(a, b):
    torch.testing.assert_close(a.sequences, b.sequences, rtol=0, atol=0)
    for x, y in zip(a.logits, b.logits):
        torch.testing.assert_close(x, y, rtol=0, atol=0)


_BF16: dict = {}


def _model(case, family, dtype=torch.float32):
    """The matrix's tiny model, or a bfloat16 copy of it (made once)."""
    attn = case.attn or "sdpa"
    if dtype == torch.float32:
        return tiny_model(family, attn)
    if (family, attn) not in _BF16:
        _BF16[family, attn] = copy.deepcopy(tiny_model(family, attn)).to(torch.bfloat16)
    return _BF16[family, attn]


@pytest.mark.parametrize("case, family", CASES)
@pytest.mark.parametrize("batches", [(3, 1), (1, 4)], ids=["shrink", "grow"])
def test_reset_cache_equals_a_fresh_one_for_another_batch_size(case, family, batches):
    model = _model(case, family)
    cache = make_cache(case.spec, model)
    _generate(model, cache, _ids(batches[0]))
    cache.reset()
    again = _generate(model, cache, _ids(batches[1], seed=1))
    _same(again, _generate(model, make_cache(case.spec, model), _ids(batches[1], seed=1)))


@pytest.mark.parametrize("case, family", CASES)
def test_reset_cache_takes_the_dtype_of_its_next_forward(case, family):
    """After reset a bfloat16 model gets what a new cache gives it: same outputs, same bytes (no float32 residual
    or pool left over from the float32 forward)."""
    model, bf16 = _model(case, family), _model(case, family, torch.bfloat16)
    cache = make_cache(case.spec, model)
    _generate(model, cache, _ids(1))
    cache.reset()
    again = _generate(bf16, cache, _ids(1, seed=1))
    fresh = make_cache(case.spec, bf16)
    _same(again, _generate(bf16, fresh, _ids(1, seed=1)))
    assert cache.nbytes == fresh.nbytes


def _stored_tensors(cache) -> list[torch.Tensor]:
    """Every tensor reachable from the cache's layers (iteratively: a recursive closure would itself be a cycle)."""
    found, stack = [], [(cache.layers, 0)]
    while stack:
        obj, depth = stack.pop()
        if isinstance(obj, torch.Tensor):
            found.append(obj)
        elif isinstance(obj, dict):
            stack += [(v, depth + 1) for v in obj.values()]
        elif isinstance(obj, (list, tuple)):
            stack += [(v, depth + 1) for v in obj]
        elif depth < 8 and hasattr(obj, "__dict__") and not isinstance(obj, torch.nn.Module):
            stack.append((vars(obj), depth + 1))
    return found


@pytest.mark.parametrize("case, family", CASES)
def test_a_forward_that_does_not_match_the_stored_state_is_a_value_error(case, family):
    model = _model(case, family)
    cache = make_cache(case.spec, model)
    with torch.no_grad():
        model(**_ids(2), past_key_values=cache)
        before = cache.get_seq_length()
        with pytest.raises(ValueError, match=r"holds a batch of 2 rows.*passes 1 rows.*cache.reset\(\)"):
            model(**_ids(1, 1), past_key_values=cache)
        with pytest.raises(ValueError, match=r"float32.*bfloat16.*cache.reset\(\)"):
            _model(case, family, torch.bfloat16)(**_ids(2, 1), past_key_values=cache)
    assert cache.get_seq_length() == before
    with torch.no_grad():  # the cache is still usable with a matching forward
        model(**_ids(2, 1), past_key_values=cache)
    assert cache.get_seq_length() == before + 1


def test_dynamic_cache_also_refuses_a_smaller_batch():
    """The behaviour we match: transformers' DynamicCache raises too (a shape error, ours is a ValueError)."""
    model = tiny_model("llama")
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(**_ids(2), past_key_values=cache)
        with pytest.raises(RuntimeError):
            model(**_ids(1, 1), past_key_values=cache)


@pytest.mark.parametrize("case, family", CASES)
def test_a_dropped_cache_frees_its_storage_at_once(case, family):
    """No reference cycles: with the cycle collector off, dropping the last reference frees every tensor."""
    model = _model(case, family)
    gc.disable()
    try:
        cache = make_cache(case.spec, model)
        with torch.no_grad():
            model(**_ids(2, 12), past_key_values=cache)
            model(**_ids(2, 1), past_key_values=cache)
        tensors = [weakref.ref(t) for t in _stored_tensors(cache)]
        assert tensors, "found no storage to watch"
        cache_ref = weakref.ref(cache)
        del cache
        assert cache_ref() is None, "the cache is part of a reference cycle"
        assert all(ref() is None for ref in tensors), "storage outlived its cache"
    finally:
        gc.enable()


@pytest.mark.parametrize("spec", ["sink:window=8:sinks=2", "paged:block_size=4"])
def test_one_hook_per_model_whatever_the_number_of_live_caches(spec):
    model = tiny_model("qwen2")
    hooks_before = len(model._forward_pre_hooks)
    caches = [make_cache(spec, model) for _ in range(200)]
    assert len(model._forward_pre_hooks) == hooks_before + 1 and hook_count(model) == 200
    inputs = _ids(2)
    inputs["attention_mask"][1, :3] = 0
    with torch.no_grad():
        model(**inputs, past_key_values=caches[7])
    assert caches[7].padding.pad == (0, 3) and caches[8].padding.pad is None  # only the cache passed is told
    gc.disable()
    try:
        del caches
        assert len(model._forward_pre_hooks) == hooks_before and hook_count(model) == 0
    finally:
        gc.enable()


@pytest.mark.parametrize("spec", ["sink:window=64:sinks=2", "paged:block_size=4", "int8", "int4:residual_length=4"])
@pytest.mark.parametrize("how", [copy.deepcopy, copy.copy])
def test_a_copy_keeps_hearing_about_padding_after_the_original_is_gone(spec, how):
    """A copy counts in the model's hook: once the original is collected, the copy still reads each row's left
    padding, and a deep copy generates what a fresh cache of its spec does (a shallow copy shares the original's
    storage)."""
    model = tiny_model("qwen2")
    inputs = _ids(2, 10, seed=3)
    inputs["attention_mask"][1, :4] = 0
    gc.collect()
    before = hook_count(model)
    original = make_cache(spec, model)
    with torch.no_grad():  # a used cache (the paged pool of the copy must grow on the copy's side)
        model(**_ids(1, 3), past_key_values=original)
    original.reset()
    observes = original.__dict__.get("_observed_model") is not None  # built from a model, reading its padding
    clone = how(original)
    assert hook_count(model) == before + 2 * observes
    del original
    gc.collect()
    assert hook_count(model) == before + observes
    if how is copy.deepcopy:
        out = _generate(model, clone, inputs)
        _same(out, _generate(model, make_cache(spec, model), inputs))
        if observes:  # lossless here: the window holds every token
            _same(out, _generate(model, DynamicCache(), inputs))
            assert clone.padding.pad == (0, 4)


def test_quantized_cache_adds_no_hook_where_padding_moves_nothing():
    """int8 encodes every token on its own and keeps no sinks: it needs no row's padding, so adds no hook; int4's key
    groups span tokens (padding must not set their ranges), so its caches share one."""
    model = tiny_model("phi3")
    before = len(model._forward_pre_hooks)
    caches = [make_cache("int8", model) for _ in range(10)]
    assert len(model._forward_pre_hooks) == before and caches
    caches += [make_cache("int4", model) for _ in range(10)]
    assert len(model._forward_pre_hooks) == before + 1

"""The shared equivalence matrix: every cache kind against DynamicCache, on every family, attention implementation,
batch shape and generate() mode."""

from __future__ import annotations

from functools import cache

import pytest
import torch
from matrix import DETERMINISTIC_GREEDY, MODES, matrix
from models import prompt, tiny_model
from transformers import DynamicCache

from hf_kvcache import make_cache
from hf_kvcache._compat import CACHE_ARG, returned_cache

NEW_TOKENS = 16


def _generate(family, attn, batch, mode, cache, max_new_tokens=NEW_TOKENS, inputs=None):
    model = tiny_model(family, attn)
    kwargs = dict(MODES[mode])
    if mode == "assisted":
        kwargs["assistant_model"] = tiny_model(family, attn, seed=1)
    torch.manual_seed(1234)
    return model.generate(
        **(inputs or prompt(batch)),
        **{CACHE_ARG: cache},  # the name this transformers release takes (past_key_values before 5.24)
        max_new_tokens=max_new_tokens,
        min_new_tokens=max_new_tokens,
        output_logits=True,
        return_dict_in_generate=True,
        **kwargs,
    )


@cache
def _reference(family, attn, batch, mode):
    return _generate(family, attn, batch, mode, DynamicCache(config=tiny_model(family).config))


def _first_difference(a: torch.Tensor, b: torch.Tensor) -> tuple[int, int] | None:
    diff = (a != b).nonzero()
    if not len(diff):
        return None
    step = int(diff[:, 1].min())
    row = int(diff[diff[:, 1] == step][0, 0])
    return row, step


@pytest.mark.parametrize("case, family, attn, batch, mode", matrix())
def test_generate_matches_dynamic_cache(case, family, attn, batch, mode):
    """Lossless kinds: identical tokens and logits. Lossy kinds: while the sequences agree (and at the first step
    where they differ, whose prefix is still shared) every logit is within the stated bound; int8 in the greedy modes
    may change a token only where the error can explain it (reference top-2 gap <= 2x the logit error there)."""
    ref = _reference(family, attn, batch, mode)
    cache_attn = case.attn or attn
    cache = make_cache(case.spec, tiny_model(family, cache_attn))
    out = _generate(family, cache_attn, batch, mode, cache)

    assert out.sequences.shape == ref.sequences.shape
    assert returned_cache(out) is cache
    if case.lossless:
        torch.testing.assert_close(out.sequences, ref.sequences, rtol=0, atol=0)
        for got, want in zip(out.logits, ref.logits):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        return
    prompt_len = ref.sequences.shape[1] - len(ref.logits)
    flip = _first_difference(out.sequences, ref.sequences)
    # Beam rows are reshuffled every step, so only the prefill step's logits are comparable row by row.
    last = 0 if mode.startswith("beam") else (flip[1] - prompt_len if flip else len(ref.logits) - 1)
    for step in range(last + 1):
        error = (out.logits[step] - ref.logits[step]).abs().amax(-1)
        bound = case.logit_bound * ref.logits[step].std(-1)
        assert (error <= bound).all(), f"step {step}: logit error {error.tolist()} > bound {bound.tolist()}"
    if case.greedy_exact and mode in DETERMINISTIC_GREEDY and flip is not None:
        row, step = flip
        logits = ref.logits[step - prompt_len][row]
        top2 = logits.topk(2).values
        error = (out.logits[step - prompt_len][row] - logits).abs().max()
        assert top2[0] - top2[1] <= 2 * error, (
            f"{case.id} changed token {step} of row {row}: the reference's top-2 logits differ by "
            f"{float(top2[0] - top2[1]):.5f}, more than twice the logit error there ({float(error):.5f})"
        )


@pytest.mark.parametrize("case, family, attn, batch, mode", matrix(modes=("greedy",)))
def test_continuation_reproduces_single_call(case, family, attn, batch, mode):
    attn = case.attn or attn
    model = tiny_model(family, attn)
    whole = _generate(family, attn, batch, "greedy", make_cache(case.spec, model), max_new_tokens=18)
    cache = make_cache(case.spec, model)
    first = _generate(family, attn, batch, "greedy", cache, max_new_tokens=10)
    assert cache.get_seq_length() == first.sequences.shape[1] - 1
    mask = torch.cat([prompt(batch)["attention_mask"], torch.ones(first.sequences.shape[0], 10, dtype=torch.long)], 1)
    inputs = {"input_ids": first.sequences, "attention_mask": mask}
    second = _generate(family, attn, batch, "greedy", cache, max_new_tokens=8, inputs=inputs)
    torch.testing.assert_close(second.sequences, whole.sequences, rtol=0, atol=0)


@torch.no_grad()
def _teacher_forced_logits(model, ids, cache, prefill=8):
    out = model(ids[:, :prefill], past_key_values=cache, use_cache=True)
    logits = [out.logits[:, -1]]
    for t in range(prefill, ids.shape[1]):
        logits.append(model(ids[:, t : t + 1], past_key_values=cache, use_cache=True).logits[:, -1])
    return torch.stack(logits, 1)


@pytest.mark.parametrize("case, family, attn, batch, mode", matrix(batches=("single",), modes=("greedy",)))
def test_logit_error_within_stated_bound(case, family, attn, batch, mode):
    """Feed the same 64 tokens through DynamicCache and the cache under test, one decode step at a time."""
    model = tiny_model(family, attn)
    ids = torch.randint(3, model.config.vocab_size, (1, 64), generator=torch.Generator().manual_seed(3))
    ref = _teacher_forced_logits(model, ids, DynamicCache(config=model.config))
    cache_model = tiny_model(family, case.attn or attn)
    cache = make_cache(case.spec, cache_model)
    got = _teacher_forced_logits(cache_model, ids, cache)
    error = float((got - ref).abs().max() / ref.std())
    if case.lossless:
        assert error < 1e-5
    else:
        assert error <= case.logit_bound, f"{case.id}: logit error {error:.4f} x std > bound {case.logit_bound}"
        assert error > 0, "a lossy cache that changes nothing did not quantize anything"
        assert sum(getattr(layer, "quantized_tokens", 0) for layer in cache.layers) > 0

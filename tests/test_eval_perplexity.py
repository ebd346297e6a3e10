"""The harness's perplexity protocol: through a DynamicCache it equals a plain full forward over each window."""

from __future__ import annotations

import math

import pytest
import torch
from models import VOCAB, tiny_model
from transformers import DynamicCache

from hf_kvcache import make_cache
from hf_kvcache.eval import stream_perplexity, window_perplexity, windows


def _full_forward_nll(model, ids, context, prefill):
    total, count = 0.0, 0
    with torch.no_grad():
        for window in windows(ids, context, prefill):
            logits = model(window[None]).logits[0, prefill - 1 : -1]
            total += torch.nn.functional.cross_entropy(logits, window[prefill:], reduction="sum").item()
            count += window.numel() - prefill
    return total, count


@pytest.mark.parametrize("family", ["llama", "gemma3", "gpt2"])
@pytest.mark.parametrize("attn", ["eager", "sdpa"])
@pytest.mark.parametrize("chunk, batch_size", [(1, 1), (3, 2), (50, 4)])
def test_dynamic_cache_equals_full_forward(family, attn, chunk, batch_size):
    model = tiny_model(family, attn)
    ids = torch.randint(3, VOCAB, (4 * 24 + 13,), generator=torch.Generator().manual_seed(0))  # partial last window
    result = window_perplexity(
        model, ids, lambda: DynamicCache(config=model.config), context=24, prefill=8, chunk=chunk, batch_size=batch_size
    )
    nll, count = _full_forward_nll(model, ids, context=24, prefill=8)
    assert (result.tokens_scored, result.windows) == (count, 5)
    assert result.nll == pytest.approx(nll, rel=1e-5)
    assert result.perplexity == pytest.approx(math.exp(nll / count), rel=1e-5)


def test_lossy_cache_costs_perplexity_and_lossless_does_not():
    model = tiny_model("llama", "sdpa")
    ids = torch.randint(3, VOCAB, (96,), generator=torch.Generator().manual_seed(1))
    run = {
        spec: window_perplexity(model, ids, lambda spec=spec: make_cache(spec, model), context=48, prefill=8)
        for spec in ("dynamic", "paged:block_size=4", "int2:residual_length=4:group_size=8")
    }
    assert run["paged:block_size=4"].nll == pytest.approx(run["dynamic"].nll, rel=1e-6)
    assert run["int2:residual_length=4:group_size=8"].nll != run["dynamic"].nll  # the cache is read back


def test_stream_buckets_add_up_and_report_flat_sink_memory():
    model = tiny_model("llama", "sdpa")
    ids = torch.randint(3, VOCAB, (200,), generator=torch.Generator().manual_seed(2))
    cache = make_cache("sink:window=16:sinks=2", model)
    result = stream_perplexity(model, ids, cache, prefill=4, bucket_size=50)
    assert sum(result.tokens) == 200 - 4 and len(result.tokens) == 4
    assert len(set(result.cache_bytes[1:])) == 1  # flat once the window is full
    dynamic = stream_perplexity(model, ids, DynamicCache(config=model.config), prefill=4, bucket_size=50)
    assert dynamic.cache_bytes[-1] > 5 * result.cache_bytes[-1]


@pytest.mark.parametrize(
    "kwargs, match",
    [(dict(prefill=0), "prefill"), (dict(context=8, prefill=8), "context"), (dict(chunk=0), "chunk")],
)
def test_bad_protocol_arguments(kwargs, match):
    model = tiny_model("llama")
    ids = torch.arange(3, 40)
    with pytest.raises(ValueError, match=match):
        window_perplexity(
            model, ids, lambda: DynamicCache(config=model.config), **({"context": 16, "prefill": 4} | kwargs)
        )


def test_stream_in_chunks_scores_the_same_tokens_as_pure_decode():
    model = tiny_model("llama", "sdpa")
    ids = torch.randint(3, VOCAB, (120,), generator=torch.Generator().manual_seed(3))
    one = stream_perplexity(model, ids, DynamicCache(config=model.config), prefill=4, bucket_size=40)
    chunked = stream_perplexity(model, ids, DynamicCache(config=model.config), prefill=4, chunk=7, bucket_size=40)
    assert chunked.tokens == one.tokens
    assert chunked.nll == pytest.approx(one.nll, rel=1e-5)  # DynamicCache is exact either way

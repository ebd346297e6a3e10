"""Scoring a text through a cache in as few forwards as give what decoding it one token at a time gives.

Perplexity *through* a cache feeds the text the way generation does, one token per forward, so that every prediction
reads what the cache kept of the tokens before it. Most of those forwards can be merged without changing a number: a
forward attends to its own new tokens exactly, so a forward of ``n`` tokens gives each of them the logits of its own
one-token forward as long as decoding would not have changed a stored token's form between the first of them and the
last. How long that is depends on the cache's state, and each layer says it
(``layer.decode_equivalent_tokens(limit)``):

- ``DynamicCache``, exact pages, a model's own sliding-window layers: any number (a stored token is the token);
- KIVI codes (``QuantizedKVCache`` at 4, 3, 2 bits) with their exact residual: until the residual would next encode
  a group (``residual_length + group_size`` tokens after the last encode): 64 tokens a forward at SmolLM2's defaults;
- a sink window: until it would start evicting;
- int8 codes with no residual, an int8 residual, int8 pages, an evicting window, any layer we do not know: one token
  per forward (the next token reads the previous one rounded or evicted; an int8 residual's forward reads its own
  tokens rounded too, but int8 codes every token's numbers as they come, and a longer forward's float order moves
  those on a rounding boundary a step).

The cache's stored state after the longer forward is the one the one-token forwards leave too (the same tokens
encoded in the same groups). What differs is float rounding: a forward over ``n`` tokens sums in another order than
``n`` one-token forwards, so logits agree to rounding (tested for every kind against one token per forward), and a
code on a rounding boundary may land one step away, as it may between two machines.

:func:`teacher_forced` is the loop: the harness's ``perplexity`` and ``repeat`` use it (``--stepwise`` makes them
take one token per forward), and a user's own scoring loop can too.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from transformers.cache_utils import (
    Cache,
    DummyLayer,
    DynamicCache,
    DynamicLayer,
    DynamicSlidingWindowLayer,
    LinearAttentionAndFullAttentionLayer,
    LinearAttentionAndSlidingWindowAttentionLayer,
    LinearAttentionLayer,
)

from ._compat import with_cache
from ._validate import check_int

__all__ = ["decode_equivalent_tokens", "teacher_forced", "tokens_per_forward"]

# transformers' layers that store what they are given and read it back unchanged (its quantized layers subclass
# DynamicLayer and re-quantize: matched by exact type, not isinstance)
_EXACT_LAYERS = (
    DynamicLayer,
    DynamicSlidingWindowLayer,
    LinearAttentionLayer,
    LinearAttentionAndFullAttentionLayer,
    LinearAttentionAndSlidingWindowAttentionLayer,
    DummyLayer,
)


def _layer_tokens(layer, limit: int) -> int:
    """How many of the next tokens, at most ``limit``, one forward can take through ``layer`` with the logits and
    stored state of one forward per token: the layer's own answer, ``limit`` for transformers' exact layers, else 1."""
    own = getattr(layer, "decode_equivalent_tokens", None)
    if own is not None:
        return own(limit)
    return limit if type(layer) in _EXACT_LAYERS else 1


def decode_equivalent_tokens(cache: Cache, limit: int) -> int:
    """How many of the next tokens, at most ``limit``, one forward can take through ``cache`` with the logits (to
    float rounding) and stored state that one forward per token gives: the least over its layers (see the module
    docstring). Always at least 1; 1 for a cache without layers we can read.

    >>> from transformers import DynamicCache
    >>> decode_equivalent_tokens(DynamicCache(), 100)
    100
    """
    check_int("limit", limit, 1)
    layers = getattr(cache, "layers", None)
    if not layers:
        return limit if type(cache) is DynamicCache else 1  # its layers come with the first forward
    return max(1, min(_layer_tokens(layer, limit) for layer in layers))


def tokens_per_forward(chunk: int, stepwise: bool) -> int | None:
    """What :func:`teacher_forced` is passed for a ``chunk`` option and a ``stepwise`` switch: ``chunk`` above 1
    (chunked scoring), 1 when ``stepwise``, else None (decoding's logits in as few forwards as the cache allows)."""
    return chunk if chunk > 1 or stepwise else None


@torch.inference_mode()
def teacher_forced(
    model, cache: Cache, input_ids: torch.Tensor, past_tokens: int, chunk: int | None = None
) -> Iterator[tuple[int, torch.Tensor]]:
    """Feed ``input_ids`` ``(B, n)`` through ``cache``, which holds ``past_tokens`` tokens of every row (no
    padding), and yield ``(start, logits)`` per forward: the logits ``(B, m, V)`` of ``input_ids[:, start:start +
    m]``. ``chunk``: tokens per forward (1: decoding; larger: chunked scoring, another protocol); None (the default):
    as many as :func:`decode_equivalent_tokens` allows, which gives decoding's logits in fewer forwards."""
    if chunk is not None:
        check_int("chunk", chunk, 1)
    b, n = input_ids.shape
    start = 0
    while start < n:
        size = chunk if chunk is not None else decode_equivalent_tokens(cache, n - start)
        stop = min(start + size, n)
        mask = torch.ones(b, past_tokens + stop, dtype=torch.long, device=input_ids.device)
        logits = model(input_ids=input_ids[:, start:stop], attention_mask=mask, **with_cache(model, cache)).logits
        yield start, logits
        start = stop

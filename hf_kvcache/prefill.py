"""One prefill, several caches: a prompt's keys and values, computed once, stored in a cache as the prompt's forward
would have stored them.

Every cache we ship stores what a forward hands it (``update`` per layer, in layer order), and a prefill's own
logits attend to the prompt's full-precision K/V whatever the cache. So the K/V of one prefill (a ``DynamicCache``'s,
or any per-layer K/V) can be written into another cache without running the model again: :func:`store_prefill` calls
each layer's ``write`` (``update`` without the read that feeds attention: no dequantized history, no gather of pages)
and gives the cache the prompt's attention mask, as the model's forward hook does, so sinks and pages know each row's
left padding. The cache's state is then the one a prefill through it leaves.

:class:`SharedPrefill` runs a prompt's forward once and hands its K/V to any number of caches: how the harness scores
several caches on one document (``hf-kvcache eval``; ``--separate-prefill`` turns it off), and how a user's own loop
can compare caches on long prompts without paying for the prompt once per cache.
"""

from __future__ import annotations

import copy
import inspect
from collections.abc import Iterable

import torch
from transformers.cache_utils import (
    Cache,
    DummyLayer,
    DynamicCache,
    DynamicIndexedLayer,
    DynamicLayer,
    DynamicSlidingWindowLayer,
    LinearAttentionAndFullAttentionLayer,
    LinearAttentionAndSlidingWindowAttentionLayer,
    LinearAttentionCacheLayerMixin,
    LinearAttentionLayer,
)

from ._compat import with_cache
from ._config import has_indexed_layers, has_state_layers, resolve_config
from .layers._common import KVLayer
from .layers.inside import AttentionInside

__all__ = ["SharedPrefill", "every_token_cache", "left_padded", "padded_positions", "store_prefill", "write_tokens"]


def left_padded(rows: list[list[int]], pad_id: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Token id lists of any lengths as one left-padded batch: ``(B, L)`` ids (``pad_id`` before each row's tokens,
    never attended to) and the attention mask (1 = real token), both int64 on the CPU."""
    width = max(map(len, rows))
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for r, row in enumerate(rows):
        ids[r, width - len(row) :] = torch.tensor(row)
        mask[r, width - len(row) :] = 1
    return ids, mask


def padded_positions(model, attention_mask: torch.Tensor | None) -> dict:
    """``{"position_ids": ...}`` for the forward of a left-padded prompt: each row's positions counted from its first
    real token, as ``generate`` counts them (a forward given no positions numbers the columns, so a padded row that
    ``generate`` then continues would sit its padding's width of positions apart from its own prompt). ``{}`` where no
    row is padded (the columns are the positions) or the model's forward takes no ``position_ids``."""
    if attention_mask is None or bool(attention_mask.all()):
        return {}
    if "position_ids" not in inspect.signature(model.forward).parameters:
        return {}
    positions = attention_mask.long().cumsum(-1) - 1
    return {"position_ids": positions.masked_fill(attention_mask == 0, 0)}


def write_tokens(cache: Cache, layer_idx: int, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
    """Store one layer's share of a forward, ``(B, H, n, D)`` keys and values, without the read that would feed its
    attention (our layers' ``write``; transformers' layers, whose ``update`` returns what they store, update). Called
    for every layer in layer order per forward, as the model does, it leaves the state the forward leaves: a chunked
    prefill written this way chunk by chunk stores what one through the cache stores, with no scratch."""
    _check_attached(cache)
    layers = getattr(cache, "layers", None)
    layer = layers[layer_idx] if layers is not None and layer_idx < len(layers) else None
    if isinstance(layer, (KVLayer, AttentionInside)):
        layer.write(key_states, value_states)
    else:
        cache.update(key_states, value_states, layer_idx)


def _check_attached(cache: Cache) -> None:
    """A cache loaded without its model stores nothing, here as in a forward (``attach(model)`` first)."""
    check = getattr(cache, "_check_attached", None)
    if check is not None:
        check()


def _copy_states(cache: Cache, layer_idx: int, source) -> None:
    """A hybrid model's recurrent / convolution layer (or a layer with nothing to cache) of the prefill, copied into
    ``cache``'s layer ``layer_idx``: its states cloned, so each cache's in-place updates stay its own."""
    layers = getattr(cache, "layers", None)
    target = layers[layer_idx] if layers is not None and layer_idx < len(layers) else None
    if isinstance(source, DummyLayer) and isinstance(target, DummyLayer):
        return
    if not (isinstance(source, LinearAttentionCacheLayerMixin) and isinstance(target, LinearAttentionCacheLayerMixin)):
        raise ValueError(
            f"store_prefill: layer {layer_idx} of the prefill is a {type(source).__name__}, the cache's a "
            f"{type(target).__name__}: a recurrent layer's states go to a recurrent layer"
        )
    fresh = LinearAttentionLayer(number_of_states=source.number_of_states)  # what a linear-attention layer's state is
    for name in vars(fresh):
        setattr(target, name, copy.deepcopy(getattr(source, name)))


def _copy_indexer(cache: Cache, layer_idx: int, indexer_keys: torch.Tensor) -> None:
    """A sparse-attention layer's indexer keys of the prefill, copied into ``cache``'s layer ``layer_idx``."""
    layers = getattr(cache, "layers", None)
    target = layers[layer_idx] if layers is not None and layer_idx < len(layers) else None
    if not hasattr(target, "update_indexer"):
        raise ValueError(
            f"store_prefill: layer {layer_idx} of the prefill holds indexer keys, the cache's "
            f"{type(target).__name__} has no place for them"
        )
    target.update_indexer(indexer_keys.clone())


def store_prefill(
    cache: Cache,
    key_value_states: Iterable,
    attention_mask: torch.Tensor | None = None,
) -> Cache:
    """Store a prefill's keys and values, ``(key_states, value_states)`` of each layer in layer order (shapes as the
    model passes them to ``Cache.update``: ``(B, H, T, D)``, every layer the whole prompt's ``T`` tokens: the
    ``layers`` of a ``DynamicCache()`` built without a config that the prompt's forward filled), in an empty
    ``cache``; ``attention_mask``: the prompt's 2-D mask (1 = real token), for caches that read each row's left
    padding. Returns ``cache``. Every layer of ``cache`` gets one: a recurrent-depth model's loop layers too (Dory's,
    which its prefill appended to that ``DynamicCache``, as ``cache`` holds them). A hybrid model's recurrent /
    convolution layers (and its layers with nothing to cache)
    are given as the prefill's transformers layer in place of a pair: their states are copied (:class:`SharedPrefill`
    does both).

    >>> from transformers import DynamicCache, LlamaConfig
    >>> from hf_kvcache import QuantizedKVCache
    >>> from hf_kvcache.prefill import store_prefill
    >>> config = LlamaConfig(num_hidden_layers=2, hidden_size=64, num_attention_heads=4, num_key_value_heads=2)
    >>> kv = [(torch.randn(1, 2, 40, 16), torch.randn(1, 2, 40, 16)) for _ in range(2)]
    >>> store_prefill(QuantizedKVCache(config), kv).get_seq_length()
    40
    """
    _check_attached(cache)
    if cache.get_seq_length() != 0:
        raise ValueError(
            f"store_prefill needs an empty cache; this one holds {cache.get_seq_length()} tokens (call cache.reset())"
        )
    if attention_mask is not None and hasattr(cache, "before_forward"):
        cache.before_forward({"attention_mask": attention_mask})  # what the model's forward hook would tell it
    count, tokens = 0, None
    for layer_idx, entry in enumerate(key_value_states):
        indexer = None
        if isinstance(entry, DynamicIndexedLayer):  # a sparse-attention layer: its K/V and its indexer's keys
            entry, indexer = (entry.keys, entry.values), entry.indexer_keys
        if isinstance(entry, (LinearAttentionCacheLayerMixin, DummyLayer)):
            _copy_states(cache, layer_idx, entry)
            if getattr(entry, "keys", None) is None:  # a layer of states alone
                count += 1
                continue
            entry = (entry.keys, entry.values)  # a layer with both: its attention's K/V too
        key_states, value_states = entry
        tokens = key_states.shape[-2] if tokens is None else tokens
        if key_states.shape[-2] != tokens:
            raise ValueError(
                f"store_prefill: layer {layer_idx} got {key_states.shape[-2]} tokens, layer 0 got {tokens}: every "
                "layer needs the whole prompt's K/V (a DynamicCache built from a hybrid model's config keeps only "
                "its sliding layers' windows; DynamicCache() without a config keeps every token)"
            )
        write_tokens(cache, layer_idx, key_states, value_states)
        if indexer is not None:
            _copy_indexer(cache, layer_idx, indexer)
        count += 1
    layers = getattr(cache, "layers", None)
    if layers is not None and count != len(layers):
        raise ValueError(f"store_prefill got the K/V of {count} layers for a cache of {len(layers)} layers")
    return cache


def every_token_cache(model) -> DynamicCache:
    """A ``DynamicCache`` whose attention layers keep every token (sliding ones too, as :func:`store_prefill` needs).
    Built without a config, so that every layer is a ``DynamicLayer``, except for hybrid models, whose recurrent /
    convolution layers need transformers' own layers (built from the config, with its sliding layers replaced)."""
    config = resolve_config(model)
    if not has_state_layers(config) and not has_indexed_layers(config):
        return DynamicCache()
    once = DynamicCache(config=config)
    once.layers = [_unbounded(layer) for layer in once.layers]
    return once


def _unbounded(layer):
    """``layer`` keeping every token: a sliding layer as a full one (with its states, where it has them)."""
    if isinstance(layer, LinearAttentionAndSlidingWindowAttentionLayer):
        return LinearAttentionAndFullAttentionLayer(number_of_states=layer.number_of_states)
    return DynamicLayer() if isinstance(layer, DynamicSlidingWindowLayer) else layer


class SharedPrefill:
    """A prompt's prefill, run once through a ``DynamicCache`` (every layer keeps every token), then stored in as many
    caches as asked (:meth:`into`), each left in the state a prefill through it leaves (tested against one for every
    cache kind we ship, sliding-window eviction and pages included).

    ``logits``: the prompt's last ``logits_to_keep`` positions' logits ``(B, n, vocab)`` (0: every position), which
    are the same through every cache (a prefill attends to its own full-precision K/V). A left-padded batch
    (``attention_mask`` with zeros) is run at ``generate``'s positions (:func:`padded_positions`), so ``generate`` can
    continue it from any cache it was stored in.

    >>> from transformers import LlamaConfig, LlamaForCausalLM
    >>> from hf_kvcache import make_cache
    >>> model = LlamaForCausalLM(LlamaConfig(num_hidden_layers=2, hidden_size=64, num_attention_heads=4,
    ...                                      num_key_value_heads=2, intermediate_size=64, vocab_size=100))
    >>> ids = torch.randint(0, 100, (1, 30))
    >>> prompt = SharedPrefill(model, ids)
    >>> for spec in ("int8", "int2"):
    ...     cache = prompt.into(make_cache(spec, model))
    ...     out = model.generate(input_ids=ids, past_key_values=cache, max_new_tokens=4, do_sample=False)
    >>> out.shape
    torch.Size([1, 34])
    """

    def __init__(
        self, model, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, logits_to_keep: int = 1
    ):
        if input_ids.ndim != 2 or input_ids.shape[1] < 1:
            raise ValueError(f"input_ids must be (batch, tokens) with at least one token, got {tuple(input_ids.shape)}")
        once = every_token_cache(model)
        inputs = {"input_ids": input_ids, "attention_mask": attention_mask, **padded_positions(model, attention_mask)}
        inputs |= with_cache(model, once)
        with torch.no_grad():
            try:  # the last positions' logits only: a long prompt's full logits can take more memory than its K/V
                logits = model(**inputs, logits_to_keep=logits_to_keep).logits
            except TypeError:  # a model whose forward has no logits_to_keep
                once = every_token_cache(model)
                inputs.update(with_cache(model, once))
                logits = model(**inputs).logits[:, -logits_to_keep:]
        self.logits = logits
        # per layer its K/V, or the layer itself where store_prefill copies more: a hybrid model's recurrent states,
        # a sparse-attention layer's indexer keys
        kept = (LinearAttentionCacheLayerMixin, DummyLayer, DynamicIndexedLayer)
        self.key_values = [layer if isinstance(layer, kept) else (layer.keys, layer.values) for layer in once.layers]
        self.attention_mask = attention_mask
        self.tokens = input_ids.shape[1]

    def into(self, cache: Cache) -> Cache:
        """Store the prefill in the empty ``cache`` (:func:`store_prefill`); returns it. A ``ValueError`` (a cache
        that cannot take a handed-over prefill) leaves the cache to be discarded: prefill a fresh one instead."""
        return store_prefill(cache, self.key_values, self.attention_mask)

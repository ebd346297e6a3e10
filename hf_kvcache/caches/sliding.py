"""``SlidingWindowKVCache``: attention sinks plus a sliding window, flat memory for any decoder; registers the
``sink`` cache kind."""

from __future__ import annotations

from functools import partial

import torch
from transformers import PretrainedConfig
from transformers.cache_utils import Cache

from .._config import (
    LayerSpec,
    is_latent_attention,
    model_type,
    uses_alibi,
)
from .._validate import check_bool, check_int
from ..formats import codec_for
from ..layers._storage import Workspace
from ..layers.quantized import QuantizedSlidingWindowLayer
from ..layers.sliding import SinkWindowLayer
from ..layers.state import cache_layer
from ..layers.window import ModelSlidingWindowLayer
from ..registry import register_cache
from ..rope import rotary_spec
from ._base import KVCacheReportMixin, PaddingObserverMixin, split_model

__all__ = ["SlidingWindowKVCache"]


# Models that size their attention mask from their own token count instead of the cache's mask sizes (found by the
# supported-models matrix: CPM-Ant, which also prepends 32 prompt-tuning tokens of its own).
OWN_MASK_MODELS = ("cpmant",)


def _refuse_unservable(config: PretrainedConfig, rerotate: bool, sinks: int) -> None:
    """Models whose positions a cache that evicts tokens cannot keep right: refused at construction."""
    if uses_alibi(config):
        raise ValueError(
            f"SlidingWindowKVCache cannot serve model_type {model_type(config)!r}: it uses ALiBi position biases, "
            "which the model builds from the full attention mask of every token seen, so they stop matching the stored "
            "keys once the window evicts; use QuantizedKVCache or PagedKVCache (which keep every token)"
        )
    if model_type(config) in OWN_MASK_MODELS:
        raise ValueError(
            f"SlidingWindowKVCache cannot serve model_type {model_type(config)!r}: it builds its attention mask from "
            "its own count of every token seen (not from the cache), so the mask stops lining up with the stored keys "
            "once the window evicts; use QuantizedKVCache or PagedKVCache (which keep every token)"
        )
    if rerotate and sinks and is_latent_attention(config):
        raise ValueError(
            f"SlidingWindowKVCache(rerotate=True) cannot serve model_type {model_type(config)!r}: its latent attention "
            "caches the rotated part of the key in the value slot, which the sink re-rotation does not know how to "
            "move; pass rerotate=False (sinks keep their original positions)"
        )


class SlidingWindowKVCache(PaddingObserverMixin, KVCacheReportMixin, Cache):
    """Bounded memory for any decoder: attention sinks plus a sliding window (StreamingLLM,
    https://arxiv.org/abs/2309.17453).

    On the model's full-attention layers, a decoding token attends to the first ``sinks`` tokens of its row, the last
    ``window`` tokens before it, and itself; each layer stores at most ``sinks + window`` tokens, so memory stays flat
    however long generation runs. A multi-token forward (prefill) attends to what is stored plus its own tokens under
    the model's causal mask, and eviction happens after it. The model's own sliding-window layers (Gemma 2/3,
    Mistral) keep their own window, exactly as ``DynamicCache`` does.

    Positions: cached keys keep the RoPE rotation of their original position. With ``rerotate=True`` the sink keys
    handed to attention are rotated to sit right before the window (StreamingLLM's position shift), so every
    query-key distance stays within ``sinks + window``. The rotation is read from the model's rotary embedding
    (standard, partial, interleaved, scaled frequencies, attention scaling; GPT-J and CodeGen's sinusoidal tables),
    layer by layer (NoPE layers, as in SmolLM3 and Llama 4, are left alone); length-dependent RoPE (``dynamic``,
    ``longrope``) is refused at construction. Models without any position rotation (learned absolute positions) get
    ``rerotate=False`` semantics; positions past a learned position table still fail in the model, as without a cache.
    Refused at construction, with the reason: ALiBi models (BLOOM, MPT, Falcon with ``alibi=True``), and
    ``rerotate=True`` on latent-attention models (DeepSeek-V2/V3).

    Left padding: a row's sinks are its first real tokens. The cache learns each row's padding from the attention
    mask: built from a model, it reads it from the model's forwards (one shared hook per model, only forwards passed
    this cache); built from a config, call ``cache.padding.observe(attention_mask)`` before generating a left-padded
    batch, or rows count as unpadded.

    Assisted and prompt-lookup decoding work after eviction has begun: while ``generate()`` records the past,
    eviction waits for its ``crop``; a crop that needs evicted tokens raises ``ValueError``.

    Args:
        config: the model's ``PretrainedConfig``, or the model itself (recommended: padding is then tracked).
        window: recent tokens kept per layer, >= 1.
        sinks: first tokens kept per row, >= 0 (0 gives a plain window).
        rerotate: re-rotate the sinks to sit right before the window.
        bits: None (full precision) or 8: int8 storage through the quantized cache's int8 codec (one scale per token
            and head), about half the bytes, still flat.

    Example:
        >>> from transformers import LlamaConfig
        >>> from hf_kvcache import SlidingWindowKVCache
        >>> config = LlamaConfig(num_hidden_layers=2, hidden_size=64, num_attention_heads=4, num_key_value_heads=2)
        >>> cache = SlidingWindowKVCache(config, window=256, sinks=4)
        >>> cache.window, cache.sinks, cache.max_stored_tokens
        (256, 4, 260)
    """

    def __init__(
        self,
        config: PretrainedConfig | torch.nn.Module,
        window: int = 1024,
        sinks: int = 4,
        rerotate: bool = True,
        bits: int | None = None,
    ):
        model, config = split_model(config)
        check_int("window", window, 1)
        check_int("sinks", sinks, 0)
        check_bool("rerotate", rerotate)
        if bits is not None and (isinstance(bits, bool) or not isinstance(bits, int) or bits != 8):
            raise ValueError(
                f"bits must be None (full precision) or 8, got {bits!r}: 4- and 2-bit keys are quantized in groups "
                "of tokens, which a window that evicts one token at a time cannot keep"
            )
        _refuse_unservable(config, rerotate, sinks)
        self.bits = bits  # before the model is bound: which layers keep plain tensors depends on it
        specs = self._bind_model(model, config)
        if any(s.indexer_dim for s in specs):
            raise ValueError(
                f"SlidingWindowKVCache cannot serve model_type {model_type(config)!r}: its sparse attention's indexer "
                "keeps a key per token seen and picks each query's tokens among them, which an evicting window would "
                "have to move with the keys; use QuantizedKVCache or PagedKVCache (which keep every token)"
            )
        self.window, self.sinks, self.rerotate, self.bits = window, sinks, rerotate, bits
        self.workspace = Workspace()
        self.rotary = None
        if rerotate and sinks and any(s.layer_type == "full_attention" and s.uses_rope for s in specs):
            self.rotary = rotary_spec(model if model is not None else config, config, "full_attention")
        owner = type(self).__name__
        super().__init__(
            layers=[cache_layer(s, i, owner, partial(self._make_layer, i, s)) for i, s in enumerate(specs)]
        )
        self._observe_model(model)

    @property
    def max_stored_tokens(self) -> int:
        """Most tokens a full-attention layer stores: ``sinks + window``."""
        return self.sinks + self.window

    @property
    def stored_tokens(self) -> int:
        """Tokens a full-attention layer stores now (every full layer stores the same; at most ``sinks + window``).

        ``get_seq_length()`` counts the tokens *seen*, which positions need; this counts what is kept."""
        full = [layer for layer, s in zip(self.layers, self.layer_specs) if s.layer_type == "full_attention"]
        return full[0].stored_tokens if full else max((layer.stored_tokens for layer in self.layers), default=0)

    def _keeps_tensors(self, spec: LayerSpec) -> bool:
        return spec.layer_type != "full_attention" and self.bits is None  # ModelSlidingWindowLayer (_make_layer)

    def _make_layer(self, layer_idx: int, spec: LayerSpec):
        owner = type(self).__name__
        int8 = codec_for(self.bits)
        if spec.layer_type == "full_attention":
            rotary = self.rotary if spec.uses_rope else None
            return SinkWindowLayer(
                spec,
                layer_idx,
                owner,
                self.window,
                self.sinks,
                rotary,
                self.padding,
                int8,
                self.workspace,
                self.attention_mode,
            )
        if int8 is not None:
            return QuantizedSlidingWindowLayer(spec, layer_idx, owner, int8, 0, self.workspace, self.attention_mode)
        return ModelSlidingWindowLayer(spec, layer_idx, owner)

    def bytes_per_token(self, dtype: torch.dtype = torch.bfloat16) -> float:
        """Stored bytes per token, summed over layers, while the window is filling (it stops at the cap)."""
        codec = codec_for(self.bits)
        if codec is not None:
            return sum(codec.bytes_per_token(s.num_kv_heads, s.key_dim, s.value_dim) for s in self.layer_specs)
        return sum(s.bytes_per_token_factor * dtype.itemsize for s in self.layer_specs)

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(window={self.window}, sinks={self.sinks}, rerotate={self.rerotate}, "
            f"bits={self.bits}, layers={len(self.layers)})"
        )


register_cache(
    "sink",
    "SlidingWindowKVCache: attention sinks + a sliding window, flat memory (bits=8 for an int8 window)",
)(SlidingWindowKVCache)

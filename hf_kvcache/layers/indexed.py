"""The layers of DeepSeek Sparse Attention (DSA: DeepSeek-V3.2, GLM-5's ``glm_moe_dsa``, transformers'
``indexed_attention`` layer type) in every hf_kvcache cache that keeps every token.

A DSA layer is full attention over a latent K/V cache whose queries each read only the top-k tokens an *indexer*
picks: one narrow key per token (``index_head_dim`` channels, one head), scored against the indexer's queries. The
model stores those keys through ``Cache.update_indexer`` beside the K/V. Here the cache's own layer keeps the K/V
(quantized, paged) and the indexer keys stay in the model's dtype, as transformers' ``DynamicIndexedLayer`` keeps them:
quantizing them would change which tokens the attention reads, not only how precisely. They grow in amortized
buffers (:class:`~hf_kvcache.layers._storage.TokenBuffers`), where ``DynamicIndexedLayer`` copies every key held at
every step (``torch.cat``). They follow every
lifecycle and batch operation of the K/V (crop, beams, batch selection, reset), and a forward of another batch size,
dtype or device than they hold raises ``ValueError``. The sliding-window cache does not serve these models: an
evicting window would have to move the indexer's positions with the keys.
"""

from __future__ import annotations

import torch

from .._config import LayerSpec
from ._common import as_index
from ._storage import TokenBuffers
from .inside import AttentionInside

__all__ = ["IndexedAttention"]


class IndexedAttention(AttentionInside):
    """An ``indexed_attention`` layer: the cache's own layer for the attention's K/V, beside the indexer's keys
    ``(B, T, index_head_dim)`` (``indexer_keys``, as ``DynamicIndexedLayer`` names them)."""

    def __init__(self, attention, spec: LayerSpec, layer_idx: int, owner: str):
        self.attention, self.spec, self.layer_idx, self.owner = attention, spec, layer_idx, owner
        self._held: TokenBuffers | None = None  # the indexer keys as (B, 1, T, D)
        self.indexer_position_ids: torch.Tensor | None = None  # transformers' field; models that set it keep it

    @property
    def indexer_keys(self) -> torch.Tensor | None:
        """Every token's indexer key, ``(B, T, D)`` (a view of the buffers); None before the first forward."""
        return None if self._held is None else self._held.view("k")[:, 0]

    @property
    def keys(self) -> torch.Tensor | None:
        """What ``DynamicIndexedLayer.keys`` tells a model that reads it (GLM-5-Next's indexer takes the tokens held
        from ``keys.shape[-2]``): the attention layer's dense keys where it keeps them, else, once it holds tokens, a
        meta tensor of their shape ``(B, H, T, D)``, which has no data to read (the K/V live in the cache's format)."""
        keys = self.attention.keys
        if isinstance(keys, torch.Tensor) or self._held is None:
            return keys
        shape = (self.indexer_keys.shape[0], self.spec.num_kv_heads, self.get_seq_length(), self.spec.passed_key_dim)
        return torch.empty(shape, device="meta")

    def decode_equivalent_tokens(self, limit: int) -> int:
        """One token per forward (:mod:`hf_kvcache.scoring`): whether the indexer's top-k over a longer forward picks
        what decoding picks is not checked."""
        return 1

    @property
    def is_indexer_initialized(self) -> bool:
        return self._held is not None

    def update_indexer(self, indexer_key_states: torch.Tensor) -> torch.Tensor:
        """Append a forward's indexer keys ``(B, n, D)`` and return every token's, ``(B, T, D)``."""
        held = self.indexer_keys
        if held is not None and (
            indexer_key_states.shape[0] != held.shape[0]
            or indexer_key_states.dtype != held.dtype
            or indexer_key_states.device != held.device
        ):
            raise ValueError(
                f"{self.owner} layer {self.layer_idx} (indexed_attention) holds indexer keys of batch "
                f"{held.shape[0]}, {held.dtype} on {held.device}; this forward passed batch "
                f"{indexer_key_states.shape[0]}, {indexer_key_states.dtype} on {indexer_key_states.device}. Call "
                "cache.reset() (or build a new cache) before another batch"
            )
        if self._held is None:
            self._held = TokenBuffers({"k": 1})
        self._held.append({"k": indexer_key_states.unsqueeze(1)})
        return self.indexer_keys

    def _map(self, keys, positions) -> None:
        """``keys`` of the held indexer keys ``(B, 1, T, D)`` and ``positions(indexer_position_ids)`` (batch on
        axis 0 and 1), where held."""
        if self._held is not None:
            self._held.map_batch(keys)
        if self.indexer_position_ids is not None:
            self.indexer_position_ids = positions(self.indexer_position_ids)

    def _beside(self, operation: str, *args) -> None:
        if operation == "reset":
            self._held = self.indexer_position_ids = None
        elif operation in ("reorder_cache", "batch_select_indices"):
            index = as_index(args[0])
            self._map(lambda t: t.index_select(0, index.to(t.device)), lambda p: p.index_select(1, index.to(p.device)))
        elif operation == "batch_repeat_interleave":
            self._map(lambda t: t.repeat_interleave(args[0], dim=0), lambda p: p.repeat_interleave(args[0], dim=1))
        elif operation in ("offload", "prefetch"):
            device = "cpu" if operation == "offload" else getattr(self.attention, "device", None)
            if device is not None:
                if self._held is not None:
                    self._held.to(device, non_blocking=True)
                if self.indexer_position_ids is not None:
                    self.indexer_position_ids = self.indexer_position_ids.to(device, non_blocking=True)

    def crop(self, tokens_to_remove: int) -> None:
        """The attention's crop, then the indexer keys cut to the tokens it kept."""
        self.attention.crop(tokens_to_remove)
        kept = self.attention.get_seq_length()
        if self._held is not None and self._held.length > kept:
            self._held.truncate(self._held.length - kept)
        if self.indexer_position_ids is not None:
            self.indexer_position_ids = self.indexer_position_ids[..., :kept]

    def _beside_nbytes(self, reserved: bool = False) -> int:
        if self._held is None:
            return 0
        return self._held.reserved_nbytes if reserved else self._held.nbytes

    def planned_nbytes(self, tokens: int, dtype: torch.dtype, prompt: int | None = None) -> int:
        """The attention's planned bytes and every token's indexer key (:mod:`hf_kvcache.plan`)."""
        return self.attention.planned_nbytes(tokens, dtype, prompt) + tokens * self.spec.indexer_dim * dtype.itemsize

"""Bytes held by any cache, and analytic bytes per token of the full-precision reference."""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache

from ._config import layer_specs, resolve_config

__all__ = ["cache_nbytes", "dynamic_bytes_per_token"]


def cache_nbytes(cache: Cache) -> int:
    """Bytes of K/V storage held by ``cache``: its own ``nbytes`` for hf_kvcache caches, else the tensors its layers
    keep in ``keys`` / ``values`` (``DynamicCache``, ``StaticCache``)."""
    if hasattr(cache, "nbytes"):
        return int(cache.nbytes)
    total = 0
    for layer in cache.layers:
        for t in (getattr(layer, "keys", None), getattr(layer, "values", None)):
            if isinstance(t, torch.Tensor):
                total += t.numel() * t.element_size()
    return total


def dynamic_bytes_per_token(config, dtype: torch.dtype = torch.bfloat16) -> int:
    """Bytes per token of a full-precision K/V cache for ``config`` (all layers, keys and values)."""
    specs = layer_specs(resolve_config(config), "dynamic_bytes_per_token")
    return sum(2 * s.num_kv_heads * s.head_dim * dtype.itemsize for s in specs)

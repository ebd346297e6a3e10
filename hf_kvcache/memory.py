"""Bytes held by any cache, and analytic bytes per token of the full-precision reference."""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache

from ._config import layer_specs, resolve_config

__all__ = ["cache_nbytes", "dynamic_bytes_per_token"]


def _tensor_bytes(obj, seen: set) -> int:
    """Bytes of the distinct tensors reachable from ``obj`` through containers and tensor subclasses."""
    if isinstance(obj, torch.Tensor):
        if hasattr(obj, "__tensor_flatten__") and type(obj) is not torch.Tensor:  # e.g. optimum-quanto QTensor
            names, _ = obj.__tensor_flatten__()
            return sum(_tensor_bytes(getattr(obj, name), seen) for name in names)
        key = (obj.untyped_storage().data_ptr(), obj.storage_offset(), obj.numel())
        if key in seen:
            return 0
        seen.add(key)
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(_tensor_bytes(v, seen) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(_tensor_bytes(v, seen) for v in obj)
    return 0


def cache_nbytes(cache: Cache) -> int:
    """Bytes of K/V storage held by ``cache``: its own ``nbytes`` for hf_kvcache caches, else every tensor its
    layers hold (``DynamicCache``'s keys / values; the quantized data, scales and residual of transformers'
    ``QuantizedCache``)."""
    if hasattr(cache, "nbytes"):
        return int(cache.nbytes)
    seen: set = set()
    return sum(_tensor_bytes(list(vars(layer).values()), seen) for layer in cache.layers)


def dynamic_bytes_per_token(config, dtype: torch.dtype = torch.bfloat16) -> int:
    """Bytes per token of a full-precision K/V cache for ``config`` (all layers, keys and values)."""
    specs = layer_specs(resolve_config(config), "dynamic_bytes_per_token")
    return sum(s.bytes_per_token_factor * dtype.itemsize for s in specs)

"""Bytes held by any cache, and analytic bytes per token of the full-precision reference."""

from __future__ import annotations

import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from transformers.cache_utils import Cache

from ._config import layer_specs, resolve_config

__all__ = ["PeakTensorBytes", "cache_nbytes", "dynamic_bytes_per_token", "model_nbytes"]


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


def recurrent_state_bytes(cache) -> int:
    """Bytes of the convolution and recurrent states the linear-attention layers of a transformers cache hold (a
    hybrid model's Mamba / gated DeltaNet / convolution layers; 0 for others): ``DynamicCache``'s or ours."""
    from transformers.cache_utils import LinearAttentionCacheLayerMixin

    return sum(
        t.numel() * t.element_size()
        for layer in cache.layers
        if isinstance(layer, LinearAttentionCacheLayerMixin)
        for states in (layer.conv_states, layer.recurrent_states)
        for t in states.values()
        if t is not None
    )


def dynamic_bytes_per_token(config, dtype: torch.dtype = torch.bfloat16) -> int:
    """Bytes per token of a full-precision K/V cache for ``config`` (all layers, keys and values, and the indexer keys
    of sparse-attention layers)."""
    specs = layer_specs(resolve_config(config), "dynamic_bytes_per_token")
    return sum((s.bytes_per_token_factor + s.indexer_dim) * dtype.itemsize for s in specs)


class PeakTensorBytes(TorchDispatchMode):
    """Peak bytes of the tensor storages created inside the ``with`` block and alive at the same time, on any
    device (how ``hf-kvcache bench`` measures peak memory on CPU, where torch keeps no allocator statistics).

    Every aten op's outputs pass through this dispatch mode; each new storage is counted once (by its data
    pointer, at its full ``nbytes``) while any tensor using it lives, and uncounted when the last one is collected.
    It sees what torch allocates for tensors: K/V, activations, logits, scratch of the kernels that return tensors.
    It does not see the weights and other tensors created before the block (add them: ``peak_bytes +
    model_nbytes(model)``), allocator caching and fragmentation, or memory that libraries take outside tensors. It
    costs a Python callback per op: use it on an untimed run.
    """

    def __init__(self) -> None:
        super().__init__()
        self.live = 0
        self.peak_bytes = 0
        self._storages: dict[int, list[int]] = {}  # data_ptr -> [nbytes, live tensors]

    def _release(self, ptr: int) -> None:
        entry = self._storages.get(ptr)
        if entry is None:
            return
        entry[1] -= 1
        if entry[1] == 0:
            self.live -= entry[0]
            del self._storages[ptr]

    def _track(self, t: torch.Tensor) -> None:
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        if not ptr:
            return
        entry = self._storages.get(ptr)
        if entry is None:
            entry = self._storages[ptr] = [storage.nbytes(), 0]
            self.live += entry[0]
            self.peak_bytes = max(self.peak_bytes, self.live)
        entry[1] += 1
        weakref.finalize(t, self._release, ptr)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        seen_inputs = {id(a) for a in (*args, *(kwargs or {}).values()) if isinstance(a, torch.Tensor)}
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and id(t) not in seen_inputs:  # in-place / out= ops return an input
                self._track(t)
        return out


def model_nbytes(model: torch.nn.Module) -> int:
    """Bytes of a model's parameters and buffers (distinct storages)."""
    seen: set = set()
    return sum(_tensor_bytes(t, seen) for t in (*model.parameters(), *model.buffers()))

"""The model's own sliding-window layers (hybrid models: Gemma 2/3, Mistral, ...) in caches that keep them in full
precision: transformers' ``DynamicSlidingWindowLayer``, with our reporting and lifecycle checks."""

from __future__ import annotations

import copy

import torch
from transformers.cache_utils import DynamicSlidingWindowLayer

from .._config import LayerSpec
from ._common import as_index, check_same_state
from ._storage import _nbytes, loaded_device, saved_tensor


def dynamic_layer_nbytes(spec: LayerSpec, tokens: int, dtype: torch.dtype) -> int:
    """Bytes one row of ``DynamicCache``'s layer for ``spec`` stores after ``tokens`` tokens: every token of a full
    layer (with its indexer's key, in a sparse-attention layer), the last ``sliding_window - 1`` of a sliding one."""
    if spec.layer_type != "full_attention" and spec.sliding_window:
        tokens = min(tokens, spec.sliding_window - 1)
    return tokens * (spec.bytes_per_token_factor + spec.indexer_dim) * dtype.itemsize


class ModelSlidingWindowLayer(DynamicSlidingWindowLayer):
    """Keeps the last ``sliding_window - 1`` tokens exactly as ``DynamicCache`` does."""

    def __init__(self, spec: LayerSpec, layer_idx: int, owner: str):
        super().__init__(sliding_window=spec.sliding_window)
        self.spec, self.layer_idx, self.owner = spec, layer_idx, owner

    @property
    def batch_size(self) -> int | None:
        return self.keys.shape[0] if self.is_initialized and self.keys.numel() else None

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        super().lazy_initialization(key_states, value_states)
        self.dtype = key_states.dtype  # what check_same_state reads; transformers records it before 5.24 only

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if self.batch_size is not None:
            check_same_state(self, key_states)
        return super().update(key_states, value_states, *args, **kwargs)

    def decode_equivalent_tokens(self, limit: int) -> int:
        """Any number (:mod:`hf_kvcache.scoring`): tokens are stored as they come, and a longer forward's mask gives
        each query its own window, as transformers' layer does."""
        return limit

    def batch_select_indices(self, indices) -> None:
        if self.get_seq_length() > 0:
            index = as_index(indices, self.keys.device)
            self.keys, self.values = self.keys.index_select(0, index), self.values.index_select(0, index)

    def __getstate__(self) -> dict:
        # transformers keeps the window as a view of the forward's whole K/V (a prompt's, on a prefill): a saved layer
        # holds the window's tokens only, in host memory (saved_tensor), and goes back to its device at load.
        state = self.__dict__.copy()
        if self.is_initialized:
            state["keys"], state["values"] = saved_tensor(self.keys), saved_tensor(self.values)
            state["saved_device"] = self.keys.device
        return state

    def __setstate__(self, state: dict) -> None:
        device = loaded_device(state.pop("saved_device", None))
        self.__dict__.update(state)
        if device is not None:
            self.keys, self.values = self.keys.to(device), self.values.to(device)

    def __deepcopy__(self, memo: dict) -> ModelSlidingWindowLayer:
        # The window's tokens, copied on their device (a deep copy of the view would copy the whole prompt's K/V)
        clone = self.__class__.__new__(self.__class__)
        memo[id(self)] = clone
        for name, value in self.__dict__.items():
            window = name in ("keys", "values") and self.is_initialized
            clone.__dict__[name] = value.clone() if window else copy.deepcopy(value, memo)
        return clone

    @property
    def stored_tokens(self) -> int:
        return self.keys.shape[-2] if self.is_initialized else 0

    def planned_nbytes(self, tokens: int, dtype: torch.dtype, prompt: int | None = None) -> int:
        """Bytes one row stores after ``tokens`` tokens of ``dtype`` K/V (:mod:`hf_kvcache.plan`)."""
        return dynamic_layer_nbytes(self.spec, tokens, dtype)

    @property
    def nbytes(self) -> int:
        if not self.is_initialized:
            return 0
        return _nbytes(self.keys) + _nbytes(self.values)

    @property
    def reserved_nbytes(self) -> int:
        if not self.is_initialized:
            return 0
        return self.keys.untyped_storage().nbytes() + self.values.untyped_storage().nbytes()

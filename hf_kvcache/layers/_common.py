"""Pieces every hf_kvcache cache layer shares: the crop argument convention and batch-axis operations."""

from __future__ import annotations

from collections.abc import Callable

import torch


def tokens_to_crop(tokens_to_remove: int) -> int:
    """``generate()`` crops with ``tokens_to_remove <= 0`` (the number of tokens to drop, negated)."""
    if tokens_to_remove > 0:
        raise ValueError(
            f"crop(tokens_to_remove={tokens_to_remove}) is not supported: pass a negative number of tokens to remove"
        )
    return -tokens_to_remove


class BatchOpsMixin:
    """``reorder_cache`` (beam search), ``batch_repeat_interleave`` and ``batch_select_indices`` through one
    ``_map_batch(fn)`` that applies a batch-axis function to every stored tensor."""

    def _map_batch(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
        raise NotImplementedError

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self._map_batch(lambda t: t.index_select(0, beam_idx.to(t.device)))

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._map_batch(lambda t: t.repeat_interleave(repeats, dim=0))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._map_batch(lambda t: t[indices.to(t.device) if isinstance(indices, torch.Tensor) else indices])

"""Pieces hf_kvcache cache layers share: the crop argument convention, batch-axis operations and the padding tracker."""

from __future__ import annotations

import weakref
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


class PaddingTracker:
    """Leading padding of each batch row, read from the 2-D attention mask of the forwards that use a cache.

    transformers gives a cache layer its keys and values only, never the attention mask. When the cache is built
    from a model, a forward pre-hook on that model records the mask of every forward that is passed this cache (and
    of no other). A cache built from a config can be told with :meth:`observe`; otherwise rows count as unpadded.
    """

    def __init__(self) -> None:
        self.pad: torch.Tensor | None = None  # (B,) leading zero columns of the last mask seen
        self._handle = None

    def observe(self, attention_mask: torch.Tensor | None) -> None:
        """Record the padding of a 2-D ``(batch, tokens)`` attention mask (1 = real token, 0 = padding)."""
        if attention_mask is None or attention_mask.dim() != 2:
            return
        real = attention_mask != 0
        self.pad = (real.cumsum(-1) == 0).sum(-1).cpu()

    def attach(self, model: torch.nn.Module, cache) -> None:
        """Hook ``model`` so that forwards passed ``cache`` report their attention mask here."""
        cache_ref = weakref.ref(cache)
        tracker_ref = weakref.ref(self)

        def hook(module, args, kwargs):
            tracker, owner = tracker_ref(), cache_ref()
            if tracker is not None and owner is not None and kwargs.get("past_key_values") is owner:
                tracker.observe(kwargs.get("attention_mask"))

        self._handle = model.register_forward_pre_hook(hook, with_kwargs=True)
        weakref.finalize(cache, self._handle.remove)

    def real_tokens(self, seen: int, batch: int) -> torch.Tensor:
        """``(B,)`` real tokens per row among the ``seen`` processed, on CPU."""
        pad = self.pad
        if pad is None or pad.shape[0] != batch:  # nothing observed for this batch: rows count as unpadded
            return torch.full((batch,), seen, dtype=torch.long)
        return torch.clamp(seen - pad, min=0)

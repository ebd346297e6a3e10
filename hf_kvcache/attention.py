"""Paged attention for :class:`~hf_kvcache.PagedKVCache`: attention that reads K/V through the block tables.

With the gather path (any attention implementation) a paged layer copies every row's blocks into contiguous K/V on
each forward. Under the ``"hf_kvcache_paged"`` implementation, registered here with transformers'
``AttentionInterface`` (and its mask function with ``AttentionMaskInterface``), the layer hands attention a reference
to its block storage instead, and :func:`paged_attention_forward` walks the blocks a page group at a time with an
online softmax (flash-decoding style), so no full-length copy of the history is ever made.

:func:`attend_page_group` is the inner loop: a pure-torch reference that runs anywhere, written so that a CUDA kernel
(Triton) can replace it with the same inputs and outputs.

>>> from hf_kvcache import PagedKVCache
>>> from hf_kvcache.attention import use_paged_attention
>>> # use_paged_attention(model); model.generate(**inputs, past_key_values=PagedKVCache(model))
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = [
    "PAGED_ATTENTION",
    "PagedKV",
    "attend_page_group",
    "paged_attention_forward",
    "register_paged_attention",
    "use_paged_attention",
]

PAGED_ATTENTION = "hf_kvcache_paged"


def is_hf_kvcache_attention(name: str | None) -> bool:
    """Whether an ``attn_implementation`` name is ours (layers then hand attention their storage)."""
    return name == PAGED_ATTENTION


PAGE_GROUP_TOKENS = 512  # tokens of history attended per inner-loop call (rounded to whole blocks)


@dataclass
class PagedKV:
    """What a paged layer hands attention in place of contiguous K/V: its storage and the slots of each row."""

    storage: object  # the layer's PagedStorage: .read(slots) -> (K, V) of those slots, (B, H, n, D)
    slots: torch.Tensor  # (B, T) storage slot of every token of every row, in order
    block_size: int


def attend_page_group(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor | None,
    scaling: float,
    running: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Fold one group of pages into a running softmax.

    Args:
        query: ``(B, H_kv, G, q, D)`` float32, G query heads per KV head.
        keys: ``(B, H_kv, n, D)`` of the group's tokens.
        values: ``(B, H_kv, n, D)`` of the group's tokens.
        mask: ``(B, 1, q, n)`` bool (True attends) or None.
        scaling: the softmax scale, usually ``head_dim ** -0.5``.
        running: ``(row max (B, H_kv, G, q), denominator (same), accumulator (B, H_kv, G, q, D))`` or None.

    Returns:
        The updated ``(row max, denominator, accumulator)``; the output is ``accumulator / denominator``.
    """
    scores = torch.einsum("bhgqd,bhnd->bhgqn", query, keys.float()) * scaling
    if mask is not None:
        scores = scores.masked_fill(~mask.unsqueeze(2), float("-inf"))  # (B, 1, 1, q, n)
    block_max = scores.amax(-1)
    if running is None:
        row_max = block_max
        denominator = torch.zeros_like(block_max)
        accumulator = torch.zeros((*block_max.shape, values.shape[-1]), dtype=torch.float32, device=query.device)
    else:
        old_max, denominator, accumulator = running
        row_max = torch.maximum(old_max, block_max)
    safe_max = torch.where(torch.isinf(row_max), 0.0, row_max)  # rows masked so far stay at zero weight
    if running is not None:
        rescale = torch.exp(old_max - safe_max)
        denominator = denominator * rescale
        accumulator = accumulator * rescale.unsqueeze(-1)
    weights = torch.exp(scores - safe_max.unsqueeze(-1))
    denominator = denominator + weights.sum(-1)
    accumulator = accumulator + torch.einsum("bhgqn,bhnd->bhgqd", weights, values.float())
    return row_max, denominator, accumulator


def paged_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """An ``AttentionInterface`` function: block-wise attention over a paged layer, sdpa for anything else.

    Layers that are not paged (a hybrid model's sliding layers, another cache, no cache) return ordinary K/V, which
    go to transformers' sdpa function unchanged.
    """
    pages = key if isinstance(key, PagedKV) else None
    if pages is None:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(
            module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs
        )
    if dropout and module.training:
        raise ValueError("paged attention is for inference: dropout must be 0")
    b, hq, q, d = query.shape
    dv = pages.storage.spec.value_dim
    scaling = d**-0.5 if scaling is None else scaling
    slots = pages.slots
    hkv = pages.storage.spec.num_kv_heads
    grouped = query.float().view(b, hkv, hq // hkv, q, d)  # (B, H_kv, G, q, D)
    step = max(1, PAGE_GROUP_TOKENS // pages.block_size) * pages.block_size
    running = None
    for start in range(0, slots.shape[1], step):
        keys, values = pages.storage.read(slots[:, start : start + step])
        mask = None if attention_mask is None else attention_mask[..., start : start + step].bool()
        running = attend_page_group(grouped, keys, values, mask, scaling, running)
    _, denominator, accumulator = running
    out = torch.where(denominator.unsqueeze(-1) > 0, accumulator / denominator.clamp_min(1e-30).unsqueeze(-1), 0.0)
    # (B, H_kv, G, q, D) -> (B, q, H, D), the layout attention functions return
    return out.view(b, hq, q, dv).transpose(1, 2).to(query.dtype).contiguous(), None


def _paged_mask(*args, **kwargs):
    """sdpa's boolean mask, always materialized: the paged function has no ``is_causal`` shortcut."""
    from transformers.masking_utils import sdpa_mask

    kwargs["allow_is_causal_skip"] = False
    return sdpa_mask(*args, **kwargs)


def register_paged_attention() -> str:
    """Register the paged attention function and its mask with transformers (idempotent); returns its name."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(PAGED_ATTENTION, paged_attention_forward)
    AttentionMaskInterface.register(PAGED_ATTENTION, _paged_mask)
    return PAGED_ATTENTION


def use_paged_attention(model) -> None:
    """Switch ``model`` to paged attention: a :class:`~hf_kvcache.PagedKVCache` then skips the gather."""
    model.set_attn_implementation(register_paged_attention())

"""The ``hf_kvcache`` attention implementation: decode attention that reads our caches' storage in place.

``import hf_kvcache`` registers it with transformers' ``AttentionInterface`` (and its mask function with
``AttentionMaskInterface``), so either of these works::

    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation="hf_kvcache")
    model.set_attn_implementation("hf_kvcache")

Under it, a layer of :class:`~hf_kvcache.QuantizedKVCache`, :class:`~hf_kvcache.SlidingWindowKVCache` or
:class:`~hf_kvcache.PagedKVCache` answers a decode forward (1 to :data:`MAX_DECODE_QUERY` new tokens: decoding,
assisted and prompt-lookup verification) with a :class:`~hf_kvcache.formats.KVHandle`: typed views of its codes,
scales, zero points, residual, block tables and the new tokens, instead of a dequantized or gathered copy. This function
hands the handle to its formats' kernels (:mod:`hf_kvcache.formats` over :mod:`hf_kvcache.kernels`: Triton on CUDA, the
pure-torch reference elsewhere), which never build a full-length full-precision copy of the history. Everything else (a
prefill, another cache, no cache, a hybrid model's own sliding layers, latent-attention models whose attention reads
expanded K/V) arrives as plain tensors and goes to sdpa, or, when the layer asks for logit softcapping (Gemma 2) or
learned sinks (GPT-OSS ``s_aux``), which sdpa cannot do, to the reference kernel over those tensors. The attention never
calls back into the cache.
"""

from __future__ import annotations

import torch

from .formats import DenseSegment, KVHandle, decode_attention

__all__ = [
    "ATTENTION",
    "MAX_DECODE_QUERY",
    "hf_kvcache_attention",
    "is_hf_kvcache_attention",
    "register_attention",
]

ATTENTION = "hf_kvcache"
MAX_DECODE_QUERY = 16  # new tokens per forward that the kernels serve; longer forwards get materialized K/V


def is_hf_kvcache_attention(name: str | None) -> bool:
    """Whether an ``attn_implementation`` name is ours (layers then hand attention their storage)."""
    return name == ATTENTION


def _causal_mask(batch: int, q: int, total: int, device: torch.device) -> torch.Tensor:
    """``(B, 1, q, total)``: query ``i`` (the ``total - q + i``-th token) sees every token up to itself."""
    columns = torch.arange(total, device=device)
    rows = torch.arange(total - q, total, device=device)
    return (columns[None, :] <= rows[:, None]).expand(batch, 1, q, total)


def _as_bool(mask: torch.Tensor | None) -> torch.Tensor | None:
    """A boolean mask (True attends) from transformers' boolean or additive float mask (0 attends)."""
    return mask if mask is None or mask.dtype == torch.bool else mask == 0


def _picked(mask: torch.Tensor | None, indices: torch.Tensor, query: torch.Tensor, total: int) -> torch.Tensor:
    """``mask`` narrowed to the keys a sparse attention's indexer picked for each query: ``indices`` ``(B, q, k)``
    key positions, which DeepSeek-V3.2, GLM-5, Dots 3 Note and the like fold into eager's and sdpa's mask themselves
    and pass to every other implementation as ``indices``. A negative entry picks nothing."""
    batch, q = query.shape[0], query.shape[2]
    columns = torch.where(indices >= 0, indices.long(), total)  # into a spare last column, then dropped
    picked = torch.zeros((batch, q, total + 1), dtype=torch.bool, device=query.device).scatter(-1, columns, True)
    base = _causal_mask(batch, q, total, query.device) if mask is None else mask
    return base & picked[..., :total].unsqueeze(1)


POSITION_BIAS_REFUSAL = (
    "model_type {!r} adds a position bias to its attention scores (position_bias), which the hf_kvcache "
    "attention's kernels do not read, so attn_implementation='hf_kvcache' cannot serve it; load or set the model "
    "with 'sdpa' or 'eager', which every hf_kvcache cache serves"
)


def hf_kvcache_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key,
    value,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    softcap: float | None = None,
    s_aux: torch.Tensor | None = None,
    indices: torch.Tensor | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """An ``AttentionInterface`` function: our kernels for a cache's storage handle, sdpa for anything else. A
    sparse attention's ``indices`` (the keys its indexer picked) narrow the mask as eager and sdpa are given it."""
    if kwargs.get("block_indices") is not None:
        raise ValueError(
            f"the hf_kvcache attention does not apply {type(module).__name__}'s block-sparse selection "
            "(block_indices); load the model with attn_implementation='sdpa'"
        )
    scaling = query.shape[-1] ** -0.5 if scaling is None else scaling
    total = key.length if isinstance(key, KVHandle) else key.shape[2]
    mask = _as_bool(attention_mask)
    if indices is not None:
        mask = _picked(mask, indices, query, total)
    if isinstance(key, KVHandle):
        if kwargs.get("position_bias") is not None:  # a cache built from a config alone (one from the model refuses)
            raise ValueError(POSITION_BIAS_REFUSAL.format(key.model_type))
        if dropout and module.training:
            raise ValueError("the hf_kvcache attention reads a cache at inference: dropout must be 0")
        if mask is None and query.shape[2] > 1:  # causal (one query token sees every token: no mask at all)
            mask = _causal_mask(query.shape[0], query.shape[2], total, query.device)
        return decode_attention(query, key, mask, scaling, softcap or 0.0, s_aux), None
    if softcap or s_aux is not None:  # sdpa has neither: the reference over the plain tensors
        if kwargs.get("position_bias") is not None:  # which adds no bias
            raise ValueError(POSITION_BIAS_REFUSAL.format(getattr(getattr(module, "config", None), "model_type", None)))
        if mask is None and query.shape[2] > 1:
            mask = _causal_mask(query.shape[0], query.shape[2], total, query.device)
        handle = KVHandle((DenseSegment(key, value),))
        return decode_attention(query, handle, mask, scaling, softcap or 0.0, s_aux), None
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if indices is not None:
        attention_mask = mask
    return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs)


def _mask(*args, **kwargs):
    """sdpa's boolean mask, skipped (None) where it is plainly causal, as sdpa's own: a prefill then takes sdpa's
    ``is_causal`` path instead of reading a materialized ``(q, T)`` mask, and a decode step over a storage handle
    builds its causal mask itself (:func:`_causal_mask`, a ``(B, 1, q, T)`` comparison)."""
    from transformers.masking_utils import sdpa_mask

    return sdpa_mask(*args, **kwargs)


def register_attention() -> str:
    """Register ``hf_kvcache`` and its mask function with transformers (idempotent)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    from ._legacy_attention import install

    AttentionInterface.register(ATTENTION, hf_kvcache_attention)
    AttentionMaskInterface.register(ATTENTION, _mask)
    install(ATTENTION)  # models that pick attention classes from their own dicts refuse the name clearly at load
    return ATTENTION

"""Dispatch of the decode-attention kernels through ``torch.library`` custom ops.

Each storage format registers its ``hf_kvcache::partial_*`` op in its module (:mod:`hf_kvcache.kernels.formats`) and
a segment calls its own (``segment.partial``): the pure-torch reference is the implementation on every device, the
Triton kernel is registered for CUDA (when triton imports), and a fake implementation gives ``torch.compile`` the
output shapes, so a compiled decode step treats each op as one opaque node (no graph break, and no attempt to trace
an interpreted Triton kernel). This module holds the split reduction over every segment (``hf_kvcache::combine``)
and :func:`decode_attention`, which walks a handle's segments.
"""

from __future__ import annotations

import torch

from . import reference
from ._available import guarded
from .append import append_kv
from .formats import triton_available
from .formats._base import Partials
from .segments import KVHandle, Segment

__all__ = ["append_kv", "decode_attention", "segment_partial", "triton_available"]


def segment_partial(
    query: torch.Tensor, segment: Segment, mask: torch.Tensor | None, scaling: float, softcap: float, splits: int
) -> Partials:
    """One segment through its format's custom op (``segment.partial``; one launch on CUDA, rotated int8 / KIVI codes
    and pre-RoPE KIVI keys included)."""
    return segment.partial(query, mask, scaling, softcap, splits)


@torch.library.custom_op("hf_kvcache::combine", mutates_args=())
def _combine(
    m: list[torch.Tensor],
    l: list[torch.Tensor],  # noqa: E741
    acc: list[torch.Tensor],
    sinks: torch.Tensor | None,
    dtype: torch.dtype,
) -> torch.Tensor:
    """:func:`reference.combine` over the partials of a handle's segments, contiguous ``(B, q, Hq, Dv)``."""
    return reference.combine(list(zip(m, l, acc)), sinks, dtype).contiguous()


@_combine.register_fake
def _(m, l, acc, sinks, dtype):  # noqa: E741
    b, hkv, g, q, _ = m[0].shape
    return m[0].new_empty((b, q, hkv * g, acc[0].shape[-1]), dtype=dtype)


@_combine.register_kernel("cuda")
def _(m, l, acc, sinks, dtype):  # noqa: E741
    partials = list(zip(m, l, acc))

    def ref() -> torch.Tensor:
        return reference.combine(partials, sinks, dtype).contiguous()

    if triton_available():
        from .triton_decode import MAX_COMBINED_SEGMENTS, triton_combine

        if len(partials) <= MAX_COMBINED_SEGMENTS:
            return guarded("combine", lambda: triton_combine(partials, sinks, dtype), ref)
    return ref()


def decode_attention(
    query: torch.Tensor,
    handle: KVHandle,
    mask: torch.Tensor | None,
    scaling: float,
    softcap: float = 0.0,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention ``(B, q, Hq, Dv)`` of ``query`` ``(B, Hq, q, D)`` over a cache layer's storage handle.

    ``mask``: the ``(B, 1, q, T)`` boolean mask of the ``hf_kvcache`` mask function (True attends), whose columns
    follow the handle's segments in order (its ``extra`` leading segments have none, and their own masks); the
    handle's ``columns`` narrow them further. On CUDA each segment is split across programs (flash-decoding); elsewhere
    one split each."""
    partials, col = [], 0
    b, _, q, _ = query.shape
    if handle.columns is not None:  # one AND over every column, the segments' masks views of it
        kept = handle.columns[:, None, None, :]
        mask = kept.expand(b, 1, q, handle.length) if mask is None else mask & kept
    extra = len(handle.extra)
    for i, segment in enumerate(handle.segments):
        if i < extra:  # outside the attention mask's columns: its own mask only
            own = handle.extra[i]
            part_mask = None if own is None else own[:, None, :].expand(b, q, segment.length)
        else:
            part_mask = None if mask is None else mask[:, 0, :, col : col + segment.length]
            col += segment.length
        splits = reference.num_splits(segment.length, query.shape[0] * segment.heads) if query.is_cuda else 1
        partials.append(segment_partial(query, segment, part_mask, scaling, softcap, splits))
    m, l_, acc = (list(x) for x in zip(*partials))
    return _combine(m, l_, acc, sinks, query.dtype)  # one launch: the splits of every segment reduced together

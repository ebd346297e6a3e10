"""Decode-attention kernels over our caches' storage.

One contract (:mod:`hf_kvcache.kernels.reference`) per storage kind (dense, int8, KIVI 4/3/2-bit, paged, int8 pages; the
quantized ones optionally Hadamard-rotated),
two implementations each: a pure-torch reference that runs anywhere with scratch bounded by a chunk, and a Triton
kernel for CUDA (:mod:`hf_kvcache.kernels.triton_decode`), dispatched through ``torch.library`` custom ops
(:mod:`hf_kvcache.kernels.ops`). The storage a layer hands over is described by :mod:`hf_kvcache.kernels.segments`.
"""

from .ops import decode_attention, triton_available
from .reference import combine, num_splits, partial, reference_attention
from .segments import (
    DenseSegment,
    Int8Segment,
    KiviSegment,
    KVHandle,
    PagedSegment,
    PreRopeSegment,
    RotatedSegment,
    Segment,
)

__all__ = [
    "DenseSegment",
    "Int8Segment",
    "KVHandle",
    "KiviSegment",
    "PagedSegment",
    "PreRopeSegment",
    "RotatedSegment",
    "Segment",
    "combine",
    "decode_attention",
    "num_splits",
    "partial",
    "reference_attention",
    "triton_available",
]

"""Dispatch of the decode-attention kernels through ``torch.library`` custom ops.

One op per storage kind, each with the contract of :mod:`hf_kvcache.kernels.reference`: the pure-torch reference is
the implementation on every device, the Triton kernel is registered for CUDA (when triton imports), and a fake
implementation gives ``torch.compile`` the output shapes, so a compiled decode step treats each op as one opaque node
(no graph break, and no attempt to trace an interpreted Triton kernel).
"""

from __future__ import annotations

import functools

import torch

from . import reference
from .segments import (
    DenseSegment,
    Int8Segment,
    KiviSegment,
    KiviTokenSegment,
    KVHandle,
    PagedSegment,
    PreRopeSegment,
    RotatedSegment,
    Segment,
    segment_heads,
)

__all__ = ["decode_attention", "triton_available"]

Partials = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


@functools.cache
def triton_available() -> bool:
    try:
        from . import triton_decode  # noqa: F401
    except Exception:  # no triton, or one that cannot build for this platform
        return False
    return True


def _fake(query: torch.Tensor, heads: int, value_dim: int, splits: int) -> Partials:
    b, hq, q, _ = query.shape
    shape = (b, heads, hq // heads, q, splits)
    m = query.new_empty(shape, dtype=torch.float32)
    return m, torch.empty_like(m), query.new_empty((*shape, value_dim), dtype=torch.float32)


def _register(name: str, schema_fn, make_segment, heads_and_dim):
    """Define ``hf_kvcache::<name>``: reference everywhere, Triton on CUDA (unless ``make_segment`` is None: a
    storage kind the Triton kernel does not read runs the reference on CUDA too), a fake for torch.compile."""
    op = torch.library.custom_op(f"hf_kvcache::{name}", mutates_args=())(schema_fn)

    @op.register_fake
    def _(*args):
        heads, value_dim = heads_and_dim(*args)
        return _fake(args[0], heads, value_dim, args[-1])

    if make_segment is None:
        return op

    @op.register_kernel("cuda")
    def _(*args):
        query, (segment, mask, scaling, softcap, splits) = args[0], make_segment(*args[1:])
        if triton_available():
            from .triton_decode import triton_partial

            return triton_partial(query, segment, mask, scaling, softcap, splits)
        return reference.partial(query, segment, mask, scaling, softcap, splits)

    return op


def _dense(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor | None,
    scaling: float,
    softcap: float,
    splits: int,
) -> Partials:
    return reference.partial(query, DenseSegment(keys, values), mask, scaling, softcap, splits)


def _int8(
    query: torch.Tensor,
    k: torch.Tensor,
    ks: torch.Tensor,
    v: torch.Tensor,
    vs: torch.Tensor,
    mask: torch.Tensor | None,
    scaling: float,
    softcap: float,
    splits: int,
) -> Partials:
    return reference.partial(query, Int8Segment(k, ks, v, vs), mask, scaling, softcap, splits)


def _kivi(
    query: torch.Tensor,
    k: torch.Tensor,
    ks: torch.Tensor,
    kz: torch.Tensor,
    v: torch.Tensor,
    vs: torch.Tensor,
    vz: torch.Tensor,
    mask: torch.Tensor | None,
    bits: int,
    group: int,
    start: int,
    length: int,
    scaling: float,
    softcap: float,
    splits: int,
) -> Partials:
    segment = KiviSegment(bits, group, start, length, k, ks, kz, v, vs, vz)
    return reference.partial(query, segment, mask, scaling, softcap, splits)


def _kivi_token(
    query: torch.Tensor,
    k: torch.Tensor,
    ks: torch.Tensor,
    kz: torch.Tensor,
    v: torch.Tensor,
    vs: torch.Tensor,
    vz: torch.Tensor,
    mask: torch.Tensor | None,
    bits: int,
    group: int,
    scaling: float,
    softcap: float,
    splits: int,
) -> Partials:
    segment = KiviTokenSegment(bits, group, k, ks, kz, v, vs, vz)
    return reference.partial(query, segment, mask, scaling, softcap, splits)


def _paged(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    block_table: torch.Tensor,
    key_scales: torch.Tensor | None,
    value_scales: torch.Tensor | None,
    mask: torch.Tensor | None,
    block_size: int,
    length: int,
    scaling: float,
    softcap: float,
    splits: int,
) -> Partials:
    segment = PagedSegment(keys, values, block_table, block_size, length, key_scales, value_scales)
    return reference.partial(query, segment, mask, scaling, softcap, splits)


_DENSE = _register(
    "partial_dense",
    _dense,
    lambda k, v, mask, *rest: (DenseSegment(k, v), mask, *rest),
    lambda q, k, v, *rest: (k.shape[1], v.shape[-1]),
)
_INT8 = _register(
    "partial_int8",
    _int8,
    lambda k, ks, v, vs, mask, *rest: (Int8Segment(k, ks, v, vs), mask, *rest),
    lambda q, k, ks, v, *rest: (k.shape[1], v.shape[-1]),
)
_KIVI = _register(
    "partial_kivi",
    _kivi,
    lambda k, ks, kz, v, vs, vz, mask, bits, group, start, length, *rest: (
        KiviSegment(bits, group, start, length, k, ks, kz, v, vs, vz),
        mask,
        *rest,
    ),
    lambda q, k, ks, kz, v, vs, vz, mask, bits, *rest: (k.shape[1], v.shape[-1] * 8 // bits),
)
_KIVI_TOKEN = _register(
    "partial_kivi_token",
    _kivi_token,
    None,  # per-token keys: the reference on every device
    lambda q, k, ks, kz, v, vs, vz, mask, bits, *rest: (k.shape[1], v.shape[-1] * 8 // bits),
)
_PAGED = _register(
    "partial_paged",
    _paged,
    lambda k, v, table, kscale, vscale, mask, block_size, length, *rest: (
        PagedSegment(k, v, table, block_size, length, kscale, vscale),
        mask,
        *rest,
    ),
    lambda q, k, v, *rest: (k.shape[1], v.shape[-1]),
)


def segment_partial(
    query: torch.Tensor, segment: Segment, mask: torch.Tensor | None, scaling: float, softcap: float, splits: int
) -> Partials:
    """One segment through its custom op (a rotated segment: its inner segment's op, the rotation folded around it as
    in :func:`reference.partial`)."""
    if isinstance(segment, PreRopeSegment):  # keys turned to their positions per tile, in one launch on CUDA
        if query.is_cuda and triton_available():
            from .triton_decode import triton_partial

            return triton_partial(query, segment, mask, scaling, softcap, splits)
        return reference.partial(query, segment, mask, scaling, softcap, splits)
    if isinstance(segment, RotatedSegment):
        return reference.fold_rotation(segment_partial, query, segment, mask, scaling, softcap, splits)
    if isinstance(segment, DenseSegment):
        return _DENSE(query, segment.keys, segment.values, mask, scaling, softcap, splits)
    if isinstance(segment, Int8Segment):
        return _INT8(query, segment.k, segment.ks, segment.v, segment.vs, mask, scaling, softcap, splits)
    if isinstance(segment, KiviSegment):
        s = segment
        args = (s.k, s.ks, s.kz, s.v, s.vs, s.vz, mask, s.bits, s.group, s.start, s.length)
        return _KIVI(query, *args, scaling, softcap, splits)
    if isinstance(segment, KiviTokenSegment):
        s = segment
        args = (s.k, s.ks, s.kz, s.v, s.vs, s.vz, mask, s.bits, s.group)
        return _KIVI_TOKEN(query, *args, scaling, softcap, splits)
    s = segment
    args = (s.keys, s.values, s.block_table, s.key_scales, s.value_scales, mask, s.block_size, s.length)
    return _PAGED(query, *args, scaling, softcap, splits)


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
    follow the handle's segments in order. On CUDA each segment is split across programs (flash-decoding); elsewhere
    one split each."""
    partials, col = [], 0
    for segment in handle.segments:
        part_mask = None if mask is None else mask[:, 0, :, col : col + segment.length]
        heads = segment_heads(segment)
        splits = reference.num_splits(segment.length, query.shape[0] * heads) if query.is_cuda else 1
        partials.append(segment_partial(query, segment, part_mask, scaling, softcap, splits))
        col += segment.length
    return reference.combine(partials, sinks, query.dtype)

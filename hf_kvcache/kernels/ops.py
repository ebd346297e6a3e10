"""Dispatch of the decode-attention kernels through ``torch.library`` custom ops.

One op per storage kind, each with the contract of :mod:`hf_kvcache.kernels.reference`: the pure-torch reference is
the implementation on every device, the Triton kernel is registered for CUDA (when triton imports), and a fake
implementation gives ``torch.compile`` the output shapes, so a compiled decode step treats each op as one opaque node
(no graph break, and no attempt to trace an interpreted Triton kernel).
"""

from __future__ import annotations

import functools

import torch

from ..rope import RotarySpec
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

__all__ = ["decode_attention", "append_kv", "triton_available"]

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
    key_rotation: torch.Tensor | None,
    value_rotation: torch.Tensor | None,
    scaling: float,
    softcap: float,
    splits: int,
) -> Partials:
    segment = _rotated(Int8Segment(k, ks, v, vs), key_rotation, value_rotation)
    return reference.partial(query, segment, mask, scaling, softcap, splits)


def _rotated(inner: Segment, key_rotation: torch.Tensor | None, value_rotation: torch.Tensor | None) -> Segment:
    """``inner`` read through the rotations its codes were stored with (none: as it is)."""
    if key_rotation is None:
        return inner
    return RotatedSegment(inner, key_rotation, value_rotation)


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
    key_rotation: torch.Tensor | None,
    value_rotation: torch.Tensor | None,
    inv_freq: torch.Tensor | None,
    rotary_dim: int,
    interleaved: bool,
    first: int,
    scaling: float,
    softcap: float,
    splits: int,
) -> Partials:
    segment = _kivi_segment(k, ks, kz, v, vs, vz, bits, group, start, length, key_rotation, value_rotation,
                            inv_freq, rotary_dim, interleaved, first)  # fmt: skip
    return reference.partial(query, segment, mask, scaling, softcap, splits)


def _kivi_segment(k, ks, kz, v, vs, vz, bits, group, start, length, hk, hv, inv_freq, rotary_dim, interleaved, first):
    """A KIVI segment, read through its rotations (``hk``) and with its keys turned to their positions (pre-RoPE:
    ``inv_freq``) when it has them."""
    segment = _rotated(KiviSegment(bits, group, start, length, k, ks, kz, v, vs, vz), hk, hv)
    if inv_freq is None:
        return segment
    return PreRopeSegment(segment, RotarySpec(inv_freq, rotary_dim, interleaved), first)


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
    lambda k, ks, v, vs, mask, hk, hv, *rest: (_rotated(Int8Segment(k, ks, v, vs), hk, hv), mask, *rest),
    lambda q, k, ks, v, *rest: (k.shape[1], v.shape[-1]),
)
_KIVI = _register(
    "partial_kivi",
    _kivi,
    lambda k, ks, kz, v, vs, vz, mask, bits, group, start, length, *rest: (
        _kivi_segment(k, ks, kz, v, vs, vz, bits, group, start, length, *rest[:6]),
        mask,
        *rest[6:],
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
    """One segment through its custom op: one launch on CUDA, rotated int8 / KIVI codes and pre-RoPE KIVI keys
    included (other rotated storage: its inner op, the rotation folded around it as in :func:`reference.partial`)."""
    rope = (None, 0, False, 0)
    if isinstance(segment, PreRopeSegment) and isinstance(segment.inner, KiviSegment):  # turned in the KIVI launch
        r = segment.rotary
        rope = (r.inv_freq.to(device=query.device, dtype=torch.float32), r.rotary_dim, r.interleaved, segment.first)
        segment = segment.inner
    if isinstance(segment, PreRopeSegment):  # other storage: the Triton launch called directly on CUDA
        if query.is_cuda and triton_available():
            from .triton_decode import triton_partial

            return triton_partial(query, segment, mask, scaling, softcap, splits)
        return reference.partial(query, segment, mask, scaling, softcap, splits)
    rotations = (None, None)
    if isinstance(segment, RotatedSegment) and isinstance(segment.inner, (Int8Segment, KiviSegment)):
        # read in place in one launch: the query rotated and the accumulator rotated back inside it
        rotations, segment = (segment.key_rotation, segment.value_rotation), segment.inner
    elif isinstance(segment, RotatedSegment):
        return reference.fold_rotation(segment_partial, query, segment, mask, scaling, softcap, splits)
    if isinstance(segment, DenseSegment):
        return _DENSE(query, segment.keys, segment.values, mask, scaling, softcap, splits)
    if isinstance(segment, Int8Segment):
        return _INT8(query, segment.k, segment.ks, segment.v, segment.vs, mask, *rotations, scaling, softcap, splits)
    if isinstance(segment, KiviSegment):
        s = segment
        args = (s.k, s.ks, s.kz, s.v, s.vs, s.vz, mask, s.bits, s.group, s.start, s.length, *rotations, *rope)
        return _KIVI(query, *args, scaling, softcap, splits)
    if isinstance(segment, KiviTokenSegment):
        s = segment
        args = (s.k, s.ks, s.kz, s.v, s.vs, s.vz, mask, s.bits, s.group)
        return _KIVI_TOKEN(query, *args, scaling, softcap, splits)
    s = segment
    args = (s.keys, s.values, s.block_table, s.key_scales, s.value_scales, mask, s.block_size, s.length)
    return _PAGED(query, *args, scaling, softcap, splits)


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
    if triton_available():
        from .triton_decode import MAX_COMBINED_SEGMENTS, triton_combine

        if len(partials) <= MAX_COMBINED_SEGMENTS:
            return triton_combine(partials, sinks, dtype)
    return reference.combine(partials, sinks, dtype).contiguous()


def _append_reference(
    k: torch.Tensor,
    v: torch.Tensor,
    k_out: torch.Tensor,
    v_out: torch.Tensor,
    k_scales: torch.Tensor | None,
    v_scales: torch.Tensor | None,
    table: torch.Tensor | None,
    start: int,
    block_size: int,
) -> None:
    from .. import quant

    for x, out, scales_out in ((k, k_out, k_scales), (v, v_out, v_scales)):
        payload = {"x": x}  # (B, H, n, D), then the scales (B, H, n[, D / G])
        if scales_out is not None:
            group = x.shape[-1] // scales_out.shape[-1] if table is None else x.shape[-1]
            codes, scales = quant.quantize_symmetric(
                x.reshape(*x.shape[:-1], -1, group), dim=-1, scale_dtype=scales_out.dtype
            )
            payload = {"x": codes.view(x.shape), "s": scales.squeeze(-1)}
            if table is not None:
                payload["s"] = payload["s"].squeeze(-1)  # one scale per token and head
        dests = {"x": out, "s": scales_out}
        if table is None:
            for name, t in payload.items():
                dests[name].copy_(t)
            continue
        positions = torch.arange(start, start + x.shape[2], device=table.device)
        slots = (table[:, positions // block_size].long() * block_size + positions % block_size).flatten()
        keep = slots >= 0  # not under a padding entry
        for name, t in payload.items():  # (B, H, n, ...) -> (B * n, H, ...) rows of the pool
            rows = t.transpose(1, 2).reshape(-1, *t.shape[1:2], *t.shape[3:])
            dests[name].index_copy_(0, slots[keep].to(out.device), rows[keep.to(rows.device)])


@torch.library.custom_op("hf_kvcache::append_kv", mutates_args=("k_out", "v_out", "k_scales", "v_scales"))
def append_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    k_out: torch.Tensor,
    v_out: torch.Tensor,
    k_scales: torch.Tensor | None = None,
    v_scales: torch.Tensor | None = None,
    table: torch.Tensor | None = None,
    start: int = 0,
    block_size: int = 1,
) -> None:
    """Store a forward's new keys and values ``(B, H, n, D)`` in a cache's storage; with ``*_scales``, as int8 codes
    and scales (:func:`hf_kvcache.quant.quantize_symmetric`, the group ``G`` = ``D / scales.shape[-1]``, the scale
    dtype the scales').

    Without ``table`` the destinations are views ``(B, H, n, D)`` and ``(B, H, n, D / G)`` of a layer's token
    buffers; with ``table`` ``(B, blocks)``, page pools ``(slots, H, D)`` and ``(slots, H)``, token ``i`` of row ``b``
    at position ``start + i`` of the row's blocks (none stored under a padding entry). One launch on CUDA
    (:func:`~hf_kvcache.kernels.triton_append.triton_append`, bit-exact to this reference), the reference
    elsewhere."""
    _append_reference(k, v, k_out, v_out, k_scales, v_scales, table, start, block_size)


@append_kv.register_fake
def _(k, v, k_out, v_out, k_scales=None, v_scales=None, table=None, start=0, block_size=1):
    return None


@append_kv.register_kernel("cuda")
def _(k, v, k_out, v_out, k_scales=None, v_scales=None, table=None, start=0, block_size=1):
    if triton_available():
        from .triton_append import triton_append

        return triton_append(k, v, k_out, v_out, k_scales, v_scales, table, start, block_size)
    return _append_reference(k, v, k_out, v_out, k_scales, v_scales, table, start, block_size)


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
    m, l_, acc = (list(x) for x in zip(*partials))
    return _combine(m, l_, acc, sinks, query.dtype)  # one launch: the splits of every segment reduced together

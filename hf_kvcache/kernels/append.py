"""The append op: a forward's new keys and values stored in a cache's storage (token buffers or page pools), as they
are or int8-encoded on the way, in one launch on CUDA."""

from __future__ import annotations

import torch

from .. import quant
from . import cpu_native
from ._available import guarded, triton_available
from ._define import custom_op
from ._eager import eager

__all__ = ["append_kv", "rotate_float32"]


def rotate_float32(x: torch.Tensor, rotation: torch.Tensor) -> torch.Tensor:
    """``x @ rotation`` in float32 (``rotation`` a float32 ``(D, D)`` matrix): the tokens a rotated int8 encoder
    quantizes, unrounded (the append kernel's product, to float rounding)."""
    return torch.matmul(x.float(), rotation)


def _encoded(x: torch.Tensor, out: torch.Tensor, scales_out: torch.Tensor | None, paged: bool) -> dict:
    """What ``x`` ``(B, H, n, D)`` stores: ``{"x": tokens}``, or int8 (fp8 where ``out`` is uint8) codes and their
    scales ``{"x": codes (B, H, n, D), "s": (B, H, n, D / G)}`` (``(B, H, n)`` for pages: one scale per token and
    head)."""
    if scales_out is None:
        return {"x": x}
    group = x.shape[-1] if paged else x.shape[-1] // scales_out.shape[-1]
    encode = quant.quantize_fp8 if out.dtype == torch.uint8 else quant.quantize_symmetric  # e4m3 bits: fp8
    codes, scales = encode(x.reshape(*x.shape[:-1], -1, group), dim=-1, scale_dtype=scales_out.dtype)
    scales = scales.squeeze(-1)
    return {"x": codes.view(x.shape), "s": scales.squeeze(-1) if paged else scales}


def _append_torch(
    k: torch.Tensor,
    v: torch.Tensor,
    k_out: torch.Tensor,
    v_out: torch.Tensor,
    k_scales: torch.Tensor | None,
    v_scales: torch.Tensor | None,
    table: torch.Tensor | None,
    start: int,
    block_size: int,
    k_rotation: torch.Tensor | None = None,
    v_rotation: torch.Tensor | None = None,
) -> None:
    if k_rotation is not None:
        k, v = rotate_float32(k, k_rotation), rotate_float32(v, v_rotation)
    paged = table is not None
    if not paged and k_scales is not None and v_scales is not None and k_out.dtype == torch.int8:
        # int8 token buffers on CPU: the native encoder writes codes and scales in place, bit for bit these
        if all(cpu_native.encode_int8(x, out, s, x.shape[-1] // s.shape[-1])
               for x, out, s in ((k, k_out, k_scales), (v, v_out, v_scales))):  # fmt: skip
            return
    alike = (
        k_scales is not None
        and v_scales is not None
        and k.shape == v.shape
        and k_scales.shape[-1:] == v_scales.shape[-1:]
        and (k_out.dtype, k_scales.dtype) == (v_out.dtype, v_scales.dtype)
    )
    # Keys and values encoded as one tensor where alike: the same codes, half the small operations that are most of
    # a short forward's encode on CPU.
    if alike:
        both = _encoded(torch.stack([k, v]), k_out, k_scales, paged)
        payloads = [{name: t[i] for name, t in both.items()} for i in range(2)]
    else:
        payloads = [_encoded(k, k_out, k_scales, paged), _encoded(v, v_out, v_scales, paged)]
    if paged:
        slots, keep = _slots(table, start, k.shape[2], block_size, k_out.device)
    for payload, out, scales_out in ((payloads[0], k_out, k_scales), (payloads[1], v_out, v_scales)):
        dests = {"x": out, "s": scales_out}
        for name, t in payload.items():
            if not paged:
                dests[name].copy_(t)
                continue
            rows = t.transpose(1, 2).reshape(-1, *t.shape[1:2], *t.shape[3:])  # (B, H, n, ...) -> (B * n, H, ...)
            dests[name].index_copy_(0, slots, rows if keep is None else rows[keep.to(rows.device)])


def _slots(table: torch.Tensor, start: int, n: int, block_size: int, device: torch.device):
    """Pool slots of positions ``start .. start + n`` of every row, flattened row-major, and which of them to keep
    (None: all; those under a padding entry are negative and not stored). Where no row has padding the rows of the
    payload are written without a boolean selection (a nonzero and two gathers, most of a short forward's append
    on CPU)."""
    positions = torch.arange(start, start + n, device=table.device)
    slots = (table[:, positions // block_size].long() * block_size + positions % block_size).flatten()
    keep = slots >= 0
    if bool(keep.all()):
        return slots.to(device), None
    return slots[keep].to(device), keep


def _append(
    k: torch.Tensor,
    v: torch.Tensor,
    k_out: torch.Tensor,
    v_out: torch.Tensor,
    k_scales: torch.Tensor | None,
    v_scales: torch.Tensor | None,
    table: torch.Tensor | None,
    start: int,
    block_size: int,
    k_rotation: torch.Tensor | None,
    v_rotation: torch.Tensor | None,
) -> None:
    """Store a forward's new keys and values ``(B, H, n, D)`` in a cache's storage; with ``*_scales``, as int8 codes
    and scales (:func:`hf_kvcache.quant.quantize_symmetric`, the group ``G`` = ``D / scales.shape[-1]``, the scale
    dtype the scales'), or, where the destination is uint8, fp8 e4m3 bits (:func:`hf_kvcache.quant.quantize_fp8`).
    ``*_rotation`` (int8 token buffers, one scale per token and head): float32 ``(D, D)`` matrices the tokens are
    multiplied by first (:func:`rotate_float32`), as a Hadamard-rotated int8 residual stores them.

    Without ``table`` the destinations are views ``(B, H, n, D)`` and ``(B, H, n, D / G)`` of a layer's token
    buffers; with ``table`` ``(B, blocks)``, page pools ``(slots, H, D)`` and ``(slots, H)``, token ``i`` of row ``b``
    at position ``start + i`` of the row's blocks (none stored under a padding entry). One launch on CUDA
    (:func:`~hf_kvcache.kernels.triton_append.triton_append`, bit-exact to this reference; with a rotation, to the
    float rounding of the product's sums), the reference elsewhere.

    Every argument is required: torch 2.11's in-place bookkeeping for a mutating custom op indexes the mutated
    arguments by position among those passed, so a defaulted, omitted ``k_scales`` raised ``IndexError`` there (on
    the first GPU run) while newer torch fills the defaults in first."""
    _append_torch(k, v, k_out, v_out, k_scales, v_scales, table, start, block_size, k_rotation, v_rotation)


_OP = custom_op("hf_kvcache::append_kv", _append, mutates_args=("k_out", "v_out", "k_scales", "v_scales"))


@_OP.register_fake
def _(k, v, k_out, v_out, k_scales, v_scales, table, start, block_size, k_rotation, v_rotation):
    return None


@_OP.register_kernel("cuda")
def _append_cuda(k, v, k_out, v_out, k_scales, v_scales, table, start, block_size, k_rotation, v_rotation):
    args = (k, v, k_out, v_out, k_scales, v_scales, table, start, block_size, k_rotation, v_rotation)
    if triton_available():
        from .triton_append import triton_append

        return guarded("append_kv", lambda: triton_append(*args), lambda: _append_torch(*args))
    return _append_torch(*args)


append_kv = eager(_OP, _append, _append_cuda)

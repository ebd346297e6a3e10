"""Writing a forward's new keys and values into a cache's storage in one Triton launch per layer: int8 codes and
scales encoded on the way (quantize-on-append), or the tokens as they are, into a layer's token buffers or through a
block table into page slots.

The int8 encoding is bit for bit :func:`hf_kvcache.quant.quantize_symmetric` (tests run this kernel under
``TRITON_INTERPRET=1``): absmax over the finite elements of each group, the scale rounded *up* to its storage dtype,
bumped to the smallest positive value if it underflowed and one more unit if the range still exceeds 127 steps,
non-finite inputs mapped (NaN to 0, infinities to the group's absmax), codes clamped then rounded half to even.
Divisions are the correctly rounded ``div_rn``, so a GPU computes the same codes (up to flush-to-zero of subnormal
inputs).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..quant import codes_per_byte
from .storage import pool_strides, strides

__all__ = ["kivi_encodable", "triton_append", "triton_kivi_encode"]


@triton.jit
def _next_up(scale):
    """The next representable value above a non-negative ``scale`` (its bits plus one), saturating at the dtype's
    largest finite value (as :func:`hf_kvcache.quant._saturate`)."""
    if scale.dtype == tl.float32:
        bits = scale.to(tl.int32, bitcast=True)
        return tl.where(bits == 0x7F7FFFFF, bits, bits + 1).to(tl.float32, bitcast=True)
    elif scale.dtype == tl.float16:
        bits = scale.to(tl.int16, bitcast=True)
        return tl.where(bits == 0x7BFF, bits, bits + 1).to(tl.float16, bitcast=True)
    else:
        bits = scale.to(tl.int16, bitcast=True)
        return tl.where(bits == 0x7F7F, bits, bits + 1).to(tl.bfloat16, bitcast=True)


@triton.jit
def _saturated(x, SDT: tl.constexpr):
    """Float32 ``x`` cast to 16-bit ``SDT`` to nearest, values past its largest finite value clamped to it (a cast
    would give inf)."""
    if SDT == tl.float16:
        return tl.minimum(tl.maximum(x, -65504.0), 65504.0).to(SDT)
    elif SDT == tl.bfloat16:
        return tl.minimum(tl.maximum(x, -3.3895313892515355e38), 3.3895313892515355e38).to(SDT)
    else:
        return x.to(SDT)


@triton.jit
def _e4m3_bits(y):
    """float32 ``y`` (``|y| <= 448``, finite) as float8 e4m3 ("fn") bits, rounded to nearest even as torch's
    ``.to(torch.float8_e4m3fn)``: normal values keep 3 mantissa bits of the float32 (rounded at bit 20, a carry
    moving into the exponent), values below 2^-6 become multiples of 2^-9 (rounded as an integer count of them; 8 of
    them is the smallest normal, whose bits are the same). The sign comes from the float's bits (-0.0 included)."""
    f = y.to(tl.int32, bitcast=True)
    sign = (f >> 24) & 0x80
    a = tl.abs(y)
    fa = a.to(tl.int32, bitcast=True)
    rounded = fa + 0x7FFFF + ((fa >> 20) & 1)
    normal = (((rounded >> 23) - 120) << 3) | ((rounded >> 20) & 7)  # exponent rebased: 127 - 7
    sub = ((a * 512.0 + 12582912.0) - 12582912.0).to(tl.int32)  # multiples of 2^-9, half to even
    return (tl.where(a >= 0.015625, normal, sub) | sign).to(tl.uint8)


@triton.jit
def _rotated(XROW, sx_d, HM, D: tl.constexpr, BLOCK_C: tl.constexpr, RC: tl.constexpr):
    """``x H`` of one token's ``D`` channels at ``XROW`` (``HM``: a row-major ``(D, D)`` float32 matrix), in float32,
    ``RC`` input channels at a time (a whole ``(D, D)`` tile would not fit in registers at D = 256)."""
    j = tl.arange(0, BLOCK_C)
    acc = tl.zeros([BLOCK_C], dtype=tl.float32)
    for i0 in range(0, D, RC):
        i = i0 + tl.arange(0, RC)
        xi = tl.load(XROW + i * sx_d, mask=i < D, other=0.0).to(tl.float32)
        hij = tl.load(HM + i[:, None] * D + j[None, :], mask=(i < D)[:, None] & (j < D)[None, :], other=0.0)
        acc += tl.sum(xi[:, None] * hij, axis=0)
    return acc


@triton.jit
def _store_token(
    X, C, S, HM, b, h, t, row, block, sx_b, sx_h, sx_t, sx_d, sc_b, sc_h, sc_t, sc_d, ss_b, ss_h, ss_t, ss_g,
    D: tl.constexpr, GROUP: tl.constexpr, SDT: tl.constexpr, QUANT: tl.constexpr,
    BLOCK_G: tl.constexpr, BLOCK_C: tl.constexpr, ROTATE: tl.constexpr, RC: tl.constexpr,
):  # fmt: skip
    """Token ``t`` of head ``h``, batch row ``b``, stored at token index ``row`` of ``C`` (and ``S``), unless its
    page ``block`` is negative (a padding entry): ``D`` channels as a ``(groups of GROUP, channels)`` tile, as they
    are (``QUANT`` 0), int8-encoded (1) or fp8-encoded (2: e4m3 bits, :func:`hf_kvcache.quant.quantize_fp8`).
    ``ROTATE`` (int8, one group per head): the token times ``HM`` in float32 first, encoded unrounded."""
    gi = tl.arange(0, BLOCK_G)
    ci = tl.arange(0, BLOCK_C)
    d = gi[:, None] * GROUP + ci[None, :]
    ok = (gi < D // GROUP)[:, None] & (ci < GROUP)[None, :]
    keep = (tl.zeros_like(gi) + block) >= 0  # compared as a vector (the interpreter mis-types a scalar's)
    raw = tl.load(X + b * sx_b + h * sx_h + t * sx_t + d * sx_d, mask=ok, other=0.0)
    dest = C + b * sc_b + h * sc_h + row * sc_t + d * sc_d
    if QUANT == 2:
        x = raw.to(tl.float32)
        finite = (x == x) & (tl.abs(x) != float("inf"))
        absmax = tl.max(tl.where(finite & ok, tl.abs(x), 0.0), 1)
        want = tl.math.div_rn(absmax, 448.0)
        scale = _saturated(want, SDT)  # rounded up to its dtype, the smallest positive value if it underflowed
        scale = tl.where(scale.to(tl.float32) < want, _next_up(scale), scale)
        scale = tl.where((absmax > 0) & (scale == 0), _next_up(tl.zeros_like(scale)), scale)
        safe = tl.where(scale > 0, scale.to(tl.float32), 1.0)
        inf_value = tl.where(x > 0, absmax[:, None], -absmax[:, None])
        x = tl.where(finite, x, tl.where(x != x, 0.0, inf_value))
        y = tl.minimum(tl.maximum(tl.math.div_rn(x, safe[:, None]), -448.0), 448.0)
        tl.store(dest, _e4m3_bits(y), mask=ok & keep[:, None])
        tl.store(S + b * ss_b + h * ss_h + row * ss_t + gi * ss_g, scale, mask=(gi < D // GROUP) & keep)
    elif QUANT == 1:
        x = raw.to(tl.float32)
        if ROTATE:  # BLOCK_G is 1: the rotated head is the tile's one row
            x = _rotated(X + b * sx_b + h * sx_h + t * sx_t, sx_d, HM, D, BLOCK_C, RC)[None, :]
        finite = (x == x) & (tl.abs(x) != float("inf"))
        absmax = tl.max(tl.where(finite & ok, tl.abs(x), 0.0), 1)  # (groups,): max(|min|, |max|) of the finite
        want = tl.math.div_rn(absmax, 127.0)
        scale = _saturated(want, SDT)  # to nearest, then up one unit where that fell below: covers the range
        scale = tl.where(scale.to(tl.float32) < want, _next_up(scale), scale)
        scale = tl.where((absmax > 0) & (scale == 0), _next_up(tl.zeros_like(scale)), scale)
        positive = tl.where(scale > 0, scale.to(tl.float32), 1.0)
        scale = tl.where(tl.math.div_rn(absmax, positive) > 127.0, _next_up(scale), scale)
        safe = tl.where(scale > 0, scale.to(tl.float32), 1.0)
        inf_value = tl.where(x > 0, absmax[:, None], -absmax[:, None])
        x = tl.where(finite, x, tl.where(x != x, 0.0, inf_value))
        codes = tl.minimum(tl.maximum(tl.math.div_rn(x, safe[:, None]), -127.0), 127.0)
        # Half to even, as torch.round: adding 1.5 x 2^23 leaves no fraction bits; the add rounds to nearest even.
        codes = ((codes + 12582912.0) - 12582912.0).to(tl.int8)
        tl.store(dest, codes, mask=ok & keep[:, None])
        tl.store(S + b * ss_b + h * ss_h + row * ss_t + gi * ss_g, scale, mask=(gi < D // GROUP) & keep)
    else:
        tl.store(dest, raw, mask=ok & keep[:, None])


@triton.jit(do_not_specialize=["START", "sks_b", "svs_b"])
def _append_kernel(
    K, V, KC, VC, KS, VS, TABLE, HK, HV,
    sk_b, sk_h, sk_t, sk_d, sv_b, sv_h, sv_t, sv_d,
    skc_b, skc_h, skc_t, skc_d, svc_b, svc_h, svc_t, svc_d,
    sks_b, sks_h, sks_t, sks_g, svs_b, svs_h, svs_t, svs_g,
    stab_b, stab_n, H, n, START,
    DK: tl.constexpr, DV: tl.constexpr, GK: tl.constexpr, GV: tl.constexpr, SDT: tl.constexpr,
    QUANT: tl.constexpr, PAGED: tl.constexpr, BS: tl.constexpr,
    BLOCK_GK: tl.constexpr, BLOCK_CK: tl.constexpr, BLOCK_GV: tl.constexpr, BLOCK_CV: tl.constexpr,
    ROTATE: tl.constexpr, RC: tl.constexpr,
):  # fmt: skip
    """Grid ``(B x H x n, 2)``: axis 1 picks keys or values, so one launch stores both."""
    pid = tl.program_id(0)
    t = pid % n
    h = ((pid // n) % H).to(tl.int64)  # 64-bit offsets: a layer's buffers or a pool may pass 2^31 elements
    b = (pid // (n * H)).to(tl.int64)
    row = t.to(tl.int64)
    block = 0
    if PAGED:  # token START + t of row b: its block from the table (a padding entry: not stored), its slot in it
        pos = START + t
        block = tl.load(TABLE + b * stab_b + (pos // BS) * stab_n)
        row = block.to(tl.int64) * BS + pos % BS
    if tl.program_id(1) == 0:
        _store_token(
            K, KC, KS, HK, b, h, t, row, block, sk_b, sk_h, sk_t, sk_d, skc_b, skc_h, skc_t, skc_d,
            sks_b, sks_h, sks_t, sks_g, DK, GK, SDT, QUANT, BLOCK_GK, BLOCK_CK, ROTATE, RC,
        )  # fmt: skip
    else:
        _store_token(
            V, VC, VS, HV, b, h, t, row, block, sv_b, sv_h, sv_t, sv_d, svc_b, svc_h, svc_t, svc_d,
            svs_b, svs_h, svs_t, svs_g, DV, GV, SDT, QUANT, BLOCK_GV, BLOCK_CV, ROTATE, RC,
        )  # fmt: skip


_SCALE_TYPES = {torch.float32: tl.float32, torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}
# KIVI's scales and zero points: those, or 8-bit scales (quant.E5M3, stored as uint8) and int8 zero points
_KIVI_TYPES = {**_SCALE_TYPES, torch.uint8: tl.uint8, torch.int8: tl.int8}


def triton_append(
    k: torch.Tensor,
    v: torch.Tensor,
    k_out: torch.Tensor,
    v_out: torch.Tensor,
    k_scales: torch.Tensor | None = None,
    v_scales: torch.Tensor | None = None,
    table: torch.Tensor | None = None,
    start: int = 0,
    block_size: int = 1,
    k_rotation: torch.Tensor | None = None,
    v_rotation: torch.Tensor | None = None,
) -> None:
    """Store ``k`` / ``v`` ``(B, H, n, D)`` in one launch: codes and scales when ``*_scales`` are given (int8 codes,
    or fp8 e4m3 bits where the destination is uint8), else the tokens as they are. ``*_rotation``: ``(D, D)`` float32
    matrices the tokens are multiplied by first, in float32 (int8 codes in token buffers, one scale per token and
    head only: a Hadamard-rotated int8 residual stored in the launch that stores it).

    Without ``table``: ``*_out`` ``(B, H, n, D)`` and ``*_scales`` ``(B, H, n, D / G)`` are the destination (views of
    a layer's token buffers; the group ``G`` is ``D / scales.shape[-1]``). With ``table`` (``(B, blocks)`` block ids,
    negative for padding): ``*_out`` are page pools ``(slots, H, D)`` and ``*_scales`` ``(slots, H)``; token ``i`` of
    row ``b`` is position ``start + i`` of that row, stored at slot ``table[b, pos // block_size] * block_size +
    pos % block_size`` (not stored under a padding entry)."""
    b, h, n, dk = k.shape
    dv = v.shape[-1]
    quant = k_scales is not None
    outs = (k_out, v_out, k_scales, v_scales)  # absent scales: zero strides
    if table is None:
        out_strides = [strides(x) for x in outs]
        gk, gv = (dk // k_scales.shape[-1], dv // v_scales.shape[-1]) if quant else (dk, dv)
    else:
        out_strides = [pool_strides(x) for x in outs]
        gk, gv = dk, dv
    rotate = k_rotation is not None
    if rotate and not (
        quant and k_out.dtype == torch.int8 and table is None and (gk, gv) == (dk, dv)
        and k_rotation.shape == (dk, dk) and v_rotation.shape == (dv, dv)
        and k_rotation.dtype == v_rotation.dtype == torch.float32
        and k_rotation.is_contiguous() and v_rotation.is_contiguous()
    ):  # fmt: skip
        raise ValueError(
            "triton_append: rotations are contiguous float32 (D, D) matrices, for int8 token buffers with one scale "
            "per token and head"
        )
    if b * h * n == 0:
        return
    _append_kernel[(b * h * n, 2)](
        k, v, k_out, v_out, k_scales if quant else k_out, v_scales if quant else v_out,
        table if table is not None else k_out, k_rotation if rotate else k_out, v_rotation if rotate else v_out,
        *k.stride(), *v.stride(), *(s for x in out_strides for s in x),
        *(table.stride() if table is not None else (0, 0)), h, n, start,
        DK=dk, DV=dv, GK=gk, GV=gv, SDT=_SCALE_TYPES[k_scales.dtype] if quant else tl.float32,
        QUANT=(2 if k_out.dtype == torch.uint8 else 1) if quant else 0,
        PAGED=table is not None, BS=block_size, BLOCK_GK=triton.next_power_of_2(dk // gk),
        BLOCK_CK=triton.next_power_of_2(gk), BLOCK_GV=triton.next_power_of_2(dv // gv),
        BLOCK_CV=triton.next_power_of_2(gv), ROTATE=rotate, RC=16,
    )  # fmt: skip


# --- KIVI: tokens leaving the residual, encoded into the storage in one launch -------------------------------------


@triton.jit
def _round_down(x, SDT: tl.constexpr):
    """Float32 ``x`` in ``SDT``, rounded toward -inf (to nearest, then one unit down where that rose above ``x``)."""
    if SDT == tl.float32:
        return x
    y = _saturated(x, SDT)
    bits = y.to(tl.int16, bitcast=True)
    down = tl.where(y > 0, bits - 1, bits + 1).to(SDT, bitcast=True)  # y <= 0 here only from x < 0: magnitude up
    top = 0x7BFF if SDT == tl.float16 else 0x7F7F  # the largest finite value's magnitude bits: saturated, kept
    return tl.where((y.to(tl.float32) > x) & ((bits & 0x7FFF) != top), down, y)


@triton.jit
def _round_up(x, SDT: tl.constexpr):
    """Non-negative float32 ``x`` in ``SDT``, rounded toward +inf."""
    if SDT == tl.float32:
        return x
    y = _saturated(x, SDT)
    return tl.where(y.to(tl.float32) < x, _next_up(y), y)


@triton.jit
def _e5m3_value(code):
    """:func:`hf_kvcache.quant.decode_e5m3`: int32 codes as float32."""
    return (code << 7).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _e5m3(x, lower):
    """:func:`hf_kvcache.quant.encode_e5m3` with ``lower``: the E5M3 code (int32) nearest non-negative ``x`` that is
    at least ``lower`` (float16 rounded up, then up to whole codes; saturating at 0xF7)."""
    half = _round_up(x, tl.float16)
    code = tl.minimum((half.to(tl.int16, bitcast=True).to(tl.int32) + 127) >> 7, 0xF7)
    below = tl.maximum(code - 1, 0)
    down = _e5m3_value(below)
    nearer = (x - down < _e5m3_value(code) - x) & (down >= lower) & (code > 0)
    return tl.where(nearer, below, code)


@triton.jit
def _e5m3_params(mn, mx, TOP: tl.constexpr, ZDT: tl.constexpr):
    """8-bit scales (codes, int32) and zero points (stored, and as float32) of a grid centered on each group, bit for
    bit :func:`hf_kvcache.quant._e5m3_params`: int8 zero points (``ZDT``) in steps of ``(TOP + 1) / 128`` scales, or
    float ones rounded to nearest in ``ZDT``."""
    mid = tl.where(mx == mn, mn, mn / 2 + mx / 2)
    if ZDT == tl.int8:
        UNIT: tl.constexpr = (TOP + 1) / 128
        SPAN: tl.constexpr = TOP + 1 - UNIT
        reach = (tl.abs(mn) + tl.abs(mx)) / (TOP + 1)
        reach = tl.where((mn != 0) | (mx != 0), tl.maximum(reach, 2.0**-17), reach)  # as the reference's E5M3_TINY
        lower = tl.maximum(tl.math.div_rn(mx, SPAN) - tl.math.div_rn(mn, SPAN), reach)
        code = _e5m3(tl.maximum(tl.math.div_rn(mx, TOP * 1.0) - tl.math.div_rn(mn, TOP * 1.0), lower), lower)
        s = _e5m3_value(code)
        u = s * UNIT
        steps = tl.math.div_rn(mid - s * (TOP / 2), tl.where(u > 0, u, 1.0))
        steps = tl.minimum(tl.maximum((steps + 12582912.0) - 12582912.0, -128.0), 127.0)  # half to even
        return code, steps.to(tl.int8), steps * u
    if ZDT == tl.float32:
        HALF_EPS: tl.constexpr = 2.0**-24
        TINY: tl.constexpr = 2.0**-149
    elif ZDT == tl.float16:
        HALF_EPS: tl.constexpr = 2.0**-11
        TINY: tl.constexpr = 2.0**-24
    else:
        HALF_EPS: tl.constexpr = 2.0**-8
        TINY: tl.constexpr = 2.0**-133
    slack = (tl.abs(mn) + tl.abs(mx) + (mx - mn)) * HALF_EPS + TINY
    lower = tl.math.div_rn(mx, TOP + 1.0) - tl.math.div_rn(mn, TOP + 1.0) + slack * (2 / (TOP + 1))
    lower = tl.where(mx > mn, tl.maximum(lower, 2.0**-17), lower)
    code = _e5m3(tl.maximum(tl.math.div_rn(mx, TOP * 1.0) - tl.math.div_rn(mn, TOP * 1.0), lower), lower)
    zero = _saturated(mid - _e5m3_value(code) * (TOP / 2), ZDT)
    return code, zero, zero.to(tl.float32)


@triton.jit
def _asymmetric(x, ok, mn, mx, MID, TOP: tl.constexpr, SDT: tl.constexpr, LEVELS: tl.constexpr,
                ZDT: tl.constexpr):  # fmt: skip
    """Codes (int32, ``[0, TOP]``), scales and zero points of groups with finite extrema ``mn`` / ``mx`` (float32,
    broadcast against ``x``), bit for bit :func:`hf_kvcache.quant.quantize_asymmetric`: the zero point is the minimum
    rounded down to ``SDT``, the scale ``(max - zero) / TOP`` (divided first) rounded up, bumped to the smallest
    positive value if it underflowed and one unit more if the range still exceeds ``TOP`` steps (8-bit scales,
    ``SDT`` uint8: :func:`_e5m3_params`, zero points in ``ZDT``); non-finite inputs mapped (infinities to the
    extrema, NaN to the value nearest 0 in the range); codes rounded half to even, or with ``LEVELS`` the index of
    the nearest level of a codebook: how many of its ``TOP`` midpoints (``MID``) lie below."""
    if SDT == tl.uint8:
        code, zero, zf = _e5m3_params(mn, mx, TOP, ZDT)
        scale = code.to(tl.uint8)
        safe = _e5m3_value(code)
        safe = tl.where(safe > 0, safe, 1.0)
    else:
        zero = _round_down(mn, SDT)
        zf = zero.to(tl.float32)
        scale = _round_up(tl.math.div_rn(mx, TOP * 1.0) - tl.math.div_rn(zf, TOP * 1.0), SDT)
        scale = tl.where((mx - zf > 0) & (scale == 0), _next_up(tl.zeros_like(scale)), scale)
        positive = tl.where(scale > 0, scale.to(tl.float32), 1.0)
        scale = tl.where(tl.math.div_rn(mx, positive) - tl.math.div_rn(zf, positive) > TOP, _next_up(scale), scale)
        safe = tl.where(scale > 0, scale.to(tl.float32), 1.0)
    finite = (x == x) & (tl.abs(x) != float("inf"))
    nan_value = tl.minimum(tl.maximum(tl.zeros_like(mn), mn), mx)
    x = tl.where(finite, x, tl.where(x != x, nan_value, tl.where(x > 0, mx, mn)))
    c = tl.math.div_rn(x, safe) - tl.math.div_rn(zf, safe)
    if LEVELS:
        codes = tl.zeros(c.shape, tl.int32)
        for i in tl.static_range(TOP):
            codes += (c > tl.load(MID + i)).to(tl.int32)
        return tl.where(ok, codes, 0), scale, zero
    c = (c + 12582912.0) - 12582912.0  # half to even, as torch.round
    codes = tl.where(ok, tl.minimum(tl.maximum(c, 0.0), TOP * 1.0), 0.0).to(tl.int32)
    return codes, scale, zero


@triton.jit
def _finite_extrema(x, ok, axis: tl.constexpr):
    """Min and max over ``axis`` of the finite elements of ``x`` where ``ok`` (both 0 for a group with none)."""
    finite = ok & (x == x) & (tl.abs(x) != float("inf"))
    mn = tl.min(tl.where(finite, x, float("inf")), axis)
    mx = tl.max(tl.where(finite, x, float("-inf")), axis)
    empty = mn > mx
    return tl.where(empty, 0.0, mn), tl.where(empty, 0.0, mx)


@triton.jit
def _pack_plane(codes, j, PER: tl.constexpr, PLANE: tl.constexpr):
    """Bytes of a ``(..., W, PER)`` code tile: bits ``PLANE`` up of each code, ``PER`` codes (``8 / PER`` bits each)
    per byte along the last axis, low bits first (:func:`hf_kvcache.quant.pack`)."""
    WIDTH: tl.constexpr = 8 // PER
    return tl.sum(((codes >> PLANE) & ((1 << WIDTH) - 1)) << (j * WIDTH), 2)


@triton.jit
def _kivi_group(
    X, P, S, Z, MID, x_off, p_row, s_off, t_stride, d_stride, p_t, p_d, s_d,
    NT, D: tl.constexpr, BITS: tl.constexpr, PER: tl.constexpr, PLANE: tl.constexpr, OFFSET: tl.constexpr,
    SCALES: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_W: tl.constexpr, SDT: tl.constexpr, LEVELS: tl.constexpr,
    ZDT: tl.constexpr,
):  # fmt: skip
    """One key group: ``NT`` tokens x ``D`` channels, a scale and zero point per channel (over the tokens), the codes'
    bit plane ``PLANE`` (bits ``PLANE`` up, ``PER`` codes per byte) written at byte ``OFFSET`` of each token's row."""
    ti = tl.arange(0, BLOCK_T)[:, None, None]
    wi = tl.arange(0, BLOCK_W)[None, :, None]
    j = tl.arange(0, PER)[None, None, :]
    d = wi * PER + j
    ok = (ti < NT) & (d < D)
    x = tl.load(X + x_off + ti * t_stride + d * d_stride, mask=ok, other=0.0).to(tl.float32)
    mn, mx = _finite_extrema(x, ok, 0)
    codes, scale, zero = _asymmetric(x, ok, mn[None], mx[None], MID, (1 << BITS) - 1, SDT, LEVELS, ZDT)
    if SCALES:
        dd = wi * PER + j  # (1, W, PER)
        tl.store(S + s_off + dd * s_d, scale, mask=dd < D)
        tl.store(Z + s_off + dd * s_d, zero, mask=dd < D)
    byte = _pack_plane(codes, j, PER, PLANE)  # (T, W)
    w2 = tl.arange(0, BLOCK_W)[None, :]
    t2 = tl.arange(0, BLOCK_T)[:, None]
    tl.store(P + p_row + t2 * p_t + (OFFSET + w2) * p_d, byte.to(tl.uint8), mask=(t2 < NT) & (w2 * PER < D))


@triton.jit
def _kivi_token(
    X, P, S, Z, MID, x_off, p_off, s_off, d_stride, p_d, s_d,
    D: tl.constexpr, G: tl.constexpr, BITS: tl.constexpr, PER: tl.constexpr, PLANE: tl.constexpr,
    OFFSET: tl.constexpr, SCALES: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_W: tl.constexpr, SDT: tl.constexpr,
    LEVELS: tl.constexpr, ZDT: tl.constexpr,
):  # fmt: skip
    """One token: ``D`` channels in groups of ``G`` (``G`` a multiple of ``PER``), a scale and zero point per group,
    the codes' bit plane ``PLANE`` written ``PER`` per byte from byte ``OFFSET`` of the token's row."""
    gi = tl.arange(0, BLOCK_G)[:, None, None]
    wi = tl.arange(0, BLOCK_W)[None, :, None]
    j = tl.arange(0, PER)[None, None, :]
    d = gi * G + wi * PER + j
    ok = (gi < D // G) & (wi < G // PER) & (j < PER)
    x = tl.load(X + x_off + d * d_stride, mask=ok, other=0.0).to(tl.float32)
    # A group's extrema reduced over both of its axes in turn, never through a reshape: Triton 3.6 compiled the
    # earlier (G, W * PER) reshape to a different element order on sm_90 (the interpreter keeps numpy's order), and
    # the values' scales came out wrong on the first GPU run.
    finite = ok & (x == x) & (tl.abs(x) != float("inf"))
    mn = tl.min(tl.min(tl.where(finite, x, float("inf")), 2), 1)
    mx = tl.max(tl.max(tl.where(finite, x, float("-inf")), 2), 1)
    empty = mn > mx  # a group with no finite element: both 0, as _finite_extrema
    mn, mx = tl.where(empty, 0.0, mn), tl.where(empty, 0.0, mx)
    codes, scale, zero = _asymmetric(x, ok, mn[:, None, None], mx[:, None, None], MID, (1 << BITS) - 1, SDT, LEVELS,
                                     ZDT)  # fmt: skip
    if SCALES:
        gs = tl.arange(0, BLOCK_G)[:, None, None]
        tl.store(S + s_off + gs * s_d, scale, mask=gs < D // G)
        tl.store(Z + s_off + gs * s_d, zero, mask=gs < D // G)
    byte = _pack_plane(codes, j, PER, PLANE)  # (G, W): byte gi * G / PER + wi of the plane
    g2 = tl.arange(0, BLOCK_G)[:, None]
    w2 = tl.arange(0, BLOCK_W)[None, :]
    where = OFFSET + g2 * (G // PER) + w2
    tl.store(P + p_off + where * p_d, byte.to(tl.uint8), mask=(g2 < D // G) & (w2 < G // PER))


@triton.jit
def _kivi_group_planes(
    X, P, S, Z, MID, x_off, p_row, s_off, t_stride, d_stride, p_t, p_d, s_d, NT,
    D: tl.constexpr, BITS: tl.constexpr, SDT: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr,
    LEVELS: tl.constexpr, ZDT: tl.constexpr,
):  # fmt: skip
    if BITS == 3:  # the 2-bit plane (4 codes per byte), then the high bits (8 per byte) after its D / 4 bytes
        _kivi_group(X, P, S, Z, MID, x_off, p_row, s_off, t_stride, d_stride, p_t, p_d, s_d, NT,
                    D, 3, 4, 0, 0, True, BLOCK_T, BLOCK_D // 4, SDT, LEVELS, ZDT)  # fmt: skip
        _kivi_group(X, P, S, Z, MID, x_off, p_row, s_off, t_stride, d_stride, p_t, p_d, s_d, NT,
                    D, 3, 8, 2, D // 4, False, BLOCK_T, BLOCK_D // 8, SDT, LEVELS, ZDT)  # fmt: skip
    else:
        _kivi_group(X, P, S, Z, MID, x_off, p_row, s_off, t_stride, d_stride, p_t, p_d, s_d, NT,
                    D, BITS, 8 // BITS, 0, 0, True, BLOCK_T, BLOCK_D // (8 // BITS), SDT, LEVELS, ZDT)  # fmt: skip


@triton.jit
def _kivi_token_planes(
    X, P, S, Z, MID, x_off, p_off, s_off, d_stride, p_d, s_d,
    D: tl.constexpr, G: tl.constexpr, BITS: tl.constexpr, SDT: tl.constexpr, BLOCK_G: tl.constexpr,
    BLOCK_C: tl.constexpr, LEVELS: tl.constexpr, ZDT: tl.constexpr,
):  # fmt: skip
    if BITS == 3:
        _kivi_token(X, P, S, Z, MID, x_off, p_off, s_off, d_stride, p_d, s_d, D, G, 3, 4, 0, 0, True, BLOCK_G,
                    BLOCK_C // 4, SDT, LEVELS, ZDT)  # fmt: skip
        _kivi_token(X, P, S, Z, MID, x_off, p_off, s_off, d_stride, p_d, s_d, D, G, 3, 8, 2, D // 4, False, BLOCK_G,
                    BLOCK_C // 8, SDT, LEVELS, ZDT)  # fmt: skip
    else:
        _kivi_token(X, P, S, Z, MID, x_off, p_off, s_off, d_stride, p_d, s_d, D, G, BITS, 8 // BITS, 0, 0, True,
                    BLOCK_G, BLOCK_C // (8 // BITS), SDT, LEVELS, ZDT)  # fmt: skip


@triton.jit
def _kivi_encode_kernel(
    K, V, KP, KS, KZ, VP, VS, VZ, KM, VM,
    sk_b, sk_h, sk_t, sk_d, sv_b, sv_h, sv_t, sv_d,
    skp_b, skp_h, skp_t, skp_d, sks_b, sks_h, sks_t, sks_d,
    svp_b, svp_h, svp_t, svp_d, svs_b, svs_h, svs_t, svs_d,
    H, n, NK,
    DK: tl.constexpr, DV: tl.constexpr, G: tl.constexpr, KBITS: tl.constexpr, VBITS: tl.constexpr,
    KEY_TOKEN: tl.constexpr, LEVELS: tl.constexpr,
    SDT: tl.constexpr, KZDT: tl.constexpr, VZDT: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_DK: tl.constexpr,
    BLOCK_GK: tl.constexpr, BLOCK_GV: tl.constexpr, BLOCK_C: tl.constexpr,
):  # fmt: skip
    """Grid ``(NK + n, B x H)``: items below ``NK`` encode keys (a group of ``G`` tokens per channel, or one token
    with ``KEY_TOKEN``), the rest one token's values each."""
    item = tl.program_id(0)
    pid = tl.program_id(1)
    h = (pid % H).to(tl.int64)  # 64-bit offsets: a layer's buffers may pass 2^31 elements
    b = (pid // H).to(tl.int64)
    if item < NK:
        if KEY_TOKEN:
            t = item.to(tl.int64)
            _kivi_token_planes(
                K, KP, KS, KZ, KM, b * sk_b + h * sk_h + t * sk_t, b * skp_b + h * skp_h + t * skp_t,
                b * sks_b + h * sks_h + t * sks_t, sk_d, skp_d, sks_d, DK, G, KBITS, SDT, BLOCK_GK, BLOCK_C, LEVELS,
                KZDT,
            )  # fmt: skip
        else:
            t0 = item.to(tl.int64) * G
            _kivi_group_planes(
                K, KP, KS, KZ, KM, b * sk_b + h * sk_h + t0 * sk_t, b * skp_b + h * skp_h + t0 * skp_t,
                b * sks_b + h * sks_h + item * sks_t, sk_t, sk_d, skp_t, skp_d, sks_d, G,
                DK, KBITS, SDT, BLOCK_T, BLOCK_DK, LEVELS, KZDT,
            )  # fmt: skip
    else:
        t = (item - NK).to(tl.int64)
        _kivi_token_planes(
            V, VP, VS, VZ, VM, b * sv_b + h * sv_h + t * sv_t, b * svp_b + h * svp_h + t * svp_t,
            b * svs_b + h * svs_h + t * svs_t, sv_d, svp_d, svs_d, DV, G, VBITS, SDT, BLOCK_GV, BLOCK_C, LEVELS,
            VZDT,
        )  # fmt: skip


def kivi_encodable(key_bits: int, value_bits: int, group: int, key_dim: int, value_dim: int,
                   per_token_keys: bool = False) -> bool:  # fmt: skip
    """Whether :func:`triton_kivi_encode` takes this geometry: every channel group of a token a whole number of packed
    bytes (``group`` a multiple of the codes per byte) and whole groups of channels; per-channel keys a whole number
    of bytes per token."""
    values = group % codes_per_byte(value_bits) == 0 and value_dim % group == 0
    if per_token_keys:
        return values and group % codes_per_byte(key_bits) == 0 and key_dim % group == 0
    return values and key_dim % codes_per_byte(key_bits) == 0


def triton_kivi_encode(k: torch.Tensor, v: torch.Tensor, out: dict[str, torch.Tensor], key_bits: int,
                       value_bits: int, group: int, per_token_keys: bool = False,
                       key_levels: torch.Tensor | None = None,
                       value_levels: torch.Tensor | None = None) -> None:  # fmt: skip
    """KIVI-encode ``k`` / ``v`` ``(B, H, n, D)`` into ``out`` (views of a layer's storage for ``n`` tokens: ``k`` /
    ``v`` packed codes, ``ks`` / ``kz`` ``(B, H, n / G, Dk)`` (per token: ``(B, H, n, Dk / G)``), ``vs`` / ``vz``
    ``(B, H, n, Dv / G)``) in one launch, bit for bit :meth:`hf_kvcache.formats.KiviCodec.encode`. Needs
    :func:`kivi_encodable` geometry (the ``scale_dtype`` is the scales'); ``key_levels`` / ``value_levels``: the
    codebooks (:func:`hf_kvcache.quant.codebook_levels`, on ``k``'s device) of a codec that has them, together."""
    b, h, n, dk = k.shape
    dv = v.shape[-1]
    nk = n if per_token_keys else n // group
    if b * h * n == 0:
        return
    if (key_levels is None) != (value_levels is None):
        raise ValueError("key_levels and value_levels: a KIVI codec has codebooks for both or for neither")
    levels = key_levels is not None
    mids = [(x[1:] + x[:-1]) / 2 if levels else k for x in (key_levels, value_levels)]  # as quantize_asymmetric's
    # Items on grid axis 0 (up to 2^31 - 1): axis 1 stops at 65,535, which a 64k-token prefill's items passed.
    _kivi_encode_kernel[(nk + n, b * h)](
        k, v, out["k"], out["ks"], out["kz"], out["v"], out["vs"], out["vz"], *mids,
        *k.stride(), *v.stride(), *strides(out["k"]), *strides(out["ks"]), *strides(out["v"]), *strides(out["vs"]),
        h, n, nk,
        DK=dk, DV=dv, G=group, KBITS=key_bits, VBITS=value_bits, KEY_TOKEN=per_token_keys, LEVELS=levels,
        SDT=_KIVI_TYPES[out["ks"].dtype], KZDT=_KIVI_TYPES[out["kz"].dtype], VZDT=_KIVI_TYPES[out["vz"].dtype],
        BLOCK_T=triton.next_power_of_2(group), BLOCK_DK=triton.next_power_of_2(dk),
        BLOCK_GK=triton.next_power_of_2(max(dk // group, 1)), BLOCK_GV=triton.next_power_of_2(max(dv // group, 1)),
        BLOCK_C=triton.next_power_of_2(group),
    )  # fmt: skip

"""Triton decode-attention kernels: the contract of :mod:`hf_kvcache.kernels.torch_decode`, reading storage in place.

Flash-decoding: the grid is (batch x KV heads, splits); a program takes all query rows of one KV head (``G`` query
heads x ``q`` query tokens, so K/V are read once per KV head, not once per query head), walks its split of the tokens
``BLOCK_N`` at a time, dequantizes each tile in registers and keeps an online softmax. Two kernels share the query
load, the softmax step and the store of the partials, and differ in how a tile is read: :func:`_partial_kernel` reads
each element as its storage lays it out (a function per storage: plain or fp8 codes, int8 with scales folded into
scores and probabilities, pages through the block table, KIVI codes addressed per element), and
:func:`_partial_group_kernel` reads KIVI codes a key group per tile (packed rows loaded whole and unpacked in
registers, the group's channel scales and zero points folded into the query, values dequantized in the model's 16-bit
dtype). Values dequantized in registers enter the second product as its first operand
(``acc^T += v^T p^T``); with one query token the mask is one row per batch row, broadcast over the heads;
:func:`triton_combine` reduces the splits of all segments in one more launch (the contract of
:func:`~hf_kvcache.kernels.torch_decode.combine`). Every load is masked (out-of-range tokens, channels
and rows), so the kernels also run under ``TRITON_INTERPRET=1`` on CPU tensors, which is how the CPU test suite checks
them (float32 and float16: the interpreter is wrong for bfloat16, which only a GPU run checks).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from ..rope import angle_table
from .storage import DENSE, FP8, INT8, KIVI, MIN_ROWS, PAGED, PAGED_INT8, KernelStorage, LaunchPlan, block, strides
from .torch_decode import MAX_SPLITS, MIN_SPLIT_TOKENS
from .waves import resident_programs, sm_count, wave_splits

__all__ = ["MAX_COMBINED_SEGMENTS", "triton_combine", "triton_partial"]

assert (DENSE, INT8, KIVI, PAGED, PAGED_INT8, FP8) == (0, 1, 2, 3, 4, 5)  # the KIND branches below test these numbers


@triton.jit
def _e4m3(byte):
    """float8 e4m3 bits (uint8) as float32, exactly, on any GPU (no fp8 hardware needed): the sign, exponent and
    mantissa moved into float16's fields (``byte << 7``) give the value over 2^8, subnormals included (exponent bias 15
    against 7); NaN (0x7F) is never stored."""
    bits = byte.to(tl.int32)
    half = (((bits & 0x80) << 8) | ((bits & 0x7F) << 7)).to(tl.int16).to(tl.float16, bitcast=True)
    return half.to(tl.float32) * 256.0


@triton.jit
def _biased_half_arith(raw):
    """int8 codes as float16 ``1152 + code``, exactly, without a conversion: the code's byte with its top bit flipped
    (``code + 128``, 0 to 255) is the low byte of 1024's mantissa (``0x6400``). The products subtract ``1152 x`` the
    other operand's sum (:func:`_half_query`). Written elementwise, sm_90 compiles this to a byte extraction per code
    and a permute per pair (two instructions a code, as bfloat16's conversion); :func:`_biased_half_ptx` is the
    same bits in a quarter of the instructions."""
    return ((raw ^ -128).to(tl.uint8, bitcast=True).to(tl.uint16) | 0x6400).to(tl.float16, bitcast=True)


@triton.jit
def _biased_half_ptx(raw):
    """:func:`_biased_half_arith` four codes at a time: one XOR flips the four top bits of a 32-bit word, two byte
    permutes put each byte under 0x64 (two float16 a register)."""
    return tl.inline_asm_elementwise(
        "{ .reg .b32 t; xor.b32 t, $2, 0x80808080; prmt.b32 $0, t, 0x64646464, 0x4140; "
        "prmt.b32 $1, t, 0x64646464, 0x4342; }",
        "=r,=r,r", [raw], dtype=tl.float16, is_pure=True, pack=4,
    )  # fmt: skip


# PTX runs on CUDA devices only: the interpreter (the CPU test suite) and other backends take the arithmetic, which
# the tests hold equal to the PTX bit for bit on a GPU.
_biased_half = _biased_half_arith if os.environ.get("TRITON_INTERPRET") == "1" else _biased_half_ptx


@triton.jit
def _half_query(q):
    """The query for codes read by :func:`_biased_half`: in float16, scaled by a power of two so its largest entry is
    at most 2^14 (a bfloat16 query can exceed float16's range; the scaling is exact), its rows' sums (``q . 1152`` is
    taken out of each score) and the factor that undoes the scaling."""
    qf = q.to(tl.float32)
    top = tl.max(tl.max(tl.abs(qf), 1), 0)
    scale = tl.exp2(14.0 - tl.ceil(tl.log2(tl.maximum(top, 1e-30))))
    q16 = (qf * scale).to(tl.float16)
    return q16, tl.sum(q16.to(tl.float32), 1), 1.0 / scale


@triton.jit
def _load_paged(
    K, KS, b, h, t, ok, tok_ok, d, s_h, s_t, s_d, ss_h, ss_t, TABLE, stab_b, stab_n,
    KIND: tl.constexpr, FOLD: tl.constexpr, BS: tl.constexpr, LARGE: tl.constexpr,
):  # fmt: skip
    """A tile of a block pool: token -> block table entry -> slot; int8 pages (``KIND`` 4) scaled here unless the
    caller folds their scales."""
    block = tl.load(TABLE + b * stab_b + (t // BS) * stab_n, mask=tok_ok, other=0)
    if LARGE:  # a pool past 2^31 elements: slot offsets in 64 bits
        block = block.to(tl.int64)
    slot = tl.maximum(block, 0) * BS + t % BS
    x = tl.load(K + slot[:, None] * s_t + h * s_h + d[None, :] * s_d, mask=ok, other=0).to(tl.float32)
    if KIND == 4 and not FOLD:
        scale = tl.load(KS + slot * ss_t + h * ss_h, mask=tok_ok, other=0).to(tl.float32)
        x = x * scale[:, None]
    return x


@triton.jit
def _load_kivi(
    K, KS, KZ, LV, base, sbase, t, ok, d, s_t, s_d, ss_t, ss_d, START,
    BITS: tl.constexpr, GROUP: tl.constexpr, IS_KEY: tl.constexpr, D: tl.constexpr, LEVELS: tl.constexpr,
):  # fmt: skip
    """A tile of KIVI codes addressed per element (tiles that are not one key group): packed codes, low bits first
    (or their levels in the codebook ``LV``), dequantized with their group's scale and zero point."""
    ta = t + START
    row = K + base + ta[:, None] * s_t
    if BITS == 3:  # a 2-bit plane (D / 4 bytes), then the high bits (D / 8 bytes)
        low = tl.load(row + (d[None, :] // 4) * s_d, mask=ok, other=0).to(tl.int32)
        high = tl.load(row + (D // 4 + d[None, :] // 8) * s_d, mask=ok, other=0).to(tl.int32)
        code = ((low >> ((d[None, :] % 4) * 2)) & 3) | (((high >> (d[None, :] % 8)) & 1) << 2)
    else:
        byte = tl.load(row + (d[None, :] // (8 // BITS)) * s_d, mask=ok, other=0)
        code = (byte.to(tl.int32) >> ((d[None, :] % (8 // BITS)) * BITS)) & ((1 << BITS) - 1)
    code = _code_values(code, LV, tl.float32, LEVELS)
    if IS_KEY:  # per (group of GROUP tokens, channel)
        where = sbase + (ta[:, None] // GROUP) * ss_t + d[None, :] * ss_d
    else:  # per (token, group of GROUP channels)
        where = sbase + ta[:, None] * ss_t + (d[None, :] // GROUP) * ss_d
    scale, zero = _kivi_params(KS, KZ, where, ok, BITS, tl.float32)
    return code * scale + zero


@triton.jit
def _kivi_params(S, Z, where, mask, BITS: tl.constexpr, dtype: tl.constexpr):
    """Scales and zero points of KIVI groups at offsets ``where``, as ``dtype``: as stored, or 8-bit
    (:data:`hf_kvcache.quant.E5M3` scales: the byte shifted into float16's exponent and mantissa; int8 zero points:
    steps of ``2^(BITS - 7)`` scales, their product exact in float32)."""
    s_raw = tl.load(S + where, mask=mask, other=0)
    z_raw = tl.load(Z + where, mask=mask, other=0)
    if s_raw.dtype == tl.uint8:
        s = ((s_raw.to(tl.int32) & 0xFF) << 7).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
        if z_raw.dtype == tl.int8:
            z = z_raw.to(tl.float32) * s * (1.0 / (1 << (7 - BITS)))
        else:
            z = z_raw.to(tl.float32)
        return s.to(dtype), z.to(dtype)
    return s_raw.to(dtype), z_raw.to(dtype)


@triton.jit
def _load_kv(
    K, KS, KZ, LV, b, h, t, tok_ok, d, d_ok,
    s_b, s_h, s_t, s_d, ss_b, ss_h, ss_t, ss_d,
    TABLE, stab_b, stab_n, START,
    KIND: tl.constexpr, BITS: tl.constexpr, GROUP: tl.constexpr, IS_KEY: tl.constexpr, BS: tl.constexpr,
    FOLD: tl.constexpr, D: tl.constexpr, LARGE: tl.constexpr, LEVELS: tl.constexpr,
):  # fmt: skip
    """A ``(BLOCK_N, BLOCK_D)`` float32 tile of keys (``IS_KEY``) or values of tokens ``t``, channels ``d``, read as
    the storage ``KIND`` lays it out. ``FOLD``: codes with one scale per token and head (int8, fp8) are returned
    unscaled; the caller folds the scales (see :func:`_load_scale`) into the scores and the probabilities instead of
    scaling every element."""
    ok = tok_ok[:, None] & d_ok[None, :]
    if KIND == 3 or KIND == 4:  # paged
        return _load_paged(
            K, KS, b, h, t, ok, tok_ok, d, s_h, s_t, s_d, ss_h, ss_t, TABLE, stab_b, stab_n, KIND, FOLD, BS,
            LARGE,
        )  # fmt: skip
    if KIND == 2:
        return _load_kivi(
            K, KS, KZ, LV, b * s_b + h * s_h, b * ss_b + h * ss_h, t, ok, d, s_t, s_d, ss_t, ss_d, START, BITS, GROUP,
            IS_KEY, D, LEVELS,
        )  # fmt: skip
    raw = tl.load(K + b * s_b + h * s_h + t[:, None] * s_t + d[None, :] * s_d, mask=ok, other=0)
    if KIND == 5:  # fp8: e4m3 bits
        return _e4m3(raw)
    x = raw.to(tl.float32)
    if KIND == 1 and not FOLD:  # int8: one scale per token and group of GROUP channels
        where = b * ss_b + h * ss_h + t[:, None] * ss_t + (d[None, :] // GROUP) * ss_d
        x = x * tl.load(KS + where, mask=ok, other=0).to(tl.float32)
    return x


@triton.jit
def _load_half(
    K, b, h, t, tok_ok, d, d_ok, s_b, s_h, s_t, s_d, TABLE, stab_b, stab_n,
    KIND: tl.constexpr, BS: tl.constexpr, LARGE: tl.constexpr,
):  # fmt: skip
    """A ``(BLOCK_N, BLOCK_D)`` tile of int8 codes (``KIND`` 1, or pages: 4), scales folded by the caller, as
    :func:`_biased_half`'s float16."""
    ok = tok_ok[:, None] & d_ok[None, :]
    if KIND == 4:
        block = tl.load(TABLE + b * stab_b + (t // BS) * stab_n, mask=tok_ok, other=0)
        if LARGE:
            block = block.to(tl.int64)
        row = (tl.maximum(block, 0) * BS + t % BS) * s_t + h * s_h
    else:
        row = b * s_b + h * s_h + t * s_t
    return _biased_half(tl.load(K + row[:, None] + d[None, :] * s_d, mask=ok, other=0))


@triton.jit
def _kivi_codes(P, base, ta, tok_ok, s_t, s_d, D: tl.constexpr, BITS: tl.constexpr, BLOCK_N: tl.constexpr,
                BLOCK_D: tl.constexpr):  # fmt: skip
    """A ``(BLOCK_N, BLOCK_D)`` int32 tile of KIVI codes: each packed byte loaded once (a row of ``D * BITS / 8``
    bytes per token) and unpacked in registers, low bits first (3 bits: the 2-bit plane, then the high-bit plane)."""
    row = P + base + ta[:, None] * s_t
    if BITS == 4:
        w = tl.arange(0, BLOCK_D // 2)
        byte = tl.load(row + w[None, :] * s_d, mask=tok_ok[:, None] & (w < D // 2)[None, :], other=0)  # uint8
        wide = byte.to(tl.int32)
        code = tl.interleave(wide & 15, wide >> 4)
    else:  # 2 bits: unpacked as bytes, widened once (widening first spills at the 8B shape on sm_90)
        w = tl.arange(0, BLOCK_D // 4)
        byte = tl.load(row + w[None, :] * s_d, mask=tok_ok[:, None] & (w < D // 4)[None, :], other=0)
        code = tl.interleave(tl.interleave(byte & 3, (byte >> 4) & 3), tl.interleave((byte >> 2) & 3, byte >> 6))
        if BITS == 3:  # the high bits after the D / 4 bytes of the low plane: bit j of byte i is code 8 i + j's
            w8 = tl.arange(0, BLOCK_D // 8)
            hb = tl.load(row + (D // 4 + w8[None, :]) * s_d, mask=tok_ok[:, None] & (w8 < D // 8)[None, :], other=0)
            hi = tl.interleave(
                tl.interleave(tl.interleave(hb & 1, (hb >> 4) & 1), tl.interleave((hb >> 2) & 1, (hb >> 6) & 1)),
                tl.interleave(tl.interleave((hb >> 1) & 1, (hb >> 5) & 1), tl.interleave((hb >> 3) & 1, hb >> 7)),
            )
            code = code | (hi << 2)
    return code.to(tl.int32)


@triton.jit
def _codes_as(code, dtype: tl.constexpr):
    """Small non-negative integer codes as ``dtype`` without a conversion instruction: OR the code into the mantissa
    of a power of two (2^23 in float32, 1024 in float16, 128 in bfloat16: each code is exact there) and subtract it."""
    if dtype == tl.float16:
        return (code | 0x6400).to(tl.int16).to(tl.float16, bitcast=True) - 1024.0
    elif dtype == tl.bfloat16:
        return (code | 0x4300).to(tl.int16).to(tl.bfloat16, bitcast=True) - 128.0
    else:
        return (code | 0x4B000000).to(tl.float32, bitcast=True) - 8388608.0


@triton.jit
def _code_values(code, LV, dtype: tl.constexpr, LEVELS: tl.constexpr):
    """Integer codes as ``dtype``: the codes themselves (uniform levels), or with ``LEVELS`` each code's level in the
    codebook ``LV`` (float32 multiples of 1/16 up to 15: exact in every dtype the products take; a code is always
    inside the table, masked loads having read 0)."""
    if LEVELS:
        return tl.load(LV + code).to(dtype)
    return _codes_as(code, dtype)


@triton.jit
def _kivi_group_expand(X, base, ta, tok_ok, s_t, s_d, D: tl.constexpr, GROUP: tl.constexpr, BLOCK_N: tl.constexpr,
                       BLOCK_D: tl.constexpr, dtype: tl.constexpr):  # fmt: skip
    """Per-token values of ``GROUP``-channel groups, loaded as a ``(BLOCK_N, groups)`` tile and broadcast over each
    group's channels to ``(BLOCK_N, BLOCK_D)`` in registers (not addressed per element), as ``dtype``."""
    NG: tl.constexpr = BLOCK_D // GROUP
    gi = tl.arange(0, NG)
    x = tl.load(X + base + ta[:, None] * s_t + gi[None, :] * s_d, mask=tok_ok[:, None] & (gi < D // GROUP)[None, :],
                other=0).to(dtype)  # fmt: skip
    return tl.reshape(tl.broadcast_to(x[:, :, None], (BLOCK_N, NG, GROUP)), (BLOCK_N, BLOCK_D))


@triton.jit
def _kivi_group_expand_8bit(S, Z, base, ta, tok_ok, s_t, s_d, D: tl.constexpr, GROUP: tl.constexpr,
                            BITS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                            dtype: tl.constexpr):  # fmt: skip
    """:func:`_kivi_group_expand` of 8-bit scales and their int8 zero points together (a zero point is a count of
    its scale's steps): both ``(BLOCK_N, BLOCK_D)``."""
    NG: tl.constexpr = BLOCK_D // GROUP
    gi = tl.arange(0, NG)
    where = base + ta[:, None] * s_t + gi[None, :] * s_d
    scale, zero = _kivi_params(S, Z, where, tok_ok[:, None] & (gi < D // GROUP)[None, :], BITS, dtype)
    scale = tl.reshape(tl.broadcast_to(scale[:, :, None], (BLOCK_N, NG, GROUP)), (BLOCK_N, BLOCK_D))
    return scale, tl.reshape(tl.broadcast_to(zero[:, :, None], (BLOCK_N, NG, GROUP)), (BLOCK_N, BLOCK_D))


@triton.jit
def _load_scale(
    KS, b, h, t, tok_ok, ss_b, ss_h, ss_t, TABLE, stab_b, stab_n, KIND: tl.constexpr, BS: tl.constexpr,
    LARGE: tl.constexpr,
):  # fmt: skip
    """The ``(BLOCK_N,)`` scales of tokens ``t`` (int8 or fp8 codes, one scale per token and head): a 1-D load, not
    a tile."""
    if KIND == 4:
        block = tl.load(TABLE + b * stab_b + (t // BS) * stab_n, mask=tok_ok, other=0)
        if LARGE:
            block = block.to(tl.int64)
        slot = tl.maximum(block, 0) * BS + t % BS
        return tl.load(KS + slot * ss_t + h * ss_h, mask=tok_ok, other=0).to(tl.float32)
    return tl.load(KS + b * ss_b + h * ss_h + t * ss_t, mask=tok_ok, other=0).to(tl.float32)


@triton.jit
def _sincos(a):
    """``(sin a, cos a)`` of float32 angles (``|a|`` up to about 10^5): reduced by multiples of pi / 2 in three parts
    (Cody-Waite, Cephes' constants), then polynomials on [-pi / 4, pi / 4]. Plain arithmetic, not libdevice's sinf /
    cosf, whose slow path for large arguments keeps a local array (kilobytes of stack per thread at the 8B shape)."""
    j = tl.floor(a * 0.6366197723675814 + 0.5)
    r = ((a - j * 1.5703125) - j * 4.837512969970703125e-4) - j * 7.549789948768648e-8
    r2 = r * r
    s = r + r * r2 * (-1.6666654611e-1 + r2 * (8.3321608736e-3 + r2 * -1.9515295891e-4))
    c = 1.0 - 0.5 * r2 + r2 * r2 * (4.166664568298827e-2 + r2 * (-1.388731625493765e-3 + r2 * 2.443315711809948e-5))
    q = j.to(tl.int32) & 3
    sin = tl.where(q == 0, s, tl.where(q == 1, c, tl.where(q == 2, -s, -c)))
    cos = tl.where(q == 0, c, tl.where(q == 1, -s, tl.where(q == 2, -c, s)))
    return sin, cos


@triton.jit
def _rope_pairs(
    k, t, tok_ok, ANGLES, POS0, ROPE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    ANGLE_TABLE: tl.constexpr,
):  # fmt: skip
    """Keys stored before RoPE (``pre_rope=True``) turned to positions ``POS0 + t``, every channel rotary: the tile
    split into its channel pairs in registers (interleaved ``(2i, 2i + 1)``, or rotate_half ``(i, i + D / 2)``), each
    pair turned, joined back. Angles in float32, as :func:`hf_kvcache.rope.rotate_positions` computes them: from the
    inverse frequencies ``ANGLES`` per element, or with ``ANGLE_TABLE`` read from ``ANGLES``, a ``(positions, 2,
    D / 2)`` table of their cosines and sines (:func:`hf_kvcache.rope.angle_table`), shared by every program."""
    HALF: tl.constexpr = BLOCK_D // 2
    if ROPE == 2:
        x1, x2 = tl.split(tl.reshape(k, (BLOCK_N, HALF, 2)))
    else:
        x1, x2 = tl.split(tl.permute(tl.reshape(k, (BLOCK_N, 2, HALF)), (0, 2, 1)))
    i = tl.arange(0, HALF)
    if ANGLE_TABLE:
        row = ANGLES + (POS0 + t)[:, None] * BLOCK_D + i[None, :]
        cos = tl.load(row, mask=tok_ok[:, None], other=1.0)
        sin = tl.load(row + HALF, mask=tok_ok[:, None], other=0.0)
    else:
        sin, cos = _sincos((POS0 + t).to(tl.float32)[:, None] * tl.load(ANGLES + i)[None, :])
    turned = tl.join(x1 * cos - x2 * sin, x2 * cos + x1 * sin)  # (BLOCK_N, HALF, 2)
    if ROPE == 2:
        return tl.reshape(turned, (BLOCK_N, BLOCK_D))
    return tl.reshape(tl.permute(turned, (0, 2, 1)), (BLOCK_N, BLOCK_D))


@triton.jit
def _rope_partner(dk, ROPE: tl.constexpr, ROT_DIM: tl.constexpr):
    """Each channel's rotary pair (itself past ``ROT_DIM``)."""
    HALF: tl.constexpr = ROT_DIM // 2
    if ROPE == 2:
        pair = dk ^ 1
    else:
        pair = tl.where(dk < HALF, dk + HALF, dk - HALF)
    return tl.where(dk < ROT_DIM, pair, dk)


@triton.jit
def _rope_tile(k, kp, t, dk, INV_FREQ, POS0, ROPE: tl.constexpr, ROT_DIM: tl.constexpr):
    """As :func:`_rope_pairs` for partial rotary or a head width that is not a power of two: ``kp`` holds the same
    tokens at each channel's pair (:func:`_rope_partner`, loaded beside the tile); channels past ``ROT_DIM`` pass
    through."""
    HALF: tl.constexpr = ROT_DIM // 2
    if ROPE == 2:
        freq_idx = dk // 2
        sign = tl.where(dk % 2 == 0, -1.0, 1.0)
    else:
        freq_idx = dk % HALF
        sign = tl.where(dk < HALF, -1.0, 1.0)
    rot = dk < ROT_DIM
    inv_freq = tl.load(INV_FREQ + freq_idx, mask=rot, other=0.0)
    sin, cos = _sincos((POS0 + t).to(tl.float32)[:, None] * inv_freq[None, :])
    return tl.where(rot[None, :], k * cos + sign[None, :] * kp * sin, k)


@triton.jit
def _dot_split(a, b):
    """``a @ b`` for a float32 ``a`` and a 16-bit ``b`` whose entries it holds exactly (a rotation's signs), on 16-bit
    tensor cores to about float32 accuracy: ``a`` split into a 16-bit head and the 16-bit rounding of its remainder,
    two products accumulated in float32."""
    a_hi = a.to(b.dtype)
    return tl.dot(a_hi, b) + tl.dot((a - a_hi.to(tl.float32)).to(b.dtype), b)


# --- one launch over one segment: two kernels (a tile per token range, a tile per KIVI key group) sharing the query,
# the online softmax and the partials' store -------------------------------------------------------------------------


@triton.jit
def _program(H, LARGE: tl.constexpr):
    """This program's batch row, KV head, split and the number of splits (grid: batch x KV heads, splits)."""
    pid = tl.program_id(0)
    b = pid // H
    h = pid % H
    if LARGE:  # storage past 2^31 elements: batch and head offsets in 64 bits
        b = b.to(tl.int64)
        h = h.to(tl.int64)
    return pid, b, h, tl.program_id(1), tl.num_programs(1)


@triton.jit
def _rows(
    Q, b, h, sq_b, sq_h, sq_q, G, q_len,
    DK: tl.constexpr, DV: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_DK: tl.constexpr, BLOCK_DV: tl.constexpr,
):  # fmt: skip
    """The program's query rows (``G`` query heads x ``q_len`` tokens, padded to ``BLOCK_R``), which are real, each
    row's query token, the key and value channels and which are real, and each row's query pointer."""
    rows = tl.arange(0, BLOCK_R)
    i = rows % q_len
    dk = tl.arange(0, BLOCK_DK)
    dv = tl.arange(0, BLOCK_DV)
    q_row = Q + b * sq_b + (h * G + rows // q_len)[:, None] * sq_h + i[:, None] * sq_q
    return rows, rows < G * q_len, i, dk, dk < DK, dv, dv < DV, q_row


@triton.jit
def _load_query(
    q_row, HK, row_ok, dk, dk_ok, sq_d, key_rotation_scale,
    DK: tl.constexpr, ROTATE: tl.constexpr, DOT_FP32: tl.constexpr, RCH: tl.constexpr, BLOCK_R: tl.constexpr,
    BLOCK_DK: tl.constexpr,
):  # fmt: skip
    """The program's ``(BLOCK_R, BLOCK_DK)`` query rows; with ``ROTATE`` (codes stored rotated, ``k H_k``) the rotated
    query, whose scores against the codes are the query's against the keys. ``H_k = c S_k``: the signs ``S_k`` (in the
    query's dtype, exact) give ``q S_k`` from one product per ``RCH``-channel slice, its products exact and summed in
    float32, scaled by ``c`` before the query's dtype holds it. (64: a whole 128 x 128 ``H_k`` in registers spilled
    14 KB; 32-channel slices left ptxas at 128 registers with spills at head_dim 64 on sm_90)"""
    q = tl.load(q_row + dk[None, :] * sq_d, mask=row_ok[:, None] & dk_ok[None, :], other=0)
    if ROTATE:
        qr = tl.zeros([BLOCK_R, BLOCK_DK], tl.float32)
        for c in tl.static_range(0, BLOCK_DK, RCH):
            cc = c + tl.arange(0, RCH)
            qc = tl.load(q_row + cc[None, :] * sq_d, mask=row_ok[:, None] & (cc < DK)[None, :], other=0)
            hk = tl.load(HK + cc[:, None] * DK + dk[None, :], mask=(cc < DK)[:, None] & dk_ok[None, :], other=0)
            if DOT_FP32:
                qr += tl.dot(qc, hk, input_precision="ieee")
            else:
                qr += tl.dot(qc, hk)
        q = (qr * key_rotation_scale).to(q.dtype)
    return q


@triton.jit
def _masked_scores(
    s, b, i, t, tok_ok, row_ok, MASK, sm_b, sm_q, sm_t, scaling, softcap,
    HAS_MASK: tl.constexpr, SOFTCAP: tl.constexpr, ONE_QUERY: tl.constexpr,
):  # fmt: skip
    """Raw scores of a tile scaled, soft-capped, and -inf where a row, a token or the mask rules them out."""
    s = s * scaling
    if SOFTCAP:
        s = softcap * (2.0 * tl.sigmoid(2.0 * s / softcap) - 1.0)  # softcap * tanh(s / softcap)
    valid = row_ok[:, None] & tok_ok[None, :]
    if HAS_MASK and ONE_QUERY:  # one query token: the tile's mask is a row, loaded once and broadcast over the
        # heads (a 2-D mask tile put the scores in a layout whose row reductions took 5 shuffle levels per row)
        allowed = tl.load(MASK + b * sm_b + t * sm_t, mask=tok_ok, other=0)
        valid = valid & (allowed != 0)[None, :]
    elif HAS_MASK:
        allowed = tl.load(MASK + b * sm_b + i[:, None] * sm_q + t[None, :] * sm_t, mask=valid, other=0)
        valid = valid & (allowed != 0)
    return tl.where(valid, s, float("-inf"))


@triton.jit
def _softmax_step(s, m_i, l_i):
    """The online softmax over one more tile: its probabilities, the factor that rescales what came before, the new
    running max and sum."""
    m_new = tl.maximum(m_i, tl.max(s, 1))
    safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.exp(s - safe[:, None])
    alpha = tl.exp(m_i - safe)
    return p, alpha, m_new, l_i * alpha + tl.sum(p, 1)


@triton.jit
def _accumulate(acc, alpha, p, v, dtype: tl.constexpr, DOT_FP32: tl.constexpr, SWAP: tl.constexpr):
    """``acc`` rescaled plus ``p v``: in float32 (``DOT_FP32``), or on 16-bit tensor cores (``dtype``) accumulated
    in float32; ``SWAP``: values dequantized in registers as the product's first operand, ``acc^T += v^T p^T``."""
    if DOT_FP32:
        return acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
    elif SWAP:
        return acc * alpha[:, None] + tl.trans(tl.dot(tl.trans(v.to(dtype)), tl.trans(p.to(dtype))))
    else:
        return acc * alpha[:, None] + tl.dot(p.to(dtype), v.to(dtype))


@triton.jit
def _store_partials(
    M_OUT, L_OUT, ACC_OUT, HV, pid, split, num_splits, rows, row_ok, dv, dv_ok, m_i, l_i, acc, R,
    value_rotation_scale,
    DV: tl.constexpr, ROTATED: tl.constexpr, DOT_FP32: tl.constexpr, RCH: tl.constexpr, BLOCK_DV: tl.constexpr,
):  # fmt: skip
    """The split's running max, sum and accumulator, ``(B * H, R, S)`` row-major; with ``ROTATED`` the accumulator of
    rotated values (``v H_v``) rotated back once (``H_v H_v = I``), ``RCH`` columns at a time: ``acc S_v`` times
    ``H_v``'s scale."""
    out = (pid * R + rows) * num_splits + split
    tl.store(M_OUT + out, m_i, mask=row_ok)
    tl.store(L_OUT + out, l_i, mask=row_ok)
    if ROTATED:
        for c in tl.static_range(0, BLOCK_DV, RCH):
            cc = c + tl.arange(0, RCH)
            hv = tl.load(HV + dv[:, None] * DV + cc[None, :], mask=dv_ok[:, None] & (cc < DV)[None, :], other=0)
            if DOT_FP32:
                part = tl.dot(acc, hv, input_precision="ieee")
            else:
                part = _dot_split(acc, hv)
            part = part * value_rotation_scale
            tl.store(ACC_OUT + out[:, None] * DV + cc[None, :], part, mask=row_ok[:, None] & (cc < DV)[None, :])
    else:
        tl.store(ACC_OUT + out[:, None] * DV + dv[None, :], acc, mask=row_ok[:, None] & dv_ok[None, :])


@triton.jit
def _kivi_group_tile(
    q, K, V, KS, KZ, VS, VZ, KL, VL, INV_FREQ, HK, b, h, t, t0, ta, tok_ok, dk, dk_ok,
    sk_b, sk_h, sk_t, sk_d, sv_b, sv_h, sv_t, sv_d, sks_b, sks_h, sks_t, sks_d, svs_b, svs_h, svs_t, svs_d,
    START, POS0, key_rotation_scale,
    DK: tl.constexpr, DV: tl.constexpr, KBITS: tl.constexpr, VBITS: tl.constexpr, GK: tl.constexpr,
    GV: tl.constexpr, DOT_FP32: tl.constexpr, ROPE: tl.constexpr, ROTATED: tl.constexpr, ANGLE_TABLE: tl.constexpr,
    SWAP: tl.constexpr, LEVELS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_DK: tl.constexpr, BLOCK_DV: tl.constexpr,
):  # fmt: skip
    """The raw scores and the values of one tile that is one key group of KIVI codes. Keys: ``q . (code x scale_c +
    zero_c) = (q x scale) . code + q . zero``, with this group's channel scales; pre-RoPE keys (``ROPE``) are
    dequantized with them instead (no fold through RoPE), rotated back when stored rotated, then turned. Values
    dequantized in the dtype they enter the product in (16-bit: packed multiply-adds, one rounding where float32 math
    rounded again when converted for the tensor cores)."""
    k = _kivi_codes(K, b * sk_b + h * sk_h, ta, tok_ok, sk_t, sk_d, DK, KBITS, BLOCK_N, BLOCK_DK)
    kgroup = b * sks_b + h * sks_h + ((t0 + START) // GK) * sks_t + dk * sks_d
    k_scale, k_zero = _kivi_params(KS, KZ, kgroup, dk_ok, KBITS, tl.float32)
    qf = q.to(tl.float32)
    if ROPE:
        if ROTATED:  # codes of k H_k: k = (k H_k) H_k back before RoPE turns it, as (c (k H_k)) S_k: c in the
            # group's scales, the product with the signs exact
            k_scale = k_scale * key_rotation_scale
            k_zero = k_zero * key_rotation_scale
        kf = _code_values(k, KL, tl.float32, LEVELS) * k_scale[None, :] + k_zero[None, :]
        if ROTATED:
            hk = tl.load(HK + dk[:, None] * DK + dk[None, :], mask=dk_ok[:, None] & dk_ok[None, :], other=0)
            if DOT_FP32:
                kf = tl.dot(kf, hk, input_precision="ieee")
            else:
                kf = tl.dot(kf.to(hk.dtype), hk)
        kf = _rope_pairs(kf, t, tok_ok, INV_FREQ, POS0, ROPE, BLOCK_N, BLOCK_DK, ANGLE_TABLE)
        qk = qf
        bias = tl.zeros([q.shape[0]], tl.float32)
    else:
        qk = qf * k_scale[None, :]
        bias = tl.sum(qf * k_zero[None, :], 1)
    VT: tl.constexpr = tl.float32 if DOT_FP32 else q.dtype
    vbase = b * svs_b + h * svs_h
    v = _kivi_codes(V, b * sv_b + h * sv_h, ta, tok_ok, sv_t, sv_d, DV, VBITS, BLOCK_N, BLOCK_DV)
    v = _code_values(v, VL, VT, LEVELS)
    if VS.dtype.element_ty == tl.uint8:  # 8-bit scales (hf_kvcache.quant.E5M3)
        v_scale, v_zero = _kivi_group_expand_8bit(VS, VZ, vbase, ta, tok_ok, svs_t, svs_d, DV, GV, VBITS, BLOCK_N,
                                                  BLOCK_DV, VT)  # fmt: skip
        v = v * v_scale + v_zero
    else:
        v_scale = _kivi_group_expand(VS, vbase, ta, tok_ok, svs_t, svs_d, DV, GV, BLOCK_N, BLOCK_DV, VT)
        v = v * v_scale + _kivi_group_expand(VZ, vbase, ta, tok_ok, svs_t, svs_d, DV, GV, BLOCK_N, BLOCK_DV, VT)
    if ROPE:
        if DOT_FP32:
            s = tl.dot(qk, tl.trans(kf), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(kf.to(q.dtype)))
    elif DOT_FP32:
        s = tl.dot(qk, tl.trans(_code_values(k, KL, tl.float32, LEVELS)), input_precision="ieee")
        s += bias[:, None]
    elif SWAP:  # codes (and levels) exact in 16 bits; unpacked in registers, the first operand: s^T = k q^T
        s = tl.trans(tl.dot(_code_values(k, KL, q.dtype, LEVELS), tl.trans(qk.to(q.dtype)))) + bias[:, None]
    else:
        s = tl.dot(qk.to(q.dtype), tl.trans(_code_values(k, KL, q.dtype, LEVELS))) + bias[:, None]
    return s, v


# Arguments that change between decode steps are not specialized on (Triton marks integers divisible by 16 and
# pointers aligned to 16 bytes, so each would compile another kernel and switch between them as lengths grow): the
# lengths, the scales' batch strides (their buffers grow with the history) and the mask, a slice whose offset and
# strides follow the length. K/V strides stay specialized: their divisibility is what lets the tile loads vectorize.
@triton.jit(do_not_specialize=["T", "sm_b", "sm_q", "POS0"], do_not_specialize_on_alignment=["MASK"])
def _partial_kernel(
    Q, K, V, KS, KZ, VS, VZ, KL, VL, TABLE, MASK, M_OUT, L_OUT, ACC_OUT, INV_FREQ, HK, HV,
    sq_b, sq_h, sq_q, sq_d,
    sk_b, sk_h, sk_t, sk_d, sv_b, sv_h, sv_t, sv_d,
    sks_b, sks_h, sks_t, sks_d, svs_b, svs_h, svs_t, svs_d,
    stab_b, stab_n, sm_b, sm_q, sm_t,
    H, T, START, q_len, G, per_split, scaling, softcap, POS0, key_rotation_scale, value_rotation_scale,
    DK: tl.constexpr, DV: tl.constexpr,
    KIND: tl.constexpr, KBITS: tl.constexpr, VBITS: tl.constexpr, GK: tl.constexpr, GV: tl.constexpr,
    BS: tl.constexpr, HAS_MASK: tl.constexpr, SOFTCAP: tl.constexpr, DOT_FP32: tl.constexpr, FOLD: tl.constexpr,
    ROPE: tl.constexpr, ROT_DIM: tl.constexpr, ROTATED: tl.constexpr, RCH: tl.constexpr,
    ANGLE_TABLE: tl.constexpr, LARGE: tl.constexpr, ONE_QUERY: tl.constexpr, SWAP: tl.constexpr, LEVELS: tl.constexpr,
    HALF: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_DK: tl.constexpr, BLOCK_DV: tl.constexpr,
):  # fmt: skip
    """One split of one (batch row, KV head) over tiles of ``BLOCK_N`` consecutive tokens, each element read as the
    storage ``KIND`` lays it out (:func:`_load_kv`): dense, int8, fp8, pages of either, and KIVI codes whose groups
    are not one tile. Pre-RoPE keys are turned per tile; codes stored rotated are read through the rotated query
    (rotated pre-RoPE keys take :func:`_partial_group_kernel`). ``HALF`` (int8 codes, scales folded): key codes enter
    the scores' product as float16 ``1152 + code`` (:func:`_biased_half`) against the query in float16
    (:func:`_half_query`), ``1152 x`` its sums taken out of the scores. (Values stay converted: as float16 their
    weights need a power of two per tile to stay in float16's range, whose reductions cost what the conversion
    saves, 36.6 against 36.2 main-loop instructions per token at Llama-3-8B's shape on sm_90.)"""
    tl.static_assert(not (ROTATED and ROPE), "rotated pre-RoPE keys are read a key group per tile")
    tl.static_assert(not HALF or (FOLD and not ROPE and not ROTATED and not DOT_FP32), "HALF reads folded int8 keys")
    pid, b, h, split, num_splits = _program(H, LARGE)
    rows, row_ok, i, dk, dk_ok, dv, dv_ok, q_row = _rows(Q, b, h, sq_b, sq_h, sq_q, G, q_len, DK, DV, BLOCK_R, BLOCK_DK,
                                                         BLOCK_DV)  # fmt: skip
    q = _load_query(q_row, HK, row_ok, dk, dk_ok, sq_d, key_rotation_scale, DK, ROTATED, DOT_FP32, RCH, BLOCK_R,
                    BLOCK_DK)  # fmt: skip
    m_i = tl.full([BLOCK_R], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_R], tl.float32)
    acc = tl.zeros([BLOCK_R, BLOCK_DV], tl.float32)
    if HALF:
        q_half, q_sum, q_unscale = _half_query(q)
    lo = split * per_split
    hi = tl.minimum(lo + per_split, T)
    for t0 in range(lo, hi, BLOCK_N):
        t = t0 + tl.arange(0, BLOCK_N)
        tok_ok = t < hi
        if HALF:
            k = _load_half(
                K, b, h, t, tok_ok, dk, dk_ok, sk_b, sk_h, sk_t, sk_d, TABLE, stab_b, stab_n, KIND, BS, LARGE
            )  # fmt: skip
        else:
            k = _load_kv(
                K, KS, KZ, KL, b, h, t, tok_ok, dk, dk_ok, sk_b, sk_h, sk_t, sk_d, sks_b, sks_h, sks_t, sks_d,
                TABLE, stab_b, stab_n, START, KIND, KBITS, GK, True, BS, FOLD, DK, LARGE, LEVELS,
            )  # fmt: skip
        v = _load_kv(
            V, VS, VZ, VL, b, h, t, tok_ok, dv, dv_ok, sv_b, sv_h, sv_t, sv_d, svs_b, svs_h, svs_t, svs_d,
            TABLE, stab_b, stab_n, START, KIND, VBITS, GV, False, BS, FOLD, DV, LARGE, LEVELS,
        )  # fmt: skip
        if ROPE:  # keys stored before RoPE: turned to their positions in registers
            if ROT_DIM == BLOCK_DK:
                k = _rope_pairs(k, t, tok_ok, INV_FREQ, POS0, ROPE, BLOCK_N, BLOCK_DK, ANGLE_TABLE)
            else:
                pair = _rope_partner(dk, ROPE, ROT_DIM)
                kp = _load_kv(
                    K, KS, KZ, KL, b, h, t, tok_ok, pair, dk_ok, sk_b, sk_h, sk_t, sk_d, sks_b, sks_h, sks_t,
                    sks_d, TABLE, stab_b, stab_n, START, KIND, KBITS, GK, True, BS, FOLD, DK, LARGE, LEVELS,
                )  # fmt: skip
                k = _rope_tile(k, kp, t, dk, INV_FREQ, POS0, ROPE, ROT_DIM)
        if DOT_FP32:
            s = tl.dot(q.to(tl.float32), tl.trans(k), input_precision="ieee")
        elif HALF:  # q . (1152 + code) - 1152 (q . 1): exact products, summed in float32
            s = (tl.dot(q_half, tl.trans(k)) - 1152.0 * q_sum[:, None]) * q_unscale
        else:  # the model's 16-bit dtype on tensor cores (int8 codes are exact in it), accumulated in float32
            s = tl.dot(q, tl.trans(k.to(q.dtype)))
        if FOLD:  # q . (code_t x scale_t) = (q . code_t) x scale_t
            key_scales = _load_scale(KS, b, h, t, tok_ok, sks_b, sks_h, sks_t, TABLE, stab_b, stab_n, KIND, BS, LARGE)
            s = s * key_scales[None, :]
        s = _masked_scores(s, b, i, t, tok_ok, row_ok, MASK, sm_b, sm_q, sm_t, scaling, softcap, HAS_MASK, SOFTCAP,
                           ONE_QUERY)  # fmt: skip
        p, alpha, m_i, l_i = _softmax_step(s, m_i, l_i)
        if FOLD:  # sum_t p_t (code_t x scale_t) = sum_t (p_t x scale_t) code_t
            value_scales = _load_scale(VS, b, h, t, tok_ok, svs_b, svs_h, svs_t, TABLE, stab_b, stab_n, KIND, BS, LARGE)
            p = p * value_scales[None, :]
        acc = _accumulate(acc, alpha, p, v, q.dtype, DOT_FP32, SWAP)
    _store_partials(M_OUT, L_OUT, ACC_OUT, HV, pid, split, num_splits, rows, row_ok, dv, dv_ok, m_i, l_i, acc,
                    G * q_len, value_rotation_scale, DV, ROTATED, DOT_FP32, RCH, BLOCK_DV)  # fmt: skip


@triton.jit(do_not_specialize=["T", "sm_b", "sm_q", "POS0"], do_not_specialize_on_alignment=["MASK"])
def _partial_group_kernel(
    Q, K, V, KS, KZ, VS, VZ, KL, VL, MASK, M_OUT, L_OUT, ACC_OUT, INV_FREQ, HK, HV,
    sq_b, sq_h, sq_q, sq_d,
    sk_b, sk_h, sk_t, sk_d, sv_b, sv_h, sv_t, sv_d,
    sks_b, sks_h, sks_t, sks_d, svs_b, svs_h, svs_t, svs_d,
    sm_b, sm_q, sm_t,
    H, T, START, q_len, G, per_split, scaling, softcap, POS0, key_rotation_scale, value_rotation_scale,
    DK: tl.constexpr, DV: tl.constexpr, KBITS: tl.constexpr, VBITS: tl.constexpr, GK: tl.constexpr, GV: tl.constexpr,
    HAS_MASK: tl.constexpr, SOFTCAP: tl.constexpr, DOT_FP32: tl.constexpr, ROPE: tl.constexpr, ROTATED: tl.constexpr,
    RCH: tl.constexpr, ANGLE_TABLE: tl.constexpr, LARGE: tl.constexpr, ONE_QUERY: tl.constexpr, SWAP: tl.constexpr,
    LEVELS: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_DK: tl.constexpr,
    BLOCK_DV: tl.constexpr,
):  # fmt: skip
    """One split of one (batch row, KV head) over KIVI codes a key group per tile (``BLOCK_N`` = the group),
    tiles aligned to the groups of the stored tokens (:func:`_kivi_group_tile`); pre-RoPE keys (every channel
    rotary) turned per tile, rotated or not."""
    pid, b, h, split, num_splits = _program(H, LARGE)
    rows, row_ok, i, dk, dk_ok, dv, dv_ok, q_row = _rows(Q, b, h, sq_b, sq_h, sq_q, G, q_len, DK, DV, BLOCK_R, BLOCK_DK,
                                                         BLOCK_DV)  # fmt: skip
    q = _load_query(q_row, HK, row_ok, dk, dk_ok, sq_d, key_rotation_scale, DK, ROTATED and not ROPE, DOT_FP32, RCH,
                    BLOCK_R, BLOCK_DK)  # fmt: skip
    m_i = tl.full([BLOCK_R], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_R], tl.float32)
    acc = tl.zeros([BLOCK_R, BLOCK_DV], tl.float32)
    lo = split * per_split
    hi = tl.minimum(lo + per_split, T)
    for t0 in range(lo - (lo + START) % BLOCK_N, hi, BLOCK_N):
        t = t0 + tl.arange(0, BLOCK_N)
        tok_ok = (t < hi) & (t >= lo)
        s, v = _kivi_group_tile(
            q, K, V, KS, KZ, VS, VZ, KL, VL, INV_FREQ, HK, b, h, t, t0, t + START, tok_ok, dk, dk_ok,
            sk_b, sk_h, sk_t, sk_d, sv_b, sv_h, sv_t, sv_d, sks_b, sks_h, sks_t, sks_d, svs_b, svs_h, svs_t, svs_d,
            START, POS0, key_rotation_scale, DK, DV, KBITS, VBITS, GK, GV, DOT_FP32, ROPE, ROTATED, ANGLE_TABLE, SWAP,
            LEVELS, BLOCK_N, BLOCK_DK, BLOCK_DV,
        )  # fmt: skip
        s = _masked_scores(s, b, i, t, tok_ok, row_ok, MASK, sm_b, sm_q, sm_t, scaling, softcap, HAS_MASK, SOFTCAP,
                           ONE_QUERY)  # fmt: skip
        p, alpha, m_i, l_i = _softmax_step(s, m_i, l_i)
        acc = _accumulate(acc, alpha, p, v, q.dtype, DOT_FP32, SWAP)
    _store_partials(M_OUT, L_OUT, ACC_OUT, HV, pid, split, num_splits, rows, row_ok, dv, dv_ok, m_i, l_i, acc,
                    G * q_len, value_rotation_scale, DV, ROTATED, DOT_FP32, RCH, BLOCK_DV)  # fmt: skip


def _reach(t: torch.Tensor | None) -> int:
    """One past the largest element offset a kernel may compute into ``t`` (its storage, for a view)."""
    if t is None:
        return 0
    return max(
        t.untyped_storage().nbytes() // t.element_size(), 1 + sum((n - 1) * st for n, st in zip(t.shape, t.stride()))
    )


_SIGNS: dict[tuple, tuple[torch.Tensor, torch.Tensor, float]] = {}


def _signs(rotation: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, float]:
    """A Hadamard rotation ``H = c S`` as its signs ``S`` (entries -1, 0, 1: exact in every dtype the products take,
    so the kernel's products with them are exact) in ``dtype`` and its scale ``c``, split once per tensor (rotations
    are cached per width and device by :func:`~hf_kvcache.formats.hadamard`, so a decode step launches no
    conversion)."""
    key = (rotation.data_ptr(), rotation.device, dtype)
    hit = _SIGNS.get(key)
    if hit is None or hit[0] is not rotation:
        scale = rotation.abs().amax().item()
        signs = torch.round(rotation / scale)
        if not torch.allclose(signs * scale, rotation, rtol=0, atol=1e-6 * scale):
            raise ValueError("the kernel reads rotations whose entries are -c, 0 or c (Hadamard transforms)")
        if len(_SIGNS) > 64:
            _SIGNS.clear()
        hit = _SIGNS[key] = (rotation, signs.to(dtype), scale)
    return hit[1], hit[2]


# Programs per SM of each compiled specialization (its constexprs and dtypes), read from the kernel Triton returns on
# the first launch of it that may choose its split count (None: unknown, the requested count is kept).
_RESIDENT: dict[tuple, int | None] = {}


def _filled(key: tuple, s: KernelStorage, plan: LaunchPlan, programs: int, splits: int, device) -> int:
    """The split count that fills whole waves (:func:`~hf_kvcache.kernels.waves.wave_splits`) once the
    specialization's residency is known; ``splits`` until then."""
    resident = _RESIDENT.get(key)
    if not resident:
        return splits
    most = min(MAX_SPLITS, -(-max(s.length, 1) // MIN_SPLIT_TOKENS))
    return wave_splits(s.length, programs, resident * sm_count(device), plan.block_n, most)


def triton_partial(
    query: torch.Tensor,
    s: KernelStorage,
    plan: LaunchPlan,
    mask: torch.Tensor | None,
    scaling: float,
    softcap: float,
    splits: int,
    exact: bool = True,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The contract of :func:`hf_kvcache.kernels.torch_decode.partial`, as one Triton launch over storage ``s`` shaped
    by ``plan`` (both from the segment's format; Hadamard rotations: the query rotated before the loop and the
    accumulator rotated back after it; keys stored before RoPE: turned to their positions per tile): KIVI codes a key
    group per tile where the plan says so (:func:`_partial_group_kernel`), every other storage a token range per tile
    (:func:`_partial_kernel`).

    ``exact=False`` (a caller that combines any number of splits, not a custom op whose fake fixed the shapes) lets a
    plan with ``fill_waves`` replace ``splits`` on CUDA by the count that fills whole waves of the SMs, from the
    programs per SM the compiled kernel holds (:mod:`hf_kvcache.kernels.waves`): the returned partials then have that
    many splits."""
    b, hq, q_len, dk = query.shape
    hkv = s.k.shape[1]
    g = hq // hkv
    dv = s.value_dim
    rows = g * q_len
    dummy = query.new_empty(0)
    mask_u8 = mask.view(torch.uint8) if mask is not None else None
    hk = hv = None
    hk_scale = hv_scale = 1.0
    if s.key_rotation is not None:  # Hadamard rotations as their signs in the products' dtype and one scale each
        hk, hk_scale = _signs(s.key_rotation, query.dtype)
        hv, hv_scale = _signs(s.value_rotation, query.dtype)
    # Pre-RoPE keys are turned per tile from a table of cos / sin, or from inv_freq by per-element polynomials.
    from_table = bool(s.rope and plan.angle_table and s.rotary_dim == block(dk))
    if (s.key_levels is None) != (s.value_levels is None):
        raise ValueError("a KIVI segment's keys and values have codebooks together or not at all")
    if plan.group_tiles and s.kind != KIVI:
        raise ValueError("a tile per key group reads KIVI storage only")
    common = dict(
        DK=s.key_dim, DV=dv, KBITS=s.key_bits, VBITS=s.value_bits, GK=s.key_group, GV=s.value_group,
        HAS_MASK=mask is not None, SOFTCAP=bool(softcap), DOT_FP32=query.dtype == torch.float32, ROPE=s.rope,
        ROTATED=hk is not None, RCH=min(64, block(dk), block(dv)), ANGLE_TABLE=from_table,
        LARGE=any(_reach(x) >= 2**31 for x in (s.k, s.v, s.ks, s.vs, s.kz, s.vz, query)),
        ONE_QUERY=q_len == 1, SWAP=plan.swap, LEVELS=s.key_levels is not None, BLOCK_R=block(rows, MIN_ROWS),
        BLOCK_N=plan.block_n, BLOCK_DK=block(dk), BLOCK_DV=block(dv), num_stages=plan.stages, num_warps=plan.warps,
    )  # fmt: skip
    if not plan.group_tiles:
        # int8 codes as float16 (1152 + code) where the plan asks and the codes are read as stored (folded scales)
        half = plan.half_codes and s.kind in (INT8, PAGED_INT8) and s.fold and not s.rope and hk is None
        common |= dict(KIND=s.kind, BS=s.block_size, FOLD=s.fold, ROT_DIM=s.rotary_dim,
                       HALF=half and query.dtype != torch.float32)  # fmt: skip
    key = None
    if not exact and plan.fill_waves and query.is_cuda:
        # (common is built in the same order every call: its items need no sorting on this per-step path)
        key = (query.device, plan.group_tiles, query.dtype, s.k.dtype, *common.items())
        splits = _filled(key, s, plan, b * hkv, splits, query.device)
    m = torch.empty((b, hkv, rows, splits), dtype=torch.float32, device=query.device)
    l_ = torch.empty_like(m)
    acc = torch.empty((b, hkv, rows, splits, dv), dtype=torch.float32, device=query.device)
    per_split = -(-max(s.length, 1) // splits)
    per_split = -(-per_split // plan.block_n) * plan.block_n
    angles = angle_table(s.inv_freq, s.first + s.length) if from_table else s.inv_freq
    codes = [s.ks, s.kz, s.vs, s.vz, s.key_levels, s.value_levels]
    outs = [m, l_, acc, *(x if x is not None else dummy for x in (angles, hk, hv))]
    table = [] if plan.group_tiles else [s.table if s.table is not None else dummy]
    mask_arg = mask_u8 if mask_u8 is not None else dummy
    args = [
        query, s.k, s.v, *(x if x is not None else dummy for x in codes), *table, mask_arg, *outs,
        *query.stride(), *s.k_strides, *s.v_strides, *s.ks_strides, *s.vs_strides,
        *([] if plan.group_tiles else strides(s.table, 2)), *strides(mask_u8, 3),
        hkv, s.length, s.start, q_len, g, per_split, float(scaling), float(softcap or 0.0), s.first, hk_scale, hv_scale,
    ]  # fmt: skip
    kernel = (_partial_group_kernel if plan.group_tiles else _partial_kernel)[(b * hkv, splits)](*args, **common)
    if key is not None and key not in _RESIDENT:
        if len(_RESIDENT) > 256:
            _RESIDENT.clear()
        _RESIDENT[key] = resident_programs(kernel, query.device)
    return m.view(b, hkv, g, q_len, splits), l_.view(b, hkv, g, q_len, splits), acc.view(b, hkv, g, q_len, splits, dv)


# --- the split reduction ----------------------------------------------------------------------------------------

MAX_COMBINED_SEGMENTS = 4  # sinks, quantized history, residual, new tokens: the most a cache layer's handle holds


@triton.jit
def _segment_top(M, row, S, top, BLOCK_S: tl.constexpr):
    s = tl.arange(0, BLOCK_S)
    m = tl.load(M + row * S + s, mask=s < S, other=float("-inf"))
    return tl.maximum(top, tl.max(m, 0))


@triton.jit
def _segment_sums(M, L, A, row, S, safe, den, num, DV: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr):
    s = tl.arange(0, BLOCK_S)
    d = tl.arange(0, BLOCK_D)
    ok = s < S
    w = tl.exp(tl.load(M + row * S + s, mask=ok, other=float("-inf")) - safe)
    den += tl.sum(tl.load(L + row * S + s, mask=ok, other=0.0) * w, 0)
    acc = tl.load(A + (row * S + s)[:, None] * DV + d[None, :], mask=ok[:, None] & (d < DV)[None, :], other=0.0)
    return den, num + tl.sum(acc * w[:, None], 0)


@triton.jit
def _combine_kernel(
    M0, L0, A0, S0, M1, L1, A1, S1, M2, L2, A2, S2, M3, L3, A3, S3, SINKS, OUT,
    so_b, so_q, so_h, so_d, HKV, G, Q,
    NSEG: tl.constexpr, HAS_SINKS: tl.constexpr, DV: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    """One program per output row (batch, KV head, query head in the group, query token): the max over every split
    of every segment (and the sink logit), then the weighted sums of ``l`` and ``acc``, divided once."""
    row = tl.program_id(0)  # row-major over (B, Hkv, G, q), the partials' layout
    qi = row % Q
    hq = (row // Q) % (HKV * G)  # KV head x G + position in its group = query head
    b = row // (Q * HKV * G)
    top = _segment_top(M0, row, S0, tl.full([], float("-inf"), tl.float32), BLOCK_S)
    if NSEG > 1:
        top = _segment_top(M1, row, S1, top, BLOCK_S)
    if NSEG > 2:
        top = _segment_top(M2, row, S2, top, BLOCK_S)
    if NSEG > 3:
        top = _segment_top(M3, row, S3, top, BLOCK_S)
    if HAS_SINKS:
        sink = tl.load(SINKS + hq).to(tl.float32)
        top = tl.maximum(top, sink)
    safe = tl.where(top == float("-inf"), 0.0, top)
    den = tl.zeros([], tl.float32)
    num = tl.zeros([BLOCK_D], tl.float32)
    den, num = _segment_sums(M0, L0, A0, row, S0, safe, den, num, DV, BLOCK_S, BLOCK_D)
    if NSEG > 1:
        den, num = _segment_sums(M1, L1, A1, row, S1, safe, den, num, DV, BLOCK_S, BLOCK_D)
    if NSEG > 2:
        den, num = _segment_sums(M2, L2, A2, row, S2, safe, den, num, DV, BLOCK_S, BLOCK_D)
    if NSEG > 3:
        den, num = _segment_sums(M3, L3, A3, row, S3, safe, den, num, DV, BLOCK_S, BLOCK_D)
    if HAS_SINKS:
        den += tl.exp(sink - safe)
    out = tl.where(den > 0, num / tl.maximum(den, 1.1754943508222875e-38), 0.0)
    d = tl.arange(0, BLOCK_D)
    tl.store(OUT + b * so_b + qi * so_q + hq * so_h + d * so_d, out.to(OUT.dtype.element_ty), mask=d < DV)


def triton_combine(
    partials: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]],
    sinks: torch.Tensor | None = None,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """The contract of :func:`hf_kvcache.kernels.torch_decode.combine` as one launch over the partials of up to
    :data:`MAX_COMBINED_SEGMENTS` segments, read where the partial kernels wrote them (no concatenation); the output
    ``(B, q, Hq, Dv)`` is contiguous."""
    if not 1 <= len(partials) <= MAX_COMBINED_SEGMENTS:
        raise ValueError(f"triton_combine takes 1 to {MAX_COMBINED_SEGMENTS} segments' partials, got {len(partials)}")
    b, hkv, g, q, _ = partials[0][0].shape
    dv = partials[0][2].shape[-1]
    out = torch.empty((b, q, hkv * g, dv), dtype=dtype, device=partials[0][0].device)
    args = []
    for i in range(MAX_COMBINED_SEGMENTS):
        m, l_, acc = partials[min(i, len(partials) - 1)]
        args += [m.contiguous(), l_.contiguous(), acc.contiguous(), m.shape[-1] if i < len(partials) else 0]
    splits = max(p[0].shape[-1] for p in partials)
    _combine_kernel[(b * hkv * g * q,)](
        *args, sinks if sinks is not None else out, out, *out.stride(), hkv, g, q,
        NSEG=len(partials), HAS_SINKS=sinks is not None, DV=dv, BLOCK_S=block(splits, 2), BLOCK_D=block(dv),
    )  # fmt: skip
    return out

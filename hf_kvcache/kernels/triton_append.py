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

from .formats._base import pool_strides, strides

__all__ = ["triton_append"]


@triton.jit
def _next_up(scale):
    """The next representable value above a non-negative ``scale`` (its bits plus one)."""
    if scale.dtype == tl.float32:
        return (scale.to(tl.int32, bitcast=True) + 1).to(tl.float32, bitcast=True)
    else:
        return (scale.to(tl.int16, bitcast=True) + 1).to(scale.dtype, bitcast=True)


@triton.jit
def _store_token(
    X, C, S, b, h, t, row, block, sx_b, sx_h, sx_t, sx_d, sc_b, sc_h, sc_t, sc_d, ss_b, ss_h, ss_t, ss_g,
    D: tl.constexpr, GROUP: tl.constexpr, SDT: tl.constexpr, QUANT: tl.constexpr,
    BLOCK_G: tl.constexpr, BLOCK_C: tl.constexpr,
):  # fmt: skip
    """Token ``t`` of head ``h``, batch row ``b``, stored at token index ``row`` of ``C`` (and ``S``), unless its
    page ``block`` is negative (a padding entry): ``D`` channels as a ``(groups of GROUP, channels)`` tile, encoded
    (``QUANT``) or as they are."""
    gi = tl.arange(0, BLOCK_G)
    ci = tl.arange(0, BLOCK_C)
    d = gi[:, None] * GROUP + ci[None, :]
    ok = (gi < D // GROUP)[:, None] & (ci < GROUP)[None, :]
    keep = (tl.zeros_like(gi) + block) >= 0  # compared as a vector (the interpreter mis-types a scalar's)
    raw = tl.load(X + b * sx_b + h * sx_h + t * sx_t + d * sx_d, mask=ok, other=0.0)
    dest = C + b * sc_b + h * sc_h + row * sc_t + d * sc_d
    if QUANT:
        x = raw.to(tl.float32)
        finite = (x == x) & (tl.abs(x) != float("inf"))
        absmax = tl.max(tl.where(finite & ok, tl.abs(x), 0.0), 1)  # (groups,): max(|min|, |max|) of the finite
        want = tl.math.div_rn(absmax, 127.0)
        scale = want.to(SDT)  # to nearest, then up one unit where that fell below: the scale covers the range
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
    K, V, KC, VC, KS, VS, TABLE,
    sk_b, sk_h, sk_t, sk_d, sv_b, sv_h, sv_t, sv_d,
    skc_b, skc_h, skc_t, skc_d, svc_b, svc_h, svc_t, svc_d,
    sks_b, sks_h, sks_t, sks_g, svs_b, svs_h, svs_t, svs_g,
    stab_b, stab_n, H, n, START,
    DK: tl.constexpr, DV: tl.constexpr, GK: tl.constexpr, GV: tl.constexpr, SDT: tl.constexpr,
    QUANT: tl.constexpr, PAGED: tl.constexpr, BS: tl.constexpr,
    BLOCK_GK: tl.constexpr, BLOCK_CK: tl.constexpr, BLOCK_GV: tl.constexpr, BLOCK_CV: tl.constexpr,
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
            K, KC, KS, b, h, t, row, block, sk_b, sk_h, sk_t, sk_d, skc_b, skc_h, skc_t, skc_d,
            sks_b, sks_h, sks_t, sks_g, DK, GK, SDT, QUANT, BLOCK_GK, BLOCK_CK,
        )  # fmt: skip
    else:
        _store_token(
            V, VC, VS, b, h, t, row, block, sv_b, sv_h, sv_t, sv_d, svc_b, svc_h, svc_t, svc_d,
            svs_b, svs_h, svs_t, svs_g, DV, GV, SDT, QUANT, BLOCK_GV, BLOCK_CV,
        )  # fmt: skip


_SCALE_TYPES = {torch.float32: tl.float32, torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}


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
) -> None:
    """Store ``k`` / ``v`` ``(B, H, n, D)`` in one launch: int8 codes and scales when ``*_scales`` are given, else
    the tokens as they are.

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
    if b * h * n == 0:
        return
    _append_kernel[(b * h * n, 2)](
        k, v, k_out, v_out, k_scales if quant else k_out, v_scales if quant else v_out,
        table if table is not None else k_out, *k.stride(), *v.stride(), *(s for x in out_strides for s in x),
        *(table.stride() if table is not None else (0, 0)), h, n, start,
        DK=dk, DV=dv, GK=gk, GV=gv, SDT=_SCALE_TYPES[k_scales.dtype] if quant else tl.float32, QUANT=quant,
        PAGED=table is not None, BS=block_size, BLOCK_GK=triton.next_power_of_2(dk // gk),
        BLOCK_CK=triton.next_power_of_2(gk), BLOCK_GV=triton.next_power_of_2(dv // gv),
        BLOCK_CV=triton.next_power_of_2(gv),
    )  # fmt: skip

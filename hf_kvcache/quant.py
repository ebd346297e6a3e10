"""Pure tensor math for KV quantization: symmetric int8, asymmetric 4/3/2-bit with packing.

No transformers imports here: this module is the reference the cache layers (and any future kernel) are tested
against.

Conventions
-----------
* A *group* is the set of elements that share one scale (and zero point). Callers reshape so that the group is one
  dimension and pass it as ``dim``; the functions reduce over that dimension with ``keepdim=True``.
* Round-trip error: for every finite input ``x`` inside a group, ``|dequantize(quantize(x)) - x| <= scale / 2``
  (up to float rounding of the arithmetic), where ``scale`` is the *stored* scale. For scales stored in a 16-bit
  dtype this still holds: the minimum is rounded down and the scale rounded up to the storage dtype before the codes
  are computed, so the stored parameters always cover the group's range. For 8-bit (:data:`E5M3`) scales too: the
  grid is centered on the group with a scale that keeps both extremes within half a step of the end codes.
* Non-finite inputs never poison a group: scales and zero points are computed from the finite elements only; ``+inf``
  and ``-inf`` are stored as the group's largest and smallest representable values and ``NaN`` as the representable
  value nearest zero. A group with no finite element stores scale 0 and reads back as zeros.
* Scales are computed in float32, so magnitudes up to about ``1e36`` round-trip within the bound (beyond that the
  range of a group overflows float32). Stored in a 16-bit dtype, a scale or zero point beyond that dtype's range
  saturates at its largest finite value: the group's extreme values are clipped (finite, never inf or NaN).
"""

from __future__ import annotations

import functools
import sys

import torch

__all__ = [
    "FP8_MAX",
    "SUPPORTED_BITS",
    "dequantize_fp8",
    "quantize_fp8",
    "quantize_symmetric",
    "dequantize_symmetric",
    "quantize_asymmetric",
    "dequantize_asymmetric",
    "pack",
    "pack_width",
    "codes_per_byte",
    "unpack",
    "levels",
    "CODEBOOKS",
    "codebook_levels",
    "E5M3",
    "E5M3_MAX",
    "decode_e5m3",
    "encode_e5m3",
    "group_params",
]

SUPPORTED_BITS = (2, 3, 4, 8)


def levels(bits: int) -> int:
    """Largest code of an unsigned ``bits``-bit quantizer (``2**bits - 1``)."""
    if bits not in SUPPORTED_BITS:
        raise ValueError(f"bits must be one of {SUPPORTED_BITS}, got {bits!r}")
    return (1 << bits) - 1


def _saturate(y: torch.Tensor) -> torch.Tensor:
    """Infinities of a 16-bit cast of finite values, back to the dtype's largest finite value (with their sign)."""
    top = torch.finfo(y.dtype).max
    return torch.where(torch.isinf(y), torch.sign(y) * top, y).to(y.dtype)


def _round_to_dtype(x: torch.Tensor, dtype: torch.dtype, direction: float) -> torch.Tensor:
    """Cast float32 ``x`` to ``dtype``, rounding toward ``direction`` (+inf or -inf) instead of to nearest, and
    saturating at the dtype's largest finite value (``x`` is finite)."""
    y = x.to(dtype)
    if dtype == torch.float32:
        return y
    overshoot = y.float() < x if direction > 0 else y.float() > x
    target = torch.full_like(y, direction)
    return _saturate(torch.where(overshoot, torch.nextafter(y, target), y))


@functools.cache
def _smallest_positive(dtype: torch.dtype) -> float:
    """The smallest positive (subnormal) value of ``dtype``, exact as a Python float."""
    return float(torch.nextafter(torch.zeros((), dtype=dtype), torch.ones((), dtype=dtype)))


def _nonzero_scale(scale: torch.Tensor, spread: torch.Tensor) -> torch.Tensor:
    """Where a group has a non-zero spread but its scale underflowed to 0 (subnormal inputs), use the smallest
    positive value of the scale dtype, so the group still reads back within half a step instead of as zeros."""
    return torch.where((spread > 0) & (scale == 0), _smallest_positive(scale.dtype), scale)


def _cover(scale: torch.Tensor, span_over_scale: torch.Tensor, top: int) -> torch.Tensor:
    """Where ``span / scale`` exceeds ``top`` (a scale rounded down: float32 division loses relative precision in
    the subnormal range), step the scale up by one unit in its dtype, so the top code is never saturated by more
    than rounding. One step suffices after a round-to-nearest division."""
    up = _saturate(torch.nextafter(scale, torch.full_like(scale, float("inf"))))
    return torch.where(span_over_scale > top, up, scale)


def _finite_extrema(x: torch.Tensor, dim: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Min and max over ``dim`` of the finite elements (0 where a group has none), and the finite mask: None where
    every element is finite, known without a device sync (on CPU), what a model passes: the quantizers then skip
    the masking, each of whose ~10 operations costs a short forward's encode as much as its arithmetic."""
    finite = torch.isfinite(x)
    if x.device.type == "cpu" and bool(finite.all()):
        return x.amin(dim=dim, keepdim=True), x.amax(dim=dim, keepdim=True), None
    mn = torch.where(finite, x, float("inf")).amin(dim=dim, keepdim=True)
    mx = torch.where(finite, x, float("-inf")).amax(dim=dim, keepdim=True)
    empty = mn > mx
    mn = torch.where(empty, 0.0, mn)
    mx = torch.where(empty, 0.0, mx)
    return mn, mx, finite


def quantize_symmetric(
    x: torch.Tensor, dim: int = -1, scale_dtype: torch.dtype = torch.float32
) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric absmax int8 quantization with one scale per group along ``dim``.

    Args:
        x: floating tensor.
        dim: the group dimension (reduced with ``keepdim=True``).
        scale_dtype: dtype the scales are stored in.

    Returns:
        ``(codes, scale)``: ``codes`` int8 in ``[-127, 127]`` with the shape of ``x``, ``scale`` with ``dim`` of size 1.
    """
    xf = x.float()
    mn, mx, finite = _finite_extrema(xf, dim)
    absmax = torch.maximum(mx.abs(), mn.abs())
    scale = _nonzero_scale(_round_to_dtype(absmax / 127.0, scale_dtype, direction=float("inf")), absmax)
    scale = _cover(scale, absmax / torch.where(scale > 0, scale.float(), 1.0), 127)
    safe = torch.where(scale > 0, scale.float(), 1.0)
    if finite is not None:  # NaN -> 0; +-inf -> +-absmax (saturates to +-127 below).
        xf = torch.where(finite, xf, torch.where(torch.isnan(xf), 0.0, torch.sign(xf) * absmax))
    codes = torch.round(xf / safe).clamp_(-127, 127).to(torch.int8)
    return codes, scale


def dequantize_symmetric(
    codes: torch.Tensor, scale: torch.Tensor, out: torch.Tensor | None = None, dtype: torch.dtype | None = None
) -> torch.Tensor:
    """Inverse of :func:`quantize_symmetric`; writes into ``out`` when given (no new full-size tensor)."""
    if out is None:
        out = torch.empty(codes.shape, dtype=dtype or scale.dtype, device=codes.device)
    return torch.mul(codes, scale, out=out)


FP8_MAX = 448.0  # the largest finite float8 e4m3 ("fn": no infinities) value


def quantize_fp8(
    x: torch.Tensor, dim: int = -1, scale_dtype: torch.dtype = torch.float32
) -> tuple[torch.Tensor, torch.Tensor]:
    """float8 e4m3 codes with one scale per group along ``dim`` (absmax / 448, the format vLLM and TensorRT-LLM
    ship for KV caches). Each code keeps 3 mantissa bits: ``|dequantize(quantize(x)) - x| <= |x| / 16 + scale / 1024``
    (a relative step for normal codes, half the smallest subnormal, ``2^-9 scale``, near zero). Non-finite inputs
    follow the module's conventions (NaN -> 0, +-inf -> +-absmax of the finite elements).

    Returns:
        ``(codes, scale)``: ``codes`` uint8 holding the e4m3 bits (``codes.view(torch.float8_e4m3fn)`` reads them),
        ``scale`` in ``scale_dtype`` with ``dim`` of size 1.
    """
    xf = x.float()
    mn, mx, finite = _finite_extrema(xf, dim)
    absmax = torch.maximum(mx.abs(), mn.abs())
    scale = _nonzero_scale(_round_to_dtype(absmax / FP8_MAX, scale_dtype, direction=float("inf")), absmax)
    safe = torch.where(scale > 0, scale.float(), 1.0)
    if finite is not None:
        xf = torch.where(finite, xf, torch.where(torch.isnan(xf), 0.0, torch.sign(xf) * absmax))
    codes = (xf / safe).clamp_(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)  # rounds to nearest even
    return codes.view(torch.uint8), scale


def dequantize_fp8(codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`quantize_fp8`, float32."""
    return codes.view(torch.float8_e4m3fn).float() * scale.float()


# 8-bit scales: ``scale_dtype=E5M3`` stores each scale as an unsigned 8-bit float, float16's 5 exponent bits and top 3
# mantissa bits (a float16 without its sign and low 7 mantissa bits: ``code << 7`` is its float16 bit pattern, which
# any kernel decodes with a shift), on a grid centered on its group (:func:`_e5m3_params`). float16's range
# (subnormals from 2^-17, at most 61,440), 3 mantissa bits.
E5M3 = torch.uint8
E5M3_MAX = 61440.0  # code 0xF7; 0xF8 up would be float16's infinities and NaNs, never stored
E5M3_TINY = 2.0**-17  # code 1, the smallest positive scale


def encode_e5m3(x: torch.Tensor, lower: torch.Tensor | None = None) -> torch.Tensor:
    """Non-negative finite float32 ``x`` as E5M3 codes (uint8), saturating at :data:`E5M3_MAX`: each rounded up to
    the next representable value, or with ``lower`` to the nearest one that is at least ``lower`` (``<= x``)."""
    half = _round_to_dtype(x.float(), torch.float16, direction=float("inf"))
    code = (half.view(torch.int16).to(torch.int32) + 127) >> 7  # up to the next multiple of 2^7 of the bit pattern
    code = code.clamp_(max=0xF7)
    if lower is not None:
        below = (code - 1).clamp_(min=0)
        down = decode_e5m3(below.to(torch.uint8))
        nearer = (x - down < decode_e5m3(code.to(torch.uint8)) - x) & (down >= lower) & (code > 0)
        code = torch.where(nearer, below, code)
    return code.to(torch.uint8)


def decode_e5m3(code: torch.Tensor) -> torch.Tensor:
    """E5M3 codes (uint8) as float32, exactly."""
    return (code.to(torch.int16) << 7).view(torch.float16).float()


def _zero_unit(bits: int) -> float:
    """The step of 8-bit zero points, in units of their group's scale: ``2^(bits - 7)``, so int8 spans ``+-2^bits``
    scales, every zero point of a group that straddles 0 (``(-(2^bits - 1), 0]`` scales)."""
    return 2.0 ** (bits - 7)


def group_params(scale: torch.Tensor, zero: torch.Tensor, bits: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Stored ``(scale, zero)`` of :func:`quantize_asymmetric` as float32: E5M3 scales decoded, int8 zero points
    (``zero_dtype=torch.int8``) in their ``2^(bits - 7)`` scale steps (an exact product; ``bits``, the codes' width,
    is needed for them only), floats as they are."""
    if scale.dtype != E5M3:
        return scale.float(), zero.float()
    s = decode_e5m3(scale)
    if zero.dtype != torch.int8:
        return s, zero.float()
    if bits is None:
        raise ValueError("bits: int8 zero points are steps of 2^(bits - 7) scales; pass the codes' width")
    return s, zero.float() * s * _zero_unit(bits)


def _e5m3_params(mn: torch.Tensor, mx: torch.Tensor, bits: int, zero_dtype: torch.dtype):
    """E5M3 scales and zero points in ``zero_dtype`` (int8: steps of ``2^(bits - 7)`` scales) for groups between
    ``mn`` and ``mx``. The scale is the E5M3 value nearest ``span / top`` that is at least ``span / (top + 1)`` (plus
    what the zero point's rounding needs), and the grid is centered on the group: both extremes lie within half a step
    of the end codes, so every element reads back within half a step of the stored scale, as with exact scales.
    Centering matters: a grid kept at the minimum with the nearest scale clips only the maxima, a bias the mean
    squared error does not show and attention does (docs/results.md, "8-bit scales"). int8 zero points also need
    ``scale >= (|mn| + |mx|) / 2^bits`` to reach the grid's start, which only groups that lie far from 0 on one side
    pay for (never one that straddles it)."""
    top = levels(bits)
    mid = torch.where(mx == mn, mn, mn / 2 + mx / 2)  # halved first: no overflow; a constant group exactly
    if zero_dtype == torch.int8:
        unit = _zero_unit(bits)
        reach = (mn.abs() + mx.abs()) / (1 << bits)
        # a group of values too small for that sum (float32 subnormals) still needs a scale to place its zero point
        reach = torch.where((mn != 0) | (mx != 0), reach.clamp(min=E5M3_TINY), reach)
        lower = torch.maximum(mx / (top + 1 - unit) - mn / (top + 1 - unit), reach)
        scale = encode_e5m3(torch.maximum(mx / top - mn / top, lower), lower)
        s = decode_e5m3(scale)
        u = s * unit
        zero = torch.round((mid - s * (top / 2)) / torch.where(u > 0, u, 1.0)).clamp_(-128, 127)
        return scale, zero.to(torch.int8), zero * u
    # the zero point rounded to nearest in its dtype moves by at most this much
    slack = (mn.abs() + mx.abs() + (mx - mn)) * (torch.finfo(zero_dtype).eps / 2) + _smallest_positive(zero_dtype)
    lower = mx / (top + 1) - mn / (top + 1) + slack * (2 / (top + 1))
    lower = torch.where(mx > mn, lower.clamp(min=E5M3_TINY), lower)  # a spread of subnormals: not a scale of 0
    scale = encode_e5m3(torch.maximum(mx / top - mn / top, lower), lower)
    zero = _saturate((mid - decode_e5m3(scale) * (top / 2)).to(zero_dtype))
    return scale, zero, zero.float()


def quantize_asymmetric(
    x: torch.Tensor,
    bits: int,
    dim: int,
    scale_dtype: torch.dtype = torch.float32,
    codebook: torch.Tensor | None = None,
    zero_dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Asymmetric (min/max) quantization to ``bits`` with one scale and zero point per group along ``dim``.

    ``x ~= codes * scale + zero`` where ``zero`` is the group minimum (KIVI's scheme, zero point in float). With a
    ``codebook`` (:func:`codebook_levels`: ``2**bits`` increasing levels in units of ``scale``, inside ``[0, 2**bits
    - 1]``) the same scale and zero point place each element, which is stored as its nearest level's index:
    ``x ~= codebook[codes] * scale + zero``, within ``scale`` times the codebook's largest half gap or end gap.

    ``scale_dtype=E5M3``: 8-bit scales (see :data:`E5M3`), zero points in ``zero_dtype``: a float dtype, or
    ``torch.int8`` for zero points in steps of ``2^(bits - 7)`` scales (8-bit too; :func:`group_params` reads both
    back). The round-trip bound holds with the stored scale.

    Returns:
        ``(codes, scale, zero)``: ``codes`` uint8 in ``[0, 2**bits - 1]`` (unpacked, shape of ``x``); ``scale`` in
        ``scale_dtype`` and ``zero`` in ``zero_dtype`` (default: ``scale_dtype``) with ``dim`` of size 1.
    """
    top = levels(bits)
    xf = x.float()
    mn, mx, finite = _finite_extrema(xf, dim)
    if scale_dtype == E5M3:
        scale, zero, zero_f = _e5m3_params(mn, mx, bits, zero_dtype or torch.float32)
        scale_f = decode_e5m3(scale)
    else:
        zero = _round_to_dtype(mn, zero_dtype or scale_dtype, direction=float("-inf"))
        # Divide before subtracting so that huge ranges do not overflow float32.
        scale = _round_to_dtype(mx / top - zero.float() / top, scale_dtype, direction=float("inf"))
        scale = _nonzero_scale(scale, mx - zero.float())
        positive = torch.where(scale > 0, scale.float(), 1.0)
        scale = _cover(scale, mx / positive - zero.float() / positive, top)
        scale_f, zero_f = scale.float(), zero.float()
    safe = torch.where(scale_f > 0, scale_f, 1.0)
    if finite is not None:  # +inf -> max, -inf -> min, NaN -> the value nearest 0 inside the group's range.
        nan_value = torch.clamp(torch.zeros_like(mn), mn, mx)
        xf = torch.where(finite, xf, torch.where(torch.isnan(xf), nan_value, torch.where(xf > 0, mx, mn)))
    position = xf / safe - zero_f / safe  # where x sits between the group's minimum (0) and maximum (top)
    if codebook is None:
        return torch.round(position).clamp_(0, top).to(torch.uint8), scale, zero
    midpoints = (codebook[1:] + codebook[:-1]).to(position.device) / 2  # nearest level: how many midpoints lie below
    return torch.bucketize(position.contiguous(), midpoints).to(torch.uint8), scale, zero


def dequantize_asymmetric(
    codes: torch.Tensor,
    scale: torch.Tensor,
    zero: torch.Tensor,
    out: torch.Tensor | None = None,
    dtype: torch.dtype | None = None,
    codebook: torch.Tensor | None = None,
    bits: int | None = None,
) -> torch.Tensor:
    """Inverse of :func:`quantize_asymmetric` (with the codebook it was quantized with, if any); writes into ``out``
    when given. E5M3 scales are read as float32 (``bits``: the codes' width, which int8 zero points need)."""
    if scale.dtype == E5M3:
        scale, zero = group_params(scale, zero, bits)
        dtype = dtype or torch.float32
    if out is None:
        out = torch.empty(codes.shape, dtype=dtype or scale.dtype, device=codes.device)
    if codebook is not None:
        codes = codebook.to(codes.device)[codes.long()]
    torch.mul(codes, scale, out=out)
    return out.add_(zero)


# Level placements of the asymmetric quantizer: "uniform" (2**bits - 1 equal steps from the group's minimum to its
# maximum, KIVI's) or "lloyd" (Lloyd-Max levels for normally distributed groups, placed between the same minimum and
# maximum: what Hadamard-rotated coordinates look like, TurboQuant's scalar step on KIVI's min / max frame).
CODEBOOKS = ("uniform", "lloyd")
# Levels are rounded to 1/16 of a step: exact in float16 and bfloat16 up to 15 (4 bits), so a kernel reads them in
# the dtype it multiplies in.
_LEVEL_UNIT = 16
_CODEBOOKS: dict[tuple[int, int], torch.Tensor] = {}


def codebook_levels(bits: int, group: int) -> torch.Tensor:
    """Lloyd-Max levels for groups of ``group`` normally distributed values quantized to ``bits`` between their
    minimum and maximum: ``2**bits`` increasing float32 levels in units of the uniform grid's step (``0`` the
    group's minimum, ``2**bits - 1`` its maximum), each a multiple of 1/16.

    Found by Lloyd's iteration (each level the mean of the values nearest it, from the uniform grid) on 2^17 standard
    normal values in groups of ``group`` and their mirror images, drawn from a fixed seed on the CPU and normalized by
    their group's range, so the levels are the same on every machine and symmetric; cached per ``(bits, group)``. A
    group of 1 or 2 values has only its extremes: its levels stay uniform.
    """
    top = levels(bits)
    cached = _CODEBOOKS.get((bits, group))
    if cached is not None:
        return cached
    grid = torch.arange(top + 1, dtype=torch.float64)
    if group > 2:
        generator = torch.Generator().manual_seed(0)
        x = torch.randn(-(-(1 << 17) // group), group, generator=generator, dtype=torch.float64)
        x = torch.cat([x, -x])  # mirrored: the distribution is symmetric, so are the levels
        mn, mx = x.amin(1, keepdim=True), x.amax(1, keepdim=True)
        position = ((x - mn) / (mx - mn) * top).flatten()
        for _ in range(100):
            cell = torch.bucketize(position, (grid[1:] + grid[:-1]) / 2)
            total = torch.zeros_like(grid).index_add_(0, cell, position)
            count = torch.zeros_like(grid).index_add_(0, cell, torch.ones_like(position))
            grid = torch.where(count > 0, total / count.clamp(min=1), grid)
    low = torch.round(grid[: (top + 1) // 2] * _LEVEL_UNIT) / _LEVEL_UNIT
    _CODEBOOKS[(bits, group)] = levels_ = torch.cat([low, top - low.flip(0)]).float()  # exactly symmetric
    return levels_


def pack_width(width: int, bits: int) -> int:
    """Bytes :func:`pack` stores for ``width`` codes of ``bits`` bits (``width * bits / 8``)."""
    return width * bits // 8


def codes_per_byte(bits: int) -> int:
    """Codes of ``bits`` bits that fill whole bytes in :func:`pack`'s layout: 8 at 3 bits (a 2-bit plane and a 1-bit
    plane, whose high bits pack 8 per byte), else ``8 / bits``; packed widths must be multiples of it."""
    return 8 if bits == 3 else 8 // bits


def _check_packable(width: int, bits: int) -> None:
    multiple = codes_per_byte(bits)
    if width % multiple:
        raise ValueError(f"last dimension ({width}) must be a multiple of {multiple} to pack {bits}-bit codes")


def _pack_uniform(codes: torch.Tensor, bits: int) -> torch.Tensor:
    per_byte = 8 // bits
    grouped = codes.reshape(*codes.shape[:-1], codes.shape[-1] // per_byte, per_byte)  # (..., D/k, k)
    packed = grouped[..., 0].clone()
    for j in range(1, per_byte):
        packed |= grouped[..., j] << (bits * j)
    return packed


def pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack unsigned ``bits``-bit codes along the last dimension, low bits first.

    8, 4 and 2 bits: ``8 // bits`` codes per byte. 3 bits: two bit planes, 8 codes in 3 bytes: the low 2 bits of
    every code packed 4 per byte (``D / 4`` bytes, as 2-bit codes), then their high bits 8 per byte (``D / 8``
    bytes). Planes keep every code inside one byte, so a kernel unpacks them with the 2-bit shifts plus one more plane
    (a 3-byte run of codes would straddle bytes), at exactly 3 bits per code (10 codes per int32 would spend 3.2).
    """
    _check_packable(codes.shape[-1], bits)
    if bits == 8:
        return codes
    if bits == 3:
        return torch.cat([_pack_uniform(codes & 3, 2), _pack_uniform(codes >> 2, 1)], dim=-1)
    return _pack_uniform(codes, bits)


def _words(packed: torch.Tensor) -> torch.Tensor | None:
    """``packed``'s bytes as int32 words, 4 bytes each with the first byte lowest, without a copy; None where its
    width, strides or offset do not allow that view (or on a big-endian machine)."""
    if sys.byteorder != "little" or packed.shape[-1] % 4:
        return None
    try:
        return packed.view(torch.int32)
    except RuntimeError:  # a stride or the storage offset is not a multiple of 4 bytes
        return None


@functools.cache
def _word_shifts(bits: int, device: torch.device) -> torch.Tensor:
    return torch.arange(32 // bits, dtype=torch.int32, device=device) * bits


def _word_codes(words: torch.Tensor, bits: int) -> torch.Tensor:
    """``(..., W)`` int32 words -> ``(..., W * 32 / bits)`` int32 codes, low bits first, in one shift-and-mask pass."""
    codes = (words.unsqueeze(-1) >> _word_shifts(bits, words.device)) & ((1 << bits) - 1)
    return codes.flatten(-2)


def _unpack_uniform(packed: torch.Tensor, bits: int, out: torch.Tensor) -> None:
    per_byte, mask = 8 // bits, (1 << bits) - 1
    words = _words(packed) if bits == 2 else None
    if words is not None:  # 16 codes per word: 2x faster on CPU than 4 shift passes per byte
        out.copy_(_word_codes(words, bits))
        return
    view = out.view(*out.shape[:-1], packed.shape[-1], per_byte)  # (..., D/k, k)
    if bits == 1:  # 8 codes per byte: one lookup of each byte's row (8 shift-and-copy passes took 3.5x on CPU)
        table = _bit_rows(out.dtype, out.device)
        torch.index_select(table, 0, packed.reshape(-1).int(), out=view.view(-1, per_byte))
        return
    for j in range(per_byte):
        view[..., j].copy_((packed >> (bits * j)) & mask)


@functools.cache
def _bit_rows(dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``(256, 8)``: row ``b`` holds byte ``b``'s bits, lowest first, as ``dtype``."""
    return ((torch.arange(256)[:, None] >> torch.arange(8)) & 1).to(dtype=dtype, device=device)


def unpack(packed: torch.Tensor, bits: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """Inverse of :func:`pack`. With ``out`` (any dtype, last dim ``8 / bits`` times larger) the codes are written
    there directly, so a float workspace can receive them without an intermediate full-size uint8 tensor."""
    width = packed.shape[-1] * 8 // bits
    if out is None:
        out = torch.empty(*packed.shape[:-1], width, dtype=torch.uint8, device=packed.device)
    if bits == 8:
        return out.copy_(packed)
    if bits == 3:
        # Each plane made contiguous first (shifting a slice of the last dim is ~1.4x slower than the copy costs).
        low, high = _words(packed[..., : width // 4].contiguous()), _words(packed[..., width // 4 :].contiguous())
        if low is not None and high is not None:  # both planes as words: int32 codes, one conversion into out
            return out.copy_(_word_codes(low, 2).add_(_word_codes(high, 1), alpha=4))
        # Planes that are not whole words: the high bits unpacked in out's dtype and added in one pass (a float add
        # per bit position cost 3x the whole 2-bit plane on CPU).
        low = width // 4
        _unpack_uniform(packed[..., :low].contiguous(), 2, out)
        high = torch.empty(out.shape, dtype=out.dtype if out.is_floating_point() else torch.uint8, device=out.device)
        _unpack_uniform(packed[..., low:].contiguous(), 1, high)
        return out.add_(high, alpha=4) if out.is_floating_point() else out.add_(high * 4)
    _unpack_uniform(packed, bits, out)
    return out

"""Property tests of the quantizer math (no model, no transformers)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from hf_kvcache import quant

finite = st.floats(min_value=-(2.0**100), max_value=2.0**100, allow_nan=False, width=32)
groups = arrays("float32", st.tuples(st.integers(1, 4), st.sampled_from([8, 16, 32])), elements=finite)
SCALE_DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def _slack(x: torch.Tensor) -> torch.Tensor:
    """Float rounding of the arithmetic itself (a few ulps of the group's magnitude)."""
    return 8 * torch.finfo(torch.float32).eps * x.abs().amax(-1, keepdim=True)


@settings(max_examples=200, deadline=None)
@given(groups)
def test_symmetric_round_trip_within_half_step(array):
    x = torch.from_numpy(array)
    codes, scale = quant.quantize_symmetric(x, dim=-1)
    assert codes.dtype == torch.int8 and codes.abs().max() <= 127
    back = quant.dequantize_symmetric(codes, scale, dtype=torch.float32)
    assert ((back - x).abs() <= scale / 2 + _slack(x)).all()


@settings(max_examples=200, deadline=None)
@given(groups, st.sampled_from([2, 3, 4]), st.sampled_from(SCALE_DTYPES))
def test_asymmetric_round_trip_within_half_step(array, bits, scale_dtype):
    x = torch.from_numpy(array)
    if scale_dtype == torch.float16:
        x = x.clamp(-6e4, 6e4)  # float16 scales cannot describe larger ranges
    codes, scale, zero = quant.quantize_asymmetric(x, bits, dim=-1, scale_dtype=scale_dtype)
    assert scale.dtype == scale_dtype and codes.max() <= quant.levels(bits)
    back = quant.dequantize_asymmetric(codes, scale.float(), zero.float())
    assert ((back - x).abs() <= scale.float() / 2 + _slack(x)).all()


def test_e5m3_codes_are_float16s_upper_bits_rounded_up():
    """Every code decodes to float16's value with the code's bits over its 7 low mantissa bits, increasing; a value
    encodes to the smallest code at least as large (or, given ``lower``, the nearest one not below it); beyond
    61,440 it saturates."""
    codes = torch.arange(0xF8, dtype=torch.uint8)
    values = quant.decode_e5m3(codes)
    assert torch.equal(values, (codes.to(torch.int16) << 7).view(torch.float16).float())
    assert (values.diff() > 0).all() and values[-1] == quant.E5M3_MAX and values[1] == 2.0**-17
    assert torch.equal(quant.encode_e5m3(values), codes)
    between = (values[1:] + values[:-1]) / 2
    assert torch.equal(quant.encode_e5m3(between), codes[1:])  # rounded up
    near_low = values[:-1] + (values[1:] - values[:-1]) / 4
    assert torch.equal(quant.encode_e5m3(near_low, lower=torch.zeros_like(near_low)), codes[:-1])  # the nearer
    assert torch.equal(quant.encode_e5m3(near_low, lower=near_low), codes[1:])  # unless it falls below lower
    assert quant.encode_e5m3(torch.tensor([1e6, 65504.0])).tolist() == [0xF7, 0xF7]


@settings(max_examples=200, deadline=None)
@given(groups, st.sampled_from([2, 3, 4]), st.sampled_from([torch.int8, torch.float16, torch.float32]))
def test_e5m3_round_trip_within_half_step(array, bits, zero_dtype):
    """8-bit scales with int8 or float zero points: every element within half a step of the stored scale, as with
    exact scales (inside the scales' range: spans up to 61,440 steps of ``2^bits - 1``)."""
    x = torch.from_numpy(array).clamp(-3e4, 3e4)
    codes, scale, zero = quant.quantize_asymmetric(x, bits, -1, quant.E5M3, zero_dtype=zero_dtype)
    assert scale.dtype == torch.uint8 and zero.dtype == zero_dtype and codes.max() <= quant.levels(bits)
    s, z = quant.group_params(scale, zero, bits)
    # The grid's own float32 rounding, at the magnitude of its zero point and span: for a group far smaller than the
    # smallest 8-bit scale (2^-17) that, not the group's values, sets the rounding (a group of 1e-9 sits a half step
    # from its codes, to the rounding of a zero point of -1.1e-5).
    rounding = 8 * torch.finfo(torch.float32).eps * (z.abs() + s * quant.levels(bits))
    back = quant.dequantize_asymmetric(codes, scale, zero, bits=bits)
    assert ((back - x).abs() <= s / 2 + _slack(x) + rounding).all()
    if zero_dtype == torch.float32:  # the grid centered on the group: its extremes equally far from the end codes
        mn, mx = x.amin(-1, keepdim=True), x.amax(-1, keepdim=True)
        mid = torch.where(mx == mn, mn, mn / 2 + mx / 2)
        assert ((zero + s * quant.levels(bits) / 2 - mid).abs() <= _slack(x) + rounding).all()


@pytest.mark.parametrize("bits", [2, 3, 4])
def test_e5m3_scales_cost_little_where_groups_straddle_zero(bits):
    """On normal groups (what Hadamard-rotated values are) 8-bit scales and int8 zero points keep the mean squared
    error of float16 ones within 1% at 2 and 3 bits and 7% at 4 (the nearest scale, not the next one up, which cost
    11-15%); a group far from 0 on one side widens its scale for its int8 zero point to reach the grid."""
    x = torch.randn(8192, 64, generator=torch.Generator().manual_seed(bits))
    c, s, z = quant.quantize_asymmetric(x, bits, -1, quant.E5M3, zero_dtype=torch.int8)
    c16, s16, z16 = quant.quantize_asymmetric(x, bits, -1, torch.float16)
    ratio = (quant.dequantize_asymmetric(c, s, z, bits=bits) - x).pow(2).mean() / (
        quant.dequantize_asymmetric(c16, s16.float(), z16.float()) - x
    ).pow(2).mean()
    assert ratio < (1.07 if bits == 4 else 1.01)
    offset = torch.tensor([[100.0, 100.5, 101.0, 100.25]])
    _, far, _ = quant.quantize_asymmetric(offset, bits, -1, quant.E5M3, zero_dtype=torch.int8)
    assert quant.decode_e5m3(far).item() >= 2 * 100.0 / 2**bits  # the zero point's reach, not the span's step


def test_e5m3_dequantize_needs_the_width_of_int8_zero_points():
    codes, scale, zero = quant.quantize_asymmetric(torch.randn(2, 8), 2, -1, quant.E5M3, zero_dtype=torch.int8)
    with pytest.raises(ValueError, match="bits"):
        quant.dequantize_asymmetric(codes, scale, zero)


@settings(max_examples=100, deadline=None)
@given(groups, st.sampled_from([2, 3, 4]), st.sampled_from(SCALE_DTYPES))
def test_codebook_round_trip_within_the_codebooks_largest_gap(array, bits, scale_dtype):
    """With a codebook each element is stored as its nearest level, under the same scale and zero point as the
    uniform grid's: the error is at most the largest half gap between levels, or an end level's distance from the
    group's minimum or maximum, in units of the scale."""
    x = torch.from_numpy(array)
    if scale_dtype == torch.float16:
        x = x.clamp(-6e4, 6e4)
    book = quant.codebook_levels(bits, x.shape[-1])
    codes, scale, zero = quant.quantize_asymmetric(x, bits, dim=-1, scale_dtype=scale_dtype, codebook=book)
    uniform = quant.quantize_asymmetric(x, bits, dim=-1, scale_dtype=scale_dtype)
    assert torch.equal(scale, uniform[1]) and torch.equal(zero, uniform[2])
    assert codes.max() <= quant.levels(bits)
    back = quant.dequantize_asymmetric(codes, scale.float(), zero.float(), codebook=book)
    reach = max(book[0].item(), quant.levels(bits) - book[-1].item(), (book.diff() / 2).max().item())
    assert ((back - x).abs() <= reach * scale.float() + _slack(x)).all()
    every_level = zero.float().unsqueeze(-1) + book * scale.float().unsqueeze(-1)  # (..., 1, levels)
    nearest = (x.unsqueeze(-1) - every_level).abs().amin(-1)
    assert ((back - x).abs() <= nearest + _slack(x)).all()


@pytest.mark.parametrize("bits", [2, 3, 4])
@pytest.mark.parametrize("group", [8, 64])
def test_lloyd_codebook_fits_normal_groups_better_than_the_uniform_grid(bits, group):
    """The Lloyd-Max levels: increasing, inside ``[0, 2^bits - 1]``, symmetric about the middle, multiples of 1/16
    (exact in 16-bit floats), the same when computed again, and a lower squared error than the uniform grid on
    normally distributed groups (what a Hadamard rotation makes of a head's channels): at 2 bits and 64-value groups
    0.11 against 0.20 of the variance."""
    book = quant.codebook_levels(bits, group)
    top = quant.levels(bits)
    assert book.shape == (top + 1,) and book.dtype == torch.float32
    assert (book.diff() > 0).all() and book[0] >= 0 and book[-1] <= top
    assert torch.equal(book * 16, (book * 16).round()) and torch.equal(book.bfloat16().float(), book)
    assert torch.equal(book + book.flip(0), torch.full_like(book, top))
    quant._CODEBOOKS.clear()
    assert torch.equal(quant.codebook_levels(bits, group), book)
    x = torch.randn(4096, group, generator=torch.Generator().manual_seed(1))
    errors = []
    for codebook in (None, book):
        codes, scale, zero = quant.quantize_asymmetric(x, bits, dim=-1, codebook=codebook)
        errors.append((quant.dequantize_asymmetric(codes, scale, zero, codebook=codebook) - x).pow(2).mean())
    assert errors[1] < errors[0]
    if (bits, group) == (2, 64):
        assert errors[1] < 0.6 * errors[0]


def test_small_groups_keep_uniform_levels():
    """Groups of one or two values hold only their extremes: their levels are the uniform grid's."""
    for bits in (2, 3, 4):
        for group in (1, 2):
            assert torch.equal(quant.codebook_levels(bits, group), torch.arange(2**bits, dtype=torch.float32))


@pytest.mark.parametrize("bits", [2, 3, 4])
def test_zeros_and_constant_rows_are_exact(bits):
    x = torch.tensor([[0.0] * 8, [3.5] * 8, [-2.25] * 8])
    codes, scale, zero = quant.quantize_asymmetric(x, bits, dim=-1)
    assert torch.equal(quant.dequantize_asymmetric(codes, scale, zero), x)
    codes, scale = quant.quantize_symmetric(x, dim=-1)
    torch.testing.assert_close(quant.dequantize_symmetric(codes, scale, dtype=torch.float32), x)


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
def test_non_finite_values_do_not_poison_their_group(bits):
    x = torch.tensor([[1.0, -2.0, float("inf"), 0.5, float("nan"), -float("inf"), 0.25, 1.5]])
    finite = torch.isfinite(x)
    if bits == 8:
        codes, scale = quant.quantize_symmetric(x, dim=-1)
        back = quant.dequantize_symmetric(codes, scale, dtype=torch.float32)
    else:
        codes, scale, zero = quant.quantize_asymmetric(x, bits, dim=-1)
        back = quant.dequantize_asymmetric(codes, scale, zero)
        assert torch.isfinite(zero).all()
    assert torch.isfinite(scale).all() and torch.isfinite(back).all()
    assert ((back - x)[finite].abs() <= scale / 2 + 1e-6).all()
    # +inf reads back as the group's largest value, -inf as its smallest, NaN as the value nearest 0.
    assert back[0, 2] == back.max() and back[0, 5] == back.min()
    assert back[0, 4].abs() <= scale.max() / 2 + 1e-6


QUANTIZERS = {
    "int8": lambda x, dt: quant.quantize_symmetric(x, dim=-1, scale_dtype=dt),
    "fp8": lambda x, dt: quant.quantize_fp8(x, dim=-1, scale_dtype=dt),
    "int3": lambda x, dt: quant.quantize_asymmetric(x, 3, dim=-1, scale_dtype=dt),
    "int2-lloyd": lambda x, dt: quant.quantize_asymmetric(x, 2, dim=-1, scale_dtype=dt,
                                                          codebook=quant.codebook_levels(2, 8)),
}  # fmt: skip


@settings(max_examples=60, deadline=None)
@given(groups, st.sampled_from(sorted(QUANTIZERS)), st.sampled_from(SCALE_DTYPES), st.integers(0, 2**31))
def test_a_non_finite_element_changes_only_its_own_group(array, name, scale_dtype, seed):
    """An all-finite tensor takes the quantizers' unmasked path (CPU); one non-finite element sends the whole tensor
    through the masked one: every other group's codes, scales and zero points stay bit for bit the same."""
    x = torch.from_numpy(array).clamp(-6e4, 6e4)  # float16 scales cannot describe larger ranges
    g = torch.Generator().manual_seed(seed)
    row = int(torch.randint(0, x.shape[0], (), generator=g))
    col = int(torch.randint(0, x.shape[1], (), generator=g))
    poisoned = x.clone()
    poisoned[row, col] = (float("nan"), float("inf"), -float("inf"))[seed % 3]
    clean, dirty = QUANTIZERS[name](x, scale_dtype), QUANTIZERS[name](poisoned, scale_dtype)
    others = torch.arange(x.shape[0]) != row
    for a, b in zip(clean, dirty):
        assert torch.equal(a[others], b[others])


def test_all_non_finite_group_reads_back_as_zeros():
    x = torch.tensor([[float("nan"), float("inf"), -float("inf"), float("nan")]])
    codes, scale = quant.quantize_symmetric(x, dim=-1)
    assert torch.equal(quant.dequantize_symmetric(codes, scale, dtype=torch.float32), torch.zeros_like(x))


@given(st.sampled_from([2, 3, 4, 8]), st.integers(1, 5), st.sampled_from([8, 16, 32, 64]), st.integers(0, 2**31))
def test_pack_unpack_round_trip(bits, rows, width, seed):
    """Into uint8 and into a float workspace slice, from packed rows read in place or as a strided view (a storage
    buffer's): the int32-word unpacking where the bytes allow it (2 bits, 3 bits at 32 channels and more), else the
    per-byte passes."""
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 1 << bits, (rows, 3, width), generator=g, dtype=torch.uint8)
    packed = quant.pack(codes, bits)
    assert packed.shape[-1] == width * bits // 8
    assert torch.equal(quant.unpack(packed, bits), codes)
    out = torch.zeros(rows, 3, width + 8)[..., 4 : 4 + width]
    assert torch.equal(quant.unpack(packed, bits, out=out), codes.float())
    buffer = torch.zeros(rows, 5, packed.shape[-1], dtype=torch.uint8)
    buffer[:, 1:4] = packed
    assert torch.equal(quant.unpack(buffer[:, 1:4], bits), codes)  # offset by one row of the buffer
    odd = torch.zeros(rows, 3, packed.shape[-1] + 1, dtype=torch.uint8)
    odd[..., 1:] = packed
    assert torch.equal(quant.unpack(odd[..., 1:], bits), codes)  # rows at odd byte offsets: no word view


def test_three_bit_packing_is_two_bit_planes():
    """8 codes in 3 bytes: the low 2 bits packed like 2-bit codes, then the high bits 8 per byte, low bit first."""
    codes = torch.tensor([[7, 0, 5, 2, 1, 6, 3, 4, 0, 0, 0, 0, 0, 0, 0, 7]], dtype=torch.uint8)
    packed = quant.pack(codes, 3)
    assert packed.shape[-1] == quant.pack_width(16, 3) == 6
    assert torch.equal(packed[:, :4], quant.pack(codes & 3, 2))
    high = (codes >> 2).view(1, 2, 8)
    assert packed[0, 4] == sum(int(high[0, 0, j]) << j for j in range(8)) == 0b10100101
    assert packed[0, 5] == 0b10000000


def test_bad_bits_and_pack_shape_are_value_errors():
    with pytest.raises(ValueError, match="bits must be one of"):
        quant.levels(5)
    with pytest.raises(ValueError, match="multiple of 4"):
        quant.pack(torch.zeros(2, 6, dtype=torch.uint8), 2)
    with pytest.raises(ValueError, match="multiple of 8"):
        quant.pack(torch.zeros(2, 12, dtype=torch.uint8), 3)


def test_subnormal_scale_rounded_down_is_stepped_up():
    # float32 division rounds 1.809e-42 / 127 down to 10 subnormal units: the top code would saturate at 129.
    x = torch.full((1, 8), 1.809e-42)
    codes, scale = quant.quantize_symmetric(x, dim=-1)
    back = quant.dequantize_symmetric(codes, scale, dtype=torch.float32)
    assert ((back - x).abs() <= scale / 2).all()
    c, s, z = quant.quantize_asymmetric(torch.tensor([[0.0, 1.809e-42] * 4]), bits=2, dim=-1)
    assert (((c.float() * s + z) - torch.tensor([[0.0, 1.809e-42] * 4])).abs() <= s / 2).all()


@pytest.mark.parametrize("bits", [2, 3, 4])
def test_packed_codes_read_as_codebook_levels(bits):
    """A codebook's codes are read a packed byte at a time (each byte's levels from a table; 3 bits: a low-plane byte
    with its codes' high bits): the same levels as indexing the codebook with the unpacked codes, into contiguous,
    strided and 16-bit outputs."""
    from hf_kvcache.formats.kivi import _unpack, _unpack_into

    book = quant.codebook_levels(bits, 64)
    codes = torch.randint(0, 2**bits, (2, 3, 37, 64), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    packed = quant.pack(codes, bits)
    want = book[codes.long()]
    assert torch.equal(_unpack(packed, bits, book), want)
    strided = torch.empty(2, 3, 64, 37).transpose(-1, -2)
    _unpack_into(packed, bits, strided, book)
    assert torch.equal(strided, want)
    half = torch.empty(2, 3, 37, 64, dtype=torch.float16)
    _unpack_into(packed, bits, half, book)
    assert torch.equal(half.float(), want)

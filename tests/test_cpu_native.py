"""The CPU kernel that decodes and encodes KIVI codes in one pass (hf_kvcache/kernels/kivi_cpu.c) against the torch
path it replaces: every layout it decodes equals it to float32 rounding, what it encodes equals it bit for bit, every
layout it does not serve falls back untouched, and a machine that cannot build it runs torch and says why.

Skipped where no C compiler is found, unless ``HF_KVCACHE_REQUIRE_NATIVE=1`` (CI sets it), which fails instead."""

from __future__ import annotations

import platform
import shlex

import pytest
import torch
from models import rotary, tiny_model

from hf_kvcache import make_cache
from hf_kvcache.formats import codec_for, kivi
from hf_kvcache.formats.kivi import KiviCodec
from hf_kvcache.formats.rotated import RotatedCodec
from hf_kvcache.kernels import cpu_native
from hf_kvcache.kernels.append import append_kv

B, H, T = 2, 3, 40  # T: a whole number of key groups (8)


@pytest.fixture(autouse=True)
def built(native_cpu):
    torch.set_num_threads(1)


def _decode_both(codec, parts, width, rope, monkeypatch, dtype=torch.float32):
    """``(native, torch, whether the kernel served)``, each decoded into a view of a longer workspace."""
    b, h, t = parts["k"].shape[:3]
    outs = []
    for mode in ("auto", "never"):
        monkeypatch.setattr(cpu_native, "NATIVE_CPU", mode)
        k, v = (torch.full((b, h, t + 8, width), 7.0, dtype=dtype) for _ in "kv")
        codec.decode(parts, k[:, :, :t], v[:, :, :t], rope)
        assert (k[:, :, t:] == 7).all() and (v[:, :, t:] == 7).all(), "wrote past the view"
        outs.append((k[:, :, :t], v[:, :, :t]))
    inner = codec.inner if isinstance(codec, RotatedCodec) else codec
    k, v = (torch.empty(b, h, t, width, dtype=dtype) for _ in "kv")
    monkeypatch.setattr(cpu_native, "NATIVE_CPU", "auto")
    served = inner.decode_native(parts, k, v, rope, rotate=isinstance(codec, RotatedCodec))
    return outs[0], outs[1], served


def _assert_equal_to_rounding(native, reference):
    """Equal to the rounding of the outputs' dtype (sums taken in another order: float32's, or float16's last bit)."""
    for got, want in zip(native, reference):
        tol = 1e-5 if want.dtype == torch.float32 else 2 * torch.finfo(want.dtype).eps
        torch.testing.assert_close(got, want, rtol=tol, atol=tol * float(want.abs().max()))


@pytest.mark.parametrize("bits", [2, 3, 4])
@pytest.mark.parametrize("rotate", [False, True], ids=["plain", "hadamard"])
@pytest.mark.parametrize("key_axis", ["channel", "token"])
@pytest.mark.parametrize("pre_rope", [False, True], ids=["post-rope", "pre-rope"])
def test_the_kernel_equals_the_torch_decode(bits, rotate, key_axis, pre_rope, monkeypatch):
    width, group = 64, 8
    inner = KiviCodec(bits, group, None, key_axis=key_axis)
    codec = RotatedCodec(inner) if rotate else inner
    g = torch.Generator().manual_seed(bits)
    k = torch.randn(B, H, T, width, generator=g) * torch.linspace(0.2, 6, width)  # channels of unlike ranges
    parts = codec.encode(k, torch.randn(B, H, T, width, generator=g))
    rope = (rotary(width), 9) if pre_rope else None
    native, reference, served = _decode_both(codec, parts, width, rope, monkeypatch)
    assert served
    _assert_equal_to_rounding(native, reference)


@pytest.mark.parametrize(
    "width, group, rotate",
    [(128, 32, True), (96, 32, False), (32, 8, True), (256, 64, True), (16, 8, True), (8, 8, True)],
)
def test_other_head_widths_and_groups(width, group, rotate, monkeypatch):
    inner = KiviCodec(3, group, None)
    codec = RotatedCodec(inner) if rotate else inner
    g = torch.Generator().manual_seed(width)
    tokens = 2 * group
    parts = codec.encode(torch.randn(B, H, tokens, width, generator=g), torch.randn(B, H, tokens, width, generator=g))
    native, reference, served = _decode_both(codec, parts, width, (rotary(width), 0), monkeypatch)
    assert served
    _assert_equal_to_rounding(native, reference)


@pytest.mark.parametrize(
    "case",
    ["lloyd codebook", "interleaved rope", "partial rope", "rotated width 96", "float16 workspace"],
)
def test_what_the_kernel_does_not_read_falls_back_to_torch(case, monkeypatch):
    """The fused pass declines (nothing written); the codes are then read by the torch path, whose plain KIVI unpack
    the kernel still serves where it can (uniform float32 codes: the interleaved and partial RoPE cases)."""
    width = 96 if case == "rotated width 96" else 64
    inner = KiviCodec(2, 8, torch.float32 if case == "float16 workspace" else None,
                      codebook="lloyd" if case == "lloyd codebook" else "uniform")  # fmt: skip
    codec = RotatedCodec(inner)
    rope = {
        "interleaved rope": (rotary(width, "interleaved"), 3),
        "partial rope": (rotary(width, "partial"), 3),
    }.get(case, (rotary(width), 3))
    g = torch.Generator().manual_seed(0)
    parts = codec.encode(torch.randn(B, H, T, width, generator=g), torch.randn(B, H, T, width, generator=g))
    dtype = torch.float16 if case == "float16 workspace" else torch.float32
    native, reference, served = _decode_both(codec, parts, width, rope, monkeypatch, dtype)
    assert not served  # the fused pass declines; a plain unpack inside the torch path may still be the kernel's
    _assert_equal_to_rounding(native, reference)


def test_tensors_that_do_not_cover_the_output_are_refused_not_read(monkeypatch):
    """The kernel checks no bounds: a scale or code tensor shorter than the tokens asked for, or an angle table
    short of the last position, is declined before the call."""
    inner = KiviCodec(3, 8, None)
    parts = inner.encode(torch.randn(1, 2, 16, 64), torch.randn(1, 2, 16, 64))
    out = torch.empty(1, 2, 16, 64)
    table = torch.zeros(20, 2, 32)
    assert cpu_native.decode_kivi(parts["k"], parts["ks"], parts["kz"], out, 3, 8, False, True, (table, 4))
    assert not cpu_native.decode_kivi(parts["k"], parts["ks"][:, :, :1], parts["kz"], out, 3, 8, False)
    assert not cpu_native.decode_kivi(parts["k"][:, :, :8], parts["ks"], parts["kz"], out, 3, 8, False)
    assert not cpu_native.decode_kivi(parts["v"], parts["vs"][:, :, :15], parts["vz"], out, 3, 8, True)
    assert not cpu_native.decode_kivi(parts["k"], parts["ks"], parts["kz"], out, 3, 8, False, True, (table, 5))
    assert not cpu_native.decode_kivi(parts["k"], parts["ks"], parts["kz"], out, 4, 8, False)  # codes of 3 bits


def _encode_both(k, v, key_bits, value_bits, group, per_token, monkeypatch, codebook="uniform"):
    """KIVI storage written by the kernel (``auto``) and by the torch path (``never``) through the encode a layer
    calls, each into views of longer tensors that must not be written past."""
    codec = KiviCodec(value_bits, group, None, "token" if per_token else "channel", key_bits, codebook)
    like = codec.like(k, v)
    stored = []
    for mode in ("auto", "never"):
        monkeypatch.setattr(cpu_native, "NATIVE_CPU", mode)
        rows = {n: k.shape[2] // codec.units[n] for n in like}
        full = {n: torch.full((*x.shape[:2], rows[n] + 3, x.shape[3]), 7, dtype=x.dtype) for n, x in like.items()}
        views = {n: full[n][:, :, : rows[n]] for n in like}
        kivi._encode(k, v, *(views[n] for n in kivi._STORED), key_bits, value_bits, group, per_token, codebook)
        assert all((full[n][:, :, rows[n] :] == 7).all() for n in like), "wrote past the view"
        stored.append(views)
    return stored


def _values(kind: str, generator) -> torch.Tensor:
    x = torch.randn(B, H, 32, 64, generator=generator) * torch.linspace(0.2, 6, 64)  # channels of unlike ranges
    if kind == "ties":  # every value on a half step of its group's grid: rounding half to even decides
        x = torch.randint(0, 13, x.shape, generator=generator).float() * 0.25
    elif kind == "constant groups":
        x[:, :, :8] = 1.5
        x[..., :8] = -2.0
    elif kind == "subnormal":  # spreads whose scale underflows: the smallest positive scale, stepped up to cover
        x = x * 1e-44
    elif kind == "huge":
        x = x * 1e37
    return x


@pytest.mark.parametrize("bits", [2, 3, 4])
@pytest.mark.parametrize("key_axis", ["channel", "token"])
@pytest.mark.parametrize("kind", ["normal", "ties", "constant groups", "subnormal", "huge"])
def test_the_encoder_equals_the_torch_encode_bit_for_bit(bits, key_axis, kind, monkeypatch):
    g = torch.Generator().manual_seed(bits)
    k, v = _values(kind, g), _values(kind, g).flip(-1)
    native, reference = _encode_both(k, v, bits, bits, 8, key_axis == "token", monkeypatch)
    for name in kivi._STORED:
        assert torch.equal(native[name], reference[name]), name


def test_the_encoder_takes_other_widths_groups_and_mixed_bits(monkeypatch):
    g = torch.Generator().manual_seed(3)
    for width, group, key_bits, value_bits in [(128, 32, 4, 2), (96, 32, 3, 3), (32, 16, 2, 4)]:
        k, v = (torch.randn(1, 2, 2 * group, width, generator=g) for _ in "kv")
        native, reference = _encode_both(k, v, key_bits, value_bits, group, False, monkeypatch)
        assert all(torch.equal(native[n], reference[n]) for n in kivi._STORED), (width, group)


@pytest.mark.parametrize("case", ["nan", "inf", "lloyd codebook", "float16"])
def test_what_the_encoder_does_not_take_is_encoded_in_torch(case, monkeypatch):
    """Values that are not finite (the torch path masks them), codebooks and 16-bit K/V: the layer's storage is what
    the torch path writes."""
    g = torch.Generator().manual_seed(0)
    k, v = torch.randn(1, 2, 16, 64, generator=g), torch.randn(1, 2, 16, 64, generator=g)
    if case in ("nan", "inf"):
        v[0, 1, 5, 3] = float(case)
    if case == "float16":
        k, v = k.half(), v.half()
    codebook = "lloyd" if case == "lloyd codebook" else "uniform"
    native, reference = _encode_both(k, v, 2, 2, 8, False, monkeypatch, codebook)
    assert all(torch.equal(native[n], reference[n]) for n in kivi._STORED)


def test_the_encoder_declines_what_it_cannot_write():
    """It checks no bounds itself: destinations of another shape, tokens that are not whole key groups, 16-bit
    inputs and values that are not finite are declined (False) before or instead of a result."""
    x = torch.randn(1, 2, 16, 64)
    codes, per_token, per_group = (torch.empty(1, 2, 16, 16, dtype=torch.uint8), torch.empty(1, 2, 16, 8),
                                   torch.empty(1, 2, 2, 64))  # fmt: skip
    assert cpu_native.encode_kivi(x, codes, per_token, per_token.clone(), 2, 8, True)
    assert cpu_native.encode_kivi(x, codes, per_group, per_group.clone(), 2, 8, False)
    assert not cpu_native.encode_kivi(x, codes, per_group[:, :, :1], per_group, 2, 8, False)  # a key group short
    assert not cpu_native.encode_kivi(x, codes[:, :, :8], per_token, per_token, 2, 8, True)
    assert not cpu_native.encode_kivi(x, codes, per_token, per_token, 4, 8, True)  # codes 2 bits wide
    assert not cpu_native.encode_kivi(x[:, :, :12], codes[:, :, :12], per_group[:, :, :1], per_group[:, :, :1], 2, 8,
                                      False)  # 12 tokens: not whole groups of 8  # fmt: skip
    assert not cpu_native.encode_kivi(x.half(), codes, per_token, per_token, 2, 8, True)
    x[0, 0, 3, 3] = float("nan")
    assert not cpu_native.encode_kivi(x, codes, per_token, per_token, 2, 8, True)


def _append_both(k, v, group, monkeypatch):
    """int8 codes and scales stored by the append op with the kernel (``auto``) and in torch (``never``), each into
    views of longer token buffers that must not be written past."""
    stored = []
    for mode in ("auto", "never"):
        monkeypatch.setattr(cpu_native, "NATIVE_CPU", mode)
        b, h, n, d = k.shape
        full = [torch.full((b, h, n + 3, d), 7, dtype=torch.int8) for _ in "kv"]
        full += [torch.full((b, h, n + 3, d // group), 7.0) for _ in "kv"]
        views = [x[:, :, :n] for x in full]
        append_kv(k, v, *views, None, 0, 1, None, None)
        assert all((x[:, :, n:] == 7).all() for x in full), "wrote past the view"
        stored.append(views)
    return stored


@pytest.mark.parametrize("kind", ["normal", "ties", "constant groups", "subnormal", "huge", "nan"])
@pytest.mark.parametrize("group", [64, 16])
def test_the_int8_encoder_equals_the_torch_encode_bit_for_bit(kind, group, monkeypatch):
    g = torch.Generator().manual_seed(group)
    k, v = _values(kind if kind != "nan" else "normal", g), _values(kind if kind != "nan" else "normal", g)
    if kind == "ties":  # each group's largest value 127 steps of 0.25: the rest on half steps, rounded half to even
        k = torch.randint(-254, 255, k.shape, generator=g).float() * 0.125
        k[..., ::group] = 31.75
    if kind == "nan":  # not finite: the kernel declines and torch encodes it (NaN stored as 0)
        v[1, 2, 7, 5] = float("nan")
        assert not cpu_native.encode_int8(
            v, torch.empty(v.shape, dtype=torch.int8), torch.empty(*v.shape[:3], 64 // group), group
        )
    native, reference = _append_both(k, v, group, monkeypatch)
    assert all(torch.equal(a, b) for a, b in zip(native, reference))


@pytest.mark.parametrize("group", [None, 16])
@pytest.mark.parametrize("width", [64, 16])
def test_rotated_int8_codes_decode_as_torch_decodes_them(group, width, monkeypatch):
    """Hadamard-rotated int8 codes (an int8 residual's under the int3 / int2 defaults) decoded and rotated back by the
    kernel: torch's decode to float32 rounding (the kernel's butterfly against torch's products)."""
    if group is not None and group > width:
        pytest.skip("a group wider than the head")
    codec = codec_for(8, group_size=group, rotate=True)
    g = torch.Generator().manual_seed(width)
    k, v = (torch.randn(B, H, T, width, generator=g) * torch.linspace(0.2, 6, width) for _ in "kv")
    native, reference, served = _decode_both(codec, codec.encode(k, v), width, None, monkeypatch)
    assert served
    _assert_equal_to_rounding(native, reference)


def test_what_the_int8_decoder_does_not_read_is_refused_untouched():
    codes = torch.randint(-127, 128, (B, H, T, 24), dtype=torch.int8)
    scale = torch.rand(B, H, T, 1)
    out = torch.full((B, H, T, 24), 7.0)
    assert not cpu_native.decode_int8_rotated(codes, scale, out, 24)  # 24 channels: not a power of two
    wide = codes.repeat(1, 1, 1, 2)[..., :32], torch.full((B, H, T, 32), 7.0)
    assert not cpu_native.decode_int8_rotated(wide[0], scale.half(), wide[1], 32)  # 16-bit scales
    assert not cpu_native.decode_int8_rotated(wide[0], scale, wide[1].half(), 32)
    assert not cpu_native.decode_int8_rotated(wide[0][:, :, :8], scale, wide[1], 32)  # codes shorter than the output
    assert not cpu_native.decode_int8_rotated(wide[0], scale, wide[1], 24)  # 32 channels are not groups of 24
    assert (out == 7).all() and (wide[1] == 7).all()
    assert not codec_for(8).decode_native({"k": codes, "ks": scale, "v": codes, "vs": scale}, out, out, None, False)
    assert cpu_native.decode_int8_rotated(
        wide[0].contiguous(), scale, wide[1], 32
    )  # the same, contiguous codes: served


def test_threads_split_the_tokens_and_agree(monkeypatch):
    codec = RotatedCodec(KiviCodec(3, 8, None))
    g = torch.Generator().manual_seed(1)
    parts = codec.encode(torch.randn(B, H, T, 64, generator=g), torch.randn(B, H, T, 64, generator=g))
    one = (torch.empty(B, H, T, 64), torch.empty(B, H, T, 64))
    codec.decode(parts, *one, (rotary(64), 2))
    monkeypatch.setattr(cpu_native, "PARALLEL_FLOATS", 1)
    torch.set_num_threads(2)
    try:
        split = (torch.empty(B, H, T, 64), torch.empty(B, H, T, 64))
        codec.decode(parts, *split, (rotary(64), 2))
    finally:
        torch.set_num_threads(1)
    for a, b in zip(one, split):
        torch.testing.assert_close(a, b, rtol=0, atol=0)  # each token decoded by the same code, whichever thread


def test_threads_split_the_encode_and_agree(monkeypatch):
    g = torch.Generator().manual_seed(2)
    k, v = (torch.randn(B, H, 32, 64, generator=g) for _ in "kv")
    one, _ = _encode_both(k, v, 3, 3, 8, False, monkeypatch)
    monkeypatch.setattr(cpu_native, "PARALLEL_FLOATS", 1)
    torch.set_num_threads(2)
    try:
        split, _ = _encode_both(k, v, 3, 3, 8, False, monkeypatch)
    finally:
        torch.set_num_threads(1)
    assert all(torch.equal(one[n], split[n]) for n in kivi._STORED)


@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="x86 instruction-set flags")
@pytest.mark.parametrize("flags", ["-mno-avx512f", "-mno-avx -mno-avx2 -mno-fma -mno-avx512f"], ids=["avx2", "sse"])
def test_narrower_vector_builds_agree(flags, tmp_path, monkeypatch):
    """The library built for 8-lane vectors (AVX2) and for SSE's 4-lane registers (what another machine's -march
    gives) decodes like the torch path and encodes the same bytes."""
    monkeypatch.setenv("CC", f"{shlex.join(cpu_native._compiler())} {flags}")
    monkeypatch.setenv("HF_KVCACHE_CACHE", str(tmp_path))
    cpu_native._library.cache_clear()
    try:
        assert cpu_native.status().startswith("built: ")
        g = torch.Generator().manual_seed(4)
        for width, group, bits in [(64, 16, 3), (128, 32, 2), (96, 32, 4), (8, 8, 3)]:
            codec = RotatedCodec(KiviCodec(bits, group, None)) if width != 96 else KiviCodec(bits, group, None)
            k, v = (torch.randn(B, H, 2 * group, width, generator=g) for _ in "kv")
            native, reference, served = _decode_both(codec, codec.encode(k, v), width, (rotary(width), 1), monkeypatch)
            assert served
            _assert_equal_to_rounding(native, reference)
            native, reference = _encode_both(k, v, bits, bits, group, False, monkeypatch)
            assert all(torch.equal(native[n], reference[n]) for n in kivi._STORED)
            native, reference = _append_both(k, v, group, monkeypatch)
            assert all(torch.equal(a, b) for a, b in zip(native, reference))
    finally:
        cpu_native._library.cache_clear()


def test_a_machine_that_cannot_build_it_decodes_in_torch_and_says_why(tmp_path, monkeypatch):
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    monkeypatch.setenv("HF_KVCACHE_CACHE", str(tmp_path / "cache"))
    cpu_native._library.cache_clear()
    try:
        assert cpu_native.status().startswith("unavailable: ")
        assert "no-such-cc" in cpu_native.status()
        codec = RotatedCodec(KiviCodec(3, 8, None))
        parts = codec.encode(torch.randn(1, 1, 8, 64), torch.randn(1, 1, 8, 64))
        k, v = torch.empty(1, 1, 8, 64), torch.empty(1, 1, 8, 64)
        assert not codec.inner.decode_native(parts, k, v, None, rotate=True)
        codec.decode(parts, k, v)  # the torch path
        assert k.isfinite().all()
    finally:
        cpu_native._library.cache_clear()
        cpu_native._WHY_NOT.clear()
    monkeypatch.setattr(cpu_native, "NATIVE_CPU", "never")
    assert cpu_native.status() == "disabled: HF_KVCACHE_NATIVE_CPU=never"


def test_a_bad_switch_is_a_clear_error(monkeypatch):
    monkeypatch.setattr(cpu_native, "NATIVE_CPU", "off")
    codec = RotatedCodec(KiviCodec(3, 8, None))
    parts = codec.encode(torch.randn(1, 1, 8, 64), torch.randn(1, 1, 8, 64))
    message = "HF_KVCACHE_NATIVE_CPU must be one of auto, never, got 'off'"
    with pytest.raises(ValueError, match=message):
        codec.decode(parts, torch.empty(1, 1, 8, 64), torch.empty(1, 1, 8, 64))
    with pytest.raises(ValueError, match=message):
        cpu_native.status()


@pytest.mark.parametrize(
    "spec",
    [
        "int3:residual_length=4:group_size=8",
        "int2:residual_length=4:group_size=8",
        "int4:residual_length=4",
        # the rotated int8 residual read by the kernel, and decoded by torch as its tokens leave for the codes
        "int2:residual_length=4:group_size=8:residual_bits=8",
    ],
)
@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_a_model_scores_the_same_through_either_decode(spec, family, monkeypatch):
    """Teacher-forced logits of a left-padded batch under sdpa with the defaults' layouts (int3 / int2:
    Hadamard-rotated codes of pre-RoPE keys, 4 sinks), the history decoded by the kernel or in torch at every step.

    With an int8 residual the two decodes of the residual differ in float rounding (to float32 rounding, the kernel
    test), and a later token's keys and values, computed through them, can land an int8 step away where a value sits
    on a rounding boundary: on an AMD EPYC, tiny Llama's unpadded row agrees to 1e-7 for 30 steps, then by 4e-3 (one
    step's effect). So that layout is held to a bound one int8 step fits, not to rounding: bit-identical decodes
    (the kernel in torch's order of operations) are what would make it exact on every CPU."""
    model = tiny_model(family, "sdpa")
    ids = torch.randint(3, model.config.vocab_size, (2, 48), generator=torch.Generator().manual_seed(5))
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    logits = []
    for mode in ("auto", "never"):
        monkeypatch.setattr(cpu_native, "NATIVE_CPU", mode)
        cache = make_cache(spec, model)
        with torch.no_grad():
            out = [model(ids[:, :8], attention_mask=mask[:, :8], past_key_values=cache).logits[:, -1]]
            for t in range(8, ids.shape[1]):
                step = model(ids[:, t : t + 1], attention_mask=mask[:, : t + 1], past_key_values=cache)
                out.append(step.logits[:, -1])
        assert sum(getattr(layer, "quantized_tokens", 0) for layer in cache.layers) > 0
        logits.append(torch.stack(out, 1))
    bound = 1e-2 if "residual_bits=8" in spec else 1e-4
    torch.testing.assert_close(logits[0], logits[1], rtol=bound, atol=bound)

"""Every decode-attention kernel against its pure-torch reference and against sdpa over the dequantized K/V.

The Triton kernels run here under ``TRITON_INTERPRET=1`` on CPU tensors (conftest sets it when there is no GPU), in
float32 and float16; on a GPU the same tests compile them for real, bfloat16 included.
"""

from __future__ import annotations

import pytest
import torch
from models import rotary

from hf_kvcache.formats import (
    DenseSegment,
    Fp8Codec,
    Fp8Segment,
    Int8Codec,
    Int8Segment,
    KiviCodec,
    KiviSegment,
    KVHandle,
    PagedSegment,
    decode_attention,
)
from hf_kvcache.kernels import combine, partial, torch_decode
from hf_kvcache.paging import PAD_BLOCK

triton_decode = pytest.importorskip("hf_kvcache.kernels.triton_decode", reason="needs triton")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# kivi{K}: K-bit keys and values; kivi{K}v{V}: K-bit keys beside V-bit values; -lloyd: the Lloyd-Max codebook.
# (2-bit codebook tables are read in the rotated and pre-RoPE tests: the kernel's table read is width-independent.)
KINDS = ("dense", "int8", "int8-g16", "fp8", "kivi4", "kivi3", "kivi2", "kivi4v2", "kivi2v3", "kivi4v3-lloyd", "paged",
         "paged-int8")  # fmt: skip


def _kivi_codec(kind: str, group: int, scale_dtype=torch.float32) -> KiviCodec:
    """The KIVI codec a kind names (``kivi4``, ``kivi4v2``, ``kivi2-lloyd``, with or without a ``-rot`` suffix)."""
    widths = kind.removeprefix("kivi").split("-")[0].split("v")
    codebook = "lloyd" if "-lloyd" in kind else "uniform"
    return KiviCodec(int(widths[-1]), group, scale_dtype, key_bits=int(widths[0]), codebook=codebook)


def _segment(kind: str, k: torch.Tensor, v: torch.Tensor, start: int = 0, block_size: int = 5):
    """A segment of ``kind`` holding ``k``/``v`` ``(B, H, T, D)``, and the K/V it really stores (dequantized)."""
    if kind == "dense":
        seg = DenseSegment(k, v)
    elif kind.startswith("int8"):
        codec = Int8Codec(16 if kind == "int8-g16" else None, torch.float32)
        p = codec.encode(k.float(), v.float())
        seg = Int8Segment(p["k"], p["ks"], p["v"], p["vs"])
    elif kind == "fp8":
        p = Fp8Codec().encode(k.float(), v.float())
        seg = Fp8Segment(p["k"], p["ks"], p["v"], p["vs"])
    elif kind.startswith("kivi"):
        group = 16
        t = k.shape[2] - k.shape[2] % group
        codec = _kivi_codec(kind, group)
        seg = codec.segment(codec.encode(k[:, :, :t].float(), v[:, :, :t].float()), start)
        assert isinstance(seg, KiviSegment) and seg.length == t - start
    else:
        seg = _paged(k, v, block_size, int8=kind == "paged-int8")
    keys, values = seg.read(0, seg.length)
    return seg, keys, values


def _paged(k, v, block_size, int8=False, pad_blocks=0, head_major=False):
    """Scatter ``k``/``v`` into a shuffled pool with ``pad_blocks`` leading padding entries in row 0; slot-major
    ``(slots, H, D)`` in memory, or head-major as :class:`~hf_kvcache.layers.paged.PagedStorage` lays its pools out
    (the same shape, a view of ``(H, slots, D)``)."""
    b, h, t, d = k.shape
    blocks = -(-t // block_size)
    ids = torch.randperm(b * blocks + 3, generator=torch.Generator().manual_seed(0))[: b * blocks].view(b, blocks)
    table = ids.to(torch.int32).clone()
    table[0, :pad_blocks] = PAD_BLOCK
    slots_total = (b * blocks + 3) * block_size
    if head_major:
        pool_k = torch.zeros((h, slots_total, d), dtype=k.dtype).transpose(0, 1)
    else:
        pool_k = torch.zeros((slots_total, h, d), dtype=k.dtype)
    pool_v = torch.zeros_like(pool_k)
    slots = (ids.unsqueeze(-1) * block_size + torch.arange(block_size)).flatten(1)[:, :t]  # (B, T)
    pool_k[slots.flatten()] = k.transpose(1, 2).reshape(-1, h, d)
    pool_v[slots.flatten()] = v.transpose(1, 2).reshape(-1, h, d)
    if not int8:
        return PagedSegment(pool_k.to(k.device), pool_v.to(k.device), table.to(k.device), block_size, t)
    kq, ks = Int8Codec(None, torch.float32)._encode_one(pool_k.float().unsqueeze(0))
    vq, vs = Int8Codec(None, torch.float32)._encode_one(pool_v.float().unsqueeze(0))
    return PagedSegment(kq[0], vq[0], table, block_size, t, ks[0, ..., 0], vs[0, ..., 0])


def _sdpa(query, keys, values, mask, scaling, softcap=0.0):
    """Plain attention over dense K/V (the independent check): repeat KV heads, mask, softmax."""
    g = query.shape[1] // keys.shape[1]
    k, v = keys.repeat_interleave(g, 1), values.repeat_interleave(g, 1)
    scores = query.float() @ k.transpose(-1, -2) * scaling
    if softcap:
        scores = softcap * torch.tanh(scores / softcap)
    if mask is not None:
        scores = scores.masked_fill(~mask[:, None], float("-inf"))
    return (scores.softmax(-1) @ v).transpose(1, 2)


def _case(kind, length=300, q_len=1, gqa=4, head_dim=64, dtype=torch.float32, padded=False, seed=0):
    g = torch.Generator().manual_seed(seed)
    b, hkv = 2, 2
    query = torch.randn(b, hkv * gqa, q_len, head_dim, generator=g).to(dtype)
    k = torch.randn(b, hkv, length, head_dim, generator=g).to(dtype)
    v = torch.randn(b, hkv, length, head_dim, generator=g).to(dtype)
    seg, keys, values = _segment(kind, k, v)
    mask = torch.ones(b, q_len, seg.length, dtype=torch.bool)
    if padded:
        mask[1, :, : min(7, seg.length - 1)] = False  # a left-padded row
    # The new tokens' causal mask: query i sees every token but the last q_len - 1 - i.
    for i in range(q_len - 1):
        mask[:, i, seg.length - (q_len - 1 - i) :] = False
    return query, seg, keys, values, mask


SLOW = pytest.mark.slow  # the full run only (tests/conftest.py: the fast tier)


def _slow_unless(fast: bool) -> tuple:
    return () if fast else (SLOW,)


# The interpreter cannot run bfloat16 (see the module docstring); compiled kernels on CUDA are checked in it too.
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if DEVICE == "cuda" else [])
DTYPE_IDS = ["fp32", "fp16"] + (["bf16"] if DEVICE == "cuda" else [])


def _two_query_mask(length: int, pad: int) -> torch.Tensor:
    """``(2, 2, length)``: row 1 left-padded by ``pad`` tokens, query token 0 not seeing the last token (causal)."""
    mask = torch.ones(2, 2, length, dtype=torch.bool)
    mask[1, :, :pad] = False
    mask[:, 0, -1] = False
    return mask


def _close(a, b, dtype):
    tol = {torch.float16: 2e-3, torch.bfloat16: 1.6e-2}.get(dtype, 2e-5)
    scale = max(1.0, float(b.abs().max()))
    torch.testing.assert_close(a.float(), b.float(), rtol=tol, atol=tol * scale)


def _triton(query, seg, mask, softcap, splits):
    """The segment through the Triton kernel as its format describes and plans the launch; the reference where the
    format says the kernel does not read it (as :func:`hf_kvcache.formats.launch`, without its fallback on failure)."""
    storage = seg.kernel_storage()
    plan = None if storage is None else seg.launch_plan(query, mask)
    if plan is None:
        return torch_decode.partial(query, seg, mask, 0.125, softcap, splits)
    return triton_decode.triton_partial(query, storage, plan, mask, 0.125, softcap, splits)


def _run(query, seg, mask, splits, softcap=0.0):
    ref = combine([partial(query, seg, mask, 0.125, softcap, splits)], dtype=torch.float32)
    tri = combine([_triton(query, seg, mask, softcap, splits)], dtype=torch.float32)
    return ref, tri


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_kernel_equals_reference_and_sdpa(kind, dtype):
    query, seg, keys, values, mask = _case(kind, dtype=dtype, padded=True)
    ref, tri = _run(query, seg, mask, splits=3)
    _close(tri, ref, dtype)
    _close(ref, _sdpa(query, keys, values, mask, 0.125), dtype)


SHAPES = {  # id: (tokens, query tokens, query heads per KV head, head_dim)
    "1tok": (1, 1, 4, 64),
    "63tok-mha-d80": (63, 1, 1, 80),
    "130tok-q5-d96": (130, 5, 2, 96),
    "300tok-q16-gqa8-d128": (300, 16, 8, 128),
    "97tok-d256": (97, 3, 4, 256),
    "1200tok": (1200, 1, 4, 64),  # a long history: many tiles per split
}


@pytest.mark.parametrize(
    "kind, length, q_len, gqa, head_dim",
    [
        pytest.param(kind, *shape, id=f"{kind}-{name}", marks=_slow_unless(shape[0] <= 1000))
        for kind in ("dense", "int8", "kivi4", "paged")
        for name, shape in SHAPES.items()
        if not (kind == "kivi4" and shape[0] < 16)  # a KIVI segment holds whole key groups of 16 tokens
    ],
)
def test_kernel_shapes(kind, length, q_len, gqa, head_dim):
    query, seg, keys, values, mask = _case(kind, length, q_len, gqa, head_dim, padded=length > 8)
    ref, tri = _run(query, seg, mask, splits=4 if length > 200 else 1)
    _close(tri, ref, torch.float32)
    _close(ref, _sdpa(query, keys, values, mask, 0.125), torch.float32)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_one_query_token_reads_any_mask_row(kind, dtype):
    """With one query token the kernel loads the mask as one row per batch row and broadcasts it over the heads:
    exact for any mask, holes included (not only left padding), and a row that sees nothing gives zeros."""
    g = torch.Generator().manual_seed(3)
    query, seg, keys, values, _ = _case(kind, 150, 1, 4, 64, dtype=dtype)
    mask = torch.rand(2, 1, seg.length, generator=g) > 0.4
    mask[0, :, 40:90] = False  # a wide hole: whole tiles masked
    mask[1] = False  # a row that attends to nothing (one launch for both rows): zeros from the kernel and the reference
    ref, tri = _run(query, seg, mask, splits=3)
    _close(tri, ref, dtype)
    _close(ref[:1], _sdpa(query[:1], keys[:1], values[:1], mask[:1], 0.125), dtype)
    assert tri[1].abs().max() == 0


def test_softcap_and_sinks():
    query, seg, keys, values, mask = _case("int8", 200, 2)
    ref, tri = _run(query, seg, mask, splits=2, softcap=3.0)
    _close(tri, ref, torch.float32)
    _close(ref, _sdpa(query, keys, values, mask, 0.125, softcap=3.0), torch.float32)
    sinks = torch.randn(query.shape[1])
    got = decode_attention(query, KVHandle((seg,)), mask[:, None], 0.125, 0.0, sinks)
    g = query.shape[1] // keys.shape[1]
    scores = query @ keys.repeat_interleave(g, 1).transpose(-1, -2) * 0.125
    scores = scores.masked_fill(~mask[:, None], float("-inf"))
    scores = torch.cat([scores, sinks.view(1, -1, 1, 1).expand(*scores.shape[:3], 1)], -1)
    want = (scores.softmax(-1)[..., :-1] @ values.repeat_interleave(g, 1)).transpose(1, 2)
    _close(got, want, torch.float32)


def test_kivi_segment_starting_inside_a_key_group():
    """A sliding layer's visible tokens may start inside a key group: scales are indexed by absolute token."""
    k, v = torch.randn(1, 2, 64, 64), torch.randn(1, 2, 64, 64)
    seg, _, _ = _segment("kivi2", k, v, start=5)
    query = torch.randn(1, 4, 1, 64)
    ref, tri = _run(query, seg, None, splits=2)
    _close(tri, ref, torch.float32)


@pytest.mark.parametrize(
    "bits, group, head_dim, dtype",
    [
        pytest.param(
            bits, group, head_dim, dtype, id=f"{bits}-{group}-{head_dim}-{name}", marks=_slow_unless(group in (16, 64))
        )
        for bits in (4, 3, 2)
        for group, head_dim in ((16, 64), (32, 96), (64, 64), (128, 128), (8, 64), (24, 96))
        # the 16-bit path (codes and values dequantized in the model's dtype) for every group size at 4 bits and
        # every width at one group size; float32 everywhere
        for dtype, name in zip(DTYPES, DTYPE_IDS)
        if dtype == torch.float32 or bits == 4 or group == 32
    ],
)
def test_kivi_group_sizes(bits, group, head_dim, dtype):
    """Key groups of 16-128 tokens (powers of two) take one group per tile with the channel scales folded into the
    query; other sizes (8, 24) dequantize per element. Both equal the reference, from a start inside a key group and
    over several splits."""
    g = torch.Generator().manual_seed(group + head_dim + bits)
    t = 2 * 128 - 2 * 128 % group  # two of the largest groups: a start inside the first, several splits
    k, v = torch.randn(2, 2, t, head_dim, generator=g), torch.randn(2, 2, t, head_dim, generator=g)
    codec = KiviCodec(bits, group, torch.float32)
    p = codec.encode(k, v)
    start = group // 2 + 3
    seg = KiviSegment(bits, bits, group, start, t - start, p["k"], p["ks"], p["kz"], p["v"], p["vs"], p["vz"])
    mask = _two_query_mask(seg.length, 9)
    query = torch.randn(2, 8, 2, head_dim, generator=g).to(dtype)
    ref, tri = _run(query, seg, mask, splits=3)
    _close(tri, ref, dtype)


@pytest.mark.parametrize(
    "bits, group, head_dim, kv_dtype, dtype",
    [
        (2, 16, 64, torch.float32, torch.float32),  # a key group per tile; zero points of keys in float32
        (3, 24, 96, torch.float16, torch.float32),  # every element dequantized; keys' zero points in float16
        (4, 32, 64, torch.float16, torch.float16),  # the 16-bit path: values dequantized in the query's dtype
    ],
    ids=["2-16-fp32", "3-24-fp16zero", "4-32-fp16"],
)
def test_kivi_8bit_scales(bits, group, head_dim, kv_dtype, dtype):
    """8-bit scales (E5M3) and int8 zero points (values; per-channel keys keep a float zero point in the K/V dtype)
    read by the kernel as the reference reads them, and both equal sdpa over the K/V they decode to."""
    from hf_kvcache import quant

    g = torch.Generator().manual_seed(bits + group)
    t = 4 * group
    k = (torch.randn(2, 2, t, head_dim, generator=g) * 3 + 5).to(kv_dtype)  # offset channels: far from 0
    v = torch.randn(2, 2, t, head_dim, generator=g).to(kv_dtype)
    p = KiviCodec(bits, group, quant.E5M3).encode(k, v)
    assert (p["ks"].dtype, p["kz"].dtype, p["vs"].dtype, p["vz"].dtype) == (torch.uint8, kv_dtype, torch.uint8,
                                                                            torch.int8)  # fmt: skip
    start = group // 2 + 1
    seg = KiviSegment(bits, bits, group, start, t - start, p["k"], p["ks"], p["kz"], p["v"], p["vs"], p["vz"])
    keys, values = seg.read(0, seg.length)
    mask = _two_query_mask(seg.length, 5)
    query = torch.randn(2, 8, 2, head_dim, generator=g).to(dtype)
    ref, tri = _run(query, seg, mask, splits=3)
    _close(tri, ref, dtype)
    _close(ref, _sdpa(query.float(), keys, values, mask, 0.125), dtype)


@pytest.mark.parametrize("head_major", [False, True], ids=["slot-major", "head-major"])
@pytest.mark.parametrize("block_size", [1, 5, 16])
def test_paged_kernel_with_padding_blocks_and_any_block_size(block_size, head_major):
    g = torch.Generator().manual_seed(1)
    k, v = torch.randn(2, 2, 77, 64, generator=g), torch.randn(2, 2, 77, 64, generator=g)
    pad = 2 if block_size > 1 else 9
    seg = _paged(k, v, block_size, pad_blocks=pad, head_major=head_major)
    assert seg.k.transpose(0, 1).is_contiguous() == head_major
    mask = torch.ones(2, 1, 77, dtype=torch.bool)
    mask[0, :, : pad * block_size] = False  # row 0's padding blocks are masked, as generate() masks left padding
    query = torch.randn(2, 8, 1, 64, generator=g)
    ref, tri = _run(query, seg, mask, splits=3)
    _close(tri, ref, torch.float32)
    _close(ref, _sdpa(query, k, v, mask, 0.125), torch.float32)


def test_reference_scratch_is_bounded_by_its_chunk(monkeypatch):
    """The reference reads at most TORCH_SCRATCH_BYTES of float32 keys, values and scores per chunk (at least
    TORCH_CHUNK tokens), and a small history in one chunk."""
    from hf_kvcache.kernels import torch_decode

    query, seg, _, _, mask = _case("int8", 2000)
    widths = []
    real = Int8Segment.scores  # one int8 scale per token: codes read, scales folded into the scores and weights
    monkeypatch.setattr(Int8Segment, "scores", lambda self, q, a, b: widths.append(b - a) or real(self, q, a, b))
    partial(query, seg, mask, 0.125, 0.0, 1)
    assert widths == [2000]  # 2 rows x 2 heads x 64 channels: 2,000 tokens are far below the budget
    widths.clear()
    monkeypatch.setattr(torch_decode, "TORCH_SCRATCH_BYTES", 2**20)
    chunk = torch_decode.chunk_tokens(query, 2, 64, 64, minimum=64)
    b, hq, q, _ = query.shape
    assert 4 * b * (2 * 128 + 2 * hq * q) * chunk <= 2**20 and chunk % 64 == 0
    partial(query, seg, mask, 0.125, 0.0, 1, chunk=chunk)
    assert max(widths) == chunk < 2000 and sum(widths) == 2000


@pytest.mark.parametrize("inner", ["int8", "kivi4", "kivi3", "kivi2", "kivi4v2", "kivi3-lloyd"])
@pytest.mark.parametrize(
    "head_dim, dtype",
    # 96 (three 32-wide Hadamard blocks) in float32: the block layout does not depend on the dtype
    [(64, d) for d in DTYPES] + [(96, torch.float32)],
    ids=lambda x: DTYPE_IDS[DTYPES.index(x)] if isinstance(x, torch.dtype) else str(x),
)
def test_rotated_segment_folds_the_rotation(inner, head_dim, dtype):
    """Codes stored Hadamard-rotated (rotate="hadamard") are read in place: the query rotated, each split's
    accumulator rotated back. That equals attention over the decoded, rotated-back K/V (the segment's read), in the
    reference and in the Triton kernel."""
    from hf_kvcache.formats import RotatedCodec, RotatedSegment

    g = torch.Generator().manual_seed(head_dim)
    k, v = torch.randn(2, 2, 160, head_dim, generator=g), torch.randn(2, 2, 160, head_dim, generator=g)
    k[..., 3] *= 20  # an outlier channel, what the rotation is for
    base = Int8Codec(None, torch.float32) if inner == "int8" else _kivi_codec(inner, 16)
    codec = RotatedCodec(base)
    seg = codec.segment(codec.encode(k, v), 0)
    assert isinstance(seg, RotatedSegment) and seg.length == 160
    keys, values = seg.read(0, seg.length)
    mask = torch.ones(2, 3, seg.length, dtype=torch.bool)
    mask[1, :, :9] = False
    mask[:, 0, -2:] = False
    query = torch.randn(2, 8, 3, head_dim, generator=g).to(dtype)
    ref = combine([partial(query, seg, mask, 0.125, 0.0, 3)], dtype=torch.float32)
    plain = combine([partial(query, DenseSegment(keys, values), mask, 0.125, 0.0, 3)], dtype=torch.float32)
    _close(ref, plain, dtype)
    _close(ref, _sdpa(query, keys, values, mask, 0.125), dtype)
    tri = combine([_triton(query, seg, mask, 0.0, 3)], dtype=torch.float32)
    _close(tri, ref, dtype)


# pre-RoPE keys over rotated int8 codes are the reference's (no group tiles): not a kernel case
@pytest.mark.parametrize("inner, pre_rope", [("int8", False), ("kivi2", False), ("kivi2", True)])
def test_rotated_segment_keeps_float16_headroom(inner, pre_rope):
    """The kernel multiplies by a Hadamard rotation's signs (exact) and applies its scale before a float16 tensor holds
    the result: a query of 1,500 in every channel (its product with the signs alone 96,000, past float16's 65,504)
    and keys with a 9,000 outlier channel rotated back per tile (72,000 unscaled) still equal the reference, finite."""
    from hf_kvcache.formats import PreRopeSegment, RotatedCodec

    head_dim = 64
    g = torch.Generator().manual_seed(11)
    k = torch.randn(1, 2, 128, head_dim, generator=g)
    k[..., 3] += 9000
    v = torch.randn(1, 2, 128, head_dim, generator=g)
    base = Int8Codec(None, torch.float32) if inner == "int8" else _kivi_codec(inner, 16)
    codec = RotatedCodec(base)
    seg = codec.segment(codec.encode(k, v), 0)
    if pre_rope:
        seg = PreRopeSegment(seg, rotary(head_dim), 5)
    query = (1500 + torch.randn(1, 8, 1, head_dim, generator=g)).half()
    ref = combine([partial(query, seg, None, 0.125, 0.0, 2)], dtype=torch.float32)
    tri = combine([_triton(query, seg, None, 0.0, 2)], dtype=torch.float32)
    assert torch.isfinite(tri).all()
    _close(tri, ref, torch.float16)


def _pre_rope_segment(inner: str, layout: str, first: int, dtype, head_dim: int, seed: int):
    """Keys stored before RoPE in ``inner``'s format (``-rot``: Hadamard-rotated codes) at positions from ``first``,
    rotary pairs ``layout`` (half, interleaved, or partial: half the channels rotary): the segment, the keys after
    RoPE it stands for, and the generator (for the query)."""
    from hf_kvcache.formats import PreRopeSegment, RotatedCodec
    from hf_kvcache.rope import rotate_positions

    spec = rotary(head_dim, layout)
    g = torch.Generator().manual_seed(seed)
    k, v = torch.randn(2, 2, 96, head_dim, generator=g), torch.randn(2, 2, 96, head_dim, generator=g)
    pre = rotate_positions(k, first, spec, inverse=True)
    if inner == "dense":
        return PreRopeSegment(DenseSegment(pre.to(dtype), v.to(dtype)), spec, first), k, g
    if inner == "fp8":
        base = Fp8Codec()
    elif inner.startswith("int8"):
        base = Int8Codec(None, torch.float32)
    else:
        base = _kivi_codec(inner, 16)
    codec = RotatedCodec(base) if inner.endswith("-rot") else base
    return PreRopeSegment(codec.segment(codec.encode(pre, v), 0), spec, first), k, g


@pytest.mark.parametrize(
    "inner, layout, first, dtype",
    [
        pytest.param(inner, layout, first, dtype, id=f"{dtype_id}-{inner}-{layout}-{first}")
        for inner in ("dense", "int8", "fp8", "kivi4", "kivi3", "kivi2", "kivi4-rot", "kivi2-rot", "kivi4v2-rot")
        + ("int8-rot", "kivi2-lloyd-rot")
        for layout in ("half", "interleaved", "partial")
        # positions past 30,000 (the kernel's own angle reduction) for every format; near 0 for one plain and one
        # rotated format (the angles are computed alike whatever the storage)
        for first in ((37, 30011) if inner in ("dense", "kivi2-rot") else (30011,))
        # 16-bit inputs for the rotate_half layout (the others split pairs alike whatever the dtype)
        for dtype, dtype_id in zip(DTYPES, DTYPE_IDS)
        if dtype == torch.float32 or layout == "half"
    ],
)
def test_pre_rope_segment_turns_keys_per_tile(inner, layout, first, dtype, monkeypatch):
    """Keys stored before RoPE (pre_rope=True) are turned to their positions in the Triton kernel per tile, equal to
    the reference, which turns each chunk it reads, at positions near 0 and past 30,000 (angles the kernel reduces
    itself) (rotate_half and interleaved pairs split in registers; partial
    rotary with each channel's pair loaded beside it). Over Hadamard-rotated KIVI codes (int3 / int2's default) the
    kernel rotates each tile back before turning it, in the same launch (the reference is not called); other rotated
    cases (int8, partial rotary) go to the reference."""
    head_dim = 64
    seg, k, g = _pre_rope_segment(inner, layout, first, dtype, head_dim, seed=7)
    keys, values = seg.read(0, seg.length)
    if inner == "dense":
        _close(keys, k, dtype)  # the round trip: turned back, then forward
    mask = _two_query_mask(seg.length, 5)
    query = torch.randn(2, 8, 2, head_dim, generator=g).to(dtype)
    ref = combine([partial(query, seg, mask, 0.125, 0.0, 2)], dtype=torch.float32)
    if inner.startswith("kivi") and inner.endswith("-rot") and layout != "partial":

        def no_reference(*args, **kwargs):
            raise AssertionError("the Triton kernel handed a rotated pre-RoPE KIVI segment to the reference")

        monkeypatch.setattr(torch_decode, "partial", no_reference)
    tri = combine([_triton(query, seg, mask, 0.0, 2)], dtype=torch.float32)
    monkeypatch.undo()
    _close(tri, ref, dtype)
    _close(ref, _sdpa(query, keys, values, mask, 0.125), dtype)


@pytest.mark.parametrize(
    "inner, layout, dtype",
    # every RoPE layout over int2's codes; 3-bit and mixed widths in the rotate_half layout (the fold is the same)
    [
        (inner, layout, dtype)
        for layout in ("half", "interleaved", "partial")
        for dtype in DTYPES
        for inner in ("kivi2-rot",)
    ]
    + [(inner, "half", dtype) for inner in ("kivi3-rot", "kivi4v2-rot") for dtype in DTYPES],
    ids=lambda x: DTYPE_IDS[DTYPES.index(x)] if isinstance(x, torch.dtype) else str(x),
)
def test_scaled_segment_divides_the_query(inner, layout, dtype, monkeypatch):
    """Smoothed keys (smooth > 0) are stored times per-pair scales; attention reads them with the query divided by
    the scales instead: equal to attention over the keys read back (divided), in the reference, and through the inner
    segment's own Triton launch (rotation and RoPE in registers) fed the divided query, which never reaches the
    reference where the inner segment's kernel reads it."""
    from hf_kvcache.formats import PreRopeSegment, RotatedCodec
    from hf_kvcache.formats.scaled import ScaledSegment, scale_keys, scale_query, smoothing_scales
    from hf_kvcache.rope import rotate_positions

    head_dim, first = 64, 37
    spec = rotary(head_dim, layout)
    g = torch.Generator().manual_seed(13)
    k, v = torch.randn(2, 2, 96, head_dim, generator=g), torch.randn(2, 2, 96, head_dim, generator=g)
    k[..., 5] += 30.0  # an offset channel: the scales move resolution to it
    pre = rotate_positions(k, first, spec, inverse=True)
    scales = smoothing_scales(pre, 1.0, spec)
    codec = RotatedCodec(_kivi_codec(inner.removesuffix("-rot"), 16))
    inner_seg = PreRopeSegment(codec.segment(codec.encode(scale_keys(pre, scales), v), 0), spec, first)
    scaled = ScaledSegment(inner_seg, scales, scales.reciprocal().to(dtype))
    keys, values = scaled.read(0, scaled.length)
    assert scales.shape == (2, 2, head_dim)  # per row and KV head: the query's rows are divided each by its own
    _close(keys, inner_seg.read_keys(0, scaled.length) / scales[:, :, None], torch.float32)
    mask = _two_query_mask(scaled.length, 5)
    query = torch.randn(2, 8, 2, head_dim, generator=g).to(dtype)
    ref = combine([partial(query, scaled, mask, 0.125, 0.0, 2)], dtype=torch.float32)
    plain = combine([partial(query, DenseSegment(keys, values), mask, 0.125, 0.0, 2)], dtype=torch.float32)
    _close(ref, plain, dtype)
    _close(ref, _sdpa(query, keys, values, mask, 0.125), dtype)
    if layout != "partial":  # the inner kernel reads rotated pre-RoPE KIVI tiles itself

        def no_reference(*args, **kwargs):
            raise AssertionError("the Triton kernel handed the scaled segment's inner segment to the reference")

        monkeypatch.setattr(torch_decode, "partial", no_reference)
    tri = combine([_triton(scale_query(query, scaled.query_scale), inner_seg, mask, 0.0, 2)], dtype=torch.float32)
    monkeypatch.undo()
    _close(tri, ref, dtype)


@pytest.mark.parametrize("inner", ["dense", "int8", "kivi3", "kivi2-rot"])
@pytest.mark.parametrize("layout", ["half", "interleaved"])
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_pre_rope_keys_turned_from_the_angle_table(inner, layout, dtype):
    """Launches planned with ``angle_table`` read each tile's cosines and sines from the rotation's table
    (:func:`hf_kvcache.rope.angle_table`, the reference's own) instead of computing them: equal to the reference at
    positions past 30,000, and the table is the one the reference turns keys with."""
    from hf_kvcache.rope import angle_table

    head_dim, first = 64, 30011
    seg, _, g = _pre_rope_segment(inner, layout, first, dtype, head_dim, seed=5)
    spec = seg.rotary
    mask = _two_query_mask(seg.length, 5)
    query = torch.randn(2, 8, 2, head_dim, generator=g).to(dtype)
    ref = combine([partial(query, seg, mask, 0.125, 0.0, 2)], dtype=torch.float32)
    storage = seg.kernel_storage()
    plan = seg.launch_plan(query, mask).replace(angle_table=True)
    tri = combine([triton_decode.triton_partial(query, storage, plan, mask, 0.125, 0.0, 2)], dtype=torch.float32)
    _close(tri, ref, dtype)
    table = angle_table(storage.inv_freq, first + seg.length)
    angles = (first + torch.arange(seg.length)).float()[:, None] * spec.inv_freq[None, :]
    assert table.shape[1:] == (2, head_dim // 2)
    assert torch.equal(table[first : first + seg.length, 0], angles.cos())
    assert torch.equal(table[first : first + seg.length, 1], angles.sin())


@pytest.mark.parametrize("kind", ["int8", "paged-int8"])
@pytest.mark.parametrize("q_len, gqa, head_dim", [(1, 4, 64), (5, 2, 96), (16, 8, 128)])
@pytest.mark.parametrize("dtype", [d for d in DTYPES if d != torch.float32], ids=str)
def test_int8_keys_read_as_biased_float16(kind, q_len, gqa, head_dim, dtype):
    """Launches planned with ``half_codes`` read int8 keys as float16 ``1152 + code`` against a float16 query scaled
    by a power of two, ``1152 x`` its sums taken out of the scores: equal to the reference for one and many query
    tokens, paged or not; a query far outside float16's range (bfloat16 models can produce one) stays finite and
    equal, the scaling being exact."""
    query, seg, _, _, mask = _case(kind, length=200, q_len=q_len, gqa=gqa, head_dim=head_dim, dtype=dtype,
                                   padded=True)  # fmt: skip
    storage = seg.kernel_storage()
    plan = seg.launch_plan(query, mask)
    assert not plan.half_codes
    for q in (query, query * 2.0**-10, query * (2.0**20 if dtype == torch.bfloat16 else 2.0**7)):
        ref = combine([partial(q, seg, mask, 0.125, 0.0, 3)], dtype=torch.float32)
        tri = combine([triton_decode.triton_partial(q, storage, plan.replace(half_codes=True), mask, 0.125, 0.0, 3)],
                      dtype=torch.float32)  # fmt: skip
        assert tri.isfinite().all()
        _close(tri, ref, dtype)


def test_biased_float16_codes_are_exact():
    """Every int8 code (-128 to 127) as :func:`_biased_half` writes it is float16 ``1152 + code`` exactly."""
    codes = torch.arange(-128, 128, dtype=torch.int8).view(4, 64)

    @triton_decode.triton.jit
    def kernel(X, Y):
        i = triton_decode.tl.arange(0, 64)
        for r in triton_decode.tl.static_range(4):
            triton_decode.tl.store(Y + r * 64 + i, triton_decode._biased_half(triton_decode.tl.load(X + r * 64 + i)))

    out = torch.empty(4, 64, dtype=torch.float16, device=DEVICE)
    kernel[(1,)](codes.to(DEVICE), out)
    assert torch.equal(out.cpu().float(), codes.float() + 1152)


def _partials(b, hkv, g, q, splits, dv, gen):
    """Random split partials, one row fully masked (m = -inf, l = 0, acc = 0) and one split of another empty."""
    m = torch.randn(b, hkv, g, q, splits, generator=gen) * 3
    l_ = torch.rand(b, hkv, g, q, splits, generator=gen) + 0.1
    acc = torch.randn(b, hkv, g, q, splits, dv, generator=gen)
    m[0, 0, 0, 0], l_[0, 0, 0, 0], acc[0, 0, 0, 0] = float("-inf"), 0.0, 0.0
    m[-1, -1, -1, -1, 0], l_[-1, -1, -1, -1, 0], acc[-1, -1, -1, -1, 0] = float("-inf"), 0.0, 0.0
    return m, l_, acc


@pytest.mark.parametrize("segments", [1, 2, 3, 4])
@pytest.mark.parametrize("sinks", [False, True])
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_combine_kernel_equals_reference(segments, sinks, dtype):
    """The split reduction in one launch over up to four segments' partials (sinks, history, residual, new tokens:
    each with its own split count), with a learned sink logit per head or none, equals torch_decode.combine; the
    custom op the attention calls is that one launch (the reference here)."""
    from hf_kvcache.kernels.ops import combine_partials

    gen = torch.Generator().manual_seed(segments)
    parts = [_partials(2, 2, 4, 3, s, 80, gen) for s in (5, 1, 7, 2)[:segments]]
    sink = torch.randn(8, generator=gen) if sinks else None
    want = combine(parts, sink, dtype)
    got = triton_decode.triton_combine(parts, sink, dtype)
    assert got.dtype == dtype and got.is_contiguous() and got.shape == want.shape == (2, 3, 8, 80)
    _close(got, want, dtype)
    assert bool((got[0, 0, 0] == 0).all()) or sinks  # a row with nothing to attend reads as zeros
    op = combine_partials(*(list(x) for x in zip(*parts)), sink, dtype)
    assert op.is_contiguous()
    _close(op, want, dtype)


def test_combine_kernel_refuses_more_segments_than_it_reads():
    gen = torch.Generator().manual_seed(0)
    parts = [_partials(1, 1, 1, 1, 1, 16, gen)] * (triton_decode.MAX_COMBINED_SEGMENTS + 1)
    with pytest.raises(ValueError, match="1 to 4 segments"):
        triton_decode.triton_combine(parts)


def _tensor_bits(t: torch.Tensor) -> torch.Tensor:
    """``t`` as integers of its width: equal bits, including NaN payloads and signed zeros."""
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.element_size()])


def _awkward_kv(dtype, head_dim, gen):
    """``(2, 3, 5, D)`` keys and values over 12 decades, with NaN, +-inf, a whole token of -inf and of zeros."""
    k = torch.randn(2, 3, 5, head_dim, generator=gen) * torch.logspace(-8, 4, 5).view(1, 1, 5, 1)
    v = torch.randn(2, 3, 5, head_dim, generator=gen) * 3
    k[0, 0, 0, 3], k[0, 0, 1, 5], k[1, 2, 2] = float("nan"), float("inf"), float("-inf")
    v[0, 1, 1] = 0.0
    return k.to(dtype), v.to(dtype)


# bfloat16 scales only on a GPU: the interpreter converts float32 to bfloat16 wrongly (see the module docstring).
SCALE_DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if DEVICE == "cuda" else [])


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("scale_dtype", SCALE_DTYPES, ids=str)
@pytest.mark.parametrize("group, head_dim", [(None, 64), (16, 64), (None, 96), (32, 96), (None, 80)])
def test_append_kernel_encodes_int8_bit_exactly(dtype, scale_dtype, group, head_dim):
    """Quantize-on-append in one launch writes exactly the codes and scales of quant.quantize_symmetric (the
    reference the int8 cache is tested against) into the slots of a layer's buffers, and nothing beside them."""
    from hf_kvcache.kernels.append import _append_torch
    from hf_kvcache.kernels.triton_append import triton_append

    k, v = _awkward_kv(dtype, head_dim, torch.Generator().manual_seed(head_dim))
    width = head_dim // (group or head_dim)
    results = []
    for store in (_append_torch, triton_append):
        kc, vc = torch.zeros(2, 3, 9, head_dim, dtype=torch.int8), torch.zeros(2, 3, 9, head_dim, dtype=torch.int8)
        ks, vs = torch.zeros(2, 3, 9, width, dtype=scale_dtype), torch.zeros(2, 3, 9, width, dtype=scale_dtype)
        store(k, v, kc[:, :, 2:7], vc[:, :, 2:7], ks[:, :, 2:7], vs[:, :, 2:7], None, 0, 1)
        results.append((kc, vc, ks, vs))
    for ref, tri in zip(*results):
        assert torch.equal(_tensor_bits(tri), _tensor_bits(ref))
    assert not results[1][0][:, :, :2].any() and not results[1][0][:, :, 7:].any()  # only the 5 slots written
    # and the reference is the codec's own encoding
    codec = Int8Codec(group, scale_dtype)
    p = codec.encode(k, v)
    assert torch.equal(results[0][0][:, :, 2:7], p["k"]) and torch.equal(results[0][2][:, :, 2:7], p["ks"])


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("head_dim", [64, 96, 128])
def test_append_kernel_rotates_int8_in_the_launch(dtype, head_dim):
    """A rotated int8 residual's append: the tokens times a Hadamard matrix in float32, then int8 per token and head,
    in the one launch: what the reference (the float32 product, then quant.quantize_symmetric) stores, to the float
    rounding of the product's sums (a code one step away where a token lands on a rounding boundary; the scales to
    float32's last bits), the codec's encode equal to its encode_into, and nothing written beside the slots."""
    from hf_kvcache.formats import codec_for, hadamard
    from hf_kvcache.kernels.append import _append_torch
    from hf_kvcache.kernels.triton_append import triton_append

    gen = torch.Generator().manual_seed(head_dim)
    k = (torch.randn(2, 3, 5, head_dim, generator=gen) * torch.logspace(-3, 3, head_dim)).to(dtype)
    v = (torch.randn(2, 3, 5, head_dim, generator=gen) * 3).to(dtype)
    h = hadamard(head_dim, torch.float32, k.device)
    results = []
    for store in (_append_torch, triton_append):
        kc, vc = (torch.zeros(2, 3, 9, head_dim, dtype=torch.int8) for _ in range(2))
        ks, vs = (torch.zeros(2, 3, 9, 1) for _ in range(2))
        store(k, v, kc[:, :, 2:7], vc[:, :, 2:7], ks[:, :, 2:7], vs[:, :, 2:7], None, 0, 1, h, h)
        results.append((kc, vc, ks, vs))
    (ref_kc, ref_vc, ref_ks, ref_vs), (kc, vc, ks, vs) = results
    for ref, got in ((ref_kc, kc), (ref_vc, vc)):
        step = (got.int() - ref.int()).abs()
        assert step.max() <= 1 and (step > 0).float().mean() < 0.01
        assert not got[:, :, :2].any() and not got[:, :, 7:].any()
    torch.testing.assert_close(ks, ref_ks, rtol=1e-6, atol=0)
    torch.testing.assert_close(vs, ref_vs, rtol=1e-6, atol=0)
    # the reference is the rotated codec's encoding; its encode_into stores the same
    codec = codec_for(8, rotate="hadamard")
    want = codec.encode(k, v)
    assert torch.equal(ref_kc[:, :, 2:7], want["k"]) and torch.equal(ref_vs[:, :, 2:7], want["vs"])
    stored = {name: torch.zeros_like(t) for name, t in want.items()}
    codec.encode_into(k, v, stored)
    assert all(torch.equal(stored[name], want[name]) for name in want)
    with pytest.raises(ValueError, match="rotations are contiguous float32"):
        triton_append(k, v, kc[:, :, 2:7], vc[:, :, 2:7], None, None, None, 0, 1, h, h)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("scale_dtype", SCALE_DTYPES, ids=str)
@pytest.mark.parametrize("head_dim", [64, 80])
def test_append_kernel_encodes_fp8_bit_exactly(dtype, scale_dtype, head_dim):
    """fp8 on append, in the same launch as int8's: exactly quant.quantize_fp8's e4m3 bits and scales (torch's
    rounding to nearest even), subnormal codes, -0.0, ties between two codes, NaN / +-inf and a token of zeros
    included, into the slots of a layer's buffers and nothing beside them."""
    from hf_kvcache.kernels.append import _append_torch
    from hf_kvcache.kernels.triton_append import triton_append

    gen = torch.Generator().manual_seed(head_dim)
    k, v = _awkward_kv(dtype, head_dim, gen)
    # one token whose scale is exactly 1 (absmax 448): exact ties (1.0625 lies between codes 1.0 and 1.125; 2^-9 x
    # 2.5 between subnormal codes 2 and 3), values past 2^-6 and just below it, and -0.0
    ties = torch.tensor([448.0, 1.0625, 1.1875, -1.0625, 2.5 * 2**-9, 3.5 * 2**-9, 0.0156, 0.0157, -0.0, 7 * 2**-10])
    v[1, 2, 4] = 0.0
    v[1, 2, 4, : len(ties)] = ties.to(dtype)
    results = []
    for store in (_append_torch, triton_append):
        kc, vc = torch.zeros(2, 3, 9, head_dim, dtype=torch.uint8), torch.zeros(2, 3, 9, head_dim, dtype=torch.uint8)
        ks, vs = torch.zeros(2, 3, 9, 1, dtype=scale_dtype), torch.zeros(2, 3, 9, 1, dtype=scale_dtype)
        store(k, v, kc[:, :, 2:7], vc[:, :, 2:7], ks[:, :, 2:7], vs[:, :, 2:7], None, 0, 1)
        results.append((kc, vc, ks, vs))
    for ref, tri in zip(*results):
        assert torch.equal(_tensor_bits(tri), _tensor_bits(ref))
    assert not results[1][0][:, :, :2].any() and not results[1][0][:, :, 7:].any()  # only the 5 slots written
    p = Fp8Codec(scale_dtype).encode(k, v)  # the reference is the codec's own encoding
    assert torch.equal(results[0][1][:, :, 2:7], p["v"]) and torch.equal(results[0][3][:, :, 2:7], p["vs"])


def _awkward_tokens(dtype, n, head_dim, gen):
    """``(2, 2, n, D)`` keys and values over 12 decades per channel and per token, with NaN, +-inf, subnormals, a
    constant channel and a token of zeros, a channel of only -inf: every branch of the asymmetric encoding."""
    scales = torch.logspace(-8, 4, head_dim).view(1, 1, 1, head_dim)
    k = torch.randn(2, 2, n, head_dim, generator=gen) * scales[..., torch.randperm(head_dim, generator=gen)]
    v = torch.randn(2, 2, n, head_dim, generator=gen) * torch.logspace(-8, 4, n).view(1, 1, n, 1)
    k[0, 0, 0, 3], k[0, 0, 1, 5], k[1, 1, :, 7] = float("nan"), float("inf"), float("-inf")
    k[1, 0, :, 2] = 0.37  # a constant channel: zero spread
    k[0, 1, :, 9] = 1e-41  # subnormal in float32: the scale underflows
    v[0, 1, 1] = 0.0
    v[1, 0, 2, :8] = float("nan")
    v[0, 1, 3, 1], v[1, 1, 0, 4] = float("-inf"), float("inf")
    return k.to(dtype), v.to(dtype)


@pytest.mark.parametrize(
    "bits, group, head_dim, key_axis, codebook, groups",
    [  # groups: key groups encoded (two where the group index must move the codes' and scales' offsets)
        (4, 16, 64, "channel", "uniform", 2),
        pytest.param(3, 8, 64, "channel", "uniform", 1, marks=SLOW),
        pytest.param(2, 24, 96, "channel", "uniform", 1, marks=SLOW),
        (3, 8, 64, "token", "uniform", 1),
        ((4, 2), 16, 64, "channel", "uniform", 1),  # (key bits, value bits)
        pytest.param((2, 3), 8, 64, "token", "uniform", 1, marks=SLOW),
        ((3, 2), 16, 64, "channel", "lloyd", 2),
        pytest.param(4, 8, 64, "token", "lloyd", 1, marks=SLOW),
    ],
)
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_kivi_encode_kernel_is_bit_exact(bits, group, head_dim, key_axis, codebook, groups, dtype):
    """Tokens leaving a KIVI cache's residual are encoded in one launch, bit for bit KiviCodec.encode (codes packed,
    3 bits in two planes; scales and zero points rounded outward in their dtype; with a codebook, each element's
    nearest level), into strided slot views of a layer's storage and nothing beside them. (A group of signed zeros
    may keep either zero as its minimum: compared as values there, as the sign of a zero point changes no decoded
    value.)"""
    _check_kivi_encode(bits, group, head_dim, key_axis, codebook, groups, dtype, None)


@pytest.mark.parametrize(
    "bits, group, key_axis, codebook",
    [(2, 16, "channel", "uniform"), (3, 8, "token", "uniform"), ((4, 2), 16, "channel", "lloyd")],
)
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_kivi_encode_kernel_is_bit_exact_with_8bit_scales(bits, group, key_axis, codebook, dtype):
    """8-bit scales (E5M3: the nearest value keeping the maximum within half a step) and int8 zero points (per-token
    groups), float zero points for per-channel keys: bit for bit the reference too."""
    from hf_kvcache import quant

    _check_kivi_encode(bits, group, 64, key_axis, codebook, 2, dtype, quant.E5M3)


def _check_kivi_encode(bits, group, head_dim, key_axis, codebook, groups, dtype, scale_dtype):
    from hf_kvcache.kernels.triton_append import kivi_encodable, triton_kivi_encode

    key_bits, value_bits = bits if isinstance(bits, tuple) else (bits, bits)
    n = groups * group
    k, v = _awkward_tokens(dtype, n, head_dim, torch.Generator().manual_seed(key_bits + value_bits + group))
    codec = KiviCodec(value_bits, group, scale_dtype, key_axis=key_axis, key_bits=key_bits, codebook=codebook)
    want = codec.encode(k, v)
    assert want["k"].shape[-1] == head_dim * key_bits // 8 and want["v"].shape[-1] == head_dim * value_bits // 8
    assert kivi_encodable(key_bits, value_bits, group, head_dim, head_dim, key_axis == "token")
    # the slots of the middle half of buffers twice as long, as TokenBuffers.reserve hands them out
    bufs = {name: torch.zeros(*t.shape[:2], 2 * t.shape[2], *t.shape[3:], dtype=t.dtype) for name, t in want.items()}
    out = {name: bufs[name][:, :, t.shape[2] // 2 : t.shape[2] // 2 + t.shape[2]] for name, t in want.items()}
    levels = [codec.levels(b, k.device) for b in (key_bits, value_bits)]
    assert (levels[0] is None) == (codebook == "uniform")
    triton_kivi_encode(k, v, out, key_bits, value_bits, group, key_axis == "token", *levels)
    for name in want:
        assert torch.equal(_tensor_bits(out[name] + 0), _tensor_bits(want[name] + 0)), name  # + 0: -0.0 -> 0.0
        rows = want[name].shape[2]
        assert not bufs[name][:, :, : rows // 2].any() and not bufs[name][:, :, rows // 2 + rows :].any(), name


def test_mutating_custom_ops_have_no_defaulted_arguments():
    """torch 2.11 (the lent GPU machines') bumps a mutating custom op's outputs' versions by their position among the
    arguments passed, so a call leaving a defaulted argument out raised IndexError there (every low-bit decode on the
    first GPU run), where newer torch fills the defaults in first: such ops take every argument, every time."""
    import hf_kvcache.kernels  # noqa: F401  (registers the ops)

    mutating = []
    for name in dir(torch.ops.hf_kvcache):
        packet = getattr(torch.ops.hf_kvcache, name)
        if not isinstance(packet, torch._ops.OpOverloadPacket):
            continue
        schema = packet.default._schema
        if any(a.alias_info is not None and a.alias_info.is_write for a in schema.arguments):
            mutating.append(name)
            assert all(not a.has_default_value() for a in schema.arguments), (name, str(schema))
    assert {"append_kv", "encode_kivi"} <= set(mutating)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_append_kernel_copies_full_precision_tokens(dtype):
    """Without scales the append stores keys and values as they are (a residual's or the sinks' buffers), both in one
    launch, into strided slot views and nothing beside them."""
    from hf_kvcache.kernels.triton_append import triton_append

    g = torch.Generator().manual_seed(3)
    k, v = torch.randn(2, 3, 4, 64, generator=g).to(dtype), torch.randn(2, 3, 4, 48, generator=g).to(dtype)
    k_buf, v_buf = torch.zeros(2, 3, 10, 64, dtype=dtype), torch.zeros(2, 3, 10, 48, dtype=dtype)
    triton_append(k, v, k_buf[:, :, 5:9], v_buf[:, :, 5:9])
    assert torch.equal(k_buf[:, :, 5:9], k) and torch.equal(v_buf[:, :, 5:9], v)
    assert not k_buf[:, :, :5].any() and not k_buf[:, :, 9:].any() and not v_buf[:, :, 9:].any()


@pytest.mark.parametrize("head_major", [False, True], ids=["slot-major", "head-major"])
@pytest.mark.parametrize("quantized", [True, False], ids=["int8-pages", "pages"])
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_append_kernel_writes_pages_through_the_block_table(quantized, dtype, head_major):
    """Tokens at positions start.. of each row go to their slots through the block table; a padding entry (a row's
    left padding blocks) stores nothing; the kernel equals the reference bit for bit, into pools laid out slot-major
    or head-major (as the paged cache's)."""
    from hf_kvcache.kernels.append import _append_torch
    from hf_kvcache.kernels.triton_append import triton_append

    k, v = _awkward_kv(dtype, 64, torch.Generator().manual_seed(5))
    if not quantized:
        k = torch.nan_to_num(k)
    table = torch.tensor([[PAD_BLOCK, 3, 0], [2, 5, 4]], dtype=torch.int32)
    results = []
    for store in (_append_torch, triton_append):
        shape = ((3, 24), (0, 1)) if head_major else ((24, 3), (0, 0))  # (dims, the two swapped back)
        pool_k = torch.zeros(*shape[0], 64, dtype=torch.int8 if quantized else dtype).transpose(*shape[1])
        pool_v = torch.zeros_like(pool_k)
        scales = [torch.zeros(*shape[0]).transpose(*shape[1]) for _ in range(2)] if quantized else [None, None]
        store(k, v, pool_k, pool_v, *scales, table, 2, 4)  # positions 2..6: blocks 0 and 1 of each row
        results.append([x for x in (pool_k, pool_v, *scales) if x is not None])
    for ref, tri in zip(*results):
        assert torch.equal(_tensor_bits(tri), _tensor_bits(ref))
    pool_k = results[1][0]
    written = {int(s) for s in pool_k.flatten(1).ne(0).any(1).nonzero()}
    # row 0: positions 2, 3 under the padding entry (not stored), 4..6 in block 3; row 1: block 2 (2, 3), block 5
    assert written == {12, 13, 14, 10, 11, 20, 21, 22}


@pytest.mark.parametrize("kind", ["int8", "kivi4", "paged", "paged-int8"])
def test_kernel_with_64_bit_offsets_equals_reference(kind, monkeypatch):
    """Storage that may pass 2^31 elements compiles the 64-bit offset variant (batch and head offsets, page slots in
    int64), which reads the same as the 32-bit one."""
    query, seg, _, _, mask = _case(kind, 200, 2, padded=True)
    ref, small = _run(query, seg, mask, splits=2)
    monkeypatch.setattr(triton_decode, "_reach", lambda t: 2**31)
    _, large = _run(query, seg, mask, splits=2)
    _close(large, ref, torch.float32)
    torch.testing.assert_close(large, small, rtol=0, atol=0)


def test_reach_counts_the_largest_offset_of_a_view():
    big = torch.empty(2, dtype=torch.int8).expand(2**31 + 5, 2)  # 2^31 rows, no memory behind them: stride 0
    assert triton_decode._reach(big) == 2
    pool = torch.empty(16, 8, 4)
    assert triton_decode._reach(pool[3:5]) == 16 * 8 * 4  # a view: its whole storage can be addressed from its base


@pytest.mark.slow
@pytest.mark.parametrize("bits", [8, 4, 3, 2])
def test_encoders_saturate_scales_past_a_16_bit_dtype_bit_exactly(bits):
    """float32 tokens of up to 1e7 with float16 scales: a scale or zero point past float16's range is stored as its
    largest finite value (the group's extremes clipped, never inf or NaN), by the Triton encoders exactly as by the
    reference; decoding gives finite values within the clipped range."""
    from hf_kvcache.kernels.append import _append_torch
    from hf_kvcache.kernels.triton_append import triton_append, triton_kivi_encode

    g = torch.Generator().manual_seed(bits)
    k = torch.randn(1, 2, 32, 64, generator=g) * torch.logspace(0, 7, 64)
    v = torch.randn(1, 2, 32, 64, generator=g) * torch.logspace(0, 7, 32).view(1, 1, 32, 1)
    if bits == 8:
        results = []
        for store in (_append_torch, triton_append):
            kc, vc = torch.zeros(1, 2, 32, 64, dtype=torch.int8), torch.zeros(1, 2, 32, 64, dtype=torch.int8)
            ks, vs = torch.zeros(1, 2, 32, 1, dtype=torch.float16), torch.zeros(1, 2, 32, 1, dtype=torch.float16)
            store(k, v, kc, vc, ks, vs, None, 0, 1)
            results.append((kc, vc, ks, vs))
        for ref, tri in zip(*results):
            assert torch.equal(_tensor_bits(tri), _tensor_bits(ref))
        scales = results[0][2:]
    else:
        codec = KiviCodec(bits, 16, torch.float16)
        want = codec.encode(k, v)
        got = {name: torch.empty_like(t) for name, t in want.items()}
        triton_kivi_encode(k, v, got, bits, bits, 16, False)
        for name in want:
            assert torch.equal(_tensor_bits(got[name] + 0), _tensor_bits(want[name] + 0)), name
        scales = [want[name] for name in ("ks", "kz", "vs", "vz")]
        keys, values = torch.empty(1, 2, 32, 64), torch.empty(1, 2, 32, 64)
        codec.decode(want, keys, values)
        assert torch.isfinite(keys).all() and torch.isfinite(values).all()
    assert all(torch.isfinite(s).all() for s in scales) and any((s.abs() == 65504).any() for s in scales)


# Handles as the caches' layers return them: plain segments, transforms their format reads in its own launch
# (KIVI's rotation and pre-RoPE keys, int8's rotation), and one it does not (fp8's rotation, folded around its op).
HANDLE_SPECS = ["int8", "int4", "int3", "int2:rotate=none:sinks=0:pre_rope=false", "paged:bits=8", "fp8",
                "int8:rotate=hadamard", "fp8:rotate=hadamard"]  # fmt: skip


@pytest.mark.parametrize("spec", HANDLE_SPECS)
def test_decode_attention_hands_segments_to_their_launch_directly(spec, monkeypatch):
    """Eager code on CUDA hands each segment whose transforms its format reads in-launch straight to the Triton
    launch (no op arguments flattened and rebuilt): over a real cache layer's handle, with a left-padded row, that
    path (the interpreter here) equals the ops' path (the references here), segment by segment."""
    from hf_kvcache.formats import handle as handle_module
    from hf_kvcache.layers import _common
    from hf_kvcache.tools.gpu_run.correctness import _mask
    from hf_kvcache.tools.gpu_run.kernels import decode_handle
    from hf_kvcache.tools.gpu_run.shapes import model_config

    monkeypatch.setattr(_common, "CPU_HANDLES", "always")
    config = model_config(True, layers=1)
    g = torch.Generator().manual_seed(4)
    kv, dim = config.num_key_value_heads, config.head_dim
    k, v = (torch.randn(2, kv, 300, dim, generator=g) for _ in range(2))  # past the KIVI residual: codes read
    k1, v1 = (torch.randn(2, kv, 1, dim, generator=g) for _ in range(2))
    handle = decode_handle(spec, config, k, v, k1, v1)[0]
    assert any(not isinstance(s, DenseSegment) for s in handle.segments)
    query = torch.randn(2, config.num_attention_heads, 1, dim, generator=g)
    mask = _mask(2, 1, handle.length, "cpu")
    want = decode_attention(query, handle, mask, dim**-0.5)
    launched, kernels = [], []
    launch, kernel = handle_module.launch, triton_decode.triton_partial
    monkeypatch.setattr(handle_module, "launches_directly", lambda q: True)
    monkeypatch.setattr(handle_module, "launch", lambda *args, **kw: launched.append(1) or launch(*args, **kw))
    monkeypatch.setattr(triton_decode, "triton_partial", lambda *args, **kw: kernels.append(1) or kernel(*args, **kw))
    got = decode_attention(query, handle, mask, dim**-0.5)
    _close(got, want, torch.float32)
    absorbed = [not isinstance(s.in_launch()[0], handle_module.OverSegment) for s in handle.segments]
    assert len(launched) == sum(absorbed) and len(kernels) >= len(launched)
    assert spec != "fp8:rotate=hadamard" or not all(absorbed)  # the branch that keeps the op's path


def test_a_launch_free_to_choose_fills_whole_waves(monkeypatch):
    """A launch whose caller combines any split count (``exact=False``) keeps the requested count until its compiled
    kernel's residency is known, then takes the count that fills whole waves (8 splits for 8 rows x 8 KV heads of 16k
    tokens on 132 SMs of 4 programs each, not 9); a plan with ``fill_waves=False`` keeps the request."""
    query, seg, _, _, _ = _case("int8", length=64)
    storage, plan = seg.kernel_storage(), seg.launch_plan(query, None)
    big = storage.replace(length=16384)
    monkeypatch.setattr(triton_decode, "sm_count", lambda device: 132)
    monkeypatch.setattr(triton_decode, "_RESIDENT", {})
    assert triton_decode._filled(("k",), big, plan, 64, 9, None) == 9
    triton_decode._RESIDENT[("k",)] = 4
    assert triton_decode._filled(("k",), big, plan, 64, 9, None) == 8
    assert plan.fill_waves and not plan.replace(fill_waves=False).fill_waves
    # off CUDA the count is the caller's whatever exact says
    m, _, acc = triton_decode.triton_partial(query, storage, plan, None, 0.125, 0.0, 3, exact=False)
    assert m.shape[-1] == 3 and acc.shape[-2] == 3

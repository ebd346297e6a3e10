"""Each storage format's launch plan (tile, pipelining depth, warps, swapped products), pinned: these are the choices
tuned against the kernels compiled for sm_80 / sm_90 (docs/gpu-report.md), so a change to them is deliberate. No
triton needed: the plan is the format's, decided before any launch."""

from __future__ import annotations

import math

import pytest
import torch

from hf_kvcache.formats import DenseSegment, Fp8Codec, Int8Codec, KiviCodec, PagedSegment, PreRopeSegment, RotatedCodec
from hf_kvcache.kernels import LaunchPlan
from hf_kvcache.rope import RotarySpec

HEAD_DIM = 128


def _query(q_len: int, group: int = 4, heads: int = 2) -> torch.Tensor:
    return torch.zeros(1, heads * group, q_len, HEAD_DIM)


def _kv(tokens: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return torch.randn(1, 2, tokens, HEAD_DIM, generator=g), torch.randn(1, 2, tokens, HEAD_DIM, generator=g)


def _segment(kind: str):
    k, v = _kv()
    if kind == "dense":
        return DenseSegment(k, v)
    if kind == "paged":
        pool = k[0].transpose(0, 1).contiguous()  # (slots, H, D)
        return PagedSegment(pool, pool, torch.zeros(1, 4, dtype=torch.int32), 16, 64)
    codec = {
        "int8": Int8Codec(None, torch.float32),
        "int8-g32": Int8Codec(32, torch.float32),
        "fp8": Fp8Codec(),
        "kivi4": KiviCodec(4, 32, torch.float32),
        "kivi4-g8": KiviCodec(4, 8, torch.float32),
        "kivi2-rot": RotatedCodec(KiviCodec(2, 32, torch.float32)),
    }[kind]
    return codec.segment(codec.encode(k, v))


def _rope(inner, rotary_dim: int = HEAD_DIM):
    inv_freq = 1.0 / 10000 ** (torch.arange(0, rotary_dim, 2).float() / rotary_dim)
    return PreRopeSegment(inner, RotarySpec(inv_freq, rotary_dim, False), 0)


@pytest.mark.parametrize(
    "kind, q_len, plan",
    [
        ("dense", 1, LaunchPlan(64, 2, 4)),
        ("dense", 16, LaunchPlan(64, 2, 8)),  # 64 query rows: eight warps
        ("int8", 1, LaunchPlan(64, 1, 4, swap=True)),  # folded scales: no pipelining; 8 rows: swapped products
        ("int8", 16, LaunchPlan(32, 1, 8)),  # 64 rows: not swapped, 32-token tiles
        ("int8-g32", 1, LaunchPlan(64, 3, 4, swap=True)),  # per-group scales: Triton's default 3 stages
        ("fp8", 1, LaunchPlan(64, 1, 4, swap=True)),  # int8's plan with folded scales
        ("fp8", 16, LaunchPlan(32, 1, 8)),
        ("kivi4", 1, LaunchPlan(32, 1, 4, swap=True, group_tiles=True)),  # a tile per key group
        ("kivi4-g8", 1, LaunchPlan(64, 3, 4, swap=True)),  # groups of 8 tokens: dequantized per element
        ("paged", 1, LaunchPlan(64, 2, 4)),
    ],
)
def test_each_format_plans_its_launch(kind, q_len, plan):
    assert _segment(kind).launch_plan(_query(q_len), None) == plan


def test_keys_before_rope_change_the_inner_formats_plan():
    """Pre-RoPE KIVI keys turned per tile: 2 stages; partial rotary (turned per element): 32-token tiles, eight
    warps, no group tiles; over rotated codes every tile is rotated back, not pipelined (one stage), and the
    per-element case has no kernel plan (None: the reference serves it); a causal mask over several query tokens
    takes eight warps for any format."""
    mask = torch.ones(1, 4, 64, dtype=torch.bool)
    assert _rope(_segment("kivi4")).launch_plan(_query(1), None) == LaunchPlan(32, 2, 4, swap=True, group_tiles=True)
    assert _rope(_segment("kivi4"), 64).launch_plan(_query(1), None) == LaunchPlan(32, 1, 8, swap=True)
    assert _rope(_segment("kivi2-rot")).launch_plan(_query(1), None) == LaunchPlan(
        32, 1, 4, swap=True, group_tiles=True
    )
    assert _rope(_segment("kivi2-rot"), 64).launch_plan(_query(1), None) is None
    assert _rope(_segment("dense")).launch_plan(_query(4), mask).warps == 8
    assert _segment("dense").launch_plan(_query(4), mask).warps == 4


def test_split_counts_fill_whole_waves():
    """The split count a launch may choose (``fill_waves``) finishes the grid soonest when programs of equal work run
    in waves of the SMs' resident programs: at 16k tokens x 8 rows x 8 KV heads on 132 SMs holding 4 programs each,
    8 splits (512 programs, one wave), not the 9 of the fixed target (576: a second wave of 48 takes as long as the
    first, as the first H200 runs measured, 0.79x sdpa there against 1.19x at 16k x 1, one wave); where few programs
    run per split, as many splits as a segment allows."""
    from hf_kvcache.kernels.torch_decode import MAX_SPLITS, num_splits
    from hf_kvcache.kernels.waves import wave_splits

    assert num_splits(16384, 64) == 9  # the fixed target's count, for the comparison
    assert wave_splits(16384, programs=64, slots=132 * 4, block_n=64, most=MAX_SPLITS) == 8
    assert wave_splits(16384, programs=64, slots=132 * 5, block_n=64, most=MAX_SPLITS) == 10  # 640 of 660
    assert wave_splits(16384, programs=64, slots=132 * 2, block_n=64, most=MAX_SPLITS) == 4  # 256 of 264
    assert wave_splits(16384, programs=8, slots=132 * 4, block_n=64, most=MAX_SPLITS) == MAX_SPLITS
    assert wave_splits(300, programs=8, slots=528, block_n=64, most=2) == 2
    assert wave_splits(16384, programs=1024, slots=528, block_n=64, most=MAX_SPLITS) == 1  # two waves already
    for programs, slots in ((64, 528), (24, 396), (8, 264)):
        best = wave_splits(65536, programs, slots, 64, MAX_SPLITS)
        cost = [math.ceil(programs * s / slots) * (math.ceil(65536 / s / 64) + 1) for s in range(1, MAX_SPLITS + 1)]
        assert cost[best - 1] == min(cost) and best == cost.index(min(cost)) + 1  # the first of the cheapest


def test_residency_of_a_compiled_kernel(monkeypatch):
    """Programs per SM follow the occupancy rules of the device's architecture (registers per warp in units of 256,
    shared memory, warp slots: 48 on sm_86 / sm_89 against 64 on sm_80 / sm_90), from what a compiled kernel reports;
    unknown architectures or kernels without figures (the interpreter's) give None, and the launch keeps its count."""
    from types import SimpleNamespace

    from hf_kvcache.kernels import waves

    kernel = SimpleNamespace(n_regs=102, metadata=SimpleNamespace(shared=10 * 1024, num_warps=4))
    for arch, expected in ((90, 4), (80, 4), (86, 4), (89, 4)):
        monkeypatch.setattr(waves, "_device", lambda index, arch=arch: (132, arch))
        assert waves.resident_programs(kernel, torch.device("cuda", 0)) == expected
    wide = SimpleNamespace(n_regs=32, metadata=SimpleNamespace(shared=0, num_warps=4))
    monkeypatch.setattr(waves, "_device", lambda index: (132, 90))
    assert waves.resident_programs(wide, torch.device("cuda", 0)) == 16  # 64 warp slots
    monkeypatch.setattr(waves, "_device", lambda index: (84, 86))
    assert waves.resident_programs(wide, torch.device("cuda", 0)) == 12  # 48 warp slots
    monkeypatch.setattr(waves, "_device", lambda index: (132, 100))
    assert waves.resident_programs(kernel, torch.device("cuda", 0)) is None
    assert waves.resident_programs(None, torch.device("cuda", 0)) is None

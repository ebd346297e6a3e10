"""Each storage format's launch plan (tile, pipelining depth, warps, swapped products), pinned: these are the choices
tuned against the kernels compiled for sm_80 / sm_90 (docs/gpu-report.md), so a change to them is deliberate. No
triton needed: the plan is the format's, decided before any launch."""

from __future__ import annotations

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

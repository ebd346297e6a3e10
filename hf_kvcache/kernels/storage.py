"""The one contract type the Triton decode kernel sees: what it reads of a segment (:class:`KernelStorage`) and how
to launch over it (:class:`LaunchPlan`).

The kernels never ask which storage format a segment is: a format module (:mod:`hf_kvcache.formats`) describes its
tensors here and picks its own plan; the kernel branches only on the storage ``kind`` it is handed, a compile-time
argument.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

__all__ = [
    "DENSE",
    "FP8",
    "INT8",
    "KIVI",
    "MIN_ROWS",
    "PAGED",
    "PAGED_INT8",
    "KernelStorage",
    "LaunchPlan",
    "block",
    "pool_strides",
    "strides",
]

# The storage kinds the Triton kernel branches on (its ``KIND`` compile-time argument).
DENSE, INT8, KIVI, PAGED, PAGED_INT8, FP8 = 0, 1, 2, 3, 4, 5

# Query rows of a program (query heads of one KV head x query tokens) are padded to at least 8: tensor-core products
# pad small M themselves, and each padded row costs softmax math.
MIN_ROWS = 8


def block(n: int, minimum: int = 16) -> int:
    """The power of two at or above ``n`` (at least ``minimum``): a tile's extent along an axis of ``n``."""
    return max(minimum, 1 << max(n - 1, 0).bit_length())


def strides(t: torch.Tensor | None, n: int = 4) -> tuple[int, ...]:
    return tuple(t.stride()) if t is not None else (0,) * n


def pool_strides(t: torch.Tensor | None) -> tuple[int, ...]:
    """A block pool ``(slots, H[, D])`` addressed as ``(batch, head, token, channel)``: no batch stride, its slot
    stride as the token stride (zeros for an absent tensor)."""
    if t is None:
        return (0, 0, 0, 0)
    return (0, t.stride(1), t.stride(0), t.stride(2) if t.dim() > 2 else 0)


@dataclass(frozen=True)
class KernelStorage:
    """What the Triton decode kernel reads of one segment. Strides are ``(batch, head, token, channel)`` (a block
    pool has no batch stride: its token stride is the slot stride); scale strides likewise."""

    kind: int  # DENSE, INT8, KIVI, PAGED, PAGED_INT8 or FP8
    k: torch.Tensor
    v: torch.Tensor
    key_dim: int  # channels per head (KIVI rows hold them packed)
    value_dim: int
    length: int
    k_strides: tuple[int, ...]
    v_strides: tuple[int, ...]
    ks: torch.Tensor | None = None
    kz: torch.Tensor | None = None
    vs: torch.Tensor | None = None
    vz: torch.Tensor | None = None
    ks_strides: tuple[int, ...] = (0, 0, 0, 0)
    vs_strides: tuple[int, ...] = (0, 0, 0, 0)
    table: torch.Tensor | None = None  # paged: (B, blocks) block table
    block_size: int = 1
    start: int = 0  # KIVI: first token of the segment in the arrays
    key_bits: int = 8  # KIVI: bits per key code and per value code
    value_bits: int = 8
    key_group: int = 1
    value_group: int = 1
    key_levels: torch.Tensor | None = None  # KIVI codebooks: (2^bits,) float32 levels the codes index; None: uniform
    value_levels: torch.Tensor | None = None
    fold: bool = False  # one scale per token and head, folded into scores and probabilities
    key_rotation: torch.Tensor | None = None  # (Dk, Dk) float32 Hadamard (entries -c, 0, c): codes stored rotated
    value_rotation: torch.Tensor | None = None
    rope: int = 0  # keys stored before RoPE: 1 halves rotate together, 2 interleaved pairs; 0 none
    rotary_dim: int = 0
    first: int = 0  # position of the segment's first token
    inv_freq: torch.Tensor | None = None

    def replace(self, **changes) -> KernelStorage:
        return dataclasses.replace(self, **changes)


@dataclass(frozen=True)
class LaunchPlan:
    """How one launch over a segment is shaped: chosen by the segment's format (``launch_plan``) from the kernels
    compiled for sm_80 / sm_90, since what fits in registers depends on how the format's tiles are read."""

    block_n: int = 64  # tokens per tile
    stages: int = 2  # software-pipelining depth of the tile loads
    warps: int = 4
    swap: bool = False  # tiles dequantized in registers enter the products as their first operand (acc^T += v^T p^T)
    group_tiles: bool = False  # KIVI: a tile is one key group, its channel scales folded into the query
    angle_table: bool = False  # pre-RoPE keys (every channel rotary) turned from a cos / sin table, not per element
    half_codes: bool = False  # int8 codes (folded scales) enter the products as float16 1152 + code, not bfloat16
    fill_waves: bool = True  # where the caller allows, a split count that fills whole waves of the SMs (waves.py)

    def replace(self, **changes) -> LaunchPlan:
        return dataclasses.replace(self, **changes)

    @staticmethod
    def rows(query: torch.Tensor, heads: int) -> int:
        """Query rows of a program: the query heads of one KV head times the query tokens."""
        return query.shape[1] // heads * query.shape[2]

    @staticmethod
    def base_warps(rows: int) -> int:
        """Eight warps once a program holds 64 query rows or more (16 query tokens x 4 heads): the scores,
        probabilities and accumulator tiles of 64+ rows spill with four."""
        return 8 if block(rows) >= 64 else 4

"""KIVI storage, 4, 3 and 2 bits: keys per channel over groups of ``G`` tokens, values per token over groups of ``G``
channels, asymmetric (scale and zero point), codes packed ``8 / bits`` per byte, low bits first (3 bits: a 2-bit
plane, then a 1-bit plane; :func:`hf_kvcache.quant.pack`). Keys and values each have their own width (``key_bits``,
``value_bits``: equal unless a cache asks for e.g. 4-bit keys beside 2-bit values). With ``key_axis="token"`` (the
paper's ablation) keys are quantized like the values.

Stored ``k`` uint8 ``(B, H, T, Dk * key_bits / 8)``, ``v`` ``(B, H, T, Dv * value_bits / 8)``; keys' ``ks`` /
``kz`` ``(B, H, T / G, Dk)`` (per token: ``(B, H, T, Dk / G)``), values' ``vs`` / ``vz`` ``(B, H, T, Dv / G)``. Read
by ``hf_kvcache::partial_kivi`` (with optional Hadamard rotations, :mod:`.rotated`, and keys stored before RoPE,
:mod:`.pre_rope`, all in one launch) and, per-token keys, ``hf_kvcache::partial_kivi_token`` (the reference on every
device).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .. import quant
from ..kernels import cpu_native, torch_decode
from ..kernels._available import guarded, triton_available
from ..kernels._define import custom_op
from ..kernels._eager import eager
from ..kernels.storage import KIVI, KernelStorage, LaunchPlan, block
from ..rope import RotarySpec, angle_table
from ._base import (
    KeyTurn,
    Partials,
    Parts,
    SegmentFormat,
    channel_groups,
    plan_warps,
    register_partial,
    swapped,
    turn_keys,
)
from .pre_rope import PreRopeSegment
from .rotated import rotated

__all__ = [
    "KEY_AXES",
    "KiviCodec",
    "KiviSegment",
    "KiviTokenSegment",
    "encode_kivi",
    "kivi_scale_dtype",
    "kivi_zero_dtype",
]

KEY_AXES = ("channel", "token")  # KIVI keys: per channel (the paper's choice, the default) or per token (its ablation)


def kivi_scale_dtype(scale_dtype: torch.dtype | None, kv_dtype: torch.dtype) -> torch.dtype:
    """KIVI's scale dtype: ``scale_dtype`` when set, else the K/V dtype when it is 16-bit (KIVI stores fp16 scales),
    else float32."""
    if scale_dtype is not None:
        return scale_dtype
    return kv_dtype if kv_dtype.itemsize == 2 else torch.float32


def kivi_zero_dtype(scale_dtype: torch.dtype | None, kv_dtype: torch.dtype, per_token: bool) -> torch.dtype:
    """The zero points' dtype: the scales' (:func:`kivi_scale_dtype`), except beside 8-bit scales
    (:data:`~hf_kvcache.quant.E5M3`): int8 steps of the scale for groups of one token's channels, which straddle 0
    where their channels' signs differ (values, Hadamard-rotated keys); per-channel key groups, whose zero point is the
    channel's offset, many steps from 0, keep it in the K/V dtype (16-bit) or float32."""
    if scale_dtype != quant.E5M3:
        return kivi_scale_dtype(scale_dtype, kv_dtype)
    return torch.int8 if per_token else kivi_scale_dtype(None, kv_dtype)


def _unpack(packed: torch.Tensor, bits: int, levels: torch.Tensor | None = None) -> torch.Tensor:
    """``(..., D * bits / 8)`` uint8 -> ``(..., D)`` float32 codes (:func:`hf_kvcache.quant.unpack`, written straight
    into the float tensor), or each code's level of the codebook ``levels``."""
    out = torch.empty((*packed.shape[:-1], packed.shape[-1] * 8 // bits), dtype=torch.float32, device=packed.device)
    _unpack_into(packed, bits, out, levels)
    return out


_TABLES: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}


def _byte_levels(levels: torch.Tensor, bits: int, dtype: torch.dtype) -> torch.Tensor:
    """The levels of every packed byte's codes, in ``dtype``: ``(256, 8 / bits)`` at 4 and 2 bits; at 3 bits
    ``(4096, 4)``, indexed by a low-plane byte plus 256 times the high bits of its four codes. Built once per codebook
    tensor (the codecs keep one per device), so a read is one gather per byte instead of one per code (6x faster on
    CPU than unpacking, then indexing the levels)."""
    key = (levels.data_ptr(), levels.device, bits, dtype)
    hit = _TABLES.get(key)
    if hit is None or hit[0] is not levels:
        byte = torch.arange(4096 if bits == 3 else 256, device=levels.device)
        if bits == 3:
            codes = [((byte >> (2 * j)) & 3) | (((byte >> (8 + j)) & 1) << 2) for j in range(4)]
        else:
            codes = [(byte >> (bits * j)) & ((1 << bits) - 1) for j in range(8 // bits)]
        if len(_TABLES) > 64:
            _TABLES.clear()
        hit = _TABLES[key] = (levels, levels[torch.stack(codes, -1)].to(dtype))
    return hit[1]


def _unpack_into(packed: torch.Tensor, bits: int, out: torch.Tensor, levels: torch.Tensor | None) -> None:
    """:func:`_unpack` written into ``out`` (``(..., D)``, any float dtype)."""
    if levels is None:
        quant.unpack(packed, bits, out=out)
        return
    table = _byte_levels(levels, bits, out.dtype)
    if bits == 3:  # codes 8m .. 8m + 3: low-plane byte 2m and the low nibble of high-plane byte m; 8m + 4 ..: 2m + 1
        low = out.shape[-1] // 4
        lo = packed[..., :low].unflatten(-1, (-1, 2)).to(torch.int16)  # 16-bit index arithmetic: 7x faster than 64
        nibbles = torch.stack([packed[..., low:] & 15, packed[..., low:] >> 4], -1).to(torch.int16)
        index = (lo + (nibbles << 8)).flatten(-2).to(torch.int32)
    else:
        index = packed.to(torch.int32)
    if out.is_contiguous():
        torch.index_select(table, 0, index.flatten(), out=out.view(-1, table.shape[-1]))
    else:
        out.copy_(table[index].flatten(-2))


def _float_params(scale: torch.Tensor, zero: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Stored scales and zero points as the decoders multiply them: 8-bit ones as float32
    (:func:`~hf_kvcache.quant.group_params`), float ones as stored."""
    return quant.group_params(scale, zero, bits) if scale.dtype == quant.E5M3 else (scale, zero)


def _rope_whole_head(rope: KeyTurn, width: int) -> bool:
    """Whether ``rope`` turns every channel of a ``width``-wide head in ``rotate_half`` pairs (the CPU kernel's)."""
    return not rope[0].interleaved and rope[0].rotary_dim == width


def _float32_arithmetic(decode):
    """A decoder ``(self, codes, scale, zero, out, bits)`` run on a float32 copy when ``out`` is float16: ``code x
    scale`` of a group spanning most of float16's range overflows it before the zero point brings it back."""

    def run(self, codes, scale, zero, out, bits):
        if out.dtype != torch.float16:
            return decode(self, codes, scale, zero, out, bits)
        wide = torch.empty(out.shape, dtype=torch.float32, device=out.device)
        decode(self, codes, scale.float(), zero.float(), wide, bits)
        out.copy_(wide)

    return run


def _token_groups_read(packed: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, bits: int,
                       levels: torch.Tensor | None) -> torch.Tensor:  # fmt: skip
    """Tokens quantized per token over groups of channels (KIVI's values): ``(B, H, n, D)`` float32."""
    codes = _unpack(packed, bits, levels)  # (B, H, n, D)
    groups = codes.view(*codes.shape[:-1], scale.shape[-1], -1)  # (B, H, n, D / G, G)
    scale, zero = quant.group_params(scale, zero, bits)
    return torch.addcmul(zero.unsqueeze(-1), groups, scale.unsqueeze(-1)).flatten(-2)


def _token_groups_weighted(weights: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor,
                           bits: int, levels: torch.Tensor | None) -> torch.Tensor:  # fmt: skip
    """``weights`` ``(B, H, G, q, n)`` times tokens quantized per token over channel groups, the scales folded into
    the weights: ``sum_t w_t (code_t x s_t + z_t) = sum_t (w_t s_t) code_t + sum_t w_t z_t`` per channel group, so
    no value is dequantized (a codebook's levels stand for the codes). ``(B, H, G, q, D)`` float32."""
    codes = _unpack(packed, bits, levels)  # (B, H, n, D)
    groups = codes.view(*codes.shape[:-1], scale.shape[-1], -1)  # (B, H, n, D / G, G)
    scale, zero = quant.group_params(scale, zero, bits)
    scaled = weights.unsqueeze(-1) * scale[:, :, None, None]  # (B, H, G, q, n, D / G)
    out = torch.einsum("bhgqnj,bhnjc->bhgqjc", scaled, groups)
    out = out + torch.einsum("bhgqn,bhnj->bhgqj", weights, zero).unsqueeze(-1)
    return out.flatten(-2)


@dataclass(frozen=True)
class KiviSegment(SegmentFormat):
    key_bits: int
    value_bits: int
    group: int  # G: tokens per key group, channels per value group
    start: int  # first token of the segment in the arrays' token axis (a sliding layer may start inside a group)
    length: int
    k: torch.Tensor  # (B, H, T, Dk * key_bits / 8) uint8
    ks: torch.Tensor  # (B, H, T / G, Dk)
    kz: torch.Tensor
    v: torch.Tensor  # (B, H, T, Dv * value_bits / 8) uint8
    vs: torch.Tensor  # (B, H, T, Dv / G)
    vz: torch.Tensor
    key_levels: torch.Tensor | None = None  # the codebooks (float32, 2^bits levels) the codes index; None: uniform
    value_levels: torch.Tensor | None = None

    ROTATIONS_IN_LAUNCH = True
    ROPE_IN_LAUNCH = True

    @property
    def value_dim(self) -> int:
        return self.v.shape[-1] * 8 // self.value_bits

    def _key_groups(self, a: int, b: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, slice]:
        """The whole key groups covering tokens ``a:b``: codes ``(B, H, groups, G, Dk)``, their channel scales and
        zero points ``(B, H, groups, Dk)`` in float32, and where ``a:b`` sits in the groups' tokens."""
        a, b = a + self.start, b + self.start
        g, g0, g1 = self.group, a // self.group, -(-b // self.group)
        codes = _unpack(self.k[:, :, g0 * g : g1 * g], self.key_bits, self.key_levels)  # (B, H, groups x G, Dk)
        grouped = codes.view(*codes.shape[:2], g1 - g0, g, codes.shape[-1])
        scale, zero = quant.group_params(self.ks[:, :, g0:g1], self.kz[:, :, g0:g1], self.key_bits)
        return grouped, scale, zero, slice(a - g0 * g, b - g0 * g)

    def read_keys(self, a: int, b: int) -> torch.Tensor:
        codes, scale, zero, cut = self._key_groups(a, b)
        return torch.addcmul(zero[:, :, :, None], codes, scale[:, :, :, None]).flatten(2, 3)[:, :, cut]

    def read_values(self, a: int, b: int) -> torch.Tensor:
        a, b = a + self.start, b + self.start
        return _token_groups_read(self.v[:, :, a:b], self.vs[:, :, a:b], self.vz[:, :, a:b], self.value_bits,
                                  self.value_levels)  # fmt: skip

    def scores(self, query: torch.Tensor, a: int, b: int) -> torch.Tensor:
        # q . (code x scale_c + zero_c) = (q x scale) . code + q . zero, with each key group's channel scales (the
        # Triton kernel's fold): no key is dequantized
        codes, scale, zero, cut = self._key_groups(a, b)
        scaled = query[:, :, :, :, None, :] * scale[:, :, None, None]  # (B, H, G, q, groups, Dk)
        dots = torch.einsum("bhgqjd,bhjtd->bhgqjt", scaled, codes)
        dots = dots + torch.einsum("bhgqd,bhjd->bhgqj", query, zero).unsqueeze(-1)
        return dots.flatten(-2)[..., cut]

    def weighted_values(self, weights: torch.Tensor, a: int, b: int) -> torch.Tensor:
        a, b = a + self.start, b + self.start
        v, vs, vz = self.v[:, :, a:b], self.vs[:, :, a:b], self.vz[:, :, a:b]
        return _token_groups_weighted(weights, v, vs, vz, self.value_bits, self.value_levels)

    def partial(self, query, mask, scaling, softcap, splits, rotations=(None, None), rope=None) -> Partials:
        """``rotations``: the ``(H_k, H_v)`` the codes were stored rotated by; ``rope``: ``(rotary, first)`` of keys
        stored before RoPE; both read in the same launch."""
        turn = (None, 0, False, 0)
        if rope is not None:
            rotary, first = rope
            turn = (rotary.inv_freq.to(device=query.device, dtype=torch.float32), rotary.rotary_dim,
                    rotary.interleaved, first)  # fmt: skip
        s = self
        args = (s.k, s.ks, s.kz, s.v, s.vs, s.vz, s.key_levels, s.value_levels, mask, s.key_bits, s.value_bits,
                s.group, s.start, s.length, *rotations, *turn)  # fmt: skip
        return _OP(query, *args, scaling, softcap, splits)

    def kernel_storage(self) -> KernelStorage:
        k, v, ks, vs = self.k, self.v, self.ks, self.vs
        return KernelStorage(
            KIVI, k, v, k.shape[-1] * 8 // self.key_bits, self.value_dim, self.length, tuple(k.stride()),
            tuple(v.stride()), ks=ks, kz=self.kz, vs=vs, vz=self.vz, ks_strides=tuple(ks.stride()),
            vs_strides=tuple(vs.stride()), start=self.start, key_bits=self.key_bits,
            value_bits=self.value_bits, key_group=self.group, value_group=self.group, key_levels=self.key_levels,
            value_levels=self.value_levels,
        )  # fmt: skip

    def launch_plan(self, query, mask, rotary_dim=0) -> LaunchPlan:
        """Key groups of 16-128 tokens (a power of two) are read a group per tile, its channel scales folded into the
        query: no pipelining (2 stages spilled at 4 query tokens on sm_90), except with keys turned per tile
        (``rotary_dim``: pre-RoPE, every channel rotary and a power-of-two width), where 2 stages spill less. Keys
        turned per element (partial rotary, or a width that is not a power of two: each channel's pair dequantized
        beside it): 32-token tiles, no pipelining, eight warps (64-token tiles spilled KBs at 4 warps). Other group
        sizes dequantize every element of the tile, with Triton's default 3 stages."""
        g = self.group
        warps = plan_warps(query, self.heads, mask, rotary_dim)
        swap = swapped(query, self.heads)
        if 16 <= g <= 128 and g & (g - 1) == 0 and (not rotary_dim or rotary_dim == block(query.shape[-1])):
            return LaunchPlan(block_n=g, stages=2 if rotary_dim else 1, warps=warps, swap=swap, group_tiles=True)
        if rotary_dim:
            return LaunchPlan(block_n=32, stages=1, warps=8, swap=swap)
        return LaunchPlan(block_n=64, stages=3, warps=warps, swap=swap)


def _segment(k, ks, kz, v, vs, vz, key_levels, value_levels, key_bits, value_bits, group, start, length, hk, hv,
             inv_freq, rotary_dim, interleaved, first):  # fmt: skip
    """A KIVI segment, read through its rotations (``hk``) and with its keys turned to their positions (pre-RoPE:
    ``inv_freq``) when it has them."""
    stored = KiviSegment(key_bits, value_bits, group, start, length, k, ks, kz, v, vs, vz, key_levels, value_levels)
    segment = rotated(stored, hk, hv)
    if inv_freq is None:
        return segment
    return PreRopeSegment(segment, RotarySpec(inv_freq, rotary_dim, interleaved), first)


def _partial(
    query: torch.Tensor,
    k: torch.Tensor,
    ks: torch.Tensor,
    kz: torch.Tensor,
    v: torch.Tensor,
    vs: torch.Tensor,
    vz: torch.Tensor,
    key_levels: torch.Tensor | None,
    value_levels: torch.Tensor | None,
    mask: torch.Tensor | None,
    key_bits: int,
    value_bits: int,
    group: int,
    start: int,
    length: int,
    key_rotation: torch.Tensor | None,
    value_rotation: torch.Tensor | None,
    inv_freq: torch.Tensor | None,
    rotary_dim: int,
    interleaved: bool,
    first: int,
    scaling: float,
    softcap: float,
    splits: int,
) -> Partials:
    segment = _segment(k, ks, kz, v, vs, vz, key_levels, value_levels, key_bits, value_bits, group, start, length,
                       key_rotation, value_rotation, inv_freq, rotary_dim, interleaved, first)  # fmt: skip
    return torch_decode.partial(query, segment, mask, scaling, softcap, splits)


_OP = register_partial(
    "partial_kivi",
    _partial,
    lambda k, ks, kz, v, vs, vz, kl, vl, mask, key_bits, value_bits, group, start, length, *rest: (
        _segment(k, ks, kz, v, vs, vz, kl, vl, key_bits, value_bits, group, start, length, *rest[:6]),
        mask,
        *rest[6:],
    ),
    lambda q, k, ks, kz, v, vs, vz, kl, vl, mask, key_bits, value_bits, *rest: (
        k.shape[1],
        v.shape[-1] * 8 // value_bits,
    ),
)


@dataclass(frozen=True)
class KiviTokenSegment(SegmentFormat):
    """KIVI codes with keys quantized per token like the values (``key_axis="token"``): served by the pure-torch
    reference on every device (the Triton kernel reads per-channel keys only)."""

    key_bits: int
    value_bits: int
    group: int  # G: channels per key group and per value group
    k: torch.Tensor  # (B, H, T, Dk * key_bits / 8) uint8
    ks: torch.Tensor  # (B, H, T, Dk / G)
    kz: torch.Tensor
    v: torch.Tensor  # (B, H, T, Dv * value_bits / 8) uint8
    vs: torch.Tensor  # (B, H, T, Dv / G)
    vz: torch.Tensor
    key_levels: torch.Tensor | None = None  # as KiviSegment's
    value_levels: torch.Tensor | None = None

    @property
    def length(self) -> int:
        return self.k.shape[2]

    @property
    def value_dim(self) -> int:
        return self.v.shape[-1] * 8 // self.value_bits

    def read_keys(self, a: int, b: int) -> torch.Tensor:
        k, ks, kz = self.k[:, :, a:b], self.ks[:, :, a:b], self.kz[:, :, a:b]
        return _token_groups_read(k, ks, kz, self.key_bits, self.key_levels)

    def read_values(self, a: int, b: int) -> torch.Tensor:
        v, vs, vz = self.v[:, :, a:b], self.vs[:, :, a:b], self.vz[:, :, a:b]
        return _token_groups_read(v, vs, vz, self.value_bits, self.value_levels)

    def weighted_values(self, weights: torch.Tensor, a: int, b: int) -> torch.Tensor:
        v, vs, vz = self.v[:, :, a:b], self.vs[:, :, a:b], self.vz[:, :, a:b]
        return _token_groups_weighted(weights, v, vs, vz, self.value_bits, self.value_levels)

    def partial(self, query, mask, scaling, softcap, splits) -> Partials:
        s = self
        return _TOKEN_OP(query, s.k, s.ks, s.kz, s.v, s.vs, s.vz, s.key_levels, s.value_levels, mask, s.key_bits,
                         s.value_bits, s.group, scaling, softcap, splits)  # fmt: skip


def _token_partial(
    query: torch.Tensor,
    k: torch.Tensor,
    ks: torch.Tensor,
    kz: torch.Tensor,
    v: torch.Tensor,
    vs: torch.Tensor,
    vz: torch.Tensor,
    key_levels: torch.Tensor | None,
    value_levels: torch.Tensor | None,
    mask: torch.Tensor | None,
    key_bits: int,
    value_bits: int,
    group: int,
    scaling: float,
    softcap: float,
    splits: int,
) -> Partials:
    segment = KiviTokenSegment(key_bits, value_bits, group, k, ks, kz, v, vs, vz, key_levels, value_levels)
    return torch_decode.partial(query, segment, mask, scaling, softcap, splits)


_TOKEN_OP = register_partial(
    "partial_kivi_token",
    _token_partial,
    None,  # per-token keys: the reference on every device
    lambda q, k, ks, kz, v, vs, vz, kl, vl, mask, key_bits, value_bits, *rest: (
        k.shape[1],
        v.shape[-1] * 8 // value_bits,
    ),
)


_STORED = ("k", "ks", "kz", "v", "vs", "vz")


def _encode_torch(k: torch.Tensor, v: torch.Tensor, out: tuple, key_bits: int, value_bits: int, group: int,
                      per_token: bool, codebook: str) -> None:  # fmt: skip
    """:meth:`KiviCodec.encode` copied into ``out``, the storage views in :data:`_STORED` order."""
    key_axis = "token" if per_token else "channel"
    parts = KiviCodec(value_bits, group, out[1].dtype, key_axis, key_bits, codebook).encode(k, v)
    for name, dest in zip(_STORED, out):
        dest.copy_(parts[name])


def _encode(
    k: torch.Tensor,
    v: torch.Tensor,
    kp: torch.Tensor,
    ks: torch.Tensor,
    kz: torch.Tensor,
    vp: torch.Tensor,
    vs: torch.Tensor,
    vz: torch.Tensor,
    key_bits: int,
    value_bits: int,
    group: int,
    per_token_keys: bool,
    codebook: str,
) -> None:
    """KIVI-encode ``k`` / ``v`` ``(B, H, n, D)`` into views of a layer's storage (packed codes, scales and zero
    points, as :meth:`KiviCodec.encode` returns them; the scale dtype the views'): one launch on CUDA
    (:func:`~hf_kvcache.kernels.triton_append.triton_kivi_encode`, bit-exact to this reference) where the geometry
    packs whole bytes per channel group; on CPU the native kernel where it reads the layout (uniform levels, float32
    K/V and scales: :func:`~hf_kvcache.kernels.cpu_native.encode_kivi`, bit-exact too); the reference elsewhere."""
    native = codebook == "uniform" and (
        cpu_native.encode_kivi(k, kp, ks, kz, key_bits, group, per_token_keys)
        and cpu_native.encode_kivi(v, vp, vs, vz, value_bits, group, True)
    )
    if not native:
        _encode_torch(k, v, (kp, ks, kz, vp, vs, vz), key_bits, value_bits, group, per_token_keys, codebook)


_ENCODE_OP = custom_op("hf_kvcache::encode_kivi", _encode, mutates_args=("kp", "ks", "kz", "vp", "vs", "vz"))


@_ENCODE_OP.register_fake
def _(k, v, kp, ks, kz, vp, vs, vz, key_bits, value_bits, group, per_token_keys, codebook):
    return None


@_ENCODE_OP.register_kernel("cuda")
def _encode_cuda(k, v, kp, ks, kz, vp, vs, vz, key_bits, value_bits, group, per_token_keys, codebook):
    stored = (kp, ks, kz, vp, vs, vz)
    encode_args = (k, v, stored, key_bits, value_bits, group, per_token_keys, codebook)
    if triton_available():
        from ..kernels.triton_append import kivi_encodable, triton_kivi_encode

        if kivi_encodable(key_bits, value_bits, group, k.shape[-1], v.shape[-1], per_token_keys):
            levels = _codebooks(codebook, key_bits, value_bits, group, k.device)
            return guarded(
                f"encode_kivi:{key_bits}:{value_bits}",
                lambda: triton_kivi_encode(
                    k, v, dict(zip(_STORED, stored)), key_bits, value_bits, group, per_token_keys, *levels
                ),
                lambda: _encode_torch(*encode_args),
            )
    return _encode_torch(*encode_args)


encode_kivi = eager(_ENCODE_OP, _encode, _encode_cuda)


_ON_DEVICE: dict[tuple, torch.Tensor] = {}


def _levels(codebook: str, bits: int, group: int, device: torch.device) -> torch.Tensor | None:
    """The levels of ``codebook`` at ``bits`` on ``device`` (None: uniform), copied there once."""
    if codebook == "uniform":
        return None
    key = (bits, group, torch.device(device))
    if key not in _ON_DEVICE:
        _ON_DEVICE[key] = quant.codebook_levels(bits, group).to(device)
    return _ON_DEVICE[key]


def _codebooks(codebook: str, key_bits: int, value_bits: int, group: int, device) -> tuple:
    """The keys' and values' levels of ``codebook`` on ``device``."""
    return _levels(codebook, key_bits, group, device), _levels(codebook, value_bits, group, device)


class KiviCodec:
    """KIVI 4/3/2-bit: keys per channel over groups of ``group_size`` tokens, values per token over groups of
    ``group_size`` channels; asymmetric (scale + zero point); codes packed ``8 // bits`` per byte, low bits first
    (3 bits: 8 codes in 3 bytes, see :func:`~hf_kvcache.quant.pack`).

    Keys need a full group of tokens before they can be encoded, so tokens leave the residual ``group_size`` at a
    time (``unit = group_size``).

    With ``key_axis="token"`` (the paper's ablation) keys are quantized like the values: per token over groups of
    ``group_size`` channels, so every token is encoded on its own (``unit = 1``).

    ``bits`` is the values' width and, unless ``key_bits`` says otherwise, the keys' (4-bit keys beside 2-bit values:
    ``KiviCodec(2, G, None, key_bits=4)``).

    ``codebook``: where a group's codes sit between its minimum and maximum, ``"uniform"`` (KIVI's equal steps) or
    ``"lloyd"`` (:func:`~hf_kvcache.quant.codebook_levels`: Lloyd-Max levels for normally distributed groups, the
    shape Hadamard-rotated coordinates take); the same bytes either way.

    Stored: ``k`` uint8 ``(B, H, T, Dk * key_bits / 8)``, ``v`` ``(B, H, T, Dv * value_bits / 8)``; ``ks`` / ``kz``
    ``(B, H, T / G, Dk)`` (one per key group and channel; ``(B, H, T, Dk / G)`` per token and channel group with
    ``key_axis="token"``); ``vs`` / ``vz`` ``(B, H, T, Dv / G)`` (one per token and channel group).
    """

    def __init__(
        self,
        bits: int,
        group_size: int,
        scale_dtype: torch.dtype | None,
        key_axis: str = "channel",
        key_bits: int | None = None,
        codebook: str = "uniform",
    ):
        self.value_bits = bits
        self.key_bits = bits if key_bits is None else key_bits
        self.group_size = group_size
        self.codebook = codebook
        self.scale_dtype = scale_dtype  # None: see kivi_scale_dtype
        self.key_axis = key_axis
        self.per_token_keys = key_axis == "token"
        self.unit = 1 if self.per_token_keys else group_size
        key_units = 1 if self.per_token_keys else group_size
        self.units = {"k": 1, "ks": key_units, "kz": key_units, "v": 1, "vs": 1, "vz": 1}

    def levels(self, bits: int, device) -> torch.Tensor | None:
        """The codebook's levels for ``bits``-bit codes on ``device``; None: uniform."""
        return _levels(self.codebook, bits, self.group_size, device)

    def _encode_per_token(self, x: torch.Tensor, bits: int, sdt: torch.dtype) -> tuple[torch.Tensor, ...]:
        groups = channel_groups(x, self.group_size)
        levels = self.levels(bits, x.device)
        zdt = kivi_zero_dtype(self.scale_dtype, x.dtype, per_token=True)
        codes, scale, zero = quant.quantize_asymmetric(groups, bits, -1, sdt, levels, zdt)
        return quant.pack(codes.view(x.shape), bits), scale.squeeze(-1), zero.squeeze(-1)  # (B, H, n, D/G)

    def encode(self, k: torch.Tensor, v: torch.Tensor) -> Parts:
        b, h, n, dk = k.shape
        sdt = kivi_scale_dtype(self.scale_dtype, k.dtype)
        if self.per_token_keys:
            kp, ks, kz = self._encode_per_token(k, self.key_bits, sdt)
        else:
            kg = k.view(b, h, n // self.group_size, self.group_size, dk)  # (B, H, n/G, G, Dk): a group is G tokens
            levels = self.levels(self.key_bits, k.device)
            zdt = kivi_zero_dtype(self.scale_dtype, k.dtype, per_token=False)
            kc, ks, kz = quant.quantize_asymmetric(kg, self.key_bits, 3, sdt, levels, zdt)
            kp, ks, kz = quant.pack(kc.view(b, h, n, dk), self.key_bits), ks.squeeze(3), kz.squeeze(3)  # (B,H,n/G,Dk)
        vp, vs, vz = self._encode_per_token(v, self.value_bits, sdt)
        return {"k": kp, "ks": ks, "kz": kz, "v": vp, "vs": vs, "vz": vz}

    def like(self, k: torch.Tensor, v: torch.Tensor) -> Parts:
        """Zero-token tensors with the dtype, device and trailing shape of each stored tensor of ``k`` / ``v``."""
        b, h, _, dk = k.shape
        dv = v.shape[-1]
        sdt = kivi_scale_dtype(self.scale_dtype, k.dtype)
        kzdt = kivi_zero_dtype(self.scale_dtype, k.dtype, self.per_token_keys)
        vzdt = kivi_zero_dtype(self.scale_dtype, v.dtype, per_token=True)
        key_params = dk // self.group_size if self.per_token_keys else dk
        return {
            "k": k.new_empty((b, h, 0, quant.pack_width(dk, self.key_bits)), dtype=torch.uint8),
            "ks": k.new_empty((b, h, 0, key_params), dtype=sdt),
            "kz": k.new_empty((b, h, 0, key_params), dtype=kzdt),
            "v": v.new_empty((b, h, 0, quant.pack_width(dv, self.value_bits)), dtype=torch.uint8),
            "vs": v.new_empty((b, h, 0, dv // self.group_size), dtype=sdt),
            "vz": v.new_empty((b, h, 0, dv // self.group_size), dtype=vzdt),
        }

    def encode_into(self, k: torch.Tensor, v: torch.Tensor, out: Parts) -> None:
        """:meth:`encode` written straight into ``out`` (views of the storage for these tokens): one kernel per layer
        on CUDA (``hf_kvcache::encode_kivi``)."""
        encode_kivi(k, v, out["k"], out["ks"], out["kz"], out["v"], out["vs"], out["vz"], self.key_bits,
                    self.value_bits, self.group_size, self.per_token_keys, self.codebook)  # fmt: skip

    def width(self, parts: Parts, name: str) -> int:
        """Channels per head of the stored ``"k"`` or ``"v"`` codes (packed ``8 / bits`` per byte)."""
        return parts[name].shape[-1] * 8 // (self.key_bits if name == "k" else self.value_bits)

    def segment(self, parts: Parts, start: int = 0) -> KiviSegment | KiviTokenSegment:
        """The tokens of ``parts`` (aligned to key groups) from ``start`` on, as the kernels read them."""
        levels = _codebooks(self.codebook, self.key_bits, self.value_bits, self.group_size, parts["k"].device)
        if self.per_token_keys:
            stored = (parts[n][:, :, start:] for n in _STORED)
            return KiviTokenSegment(self.key_bits, self.value_bits, self.group_size, *stored, *levels)
        length = parts["k"].shape[2] - start
        bits = (self.key_bits, self.value_bits)
        return KiviSegment(*bits, self.group_size, start, length, *(parts[n] for n in _STORED), *levels)

    @_float32_arithmetic
    def _decode_per_token(self, codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, out: torch.Tensor,
                          bits: int):  # fmt: skip
        _unpack_into(codes, bits, out, self.levels(bits, out.device))
        g = channel_groups(out, self.group_size)
        g.mul_(scale.unsqueeze(-1)).add_(zero.unsqueeze(-1))

    @_float32_arithmetic
    def _decode_key_groups(self, codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, out: torch.Tensor,
                           bits: int):  # fmt: skip
        b, h, t, dk = out.shape
        _unpack_into(codes, bits, out, self.levels(bits, out.device))
        kg = out.view(b, h, t // self.group_size, self.group_size, dk)
        kg.mul_(scale.unsqueeze(3)).add_(zero.unsqueeze(3))

    def _kernel_layout(self, rope: KeyTurn | None, key_dim: int) -> bool:
        """Whether the CPU kernel reads these codes and keys: uniform levels, RoPE (if any) over the whole head in
        ``rotate_half`` pairs."""
        return self.codebook == "uniform" and (rope is None or _rope_whole_head(rope, key_dim))

    def reads_natively(self, dtype: torch.dtype, key_dim: int, value_dim: int, rope: KeyTurn | None,
                       rotate: bool = False) -> bool:  # fmt: skip
        """Whether :meth:`decode_native` serves a layer of ``dtype`` K/V of these widths (its CPU kernel built)."""
        if not self._kernel_layout(rope, key_dim):
            return False
        if dtype != torch.float32 or kivi_scale_dtype(self.scale_dtype, dtype) not in (torch.float32, quant.E5M3):
            return False
        widths = all(cpu_native.width_served(w, rotate) for w in (key_dim, value_dim))
        return widths and all(b in cpu_native.BITS for b in (self.key_bits, self.value_bits)) and cpu_native.usable()

    def decode_native(self, parts: Parts, k_out: torch.Tensor, v_out: torch.Tensor, rope: KeyTurn | None,
                      rotate: bool) -> bool:  # fmt: skip
        """:meth:`decode` by the CPU kernel (:mod:`hf_kvcache.kernels.cpu_native`) in one pass per token, the
        Hadamard rotation undone where ``rotate`` (:class:`RotatedCodec`): True where it did, False (nothing
        written) where it cannot serve (a codebook, RoPE on part of the head or interleaved, not float32, ...)."""
        if not self._kernel_layout(rope, k_out.shape[-1]):
            return False
        table = None if rope is None else angle_table(rope[0].inv_freq, rope[1] + k_out.shape[-2])
        # 8-bit scales are read as float32 copies: a 32nd of the codes' elements at the default group
        keys = (parts["k"], *_float_params(parts["ks"], parts["kz"], self.key_bits), k_out, self.key_bits)
        values = (parts["v"], *_float_params(parts["vs"], parts["vz"], self.value_bits), v_out, self.value_bits)
        if not (cpu_native.serves(*keys, rotate, table) and cpu_native.serves(*values, rotate, None)):
            return False
        turn = None if rope is None else (table, rope[1])
        return cpu_native.decode_kivi(*keys, self.group_size, self.per_token_keys, rotate, turn) and (
            cpu_native.decode_kivi(*values, self.group_size, True, rotate)
        )

    def decode(self, parts: Parts, k_out: torch.Tensor, v_out: torch.Tensor, rope: KeyTurn | None = None) -> None:
        if self.decode_native(parts, k_out, v_out, rope, rotate=False):
            return
        ks, kz = _float_params(parts["ks"], parts["kz"], self.key_bits)
        if self.per_token_keys:
            self._decode_per_token(parts["k"], ks, kz, k_out, self.key_bits)
        else:
            self._decode_key_groups(parts["k"], ks, kz, k_out, self.key_bits)
        vs, vz = _float_params(parts["vs"], parts["vz"], self.value_bits)
        self._decode_per_token(parts["v"], vs, vz, v_out, self.value_bits)
        turn_keys(k_out, rope)

    def bytes_per_token(
        self, num_kv_heads: int, key_dim: int, value_dim: int, kv_dtype: torch.dtype = torch.bfloat16
    ) -> float:
        """Stored bytes per quantized token of one layer (keys and values, all heads); excludes the residual."""
        scale = kivi_scale_dtype(self.scale_dtype, kv_dtype).itemsize
        key_zero = kivi_zero_dtype(self.scale_dtype, kv_dtype, self.per_token_keys).itemsize
        value_zero = kivi_zero_dtype(self.scale_dtype, kv_dtype, per_token=True).itemsize
        data = (key_dim * self.key_bits + value_dim * self.value_bits) / 8
        if self.per_token_keys:  # scale + zero per token and group of G channels
            key_params = (key_dim // self.group_size) * (scale + key_zero)
        else:  # scale + zero per channel, shared by G tokens
            key_params = key_dim * (scale + key_zero) / self.group_size
        value_params = (value_dim // self.group_size) * (scale + value_zero)
        return num_kv_heads * (data + key_params + value_params)

"""What a cache layer hands the ``hf_kvcache`` attention instead of materialized K/V: typed views of its storage.

A :class:`KVHandle` is an ordered tuple of segments; attention reads them in order, and column ``j`` of the attention
mask is token ``j`` of their concatenation. Every segment is a frozen dataclass of plain tensors (views of the
cache's storage, never copies of its history) and knows how to read a range of its tokens back in float32
(:meth:`read`), which is what the pure-torch reference kernels use; the Triton kernels read the same tensors in place.

Layouts (``B`` batch, ``H`` KV heads, ``T`` tokens, ``D`` channels):

* :class:`DenseSegment`: keys ``(B, H, T, Dk)`` and values ``(B, H, T, Dv)`` in the model's dtype (residual, new
  tokens, a full-precision window, re-rotated sinks).
* :class:`Int8Segment`: int8 codes ``(B, H, T, D)`` and scales ``(B, H, T, D / G)``, ``G`` channels per scale
  (:class:`~hf_kvcache.layers._codecs.Int8Codec`).
* :class:`KiviSegment`: KIVI codes packed ``8 / bits`` per byte, low bits first (3 bits: two bit planes, see
  :func:`hf_kvcache.quant.pack`), ``(B, H, T, D * bits / 8)``; keys
  scale / zero point per (group of ``G`` tokens, channel) ``(B, H, T / G, Dk)``, values per (token, group of ``G``
  channels) ``(B, H, T, Dv / G)``. The segment covers tokens ``start .. start + length`` of these arrays (a sliding
  layer may start inside a key group).
* :class:`KiviTokenSegment`: KIVI codes as above with keys quantized per token like the values (``key_axis="token"``,
  KIVI's ablation): keys and values scale / zero point per (token, group of ``G`` channels), ``(B, H, T, D / G)``.
  Served by the pure-torch reference on every device (the Triton kernel reads per-channel keys only).
* :class:`RotatedSegment`: any quantized segment above whose keys and values were stored Hadamard-rotated
  (``rotate="hadamard"``); read with the query rotated and each split's accumulator rotated back.
* :class:`PreRopeSegment`: a quantized segment whose keys were stored before RoPE (``pre_rope=True``), rotated to
  their positions as they are read.
* :class:`PagedSegment`: a block pool ``(slots, H, D)`` addressed through a block table ``(B, blocks)`` (int32 on the
  pool's device; :data:`~hf_kvcache.paging.PAD_BLOCK` entries are padding and must be masked), ``length`` tokens per
  row; optionally int8 pages with one scale per token and head, ``(slots, H)``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..rope import RotarySpec, rotate_positions

__all__ = [
    "DenseSegment",
    "Int8Segment",
    "KVHandle",
    "KiviSegment",
    "KiviTokenSegment",
    "PagedSegment",
    "PreRopeSegment",
    "RotatedSegment",
    "Segment",
    "segment_heads",
    "segment_value_dim",
]


def _group_expand(scale: torch.Tensor, width: int) -> torch.Tensor:
    """``(..., D / G)`` per-group scales to ``(..., D)`` per-channel."""
    return scale.float().repeat_interleave(width // scale.shape[-1], dim=-1)


@dataclass(frozen=True)
class DenseSegment:
    keys: torch.Tensor  # (B, H, T, Dk)
    values: torch.Tensor  # (B, H, T, Dv)

    @property
    def length(self) -> int:
        return self.keys.shape[2]

    def read(self, a: int, b: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.keys[:, :, a:b].float(), self.values[:, :, a:b].float()


@dataclass(frozen=True)
class Int8Segment:
    k: torch.Tensor  # (B, H, T, Dk) int8
    ks: torch.Tensor  # (B, H, T, Dk / Gk)
    v: torch.Tensor  # (B, H, T, Dv) int8
    vs: torch.Tensor  # (B, H, T, Dv / Gv)

    @property
    def length(self) -> int:
        return self.k.shape[2]

    @property
    def per_token_scales(self) -> bool:
        """One scale per token and head (int8's default): the scales fold into scores and weights, in the reference
        (:meth:`read_folded`) and the Triton kernel alike."""
        return self.ks.shape[-1] == 1 and self.vs.shape[-1] == 1

    def read_folded(self, a: int, b: int) -> tuple[torch.Tensor, ...] | None:
        """Codes and ``(B, H, n)`` scales of tokens ``a:b`` when :attr:`per_token_scales`, else None."""
        if not self.per_token_scales:
            return None
        k, v = self.k[:, :, a:b].float(), self.v[:, :, a:b].float()
        return k, self.ks[:, :, a:b, 0].float(), v, self.vs[:, :, a:b, 0].float()

    def read(self, a: int, b: int) -> tuple[torch.Tensor, torch.Tensor]:
        k = self.k[:, :, a:b].float() * _group_expand(self.ks[:, :, a:b], self.k.shape[-1])
        v = self.v[:, :, a:b].float() * _group_expand(self.vs[:, :, a:b], self.v.shape[-1])
        return k, v


def _unpack(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """``(..., D * bits / 8)`` uint8 -> ``(..., D)`` float32 codes (3 bits: a 2-bit plane, then a 1-bit plane; see
    :func:`hf_kvcache.quant.pack`)."""
    if bits == 3:
        low = packed.shape[-1] * 2 // 3  # D / 4 bytes of low 2 bits, then D / 8 of high bits
        return _unpack(packed[..., :low], 2) + 4 * _unpack(packed[..., low:], 1)
    per_byte = 8 // bits
    shifts = torch.arange(per_byte, device=packed.device, dtype=torch.uint8) * bits
    codes = (packed.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)  # (..., D / k, k)
    return codes.flatten(-2).float()


@dataclass(frozen=True)
class KiviSegment:
    bits: int
    group: int  # G: tokens per key group, channels per value group
    start: int  # first token of the segment in the arrays' token axis
    length: int
    k: torch.Tensor  # (B, H, T, Dk * bits / 8) uint8
    ks: torch.Tensor  # (B, H, T / G, Dk)
    kz: torch.Tensor
    v: torch.Tensor  # (B, H, T, Dv * bits / 8) uint8
    vs: torch.Tensor  # (B, H, T, Dv / G)
    vz: torch.Tensor

    def read(self, a: int, b: int) -> tuple[torch.Tensor, torch.Tensor]:
        a, b = a + self.start, b + self.start
        groups = torch.arange(a, b, device=self.k.device) // self.group
        k = _unpack(self.k[:, :, a:b], self.bits) * self.ks[:, :, groups].float() + self.kz[:, :, groups].float()
        width = self.v.shape[-1] * 8 // self.bits
        v = _unpack(self.v[:, :, a:b], self.bits) * _group_expand(self.vs[:, :, a:b], width)
        return k, v + _group_expand(self.vz[:, :, a:b], width)


@dataclass(frozen=True)
class KiviTokenSegment:
    bits: int
    group: int  # G: channels per key group and per value group
    k: torch.Tensor  # (B, H, T, Dk * bits / 8) uint8
    ks: torch.Tensor  # (B, H, T, Dk / G)
    kz: torch.Tensor
    v: torch.Tensor  # (B, H, T, Dv * bits / 8) uint8
    vs: torch.Tensor  # (B, H, T, Dv / G)
    vz: torch.Tensor

    @property
    def length(self) -> int:
        return self.k.shape[2]

    def _read(self, codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, a: int, b: int) -> torch.Tensor:
        width = codes.shape[-1] * 8 // self.bits
        x = _unpack(codes[:, :, a:b], self.bits) * _group_expand(scale[:, :, a:b], width)
        return x + _group_expand(zero[:, :, a:b], width)

    def read(self, a: int, b: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self._read(self.k, self.ks, self.kz, a, b), self._read(self.v, self.vs, self.vz, a, b)


@dataclass(frozen=True)
class PagedSegment:
    keys: torch.Tensor  # (slots, H, Dk): model dtype, or int8 codes with key_scales
    values: torch.Tensor  # (slots, H, Dv)
    block_table: torch.Tensor  # (B, blocks) int32; PAD_BLOCK (-1) entries are masked padding
    block_size: int
    length: int  # tokens per row
    key_scales: torch.Tensor | None = None  # (slots, H) for int8 pages
    value_scales: torch.Tensor | None = None

    def slots(self, a: int, b: int) -> torch.Tensor:
        """``(B, b - a)`` storage slots of tokens ``a .. b`` (padding entries read slot 0)."""
        positions = torch.arange(a, b, device=self.block_table.device)
        blocks = self.block_table[:, positions // self.block_size].long().clamp_min(0)
        return blocks * self.block_size + positions % self.block_size

    def read(self, a: int, b: int) -> tuple[torch.Tensor, torch.Tensor]:
        slots = self.slots(a, b)
        batch, n = slots.shape
        flat = slots.flatten()
        k = self.keys.index_select(0, flat).float()  # (B * n, H, Dk)
        v = self.values.index_select(0, flat).float()
        if self.key_scales is not None:
            k = k * self.key_scales.index_select(0, flat).float().unsqueeze(-1)
            v = v * self.value_scales.index_select(0, flat).float().unsqueeze(-1)
        # (B * n, H, D) -> (B, H, n, D)
        return k.view(batch, n, *k.shape[1:]).transpose(1, 2), v.view(batch, n, *v.shape[1:]).transpose(1, 2)


@dataclass(frozen=True)
class RotatedSegment:
    """A quantized segment whose keys and values were stored rotated by orthonormal, symmetric transforms of the head
    dimension (``rotate="hadamard"``: ``k H_k``, ``v H_v``).

    Attention reads the codes as they are: scores are unchanged with the query rotated, ``q . k = (q H_k) . (k H_k)``,
    and a split's accumulator comes out rotated, ``sum_j p_j (v_j H_v) = (sum_j p_j v_j) H_v``, so it is rotated back
    once per split (``H_v H_v = I``). :meth:`read` rotates the decoded tokens back instead: the plain reading the fold
    is tested against.
    """

    inner: DenseSegment | Int8Segment | KiviSegment | KiviTokenSegment
    key_rotation: torch.Tensor  # (Dk, Dk) float32
    value_rotation: torch.Tensor  # (Dv, Dv) float32

    @property
    def length(self) -> int:
        return self.inner.length

    def read(self, a: int, b: int) -> tuple[torch.Tensor, torch.Tensor]:
        k, v = self.inner.read(a, b)
        return k @ self.key_rotation, v @ self.value_rotation


@dataclass(frozen=True)
class PreRopeSegment:
    """A quantized segment whose keys were stored before RoPE (``pre_rope=True``, KVQuant): token ``t`` of the segment
    sits at position ``first + t`` and its key is rotated there as it is read, chunk by chunk (:meth:`read`); values
    are read as stored. The Triton kernel turns each tile of keys in registers; over a :class:`RotatedSegment` the
    reference serves it on every device (RoPE sits between the rotation and the query, so the rotation cannot be
    folded). Not a custom op: on CUDA the Triton launch is called directly, elsewhere the reference."""

    inner: DenseSegment | Int8Segment | KiviSegment | KiviTokenSegment | RotatedSegment
    rotary: RotarySpec
    first: int  # position (token index in the layer) of the segment's first token

    @property
    def length(self) -> int:
        return self.inner.length

    def read(self, a: int, b: int) -> tuple[torch.Tensor, torch.Tensor]:
        k, v = self.inner.read(a, b)
        return rotate_positions(k, self.first + a, self.rotary), v


Segment = DenseSegment | Int8Segment | KiviSegment | KiviTokenSegment | PagedSegment | RotatedSegment | PreRopeSegment


def segment_heads(segment: Segment) -> int:
    """KV heads of a segment."""
    if isinstance(segment, (RotatedSegment, PreRopeSegment)):
        return segment_heads(segment.inner)
    return segment.keys.shape[1] if isinstance(segment, (DenseSegment, PagedSegment)) else segment.k.shape[1]


def segment_value_dim(segment: Segment) -> int:
    """Channels per head of a segment's values."""
    if isinstance(segment, PreRopeSegment):
        return segment_value_dim(segment.inner)
    if isinstance(segment, RotatedSegment):
        return segment.value_rotation.shape[-1]
    if isinstance(segment, (DenseSegment, PagedSegment)):
        return segment.values.shape[-1]
    if isinstance(segment, (KiviSegment, KiviTokenSegment)):
        return segment.v.shape[-1] * 8 // segment.bits
    return segment.v.shape[-1]


@dataclass(frozen=True)
class KVHandle:
    """What a layer of our caches returns (as both "keys" and "values") under the ``hf_kvcache`` attention.

    Only the ``hf_kvcache`` attention function reads it. A model whose attention code works on the cached keys or
    values itself between the cache and the attention function (DiffLlama splits the values, Doge transposes them,
    JetMoE repeats them) gets a one-line ``ValueError`` naming its ``model_type`` at the first such use, never a
    ``TypeError`` from deep inside the model: load it with ``sdpa`` or ``eager`` attention.
    """

    segments: tuple[Segment, ...]
    model_type: str | None = field(default=None, compare=False)

    def _refuse(self, use: str):
        raise ValueError(
            f"model_type {self.model_type!r} works on the cached keys or values itself ({use}) before calling its "
            "attention function, so attn_implementation='hf_kvcache' cannot serve it; load or set the model with "
            "'sdpa' or 'eager' attention, which every hf_kvcache cache serves"
        )

    def __getattr__(self, name: str):
        if name.startswith("__"):  # copy, pickle and friends probe these: a plain AttributeError
            raise AttributeError(name)
        self._refuse(f".{name}")

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        handle = next(a for a in (*args, *(kwargs or {}).values()) if isinstance(a, KVHandle))
        handle._refuse(f"{getattr(func, '__name__', func)}()")

    @property
    def length(self) -> int:
        return sum(s.length for s in self.segments)

    @property
    def value_dim(self) -> int:
        return segment_value_dim(self.segments[0])

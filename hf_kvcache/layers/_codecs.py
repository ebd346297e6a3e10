"""Codecs: how a quantized cache layer turns K/V chunks into stored tensors and back.

A codec names its stored tensors and their token units (``units``: tokens per slot along the token axis, for
:class:`~hf_kvcache.layers._storage.TokenBuffers`), encodes a chunk of ``n`` tokens (``n`` a multiple of ``unit``)
into a dict of plain tensors, and decodes such a dict (any token range aligned to ``unit``) into caller-provided
output tensors. The same dicts are what the fused attention kernels read (:mod:`hf_kvcache.kernels`).

Keys and values may differ in width (latent attention); every group is taken within one tensor.
"""

from __future__ import annotations

import torch

from .. import quant
from ..kernels import Int8Segment, KiviSegment, RotatedSegment
from ..kernels.ops import append_kv
from ..kernels.segments import KiviTokenSegment

__all__ = ["KEY_AXES", "ROTATIONS", "Int8Codec", "KiviCodec", "RotatedCodec", "hadamard", "kivi_scale_dtype"]

KEY_AXES = ("channel", "token")  # KIVI keys: per channel (the paper's choice, the default) or per token (its ablation)
ROTATIONS = ("hadamard",)

Parts = dict[str, torch.Tensor]


def _groups(x: torch.Tensor, group_size: int) -> torch.Tensor:
    """Split the last (channel) axis into groups: ``(B, H, T, D) -> (B, H, T, D / G, G)``."""
    return x.view(*x.shape[:-1], x.shape[-1] // group_size, group_size)


def kivi_scale_dtype(scale_dtype: torch.dtype | None, kv_dtype: torch.dtype) -> torch.dtype:
    """KIVI's scale dtype: ``scale_dtype`` when set, else the K/V dtype when it is 16-bit (KIVI stores fp16 scales),
    else float32."""
    if scale_dtype is not None:
        return scale_dtype
    return kv_dtype if kv_dtype.itemsize == 2 else torch.float32


class Int8Codec:
    """Symmetric absmax int8, one scale per token, head and channel group (``group_size`` channels; None: the whole
    head). Every token is encoded on its own, so it can leave the residual as soon as it arrives (``unit = 1``).

    Stored: ``k`` / ``v`` int8 ``(B, H, T, D)``; ``ks`` / ``vs`` scales ``(B, H, T, D / G)``.
    """

    unit = 1
    units = {"k": 1, "ks": 1, "v": 1, "vs": 1}

    def __init__(self, group_size: int | None, scale_dtype: torch.dtype, backend: str = "torch"):
        self.group_size = group_size
        self.scale_dtype = scale_dtype
        self.backend = backend

    def group(self, width: int) -> int:
        """Channels per scale for a tensor of ``width`` channels."""
        return self.group_size or width

    def _encode_one(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        g = _groups(x, self.group(x.shape[-1]))  # (B, H, n, D/G, G)
        if self.backend == "bitsandbytes":
            return _bnb_int8(g, self.scale_dtype)
        codes, scale = quant.quantize_symmetric(g, dim=-1, scale_dtype=self.scale_dtype)
        return codes.view(x.shape), scale.squeeze(-1)

    def encode(self, k: torch.Tensor, v: torch.Tensor) -> Parts:
        kc, ks = self._encode_one(k)
        vc, vs = self._encode_one(v)
        return {"k": kc, "ks": ks, "v": vc, "vs": vs}

    def like(self, k: torch.Tensor, v: torch.Tensor) -> Parts:
        """Zero-token tensors with the dtype, device and trailing shape of each stored tensor of ``k`` / ``v``."""
        b, h = k.shape[:2]
        dk, dv = k.shape[-1], v.shape[-1]
        return {
            "k": k.new_empty((b, h, 0, dk), dtype=torch.int8),
            "ks": k.new_empty((b, h, 0, dk // self.group(dk)), dtype=self.scale_dtype),
            "v": v.new_empty((b, h, 0, dv), dtype=torch.int8),
            "vs": v.new_empty((b, h, 0, dv // self.group(dv)), dtype=self.scale_dtype),
        }

    def encode_into(self, k: torch.Tensor, v: torch.Tensor, out: Parts) -> None:
        """:meth:`encode` written straight into ``out`` (views of the storage): one kernel per layer on CUDA."""
        if self.backend == "bitsandbytes":
            for name, t in self.encode(k, v).items():
                out[name].copy_(t)
            return
        append_kv(k, v, out["k"], out["v"], out["ks"], out["vs"])

    def _decode_one(self, codes: torch.Tensor, scale: torch.Tensor, out: torch.Tensor) -> None:
        # copy_ then an in-place multiply (not torch.mul(out=)): `out` is often a non-contiguous workspace slice,
        # which torch.compile cannot take as an `out=` argument.
        groups = _groups(out, self.group(out.shape[-1]))
        groups.copy_(_groups(codes, self.group(codes.shape[-1])))
        groups.mul_(scale.unsqueeze(-1))

    def decode(self, parts: Parts, k_out: torch.Tensor, v_out: torch.Tensor) -> None:
        self._decode_one(parts["k"], parts["ks"], k_out)
        self._decode_one(parts["v"], parts["vs"], v_out)

    @staticmethod
    def width(parts: Parts, name: str) -> int:
        """Channels per head of the stored ``"k"`` or ``"v"`` codes."""
        return parts[name].shape[-1]

    def segment(self, parts: Parts, start: int = 0) -> Int8Segment:
        """The tokens of ``parts`` from ``start`` on, as the kernels read them (views, no copy)."""
        return Int8Segment(*(parts[name][:, :, start:] for name in ("k", "ks", "v", "vs")))

    def bytes_per_token(
        self, num_kv_heads: int, key_dim: int, value_dim: int, kv_dtype: torch.dtype = torch.bfloat16
    ) -> float:
        """Stored bytes per token of one layer (keys and values, all heads); the K/V dtype does not matter."""
        scale = self.scale_dtype.itemsize
        return num_kv_heads * sum(d + d // self.group(d) * scale for d in (key_dim, value_dim))


def _bnb_int8(g: torch.Tensor, scale_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """int8 codes with bitsandbytes' row-wise absmax quantizer (``int8_vectorwise_quant``)."""
    import bitsandbytes.functional as bnbf

    shape = g.shape
    # bitsandbytes has no notion of non-finite inputs: apply our documented mapping first (NaN -> 0, +-inf -> +-max).
    finite = torch.isfinite(g)
    absmax = torch.where(finite, g.abs(), 0).amax(dim=-1, keepdim=True)
    g = torch.where(finite, g, torch.where(torch.isnan(g), 0, torch.sign(g) * absmax))
    codes, row_absmax, _ = bnbf.int8_vectorwise_quant(g.reshape(-1, shape[-1]).contiguous())
    scale = (row_absmax.float() / 127.0).to(scale_dtype).view(shape[:-1])
    return codes.view(*shape[:-2], shape[-2] * shape[-1]), scale


class KiviCodec:
    """KIVI 4/3/2-bit: keys per channel over groups of ``group_size`` tokens, values per token over groups of
    ``group_size`` channels; asymmetric (scale + zero point); codes packed ``8 // bits`` per byte, low bits first
    (3 bits: 8 codes in 3 bytes, see :func:`~hf_kvcache.quant.pack`).

    Keys need a full group of tokens before they can be encoded, so tokens leave the residual ``group_size`` at a
    time (``unit = group_size``).

    With ``key_axis="token"`` (the paper's ablation) keys are quantized like the values: per token over groups of
    ``group_size`` channels, so every token is encoded on its own (``unit = 1``).

    Stored: ``k`` / ``v`` uint8 ``(B, H, T, D * bits / 8)``; ``ks`` / ``kz`` ``(B, H, T / G, Dk)`` (one per key
    group and channel; ``(B, H, T, Dk / G)`` per token and channel group with ``key_axis="token"``); ``vs`` / ``vz``
    ``(B, H, T, Dv / G)`` (one per token and channel group).
    """

    def __init__(self, bits: int, group_size: int, scale_dtype: torch.dtype | None, key_axis: str = "channel"):
        self.bits = bits
        self.group_size = group_size
        self.scale_dtype = scale_dtype  # None: see kivi_scale_dtype
        self.key_axis = key_axis
        self.per_token_keys = key_axis == "token"
        self.unit = 1 if self.per_token_keys else group_size
        key_units = 1 if self.per_token_keys else group_size
        self.units = {"k": 1, "ks": key_units, "kz": key_units, "v": 1, "vs": 1, "vz": 1}

    def _encode_per_token(self, x: torch.Tensor, sdt: torch.dtype) -> tuple[torch.Tensor, ...]:
        codes, scale, zero = quant.quantize_asymmetric(_groups(x, self.group_size), self.bits, dim=-1, scale_dtype=sdt)
        return quant.pack(codes.view(x.shape), self.bits), scale.squeeze(-1), zero.squeeze(-1)  # (B, H, n, D/G)

    def encode(self, k: torch.Tensor, v: torch.Tensor) -> Parts:
        b, h, n, dk = k.shape
        sdt = kivi_scale_dtype(self.scale_dtype, k.dtype)
        if self.per_token_keys:
            kp, ks, kz = self._encode_per_token(k, sdt)
        else:
            kg = k.view(b, h, n // self.group_size, self.group_size, dk)  # (B, H, n/G, G, Dk): a group is G tokens
            kc, ks, kz = quant.quantize_asymmetric(kg, self.bits, dim=3, scale_dtype=sdt)
            kp, ks, kz = quant.pack(kc.view(b, h, n, dk), self.bits), ks.squeeze(3), kz.squeeze(3)  # (B, H, n/G, Dk)
        vp, vs, vz = self._encode_per_token(v, sdt)
        return {"k": kp, "ks": ks, "kz": kz, "v": vp, "vs": vs, "vz": vz}

    def width(self, parts: Parts, name: str) -> int:
        """Channels per head of the stored ``"k"`` or ``"v"`` codes (packed ``8 / bits`` per byte)."""
        return parts[name].shape[-1] * 8 // self.bits

    def segment(self, parts: Parts, start: int = 0) -> KiviSegment | KiviTokenSegment:
        """The tokens of ``parts`` (aligned to key groups) from ``start`` on, as the kernels read them."""
        names = ("k", "ks", "kz", "v", "vs", "vz")
        if self.per_token_keys:
            return KiviTokenSegment(self.bits, self.group_size, *(parts[n][:, :, start:] for n in names))
        length = parts["k"].shape[2] - start
        return KiviSegment(self.bits, self.group_size, start, length, *(parts[n] for n in names))

    def _decode_per_token(self, codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, out: torch.Tensor):
        quant.unpack(codes, self.bits, out=out)
        g = _groups(out, self.group_size)
        g.mul_(scale.unsqueeze(-1)).add_(zero.unsqueeze(-1))

    def decode(self, parts: Parts, k_out: torch.Tensor, v_out: torch.Tensor) -> None:
        if self.per_token_keys:
            self._decode_per_token(parts["k"], parts["ks"], parts["kz"], k_out)
        else:
            b, h, t, dk = k_out.shape
            quant.unpack(parts["k"], self.bits, out=k_out)
            kg = k_out.view(b, h, t // self.group_size, self.group_size, dk)
            kg.mul_(parts["ks"].unsqueeze(3)).add_(parts["kz"].unsqueeze(3))
        self._decode_per_token(parts["v"], parts["vs"], parts["vz"], v_out)

    def bytes_per_token(
        self, num_kv_heads: int, key_dim: int, value_dim: int, kv_dtype: torch.dtype = torch.bfloat16
    ) -> float:
        """Stored bytes per quantized token of one layer (keys and values, all heads); excludes the residual."""
        scale = kivi_scale_dtype(self.scale_dtype, kv_dtype).itemsize
        data = (key_dim + value_dim) * self.bits / 8
        if self.per_token_keys:  # scale + zero per token and group of G channels
            key_params = 2 * (key_dim // self.group_size) * scale
        else:  # scale + zero per channel, shared by G tokens
            key_params = 2 * key_dim * scale / self.group_size
        value_params = 2 * (value_dim // self.group_size) * scale
        return num_kv_heads * (data + key_params + value_params)


_HADAMARD: dict[tuple[int, torch.dtype, torch.device], torch.Tensor] = {}


def hadamard(width: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """An orthonormal, symmetric ``(width, width)`` Hadamard transform (so it is its own inverse): Sylvester's
    construction on blocks of the largest power of two dividing ``width``, block-diagonal for other widths
    (96 = 3 blocks of 32). Built in float64, cached per width, dtype and device."""
    key = (width, dtype, torch.device(device))
    if key not in _HADAMARD:
        block = width & -width  # the largest power of two dividing width
        h = torch.ones(1, 1, dtype=torch.float64)
        while h.shape[0] < block:
            h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
        h = torch.block_diag(*[h / block**0.5] * (width // block))
        _HADAMARD[key] = h.to(dtype=dtype, device=device)
    return _HADAMARD[key]


class RotatedCodec:
    """Any codec, applied to keys and values rotated by a Hadamard transform of the head dimension (QuaRot,
    TurboQuant): an outlier channel is spread over every channel of its block before quantizing, and decoding
    rotates back (the transform is orthonormal and symmetric, its own inverse). Stored tensors and bytes are the
    inner codec's. The kernels read the codes in place (:class:`~hf_kvcache.kernels.RotatedSegment`): the rotation
    is folded into the query and the attention output, so a decode step adds two small products per layer instead of
    one per cached token."""

    def __init__(self, inner):
        self.inner = inner
        self.unit, self.units = inner.unit, inner.units

    def __getattr__(self, name):  # group_size, bits, key_axis, ... of the inner codec
        if name == "inner":
            raise AttributeError(name)
        return getattr(self.inner, name)

    @staticmethod
    def _rotate(x: torch.Tensor) -> torch.Tensor:
        return x @ hadamard(x.shape[-1], x.dtype, x.device)

    def encode(self, k: torch.Tensor, v: torch.Tensor) -> Parts:
        return self.inner.encode(self._rotate(k), self._rotate(v))

    def decode(self, parts: Parts, k_out: torch.Tensor, v_out: torch.Tensor) -> None:
        self.inner.decode(parts, k_out, v_out)
        k_out.copy_(self._rotate(k_out))
        v_out.copy_(self._rotate(v_out))

    def segment(self, parts: Parts, start: int = 0) -> RotatedSegment:
        inner = self.inner.segment(parts, start)
        device, (dk, dv) = parts["k"].device, (self.inner.width(parts, name) for name in ("k", "v"))
        return RotatedSegment(inner, hadamard(dk, torch.float32, device), hadamard(dv, torch.float32, device))

    def bytes_per_token(self, *args, **kwargs) -> float:
        return self.inner.bytes_per_token(*args, **kwargs)

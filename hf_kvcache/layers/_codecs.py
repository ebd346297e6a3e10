"""Codecs: how a quantized cache layer turns K/V chunks into stored tensors and back.

A codec names its stored tensors and their token units (for :class:`TokenBuffers`), encodes a chunk of ``n`` tokens
(``n`` a multiple of ``unit``), and decodes the live tokens of a buffer into caller-provided output tensors.
"""

from __future__ import annotations

import torch

from .. import quant
from ._storage import TokenBuffers


def _groups(x: torch.Tensor, group_size: int) -> torch.Tensor:
    """Split the last (head_dim) axis into groups: ``(B, H, T, D) -> (B, H, T, D / G, G)``."""
    return x.view(*x.shape[:-1], x.shape[-1] // group_size, group_size)


class Int8Codec:
    """Symmetric absmax int8, one scale per token, head and channel group (``group_size`` channels).

    Every token is encoded on its own, so a token can leave the residual as soon as it arrives (``unit = 1``).
    """

    unit = 1
    units = {"k": 1, "ks": 1, "v": 1, "vs": 1}

    def __init__(self, group_size: int, scale_dtype: torch.dtype, backend: str = "torch"):
        self.group_size = group_size
        self.scale_dtype = scale_dtype
        self.backend = backend

    def _encode_one(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        g = _groups(x, self.group_size)  # (B, H, n, D/G, G)
        if self.backend == "bitsandbytes":
            return _bnb_int8(g, self.scale_dtype)
        codes, scale = quant.quantize_symmetric(g, dim=-1, scale_dtype=self.scale_dtype)
        return codes.view(x.shape), scale.squeeze(-1)

    def encode(self, k: torch.Tensor, v: torch.Tensor) -> dict[str, torch.Tensor]:
        kc, ks = self._encode_one(k)
        vc, vs = self._encode_one(v)
        return {"k": kc, "ks": ks, "v": vc, "vs": vs}

    def _decode_one(self, codes: torch.Tensor, scale: torch.Tensor, out: torch.Tensor) -> None:
        torch.mul(_groups(codes, self.group_size), scale.unsqueeze(-1), out=_groups(out, self.group_size))

    def decode(self, buf: TokenBuffers, k_out: torch.Tensor, v_out: torch.Tensor) -> None:
        self._decode_one(buf.view("k"), buf.view("ks"), k_out)
        self._decode_one(buf.view("v"), buf.view("vs"), v_out)

    def bytes_per_token(self, num_kv_heads: int, head_dim: int) -> float:
        """Stored bytes per token of one layer (keys and values, all heads)."""
        scale = torch.finfo(self.scale_dtype).bits // 8
        return 2 * num_kv_heads * (head_dim + head_dim // self.group_size * scale)


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
    """KIVI 4/2-bit: keys per channel over groups of ``group_size`` tokens, values per token over groups of
    ``group_size`` channels; asymmetric (scale + zero point); codes packed ``8 // bits`` per byte.

    Keys need a full group of tokens before they can be encoded, so tokens leave the residual ``group_size`` at a
    time (``unit = group_size``).
    """

    def __init__(self, bits: int, group_size: int, scale_dtype: torch.dtype):
        self.bits = bits
        self.group_size = group_size
        self.scale_dtype = scale_dtype
        self.unit = group_size
        self.units = {"k": 1, "ks": group_size, "kz": group_size, "v": 1, "vs": 1, "vz": 1}

    def encode(self, k: torch.Tensor, v: torch.Tensor) -> dict[str, torch.Tensor]:
        b, h, n, d = k.shape
        # scale_dtype None: follow the K/V dtype when it is 16-bit (as KIVI stores fp16 scales), else float32.
        sdt = self.scale_dtype or (k.dtype if k.dtype.itemsize == 2 else torch.float32)
        kg = k.view(b, h, n // self.group_size, self.group_size, d)  # (B, H, n/G, G, D): a group is G tokens
        kc, ks, kz = quant.quantize_asymmetric(kg, self.bits, dim=3, scale_dtype=sdt)
        vc, vs, vz = quant.quantize_asymmetric(_groups(v, self.group_size), self.bits, dim=-1, scale_dtype=sdt)
        return {
            "k": quant.pack(kc.view(b, h, n, d), self.bits),
            "ks": ks.squeeze(3),  # (B, H, n/G, D)
            "kz": kz.squeeze(3),
            "v": quant.pack(vc.view(b, h, n, d), self.bits),
            "vs": vs.squeeze(-1),  # (B, H, n, D/G)
            "vz": vz.squeeze(-1),
        }

    def decode(self, buf: TokenBuffers, k_out: torch.Tensor, v_out: torch.Tensor) -> None:
        b, h, t, d = k_out.shape
        quant.unpack(buf.view("k"), self.bits, out=k_out)
        kg = k_out.view(b, h, t // self.group_size, self.group_size, d)
        kg.mul_(buf.view("ks").unsqueeze(3)).add_(buf.view("kz").unsqueeze(3))
        quant.unpack(buf.view("v"), self.bits, out=v_out)
        vg = _groups(v_out, self.group_size)
        vg.mul_(buf.view("vs").unsqueeze(-1)).add_(buf.view("vz").unsqueeze(-1))

    def bytes_per_token(self, num_kv_heads: int, head_dim: int) -> float:
        """Stored bytes per quantized token of one layer (keys and values, all heads); excludes the residual."""
        scale = torch.finfo(self.scale_dtype).bits // 8
        data = head_dim * self.bits / 8
        key_params = 2 * head_dim * scale / self.group_size  # scale + zero per channel, shared by G tokens
        value_params = 2 * (head_dim // self.group_size) * scale
        return num_kv_heads * (2 * data + key_params + value_params)

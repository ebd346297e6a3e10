"""fp8 storage: float8 e4m3 codes with one scale per token and head (absmax / 448), the KV-cache format vLLM and
TensorRT-LLM ship. Same bytes as int8; where int8 spends its 8 bits on 255 evenly spaced steps, e4m3 keeps 3 mantissa
bits at every magnitude, so small entries next to an outlier keep their relative precision.

Stored ``k`` / ``v`` uint8 ``(B, H, T, D)`` holding the e4m3 bits (``.view(torch.float8_e4m3fn)`` reads them: the
token buffers, beams and crops move plain bytes), ``ks`` / ``vs`` scales ``(B, H, T, 1)``; read by the
``hf_kvcache::partial_fp8`` op. The Triton kernel reads the codes in place and turns the bits into float16 fields in
registers, so a GPU without fp8 instructions (Ampere and older) reads them too; the scales fold into the scores and
the probabilities, as int8's do.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .. import quant
from ..kernels import reference
from ..kernels.storage import FP8, KernelStorage, LaunchPlan
from ._base import Partials, Parts, SegmentFormat, plan_warps, register_partial, swapped

__all__ = ["Fp8Codec", "Fp8Segment"]


@dataclass(frozen=True)
class Fp8Segment(SegmentFormat):
    k: torch.Tensor  # (B, H, T, Dk) uint8: e4m3 bits
    ks: torch.Tensor  # (B, H, T, 1)
    v: torch.Tensor  # (B, H, T, Dv) uint8
    vs: torch.Tensor  # (B, H, T, 1)

    @property
    def length(self) -> int:
        return self.k.shape[2]

    def read_keys(self, a: int, b: int) -> torch.Tensor:
        return quant.dequantize_fp8(self.k[:, :, a:b], self.ks[:, :, a:b])

    def read_values(self, a: int, b: int) -> torch.Tensor:
        return quant.dequantize_fp8(self.v[:, :, a:b], self.vs[:, :, a:b])

    def scores(self, query: torch.Tensor, a: int, b: int) -> torch.Tensor:
        # q . (code_t x scale_t) = (q . code_t) x scale_t
        codes = self.k[:, :, a:b].view(torch.float8_e4m3fn).float()
        return torch.einsum("bhgqd,bhnd->bhgqn", query, codes) * self.ks[:, :, None, None, a:b, 0].float()

    def weighted_values(self, weights: torch.Tensor, a: int, b: int) -> torch.Tensor:
        # sum_t w_t (code_t x scale_t) = sum_t (w_t x scale_t) code_t
        scaled = weights * self.vs[:, :, None, None, a:b, 0].float()
        return torch.einsum("bhgqn,bhnd->bhgqd", scaled, self.v[:, :, a:b].view(torch.float8_e4m3fn).float())

    def partial(self, query, mask, scaling, softcap, splits) -> Partials:
        return _OP(query, self.k, self.ks, self.v, self.vs, mask, scaling, softcap, splits)

    def kernel_storage(self) -> KernelStorage:
        k, v, ks, vs = self.k, self.v, self.ks, self.vs
        return KernelStorage(
            FP8, k, v, k.shape[-1], v.shape[-1], self.length, tuple(k.stride()), tuple(v.stride()), ks=ks, vs=vs,
            ks_strides=tuple(ks.stride()), vs_strides=tuple(vs.stride()), key_group=k.shape[-1],
            value_group=v.shape[-1], fold=True,
        )  # fmt: skip

    def launch_plan(self, query, mask, rotary_dim=0) -> LaunchPlan:
        """int8's plan with folded scales (the same bytes, read the same way; the bits turned in registers instead
        of converted): no pipelining, 32-token tiles unless swapped. Not yet tuned on a GPU of its own."""
        swap = swapped(query, self.heads)
        return LaunchPlan(
            block_n=64 if swap else 32, stages=1, warps=plan_warps(query, self.heads, mask, rotary_dim), swap=swap
        )


def _partial(
    query: torch.Tensor,
    k: torch.Tensor,
    ks: torch.Tensor,
    v: torch.Tensor,
    vs: torch.Tensor,
    mask: torch.Tensor | None,
    scaling: float,
    softcap: float,
    splits: int,
) -> Partials:
    return reference.partial(query, Fp8Segment(k, ks, v, vs), mask, scaling, softcap, splits)


_OP = register_partial(
    "partial_fp8",
    _partial,
    lambda k, ks, v, vs, mask, *rest: (Fp8Segment(k, ks, v, vs), mask, *rest),
    lambda q, k, ks, v, *rest: (k.shape[1], v.shape[-1]),
)


class Fp8Codec:
    """float8 e4m3 codes, one scale per token and head (:func:`hf_kvcache.quant.quantize_fp8`). Every token is
    encoded on its own, so it can leave the residual as soon as it arrives (``unit = 1``).

    Stored: ``k`` / ``v`` uint8 ``(B, H, T, D)`` (e4m3 bits); ``ks`` / ``vs`` scales ``(B, H, T, 1)``.
    """

    unit = 1
    units = {"k": 1, "ks": 1, "v": 1, "vs": 1}

    def __init__(self, scale_dtype: torch.dtype = torch.float32):
        self.scale_dtype = scale_dtype

    def encode(self, k: torch.Tensor, v: torch.Tensor) -> Parts:
        kc, ks = quant.quantize_fp8(k, dim=-1, scale_dtype=self.scale_dtype)
        vc, vs = quant.quantize_fp8(v, dim=-1, scale_dtype=self.scale_dtype)
        return {"k": kc, "ks": ks, "v": vc, "vs": vs}

    def like(self, k: torch.Tensor, v: torch.Tensor) -> Parts:
        """Zero-token tensors with the dtype, device and trailing shape of each stored tensor of ``k`` / ``v``."""
        b, h = k.shape[:2]
        return {
            "k": k.new_empty((b, h, 0, k.shape[-1]), dtype=torch.uint8),
            "ks": k.new_empty((b, h, 0, 1), dtype=self.scale_dtype),
            "v": v.new_empty((b, h, 0, v.shape[-1]), dtype=torch.uint8),
            "vs": v.new_empty((b, h, 0, 1), dtype=self.scale_dtype),
        }

    def encode_into(self, k: torch.Tensor, v: torch.Tensor, out: Parts) -> None:
        """:meth:`encode` copied into ``out`` (views of the storage): a few elementwise launches per layer on CUDA,
        where int8 has a fused append kernel."""
        for name, t in self.encode(k, v).items():
            out[name].copy_(t)

    def decode(self, parts: Parts, k_out: torch.Tensor, v_out: torch.Tensor) -> None:
        k_out.copy_(quant.dequantize_fp8(parts["k"], parts["ks"]))
        v_out.copy_(quant.dequantize_fp8(parts["v"], parts["vs"]))

    @staticmethod
    def width(parts: Parts, name: str) -> int:
        """Channels per head of the stored ``"k"`` or ``"v"`` codes."""
        return parts[name].shape[-1]

    def segment(self, parts: Parts, start: int = 0) -> Fp8Segment:
        """The tokens of ``parts`` from ``start`` on, as the kernels read them (views, no copy)."""
        return Fp8Segment(*(parts[name][:, :, start:] for name in ("k", "ks", "v", "vs")))

    def bytes_per_token(
        self, num_kv_heads: int, key_dim: int, value_dim: int, kv_dtype: torch.dtype = torch.bfloat16
    ) -> float:
        """Stored bytes per token of one layer (keys and values, all heads); the K/V dtype does not matter."""
        return num_kv_heads * (key_dim + value_dim + 2 * self.scale_dtype.itemsize)

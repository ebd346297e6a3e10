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
from ..kernels import torch_decode
from ..kernels.storage import FP8
from ._base import Partials, register_partial
from .int8 import Int8Codec, Int8Segment

__all__ = ["Fp8Codec", "Fp8Segment"]


@dataclass(frozen=True)
class Fp8Segment(Int8Segment):
    """int8's layout with e4m3 codes: ``k`` / ``v`` uint8 ``(B, H, T, D)`` (the bits), ``ks`` / ``vs`` ``(B, H, T, 1)``;
    the scales fold into the scores and the weights as int8's per-token scales do (the same launch plan)."""

    ROTATIONS_IN_LAUNCH = False  # its op takes no rotations: a rotated fp8 segment folds them around the op
    KIND = FP8

    @staticmethod
    def codes(x: torch.Tensor) -> torch.Tensor:
        return x.view(torch.float8_e4m3fn).float()

    def partial(self, query, mask, scaling, softcap, splits) -> Partials:
        return _OP(query, self.k, self.ks, self.v, self.vs, mask, scaling, softcap, splits)


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
    return torch_decode.partial(query, Fp8Segment(k, ks, v, vs), mask, scaling, softcap, splits)


_OP = register_partial(
    "partial_fp8",
    _partial,
    lambda k, ks, v, vs, mask, *rest: (Fp8Segment(k, ks, v, vs), mask, *rest),
    lambda q, k, ks, v, *rest: (k.shape[1], v.shape[-1]),
)


class Fp8Codec(Int8Codec):
    """float8 e4m3 codes, one scale per token and head (:func:`hf_kvcache.quant.quantize_fp8`): int8's layout and
    bookkeeping (every token encoded on its own, ``unit = 1``; appended through ``hf_kvcache::append_kv``, one launch
    per layer on CUDA, which encodes e4m3 where the destination is uint8), e4m3 numbers in its bytes.

    Stored: ``k`` / ``v`` uint8 ``(B, H, T, D)`` (e4m3 bits); ``ks`` / ``vs`` scales ``(B, H, T, 1)``.
    """

    segment_type = Fp8Segment
    code_dtype = torch.uint8

    def __init__(self, scale_dtype: torch.dtype = torch.float32):
        super().__init__(None, scale_dtype)

    def _encode_one(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return quant.quantize_fp8(x, dim=-1, scale_dtype=self.scale_dtype)

    def _decode_one(self, codes: torch.Tensor, scale: torch.Tensor, out: torch.Tensor) -> None:
        out.copy_(quant.dequantize_fp8(codes, scale))

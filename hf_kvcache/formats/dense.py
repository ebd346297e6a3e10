"""Dense storage: keys and values as the model made them (the residual, new tokens, a full-precision window, sinks).

Stored ``k`` / ``v`` ``(B, H, T, D)`` in the model's dtype; read by the ``hf_kvcache::partial_dense`` op.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..kernels import torch_decode
from ..kernels.append import append_kv
from ..kernels.storage import DENSE, KernelStorage
from ._base import KeyTurn, Partials, Parts, SegmentFormat, register_partial, turn_keys

__all__ = ["DenseSegment", "IdentityCodec"]


@dataclass(frozen=True)
class DenseSegment(SegmentFormat):
    k: torch.Tensor  # (B, H, T, Dk) keys
    v: torch.Tensor  # (B, H, T, Dv) values

    @property
    def length(self) -> int:
        return self.k.shape[2]

    def read_keys(self, a: int, b: int) -> torch.Tensor:
        return self.k[:, :, a:b].float()

    def read_values(self, a: int, b: int) -> torch.Tensor:
        return self.v[:, :, a:b].float()

    def partial(self, query, mask, scaling, softcap, splits) -> Partials:
        return _OP(query, self.k, self.v, mask, scaling, softcap, splits)

    def kernel_storage(self) -> KernelStorage:
        k, v = self.k, self.v
        return KernelStorage(DENSE, k, v, k.shape[-1], v.shape[-1], self.length, tuple(k.stride()), tuple(v.stride()))


def _partial(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor | None,
    scaling: float,
    softcap: float,
    splits: int,
) -> Partials:
    return torch_decode.partial(query, DenseSegment(keys, values), mask, scaling, softcap, splits)


_OP = register_partial(
    "partial_dense",
    _partial,
    lambda k, v, mask, *rest: (DenseSegment(k, v), mask, *rest),
    lambda q, k, v, *rest: (k.shape[1], v.shape[-1]),
)


class IdentityCodec:
    """Stores keys and values as they are (a sliding layer's full-precision window)."""

    unit = 1
    units = {"k": 1, "v": 1}

    def encode(self, k: torch.Tensor, v: torch.Tensor) -> Parts:
        return {"k": k, "v": v}

    def like(self, k: torch.Tensor, v: torch.Tensor) -> Parts:
        return {"k": k, "v": v}

    def encode_into(self, k: torch.Tensor, v: torch.Tensor, out: Parts) -> None:
        append_kv(k, v, out["k"], out["v"], None, None, None, 0, 1, None, None)  # both in one launch on CUDA

    def decode(self, parts: Parts, k_out: torch.Tensor, v_out: torch.Tensor, rope: KeyTurn | None = None) -> None:
        k_out.copy_(parts["k"])
        v_out.copy_(parts["v"])
        turn_keys(k_out, rope)

    def segment(self, parts: Parts, start: int = 0) -> DenseSegment:
        return DenseSegment(parts["k"][:, :, start:], parts["v"][:, :, start:])

    def bytes_per_token(
        self, num_kv_heads: int, key_dim: int, value_dim: int, kv_dtype: torch.dtype = torch.bfloat16
    ) -> float:
        """Stored bytes per token of one layer (keys and values, all heads)."""
        return num_kv_heads * (key_dim + value_dim) * kv_dtype.itemsize

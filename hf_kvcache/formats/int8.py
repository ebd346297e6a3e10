"""int8 storage: symmetric absmax codes, one scale per token, head and group of channels (the whole head by default).

Stored ``k`` / ``v`` int8 ``(B, H, T, D)``, ``ks`` / ``vs`` scales ``(B, H, T, D / G)``; read by the
``hf_kvcache::partial_int8`` op, optionally Hadamard-rotated (:mod:`.rotated`). One scale per token and head folds
into the scores and the probabilities (the reference and the Triton kernel alike) instead of scaling every element.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .. import quant
from ..kernels import cpu_native, torch_decode
from ..kernels.append import append_kv
from ..kernels.storage import INT8, KernelStorage, LaunchPlan
from ._base import (
    KeyTurn,
    Partials,
    Parts,
    SegmentFormat,
    channel_groups,
    group_expand,
    plan_warps,
    register_partial,
    swapped,
    turn_keys,
)
from .rotated import rotated

__all__ = ["Int8Codec", "Int8Segment"]


@dataclass(frozen=True)
class Int8Segment(SegmentFormat):
    k: torch.Tensor  # (B, H, T, Dk) int8
    ks: torch.Tensor  # (B, H, T, Dk / Gk)
    v: torch.Tensor  # (B, H, T, Dv) int8
    vs: torch.Tensor  # (B, H, T, Dv / Gv)

    ROTATIONS_IN_LAUNCH = True
    KIND = INT8  # how the kernel reads the codes (fp8 reuses this layout with its own kind)

    @property
    def length(self) -> int:
        return self.k.shape[2]

    @property
    def per_token_scales(self) -> bool:
        """One scale per token and head (int8's default): the scales fold into scores and weights, in the reference
        (:meth:`scores`, :meth:`weighted_values`) and the Triton kernel alike."""
        return self.ks.shape[-1] == 1 and self.vs.shape[-1] == 1

    @staticmethod
    def codes(x: torch.Tensor) -> torch.Tensor:
        """Stored codes as float32 numbers (before their scales)."""
        return x.float()

    def read_keys(self, a: int, b: int) -> torch.Tensor:
        return self.codes(self.k[:, :, a:b]) * group_expand(self.ks[:, :, a:b], self.k.shape[-1])

    def read_values(self, a: int, b: int) -> torch.Tensor:
        return self.codes(self.v[:, :, a:b]) * group_expand(self.vs[:, :, a:b], self.v.shape[-1])

    def scores(self, query: torch.Tensor, a: int, b: int) -> torch.Tensor:
        if not self.per_token_scales:
            return super().scores(query, a, b)
        # q . (code_t x scale_t) = (q . code_t) x scale_t
        codes = torch.einsum("bhgqd,bhnd->bhgqn", query, self.codes(self.k[:, :, a:b]))
        return codes * self.ks[:, :, None, None, a:b, 0].float()

    def weighted_values(self, weights: torch.Tensor, a: int, b: int) -> torch.Tensor:
        if not self.per_token_scales:
            return super().weighted_values(weights, a, b)
        # sum_t w_t (code_t x scale_t) = sum_t (w_t x scale_t) code_t
        scaled = weights * self.vs[:, :, None, None, a:b, 0].float()
        return torch.einsum("bhgqn,bhnd->bhgqd", scaled, self.codes(self.v[:, :, a:b]))

    def partial(self, query, mask, scaling, softcap, splits, rotations=(None, None)) -> Partials:
        """``rotations``: the ``(H_k, H_v)`` the codes were stored rotated by, read in the same launch."""
        return _OP(query, self.k, self.ks, self.v, self.vs, mask, *rotations, scaling, softcap, splits)

    def kernel_storage(self) -> KernelStorage:
        k, v, ks, vs = self.k, self.v, self.ks, self.vs
        return KernelStorage(
            self.KIND, k, v, k.shape[-1], v.shape[-1], self.length, tuple(k.stride()), tuple(v.stride()),
            ks=ks, vs=vs, ks_strides=tuple(ks.stride()), vs_strides=tuple(vs.stride()),
            key_group=k.shape[-1] // ks.shape[-1], value_group=v.shape[-1] // vs.shape[-1],
            fold=self.per_token_scales,
        )  # fmt: skip

    def launch_plan(self, query, mask, rotary_dim=0) -> LaunchPlan:
        """Scales folded (one per token and head): no pipelining, 102 registers and 4 resident blocks per SM at the
        8B shape on sm_90 (2 stages took 160 and 3 blocks), latency hidden by resident warps instead of cp.async
        stages, and 32-token tiles unless the tiles are swapped (64-token ones spilled at 64 query rows); per-group
        scales: Triton's default 3 stages."""
        swap = swapped(query, self.heads)
        fold = self.per_token_scales
        return LaunchPlan(
            block_n=32 if fold and not swap else 64,
            stages=1 if fold else 3,
            warps=plan_warps(query, self.heads, mask, rotary_dim),
            swap=swap,
        )


def _partial(
    query: torch.Tensor,
    k: torch.Tensor,
    ks: torch.Tensor,
    v: torch.Tensor,
    vs: torch.Tensor,
    mask: torch.Tensor | None,
    key_rotation: torch.Tensor | None,
    value_rotation: torch.Tensor | None,
    scaling: float,
    softcap: float,
    splits: int,
) -> Partials:
    segment = rotated(Int8Segment(k, ks, v, vs), key_rotation, value_rotation)
    return torch_decode.partial(query, segment, mask, scaling, softcap, splits)


_OP = register_partial(
    "partial_int8",
    _partial,
    lambda k, ks, v, vs, mask, hk, hv, *rest: (rotated(Int8Segment(k, ks, v, vs), hk, hv), mask, *rest),
    lambda q, k, ks, v, *rest: (k.shape[1], v.shape[-1]),
)


class Int8Codec:
    """Symmetric absmax int8, one scale per token, head and channel group (``group_size`` channels; None: the whole
    head). Every token is encoded on its own, so it can leave the residual as soon as it arrives (``unit = 1``).

    Stored: ``k`` / ``v`` int8 ``(B, H, T, D)``; ``ks`` / ``vs`` scales ``(B, H, T, D / G)``.
    """

    unit = 1
    units = {"k": 1, "ks": 1, "v": 1, "vs": 1}
    segment_type = Int8Segment
    code_dtype = torch.int8

    def __init__(self, group_size: int | None, scale_dtype: torch.dtype, backend: str = "torch"):
        self.group_size = group_size
        self.scale_dtype = scale_dtype
        self.backend = backend

    def group(self, width: int) -> int:
        """Channels per scale for a tensor of ``width`` channels."""
        return self.group_size or width

    def _encode_one(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        g = channel_groups(x, self.group(x.shape[-1]))  # (B, H, n, D/G, G)
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
            "k": k.new_empty((b, h, 0, dk), dtype=self.code_dtype),
            "ks": k.new_empty((b, h, 0, dk // self.group(dk)), dtype=self.scale_dtype),
            "v": v.new_empty((b, h, 0, dv), dtype=self.code_dtype),
            "vs": v.new_empty((b, h, 0, dv // self.group(dv)), dtype=self.scale_dtype),
        }

    def encode_into(self, k: torch.Tensor, v: torch.Tensor, out: Parts) -> None:
        """:meth:`encode` written straight into ``out`` (views of the storage): one kernel per layer on CUDA."""
        if self.backend == "bitsandbytes":
            for name, t in self.encode(k, v).items():
                out[name].copy_(t)
            return
        append_kv(k, v, out["k"], out["v"], out["ks"], out["vs"], None, 0, 1, None, None)

    def encode_rotated_into(
        self, k: torch.Tensor, v: torch.Tensor, out: Parts, k_rotation: torch.Tensor, v_rotation: torch.Tensor
    ) -> bool:
        """``k @ k_rotation`` and ``v @ v_rotation`` (float32, unrounded) encoded into ``out`` in the one launch that
        stores them (:class:`~hf_kvcache.formats.RotatedCodec`'s int8); False where this codec cannot (bitsandbytes'
        encoder, or several scales per head): the caller rotates first then."""
        if self.backend == "bitsandbytes" or any(self.group(x.shape[-1]) != x.shape[-1] for x in (k, v)):
            return False
        append_kv(k, v, out["k"], out["v"], out["ks"], out["vs"], None, 0, 1, k_rotation, v_rotation)
        return True

    def _decode_one(self, codes: torch.Tensor, scale: torch.Tensor, out: torch.Tensor) -> None:
        # copy_ then an in-place multiply (not torch.mul(out=)): `out` is often a non-contiguous workspace slice,
        # which torch.compile cannot take as an `out=` argument.
        groups = channel_groups(out, self.group(out.shape[-1]))
        groups.copy_(channel_groups(codes, self.group(codes.shape[-1])))
        groups.mul_(scale.unsqueeze(-1))

    def decode_native(self, parts: Parts, k_out: torch.Tensor, v_out: torch.Tensor, rope: KeyTurn | None,
                      rotate: bool) -> bool:  # fmt: skip
        """:class:`RotatedCodec`'s decode of these codes by the CPU kernel, rotated back in the same pass
        (:func:`~hf_kvcache.kernels.cpu_native.decode_int8_rotated`; to float32 rounding). False where it cannot
        serve (unrotated codes, whose two torch passes are faster; keys to turn; not float32 or not on the CPU):
        the caller decodes in torch then."""
        if not rotate or rope is not None or k_out.device.type != "cpu":
            return False
        return all(
            cpu_native.decode_int8_rotated(parts[c], parts[s], out, self.group(out.shape[-1]))
            for c, s, out in (("k", "ks", k_out), ("v", "vs", v_out))
        )

    def decode(self, parts: Parts, k_out: torch.Tensor, v_out: torch.Tensor, rope: KeyTurn | None = None) -> None:
        self._decode_one(parts["k"], parts["ks"], k_out)
        self._decode_one(parts["v"], parts["vs"], v_out)
        turn_keys(k_out, rope)

    decode_reference = decode  # torch's decode, the one a layer encodes again from (RotatedCodec.decode_reference)

    @staticmethod
    def width(parts: Parts, name: str) -> int:
        """Channels per head of the stored ``"k"`` or ``"v"`` codes."""
        return parts[name].shape[-1]

    def segment(self, parts: Parts, start: int = 0) -> Int8Segment:
        """The tokens of ``parts`` from ``start`` on, as the kernels read them (views, no copy)."""
        return self.segment_type(*(parts[name][:, :, start:] for name in ("k", "ks", "v", "vs")))

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

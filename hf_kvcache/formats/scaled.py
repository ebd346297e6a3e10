"""Smoothed keys (``smooth``): keys stored scaled per channel, ``k * s``, and read back with the query scaled by
``1 / s``, so every score is unchanged, ``q . k = (q / s) . (k * s)``, while the codes' error falls where queries
look least.

Why it pays over Hadamard-rotated codes: a key channel with a large offset and a small spread across tokens (the
offset every token shares, which a per-channel zero point stores exactly) is where the queries are large too, and the
rotation spreads the other channels' rounding error into it, where the query multiplies it. Scaling such a channel up
before rotating (SmoothQuant's migration, between keys and queries instead of activations and weights) gives it a
larger share of the range and a smaller share of the error. The scale of a channel pair is
``(E[k^2] / Var k) ** (strength / 4)`` (``strength=1`` minimizes ``E[(q . dk)^2]`` when the query's energy is the key's
offset energy; both channels of a RoPE pair share it, so it commutes with RoPE and keys stored before RoPE are turned
as before), taken per batch row from the row's first real tokens a layer encodes and kept for the layer's life, so a
row's codes never depend on the rows beside it. Stored bytes are the inner format's, and per layer and row one
``(heads, head_dim)`` float32 tensor and its inverse in the K/V dtype.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..kernels import torch_decode
from ..rope import RotarySpec
from ._base import OverSegment, Partials, SegmentFormat

__all__ = ["ScaledSegment", "pair_channels", "scale_keys", "scale_query", "smoothing_scales", "unscale_keys"]

# Bounds of E[k^2] / Var k: a channel that does not vary over the tokens measured (a constant channel, or a chunk of
# one repeated token) would otherwise get an unbounded scale.
_MAX_RATIO = 2.0**16


def pair_channels(x: torch.Tensor, rope: RotarySpec | None) -> torch.Tensor:
    """``x`` ``(..., D)`` with each RoPE channel pair's two entries replaced by their mean (``rope``'s layout:
    ``(i, i + rotary_dim / 2)`` or interleaved ``(2i, 2i + 1)``; channels past ``rotary_dim`` as they are); None: ``x``
    as it is (keys stored after RoPE, read without turning: any per-channel scale commutes)."""
    if rope is None:
        return x
    r = rope.rotary_dim
    out = x.clone()
    if rope.interleaved:
        pairs = x[..., :r].unflatten(-1, (r // 2, 2)).mean(-1, keepdim=True)
        out[..., :r] = pairs.expand(*pairs.shape[:-1], 2).flatten(-2)
    else:
        mean = (x[..., : r // 2] + x[..., r // 2 : r]) / 2
        out[..., : r // 2] = mean
        out[..., r // 2 : r] = mean
    return out


def smoothing_scales(keys: torch.Tensor, strength: float, rope: RotarySpec | None = None) -> torch.Tensor:
    """Per-row, per-head channel scales ``(B, H, D)`` float32 for keys ``(B, H, n, D)`` (each row's tokens pooled):
    ``(E[k^2] / Var k) ** (strength / 4)`` per channel (per RoPE pair, :func:`pair_channels`), normalized to a
    geometric mean of 1 per head so the scaled keys keep their magnitude. Non-finite keys (a layer marks a row's
    padding NaN) are left out of the statistics; a row's head with nothing finite gets scales of 1."""
    k = keys.detach().float().contiguous()  # the sums' order, so the scales, must not depend on the layout
    finite = torch.isfinite(k)
    count = finite.sum(2).clamp_min(1)
    k = torch.where(finite, k, 0.0)
    second = k.pow(2).sum(2) / count
    mean = k.sum(2) / count
    # two passes: E[k^2] - mean^2 cancels in float32 on the offset channels whose scales matter most
    variance = torch.where(finite, k - mean[:, :, None], 0.0).pow(2).sum(2) / count
    second, variance = pair_channels(second, rope), pair_channels(variance, rope)
    floor = second.mean(-1, keepdim=True) * 1e-12 + torch.finfo(torch.float32).tiny
    ratio = ((second + floor) / (variance + floor)).clamp(1.0, _MAX_RATIO)
    log_scale = ratio.log() * (strength / 4)
    log_scale = log_scale - log_scale.mean(-1, keepdim=True)
    scales = log_scale.exp()
    return torch.where(torch.isfinite(scales), scales, 1.0)


def scale_keys(keys: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """``keys * scales`` (``(B, H, n, D)`` by ``(B, H, D)``) computed in float32, in ``keys``' dtype."""
    return (keys.float() * scales[:, :, None]).to(keys.dtype)


def unscale_keys(keys: torch.Tensor, scales: torch.Tensor) -> None:
    """Decoded keys ``(B, H, n, D)`` back to the model's, in place (``keys / scales``, ``(B, H, D)``)."""
    keys.div_(scales[:, :, None])  # in float32, rounded once to the keys' dtype


def scale_query(query: torch.Tensor, query_scale: torch.Tensor) -> torch.Tensor:
    """``query`` ``(B, Hq, q, D)`` times its row's and KV head's ``query_scale`` (``(B, Hkv, D)``, ``1 / s`` in the
    query's dtype: one product, one launch on CUDA; grouped-query heads in order)."""
    grouped = query.unflatten(1, (query_scale.shape[1], -1))  # (B, Hkv, G, q, D), a view
    return (grouped * query_scale[:, :, None, None]).flatten(1, 2)


@dataclass(frozen=True)
class ScaledSegment(OverSegment):
    """A segment whose keys were stored times ``key_scale`` (per row, KV head and channel): read back divided,
    scored with the query divided instead, inside whatever launch reads the inner segment."""

    inner: SegmentFormat
    key_scale: torch.Tensor  # (B, Hkv, Dk) float32: stored keys are k * key_scale
    query_scale: torch.Tensor  # (B, Hkv, Dk) 1 / key_scale in the queries' dtype (what the launches are fed)

    def read_keys(self, a: int, b: int) -> torch.Tensor:
        return self.inner.read_keys(a, b) / self.key_scale[:, :, None]

    def read_values(self, a: int, b: int) -> torch.Tensor:
        return self.inner.read_values(a, b)

    def scores(self, query: torch.Tensor, a: int, b: int) -> torch.Tensor:
        return self.inner.scores(query / self.key_scale[:, :, None, None], a, b)  # query (B, Hkv, G, q, Dk)

    def weighted_values(self, weights: torch.Tensor, a: int, b: int) -> torch.Tensor:
        return self.inner.weighted_values(weights, a, b)

    def launch_input(self, query: torch.Tensor) -> tuple[torch.Tensor, SegmentFormat]:
        return self.inner.launch_input(scale_query(query, self.query_scale))

    def partial_apart(self, query, mask, scaling, softcap, splits) -> Partials:
        """The inner segment's own partials (its launch, rotation and RoPE included) for the query over ``s``."""
        return self.inner.partial(scale_query(query, self.query_scale), mask, scaling, softcap, splits)

    def torch_partial(self, query, mask, scaling, softcap, splits, chunk=None) -> Partials:
        return torch_decode.partial(scale_query(query, self.query_scale), self.inner, mask, scaling, softcap, splits,
                                    chunk)  # fmt: skip

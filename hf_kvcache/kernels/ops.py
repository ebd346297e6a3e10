"""The split reduction as a ``torch.library`` custom op, ``hf_kvcache::combine``: the pure-torch reference on every
device, the Triton kernel on CUDA (when triton imports), and a fake implementation giving ``torch.compile`` the output
shape, so a compiled decode step treats it as one opaque node. Each storage format registers its own
``hf_kvcache::partial_*`` op the same way (:mod:`hf_kvcache.formats`).
"""

from __future__ import annotations

import torch

from . import torch_decode
from ._available import guarded, triton_available
from ._define import custom_op
from ._eager import eager

__all__ = ["combine_partials"]


def _combine_torch(
    m: list[torch.Tensor],
    l: list[torch.Tensor],  # noqa: E741
    acc: list[torch.Tensor],
    sinks: torch.Tensor | None,
    dtype: torch.dtype,
) -> torch.Tensor:
    """:func:`torch_decode.combine` over the partials of a handle's segments, contiguous ``(B, q, Hq, Dv)``."""
    return torch_decode.combine(list(zip(m, l, acc)), sinks, dtype).contiguous()


_OP = custom_op("hf_kvcache::combine", _combine_torch)


@_OP.register_fake
def _(m, l, acc, sinks, dtype):  # noqa: E741
    b, hkv, g, q, _ = m[0].shape
    return m[0].new_empty((b, q, hkv * g, acc[0].shape[-1]), dtype=dtype)


@_OP.register_kernel("cuda")
def _combine_cuda(m, l, acc, sinks, dtype):  # noqa: E741
    partials = list(zip(m, l, acc))

    def ref() -> torch.Tensor:
        return torch_decode.combine(partials, sinks, dtype).contiguous()

    if triton_available():
        from .triton_decode import MAX_COMBINED_SEGMENTS, triton_combine

        if len(partials) <= MAX_COMBINED_SEGMENTS:
            return guarded("combine", lambda: triton_combine(partials, sinks, dtype), ref)
    return ref()


combine_partials = eager(_OP, _combine_torch, _combine_cuda)

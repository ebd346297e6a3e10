"""One module per storage format: its codec, bytes per token, segment, reference read, custom op and the arguments of
its Triton branch (see :mod:`._base` for the shared contract).

* :mod:`.dense`: keys and values as the model made them (:class:`DenseSegment`, :class:`IdentityCodec`);
* :mod:`.int8`: symmetric int8 codes with per-token (group) scales (:class:`Int8Segment`, :class:`Int8Codec`);
* :mod:`.kivi`: KIVI 4/3/2-bit codes (:class:`KiviSegment`, :class:`KiviTokenSegment`, :class:`KiviCodec`);
* :mod:`.paged`: block pools through a block table, dense or int8 pages (:class:`PagedSegment`);
* :mod:`.rotated` and :mod:`.pre_rope`: transforms over a quantized format (Hadamard-rotated codes,
  :class:`RotatedSegment`, :class:`RotatedCodec`; keys stored before RoPE, :class:`PreRopeSegment`).
"""

import torch

from ._base import KernelStorage, SegmentFormat, triton_available
from .dense import DenseSegment, IdentityCodec
from .int8 import Int8Codec, Int8Segment
from .kivi import KEY_AXES, KiviCodec, KiviSegment, KiviTokenSegment, kivi_scale_dtype
from .paged import PagedSegment
from .pre_rope import PreRopeSegment
from .rotated import ROTATIONS, RotatedCodec, RotatedSegment, hadamard


def codec_for(
    bits: int | None,
    group_size: int | None = None,
    scale_dtype=None,
    key_axis: str = "channel",
    rotate: bool = False,
    backend: str = "torch",
) -> Int8Codec | KiviCodec | RotatedCodec | None:
    """The codec that stores K/V at ``bits``, the one place a width becomes a format: ``None`` (the model's dtype:
    no codec), 8 (:class:`Int8Codec`, one scale per ``group_size`` channels, None: per head, float32 scales unless
    ``scale_dtype``), 4 / 3 / 2 (:class:`KiviCodec`, key groups of ``group_size`` tokens along ``key_axis``);
    ``rotate``: Hadamard-rotated first (:class:`RotatedCodec`). Arguments are the caches' validated options."""
    if bits is None:
        return None
    if bits == 8:
        codec = Int8Codec(group_size, scale_dtype or torch.float32, backend)
    else:
        codec = KiviCodec(bits, group_size, scale_dtype, key_axis)
    return RotatedCodec(codec) if rotate else codec


__all__ = [
    "KEY_AXES",
    "ROTATIONS",
    "DenseSegment",
    "IdentityCodec",
    "Int8Codec",
    "Int8Segment",
    "KernelStorage",
    "KiviCodec",
    "KiviSegment",
    "KiviTokenSegment",
    "PagedSegment",
    "PreRopeSegment",
    "RotatedCodec",
    "RotatedSegment",
    "SegmentFormat",
    "hadamard",
    "kivi_scale_dtype",
    "codec_for",
    "triton_available",
]

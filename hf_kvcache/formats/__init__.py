"""Storage formats: one module per format, its codec, bytes per token, segment, reference read, custom op and what
the Triton kernel reads of it and how to launch it (see :mod:`._base` for the shared contract). This package sits
above :mod:`hf_kvcache.kernels` and imports from it, never the other way.

* :mod:`.dense`: keys and values as the model made them (:class:`DenseSegment`, :class:`IdentityCodec`);
* :mod:`.int8`: symmetric int8 codes with per-token (group) scales (:class:`Int8Segment`, :class:`Int8Codec`);
* :mod:`.fp8`: float8 e4m3 codes with one scale per token and head (:class:`Fp8Segment`, :class:`Fp8Codec`);
* :mod:`.kivi`: KIVI 4/3/2-bit codes (:class:`KiviSegment`, :class:`KiviTokenSegment`, :class:`KiviCodec`);
* :mod:`.paged`: block pools through a block table, dense or int8 pages (:class:`PagedSegment`);
* :mod:`.rotated` and :mod:`.pre_rope`: transforms over a quantized format (Hadamard-rotated codes,
  :class:`RotatedSegment`, :class:`RotatedCodec`; keys stored before RoPE, :class:`PreRopeSegment`);
* :mod:`.handle`: what a cache layer hands the ``hf_kvcache`` attention (:class:`KVHandle`, its segments in order)
  and one decode step over it (:func:`decode_attention`).
"""

import torch

from ..kernels._available import triton_available
from ..kernels.storage import KernelStorage, LaunchPlan
from ._base import SegmentFormat, launch
from .dense import DenseSegment, IdentityCodec
from .fp8 import Fp8Codec, Fp8Segment
from .handle import KVHandle, decode_attention, segment_inputs
from .int8 import Int8Codec, Int8Segment
from .kivi import KEY_AXES, KiviCodec, KiviSegment, KiviTokenSegment, kivi_scale_dtype
from .paged import PagedSegment
from .pre_rope import PreRopeSegment
from .rotated import ROTATIONS, RotatedCodec, RotatedSegment, hadamard


def codec_for(
    bits: int | str | None,
    group_size: int | None = None,
    scale_dtype=None,
    key_axis: str = "channel",
    rotate: bool = False,
    backend: str = "torch",
    key_bits: int | None = None,
    codebook: str = "uniform",
) -> Int8Codec | Fp8Codec | KiviCodec | RotatedCodec | None:
    """The codec that stores K/V at ``bits``, the one place a width becomes a format: ``None`` (the model's dtype:
    no codec), 8 (:class:`Int8Codec`, one scale per ``group_size`` channels, None: per head, float32 scales unless
    ``scale_dtype``), ``"fp8"`` (:class:`Fp8Codec`, one scale per token and head), 4 / 3 / 2 (:class:`KiviCodec`,
    key groups of ``group_size`` tokens along ``key_axis``, keys at ``key_bits`` when set, levels placed by
    ``codebook``); ``rotate``: Hadamard-rotated first (:class:`RotatedCodec`). Arguments are the caches' validated
    options."""
    if bits is None:
        return None
    if bits == 8:
        codec = Int8Codec(group_size, scale_dtype or torch.float32, backend)
    elif bits == "fp8":
        codec = Fp8Codec(scale_dtype or torch.float32)
    else:
        codec = KiviCodec(bits, group_size, scale_dtype, key_axis, key_bits, codebook)
    return RotatedCodec(codec) if rotate else codec


__all__ = [
    "KEY_AXES",
    "ROTATIONS",
    "DenseSegment",
    "Fp8Codec",
    "Fp8Segment",
    "IdentityCodec",
    "Int8Codec",
    "Int8Segment",
    "KVHandle",
    "KernelStorage",
    "KiviCodec",
    "KiviSegment",
    "KiviTokenSegment",
    "LaunchPlan",
    "PagedSegment",
    "PreRopeSegment",
    "RotatedCodec",
    "RotatedSegment",
    "SegmentFormat",
    "hadamard",
    "kivi_scale_dtype",
    "codec_for",
    "decode_attention",
    "launch",
    "segment_inputs",
    "triton_available",
]

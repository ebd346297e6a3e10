"""One module per storage format: its codec, bytes per token, segment, reference read, custom op and the arguments of
its Triton branch (see :mod:`._base` for the shared contract).

* :mod:`.dense`: keys and values as the model made them (:class:`DenseSegment`, :class:`IdentityCodec`);
* :mod:`.int8`: symmetric int8 codes with per-token (group) scales (:class:`Int8Segment`, :class:`Int8Codec`);
* :mod:`.kivi`: KIVI 4/3/2-bit codes (:class:`KiviSegment`, :class:`KiviTokenSegment`, :class:`KiviCodec`);
* :mod:`.paged`: block pools through a block table, dense or int8 pages (:class:`PagedSegment`);
* :mod:`.rotated` and :mod:`.pre_rope`: transforms over a quantized format (Hadamard-rotated codes,
  :class:`RotatedSegment`, :class:`RotatedCodec`; keys stored before RoPE, :class:`PreRopeSegment`).
"""

from ._base import KernelStorage, SegmentFormat, triton_available
from .dense import DenseSegment, IdentityCodec
from .int8 import Int8Codec, Int8Segment
from .kivi import KEY_AXES, KiviCodec, KiviSegment, KiviTokenSegment, kivi_scale_dtype
from .paged import PagedSegment
from .pre_rope import PreRopeSegment
from .rotated import ROTATIONS, RotatedCodec, RotatedSegment, hadamard

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
    "triton_available",
]

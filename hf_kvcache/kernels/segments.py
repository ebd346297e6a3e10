"""What a cache layer hands the ``hf_kvcache`` attention instead of materialized K/V: typed views of its storage.

A :class:`KVHandle` is an ordered tuple of segments; attention reads them in order, and column ``j`` of the attention
mask is token ``j`` of their concatenation. Every segment is a frozen dataclass of plain tensors (views of the
cache's storage, never copies of its history) that knows its ``length``, ``heads`` and ``value_dim``, how to read a
range of its tokens back in float32 (``read``, what the pure-torch reference kernels use), its own custom op
(``partial``) and what the Triton kernel reads of it (``kernel_storage``). Each storage format, with its layout, is
one module of :mod:`hf_kvcache.kernels.formats` (dense, int8, KIVI, paged; Hadamard-rotated and pre-RoPE keys over
them).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .formats import (
    DenseSegment,
    Int8Segment,
    KiviSegment,
    KiviTokenSegment,
    PagedSegment,
    PreRopeSegment,
    RotatedSegment,
)

__all__ = [
    "DenseSegment",
    "Int8Segment",
    "KVHandle",
    "KiviSegment",
    "KiviTokenSegment",
    "PagedSegment",
    "PreRopeSegment",
    "RotatedSegment",
    "Segment",
]

Segment = DenseSegment | Int8Segment | KiviSegment | KiviTokenSegment | PagedSegment | RotatedSegment | PreRopeSegment


@dataclass(frozen=True)
class KVHandle:
    """What a layer of our caches returns (as both "keys" and "values") under the ``hf_kvcache`` attention.

    Only the ``hf_kvcache`` attention function reads it. A model whose attention code works on the cached keys or
    values itself between the cache and the attention function (DiffLlama splits the values, Doge transposes them,
    JetMoE repeats them) gets a one-line ``ValueError`` naming its ``model_type`` at the first such use, never a
    ``TypeError`` from deep inside the model: load it with ``sdpa`` or ``eager`` attention.
    """

    segments: tuple[Segment, ...]
    model_type: str | None = field(default=None, compare=False)
    # (B, T): the mask columns attention may read (AND-ed with the attention mask), or None: all. A quantized layer's
    # exact sinks mask the codes' copies of them out this way.
    columns: object = field(default=None, compare=False)
    # Leading segments outside the attention mask's columns (each row's exact sinks), with their own (B, n) masks (or
    # None: every token), read under those only.
    extra: tuple = field(default=(), compare=False)

    def _refuse(self, use: str):
        raise ValueError(
            f"model_type {self.model_type!r} works on the cached keys or values itself ({use}) before calling its "
            "attention function, so attn_implementation='hf_kvcache' cannot serve it; load or set the model with "
            "'sdpa' or 'eager' attention, which every hf_kvcache cache serves"
        )

    def __getattr__(self, name: str):
        if name.startswith("__"):  # copy, pickle and friends probe these: a plain AttributeError
            raise AttributeError(name)
        self._refuse(f".{name}")

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        handle = next(a for a in (*args, *(kwargs or {}).values()) if isinstance(a, KVHandle))
        handle._refuse(f"{getattr(func, '__name__', func)}()")

    @property
    def length(self) -> int:
        """Tokens of the attention mask's columns (extra segments have none)."""
        return sum(s.length for s in self.segments[len(self.extra) :])

    @property
    def value_dim(self) -> int:
        return self.segments[0].value_dim

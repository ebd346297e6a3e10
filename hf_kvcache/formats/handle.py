"""What a cache layer hands the ``hf_kvcache`` attention instead of materialized K/V, and how attention reads it.

A :class:`KVHandle` is an ordered tuple of segments; attention reads them in order, and column ``j`` of the attention
mask is token ``j`` of their concatenation. Every segment is a frozen dataclass of plain tensors (views of the
cache's storage, never copies of its history) that knows its ``length``, ``heads`` and ``value_dim``, how to read a
range of its tokens back in float32 (``read``, what the pure-torch reference kernels use), its own custom op
(``partial``) and what the Triton kernel reads of it (``kernel_storage``, ``launch_plan``). Each storage format, with
its layout, is one module of this package.

:func:`decode_attention` is one decode step's whole path: each segment's own op (one launch on CUDA), then one
``hf_kvcache::combine`` over every segment's splits. Eager code on CUDA hands a segment whose transforms its stored
format reads in its own launch straight to that launch (:func:`~._base.launch`), as it is: the op's flat arguments,
and the segment rebuilt from them, are what ``torch.compile`` needs, and cost the host as much as the kernels take.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

from ..kernels._eager import dispatching
from ..kernels.ops import combine_partials
from ..kernels.torch_decode import num_splits
from ._base import OverSegment, SegmentFormat, launch

__all__ = ["KVHandle", "decode_attention", "segment_inputs"]


@dataclass(frozen=True)
class KVHandle:
    """What a layer of our caches returns (as both "keys" and "values") under the ``hf_kvcache`` attention.

    Only the ``hf_kvcache`` attention function reads it. A model whose attention code works on the cached keys or
    values itself between the cache and the attention function (DiffLlama splits the values, Doge transposes them,
    JetMoE repeats them) gets a one-line ``ValueError`` naming its ``model_type`` at the first such use, never a
    ``TypeError`` from deep inside the model: load it with ``sdpa`` or ``eager`` attention.
    """

    segments: tuple[SegmentFormat, ...]
    model_type: str | None = field(default=None, compare=False)
    # (B, T): the mask columns attention may read (AND-ed with the attention mask), or None: all. A quantized layer's
    # exact sinks mask the codes' copies of them out this way.
    columns: object = field(default=None, compare=False)
    # Leading segments outside the attention mask's columns (each row's exact sinks), with their own (B, n) masks (or
    # None: every token), read under those and the attention mask's columns of the same positions (``extra_at``).
    extra: tuple = field(default=(), compare=False)
    # Per extra segment, (B, n): the attention mask's column of each of its tokens (the codes' copy of a sink sits
    # there), so a mask that hides a position (a sparse attention's indexer not picking it) hides its exact copy too.
    extra_at: tuple = field(default=(), compare=False)

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


def segment_inputs(
    query: torch.Tensor, handle: KVHandle, mask: torch.Tensor | None
) -> Iterator[tuple[SegmentFormat, torch.Tensor | None, int]]:
    """Each segment of ``handle`` with its ``(B, q, n)`` mask (or None) and its number of splits (on CUDA each segment
    is split across programs, flash-decoding; elsewhere one split each).

    ``mask``: the ``(B, 1, q, T)`` boolean mask of the ``hf_kvcache`` mask function (True attends), whose columns
    follow the handle's segments in order (its ``extra`` leading segments have none, and their own masks); the
    handle's ``columns`` narrow them further."""
    col = 0
    b, _, q, _ = query.shape
    given = mask
    if handle.columns is not None:  # one AND over every column, the segments' masks views of it
        kept = handle.columns[:, None, None, :]
        mask = kept.expand(b, 1, q, handle.length) if mask is None else mask & kept
    extra = len(handle.extra)
    for i, segment in enumerate(handle.segments):
        if i < extra:  # outside the attention mask's columns: its own mask, and the given mask at its positions
            own = handle.extra[i]
            part_mask = None if own is None else own[:, None, :].expand(b, q, segment.length)
            if given is not None and i < len(handle.extra_at):  # one gather per step once every sink is held
                at = handle.extra_at[i]
                if own is not None:  # a sink not held yet may sit past the mask's end: its own mask hides it
                    at = at.clamp(0, given.shape[-1] - 1)
                rows = given.expand(b, 1, q, given.shape[-1])[:, 0]
                seen = rows.gather(-1, at[:, None, :].expand(b, q, segment.length))
                part_mask = seen if part_mask is None else part_mask & seen
        else:
            part_mask = None if mask is None else mask[:, 0, :, col : col + segment.length]
            col += segment.length
        yield segment, part_mask, num_splits(segment.length, b * segment.heads) if query.is_cuda else 1


def launches_directly(query: torch.Tensor) -> bool:
    """Whether :func:`decode_attention` hands segments to their Triton launch itself: eager code on CUDA (compiled
    code keeps the custom ops, one opaque node each, and so does :func:`~hf_kvcache.kernels._eager.through_ops`; off
    CUDA each op's reference serves)."""
    return query.is_cuda and not dispatching()


def decode_attention(
    query: torch.Tensor,
    handle: KVHandle,
    mask: torch.Tensor | None,
    scaling: float,
    softcap: float = 0.0,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention ``(B, q, Hq, Dv)`` of ``query`` ``(B, Hq, q, D)`` over a cache layer's storage handle (``mask``: see
    :func:`segment_inputs`; ``sinks``: one learned logit per query head, GPT-OSS's ``s_aux``)."""
    partials = []
    direct = launches_directly(query)
    for segment, part_mask, splits in segment_inputs(query, handle, mask):
        read_with, segment = segment.launch_input(query)  # smoothed keys: the query divided by their scales
        stored, extras = segment.in_launch()  # a rotation or pre-RoPE keys read in the stored format's own launch
        if direct and not isinstance(stored, OverSegment):  # the launch its op would make, from the segment itself,
            # free to choose its split count (the combine below reads any)
            partials.append(launch(read_with, segment, part_mask, scaling, softcap, splits, exact=False))
        else:
            partials.append(stored.partial(read_with, part_mask, scaling, softcap, splits, **extras))
    m, l_, acc = (list(x) for x in zip(*partials))
    return combine_partials(m, l_, acc, sinks, query.dtype)  # one launch: the splits of every segment reduced together

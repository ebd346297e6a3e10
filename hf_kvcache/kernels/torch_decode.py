"""Pure-torch reference of the decode-attention kernels: runs anywhere, never builds a full-length full-precision
copy of the history.

The contract every implementation (this one, the Triton one) follows, for one segment of a :class:`KVHandle`:

``partial(query, segment, mask, scaling, softcap, num_splits) -> (m, l, acc)``

* ``query``: ``(B, Hq, q, D)`` in the model's layout; query head ``j`` reads KV head ``j // (Hq / Hkv)`` (GQA).
* ``mask``: ``(B, q, T)`` bool over the segment's ``T`` tokens (True attends), or None.
* the segment's tokens are cut into ``num_splits`` contiguous splits of ``ceil(T / num_splits)`` tokens; for each
  split, with ``s = softcap * tanh(q.k * scaling / softcap)`` (or ``q.k * scaling``) over its unmasked tokens:
  ``m = max s``, ``l = sum exp(s - m)``, ``acc = sum exp(s - m) v``. An empty or fully masked split has
  ``m = -inf, l = 0, acc = 0``.
* outputs, float32: ``m`` and ``l`` ``(B, Hkv, G, q, S)``, ``acc`` ``(B, Hkv, G, q, S, Dv)``, ``G = Hq / Hkv``.

:func:`combine` merges the partials of all segments (and a learned sink logit per head, as GPT-OSS has) into the
attention output ``(B, q, Hq, Dv)``. Splits are what lets a GPU spread one long row over many programs
(flash-decoding); here they only fix the shape of the contract. The reference walks each split in chunks with an
online softmax, each chunk's float32 reads and scores within ``TORCH_SCRATCH_BYTES`` (at least
``TORCH_CHUNK`` tokens), so its scratch is bounded, not the history's size; a small model's history is one chunk,
so a decode step costs a few operations per segment, not a few per 512 tokens.
"""

from __future__ import annotations

from typing import Protocol

import torch

__all__ = [
    "TORCH_CHUNK",
    "TORCH_SCRATCH_BYTES",
    "Segment",
    "chunk_tokens",
    "combine",
    "num_splits",
    "partial",
    "partial_from_reads",
    "split_bounds",
]


class Segment(Protocol):
    """What the reference reads of a segment (a storage format's segment, :mod:`hf_kvcache.formats`): its extent, and
    its products with a grouped float32 query ``(B, Hkv, G, q, Dk)`` and with softmax weights, tokens ``a:b`` at a
    time (a format folds its scales there, as its kernel does)."""

    @property
    def length(self) -> int: ...
    @property
    def heads(self) -> int: ...
    @property
    def value_dim(self) -> int: ...
    def scores(self, query: torch.Tensor, a: int, b: int) -> torch.Tensor: ...
    def weighted_values(self, weights: torch.Tensor, a: int, b: int) -> torch.Tensor: ...
    def torch_partial(self, query, mask, scaling, softcap, splits, chunk=None): ...


TORCH_CHUNK = 512  # tokens dequantized at a time by the reference, at least
# Bytes of float32 reads and scores per chunk: one chunk for SmolLM2's history at 8k tokens (3 KV heads x 64 channels),
# 512 tokens at Llama-3-8B's attention shape with 8 rows. Few large operations instead of many small ones is what the
# CPU needs (each torch call costs microseconds of dispatch whatever its size).
TORCH_SCRATCH_BYTES = 32 * 2**20
MIN_SPLIT_TOKENS = 256  # a split below this is not worth a program
MAX_SPLITS = 64
TARGET_PROGRAMS = 528  # about four waves of programs on a 132-SM GPU


def num_splits(length: int, batch_heads: int) -> int:
    """Splits of a ``length``-token segment for ``batch_heads`` (batch x KV heads) programs per split."""
    wanted = max(1, -(-TARGET_PROGRAMS // max(batch_heads, 1)))
    return max(1, min(MAX_SPLITS, -(-length // MIN_SPLIT_TOKENS), wanted))


def chunk_tokens(query: torch.Tensor, heads: int, key_dim: int, value_dim: int, minimum: int = TORCH_CHUNK) -> int:
    """Tokens per chunk of the reference for this query: float32 keys, values and scores of a chunk within
    :data:`TORCH_SCRATCH_BYTES` (a multiple of 64 tokens, so chunks stay aligned to KIVI's key groups)."""
    b, hq, q, _ = query.shape
    per_token = 4 * b * (heads * (key_dim + value_dim) + 2 * hq * q)  # reads, scores and weights
    return max(minimum, TORCH_SCRATCH_BYTES // per_token // 64 * 64)


def split_bounds(length: int, splits: int) -> list[tuple[int, int]]:
    per = -(-length // splits) if length else 0
    return [(min(s * per, length), min((s + 1) * per, length)) for s in range(splits)]


def partial(
    query: torch.Tensor,
    segment: Segment,
    mask: torch.Tensor | None,
    scaling: float,
    softcap: float,
    splits: int,
    chunk: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The contract in the module docstring, in pure torch: :func:`partial_from_reads` over the segment's tokens, or
    the segment's own reading of it (a rotated segment folds its rotation around its inner segment's)."""
    return segment.torch_partial(query, mask, scaling, softcap, splits, chunk)


def partial_from_reads(
    query: torch.Tensor,
    segment: Segment,
    mask: torch.Tensor | None,
    scaling: float,
    softcap: float,
    splits: int,
    chunk: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`partial` from the segment's ``scores`` and ``weighted_values`` (its reads, or its folded scales),
    ``chunk`` tokens at a time (default :func:`chunk_tokens`) with an online softmax."""
    b, hq, q, d = query.shape
    hkv = segment.heads
    g = hq // hkv
    dv = segment.value_dim
    chunk = chunk or chunk_tokens(query, hkv, d, dv)
    grouped = query.float().reshape(b, hkv, g, q, d)  # query head j = kv head j // g
    ms, ls, accs = [], [], []
    for start, stop in split_bounds(segment.length, splits):
        m = torch.full((b, hkv, g, q), float("-inf"), device=query.device)
        l_ = torch.zeros_like(m)
        acc = torch.zeros((b, hkv, g, q, dv), device=query.device)
        for a in range(start, stop, chunk):
            z = min(a + chunk, stop)
            scores = segment.scores(grouped, a, z) * scaling  # the format's own arithmetic (folded scales)
            if softcap:
                scores = softcap * torch.tanh(scores / softcap)
            if mask is not None:
                scores = scores.masked_fill(~mask[:, None, None, :, a:z], float("-inf"))
            new_m = torch.maximum(m, scores.amax(-1))
            safe = torch.where(torch.isinf(new_m), 0.0, new_m)  # rows masked so far keep weight 0
            weights = torch.exp(scores - safe.unsqueeze(-1))
            rescale = torch.exp(m - safe)
            l_ = l_ * rescale + weights.sum(-1)
            acc = acc * rescale.unsqueeze(-1) + segment.weighted_values(weights, a, z)
            m = new_m
        ms.append(m)
        ls.append(l_)
        accs.append(acc)
    return torch.stack(ms, -1), torch.stack(ls, -1), torch.stack(accs, -2)


def combine(
    partials: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]],
    sinks: torch.Tensor | None = None,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Merge the splits of every segment: ``(B, q, Hq, Dv)`` in ``dtype``. ``sinks``: one learned logit per query
    head ``(Hq,)`` that joins the softmax with a zero value (GPT-OSS's ``s_aux``)."""
    m = torch.cat([p[0] for p in partials], -1)  # (B, Hkv, G, q, S)
    l_ = torch.cat([p[1] for p in partials], -1)
    acc = torch.cat([p[2] for p in partials], -2)  # (B, Hkv, G, q, S, Dv)
    b, hkv, g, q, _ = m.shape
    top = m.amax(-1)
    if sinks is not None:
        sink = sinks.float().view(1, hkv, g, 1)
        top = torch.maximum(top, sink)
    safe = torch.where(torch.isinf(top), 0.0, top)
    weights = torch.exp(m - safe.unsqueeze(-1))
    denominator = (l_ * weights).sum(-1)
    if sinks is not None:
        denominator = denominator + torch.exp(sink - safe)
    numerator = (acc * weights.unsqueeze(-1)).sum(-2)
    tiny = torch.finfo(torch.float32).tiny
    out = torch.where(denominator.unsqueeze(-1) > 0, numerator / denominator.clamp_min(tiny).unsqueeze(-1), 0.0)
    # (B, Hkv, G, q, Dv) -> (B, q, Hq, Dv), the layout attention functions return
    return out.reshape(b, hkv * g, q, -1).transpose(1, 2).to(dtype)


def torch_attention(
    query: torch.Tensor,
    segments: tuple[Segment, ...],
    mask: torch.Tensor | None,
    scaling: float,
    softcap: float = 0.0,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of ``query`` over ``segments`` in order (mask columns follow them), all in the reference."""
    partials, col = [], 0
    for segment in segments:
        part_mask = None if mask is None else mask[..., col : col + segment.length]
        partials.append(partial(query, segment, part_mask, scaling, softcap, 1))
        col += segment.length
    return combine(partials, sinks, query.dtype)

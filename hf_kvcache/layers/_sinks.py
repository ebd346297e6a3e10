"""Attention sinks per row: each row's first real tokens, kept in full precision beside a quantized layer's codes.

A left-padded batch puts row ``r``'s first real token at position ``p_r`` (its padding). The layer's codes hold every
position, padding and sinks included, so that every row shares one token axis (mask column ``t`` is position ``t``);
this buffer holds each row's ``count`` sink tokens exactly, at positions ``p_r .. p_r + count - 1``:

* encoding: the padding and sink positions of a chunk are replaced, before their group's range is taken, by the
  row's first token after its sinks (:meth:`RowSinks.exclude`): the outliers sinks typically are never stretch a
  key group, and padding never does (neither is ever read from the codes);
* reading: materialized K/V get the exact tokens written over those positions (:meth:`patch`); a storage handle gets
  them as one more segment, with the codes' copies masked out per row (:meth:`columns`), or, in the common case of
  no padding, as the first segment with the codes read from position ``count`` on (:meth:`aligned`).

Row ``r`` holds ``clamp(tokens - p_r, 0, count)`` sinks after ``tokens`` tokens: nothing else to track, through
``crop`` too.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

__all__ = ["RowSinks", "fill_front", "front_mask"]


class RowSinks:
    def __init__(self, count: int, pads: tuple[int, ...], keys: torch.Tensor, values: torch.Tensor):
        """``keys`` / ``values``: a forward's ``(B, H, n, D)`` states (dtype, device and widths of the buffers)."""
        b, h = keys.shape[:2]
        self.count = count
        self.k = keys.new_zeros((b, h, count, keys.shape[-1]))  # (B, H, S, Dk)
        self.v = values.new_zeros((b, h, count, values.shape[-1]))
        self._set_pads(pads)

    def _set_pads(self, pads: tuple[int, ...]) -> None:
        self.pads = tuple(pads)
        self.starts = torch.tensor(self.pads, device=self.k.device)  # (B,) each row's first real token
        self._kept: torch.Tensor | None = None  # columns() once every sink is held, for the positions so far
        self._at: tuple[int, torch.Tensor] | None = None  # (first, positions(first)): one tensor for every step

    def complete(self, tokens: int) -> bool:
        """Every row holds all its sinks once ``tokens`` tokens are stored."""
        return tokens >= max(self.pads) + self.count

    def aligned(self, tokens: int) -> bool:
        """No padding and every sink held: the sinks are positions ``0 .. count - 1`` of every row."""
        return not any(self.pads) and tokens >= self.count

    def slots(self, first: int) -> torch.Tensor:
        """``(B, S)``: where each row's sink ``j`` sits among positions counted from ``first``."""
        return self.starts[:, None] + torch.arange(self.count, device=self.starts.device) - first

    def positions(self, first: int) -> torch.Tensor:
        """:meth:`slots` from ``first``, kept: a decode step reads the same tensor (no launch)."""
        if self._at is None or self._at[0] != first:
            self._at = (first, self.slots(first))
        return self._at[1]

    def filled(self, tokens: int) -> torch.Tensor:
        """``(B, S)`` bool: the sinks held after ``tokens`` tokens."""
        return self.slots(0) < tokens

    def fill(self, keys: torch.Tensor, values: torch.Tensor, first: int) -> None:
        """Take the sinks among a forward's tokens (positions ``first ..``)."""
        n = keys.shape[2]
        if first >= max(self.pads) + self.count or n == 0:
            return
        slots = self.slots(first)
        take = (slots >= 0) & (slots < n)
        index = slots.clamp(0, n - 1)[:, None, :, None]  # (B, 1, S, 1)
        for mine, new in ((self.k, keys), (self.v, values)):
            picked = new.gather(2, index.expand(*new.shape[:2], -1, new.shape[-1]))
            mine.copy_(torch.where(take[:, None, :, None], picked, mine))

    def exclude(self, x: torch.Tensor, first: int) -> torch.Tensor:
        """A chunk of positions ``first ..`` about to be encoded, its padding and sink positions replaced by each
        row's first token after its sinks (when in the chunk): they never set a group's range."""
        return fill_front(x, [p + self.count - first for p in self.pads])

    def patch(self, keys: torch.Tensor, values: torch.Tensor, first: int, tokens: int) -> None:
        """Materialized K/V ``(B, H, L, D)`` of positions ``first ..``: the sinks held among the first ``tokens``
        positions written over their codes' copies."""
        if self.aligned(tokens):  # positions 0 .. count - 1 of every row: one slice each (a decode step's case)
            start, stop = first, min(self.count, first + keys.shape[2])
            if start < stop:
                keys[:, :, : stop - start].copy_(self.k[:, :, start:stop])
                values[:, :, : stop - start].copy_(self.v[:, :, start:stop])
            return
        slots = self.slots(first)
        held = self.filled(tokens) & (slots >= 0) & (slots < keys.shape[2])
        if not bool(held.any()):
            return
        index = slots.clamp(0, keys.shape[2] - 1)[:, None, :, None]
        for out, exact in ((keys, self.k), (values, self.v)):
            at = index.expand(*out.shape[:2], -1, out.shape[-1])
            out.scatter_(2, at, torch.where(held[:, None, :, None], exact.to(out.dtype), out.gather(2, at)))

    def columns(self, first: int, n: int, tokens: int) -> torch.Tensor:
        """``(B, n)``: which of positions ``first .. first + n - 1`` a handle reads from the codes and the residual:
        not the sinks held after ``tokens`` tokens, which it reads exactly. Once every row holds all its sinks the
        mask of the positions so far is kept, so a decode step takes a view of it (no launch)."""
        if not self.complete(tokens):
            return self._columns(first, first + n, tokens)
        stop = first + n
        if self._kept is None or self._kept.shape[1] < stop:  # grown geometrically: rebuilt once in many steps
            self._kept = self._columns(0, max(2 * stop, 256), tokens)
        return self._kept[:, first:stop]

    def _columns(self, start: int, stop: int, tokens: int) -> torch.Tensor:
        positions = torch.arange(start, stop, device=self.starts.device)[None, :]
        held = (positions >= self.starts[:, None]) & (positions < self.starts[:, None] + self.count)
        return ~(held & (positions < tokens))

    def map_batch(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
        self.k, self.v = fn(self.k).contiguous(), fn(self.v).contiguous()
        self._set_pads(tuple(fn(self.starts).tolist()))

    def to(self, device, non_blocking: bool = False) -> None:
        self.k, self.v = self.k.to(device, non_blocking=non_blocking), self.v.to(device, non_blocking=non_blocking)
        self.starts = self.starts.to(device)
        self._kept = self._at = None

    @property
    def nbytes(self) -> int:
        return self.k.numel() * self.k.element_size() + self.v.numel() * self.v.element_size()


def fill_front(x: torch.Tensor, ends: list[int]) -> torch.Tensor:
    """A chunk ``(B, H, n, D)`` about to be encoded with row ``r``'s first ``ends[r]`` positions (its padding, and its
    sinks where they are kept apart) replaced by its token at ``ends[r]`` (the chunk's last where that is past it), so
    that they never set the range of a group they share with the row's own tokens; ``x`` itself where no row has any
    (a decode step's case)."""
    if all(e <= 0 for e in ends):
        return x
    n = x.shape[2]
    end = torch.tensor(ends, device=x.device).clamp(0, n - 1)
    fill = x.gather(2, end[:, None, None, None].expand(*x.shape[:2], 1, x.shape[-1]))
    return torch.where(front_mask(ends, n, x.device)[:, None, :, None], fill, x)


def front_mask(ends: list[int], n: int, device) -> torch.Tensor:
    """``(B, n)`` bool: which of a chunk's ``n`` positions lie before row ``r``'s ``ends[r]``."""
    return torch.arange(n, device=device)[None, :] < torch.tensor(ends, device=device)[:, None]

"""Paged storage: a block pool ``(slots, H, D)`` addressed through a block table ``(B, blocks)`` (int32 on the pool's
device; :data:`~hf_kvcache.paging.PAD_BLOCK` entries are padding and must be masked), ``length`` tokens per row; in
the model's dtype, or int8 pages with one scale per token and head ``(slots, H)`` (encoded by
:class:`~hf_kvcache.formats.int8.Int8Codec`'s quantizer on append). Read by ``hf_kvcache::partial_paged``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..kernels import torch_decode
from ..kernels.storage import PAGED, PAGED_INT8, KernelStorage, LaunchPlan, pool_strides
from ._base import Partials, SegmentFormat, plan_warps, register_partial, swapped

__all__ = ["PagedSegment", "gather_rows"]


def gather_rows(pool: torch.Tensor, slots: torch.Tensor, batched: bool | None = None) -> torch.Tensor:
    """``(B, H, n, ...)`` of a pool's ``(B, n)`` slots, contiguous as DynamicCache's K/V are (some models ``.view()``
    what they get back). The caches' pools are head-major (:class:`~hf_kvcache.layers.paged.PagedStorage`): one row,
    or several off CUDA, is each row gathered straight into its place, one copy. Several rows on CUDA: one gather and
    one transposing copy, two launches whatever the batch (a launch per row would cost more than the second copy at
    decode's small sizes). ``batched`` forces one way (None: by device)."""
    heads = pool.transpose(0, 1)  # (H, slots, ...): contiguous for head-major pools
    rows, n = slots.shape
    if rows > 1 and (heads.is_cuda if batched is None else batched):
        x = heads.index_select(1, slots.flatten())
        return x.view(x.shape[0], rows, n, *x.shape[2:]).transpose(0, 1).contiguous()
    out = heads.new_empty((rows, heads.shape[0], n, *heads.shape[2:]))
    for row, row_slots in enumerate(slots):
        torch.index_select(heads, 1, row_slots, out=out[row])
    return out


@dataclass(frozen=True)
class PagedSegment(SegmentFormat):
    k: torch.Tensor  # (slots, H, Dk) keys: model dtype, or int8 codes with ks
    v: torch.Tensor  # (slots, H, Dv) values
    block_table: torch.Tensor  # (B, blocks) int32; PAD_BLOCK (-1) entries are masked padding
    block_size: int
    length: int  # tokens per row
    ks: torch.Tensor | None = None  # (slots, H) key scales of int8 pages
    vs: torch.Tensor | None = None  # (slots, H) value scales

    def slots(self, a: int, b: int) -> torch.Tensor:
        """``(B, b - a)`` storage slots of tokens ``a .. b`` (padding entries read slot 0)."""
        positions = torch.arange(a, b, device=self.block_table.device)
        blocks = self.block_table[:, positions // self.block_size].long().clamp_min(0)
        return blocks * self.block_size + positions % self.block_size

    def _gather(self, pool: torch.Tensor, scales: torch.Tensor | None, a: int, b: int) -> torch.Tensor:
        slots = self.slots(a, b)
        x = gather_rows(pool, slots).float()  # (B, H, n, D)
        if scales is not None:
            x = x * gather_rows(scales, slots).float().unsqueeze(-1)
        return x

    def read_keys(self, a: int, b: int) -> torch.Tensor:
        return self._gather(self.k, self.ks, a, b)

    def read_values(self, a: int, b: int) -> torch.Tensor:
        return self._gather(self.v, self.vs, a, b)

    def partial(self, query, mask, scaling, softcap, splits) -> Partials:
        s = self
        args = (s.k, s.v, s.block_table, s.ks, s.vs, mask, s.block_size, s.length)
        return _OP(query, *args, scaling, softcap, splits)

    def kernel_storage(self) -> KernelStorage:
        k, v, ks, vs = self.k, self.v, self.ks, self.vs
        int8 = ks is not None
        return KernelStorage(
            PAGED_INT8 if int8 else PAGED, k, v, k.shape[-1], v.shape[-1], self.length, pool_strides(k),
            pool_strides(v), ks=ks, vs=vs, ks_strides=pool_strides(ks), vs_strides=pool_strides(vs),
            table=self.block_table, block_size=self.block_size, fold=int8,
        )  # fmt: skip

    def launch_plan(self, query, mask, rotary_dim=0) -> LaunchPlan:
        """Gathers through the block table: 2 stages for pages in the model's dtype (3 spilled at 4 query tokens),
        Triton's default 3 for int8 pages (whose tiles are dequantized in registers, so swapped while they fit)."""
        warps = plan_warps(query, self.heads, mask, rotary_dim)
        if self.ks is None:
            return LaunchPlan(block_n=64, stages=2, warps=warps)
        return LaunchPlan(block_n=64, stages=3, warps=warps, swap=swapped(query, self.heads))


def _partial(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    block_table: torch.Tensor,
    key_scales: torch.Tensor | None,
    value_scales: torch.Tensor | None,
    mask: torch.Tensor | None,
    block_size: int,
    length: int,
    scaling: float,
    softcap: float,
    splits: int,
) -> Partials:
    segment = PagedSegment(keys, values, block_table, block_size, length, key_scales, value_scales)
    return torch_decode.partial(query, segment, mask, scaling, softcap, splits)


_OP = register_partial(
    "partial_paged",
    _partial,
    lambda k, v, table, kscale, vscale, mask, block_size, length, *rest: (
        PagedSegment(k, v, table, block_size, length, kscale, vscale),
        mask,
        *rest,
    ),
    lambda q, k, v, *rest: (k.shape[1], v.shape[-1]),
)

"""Paged cache layers: K/V in fixed-size blocks of a shared pool, addressed through per-row block tables
(PagedAttention, https://arxiv.org/abs/2309.06180).

One :class:`PagedState` serves all full-attention layers of a cache: a block id names the same token slots in every
layer's storage, so the bookkeeping (allocation, copy-on-write, forks, crops) happens once per forward, at the first
full-attention layer, and the other layers write into the slots it chose. Beam reordering, ``num_return_sequences``
forks and row selection only rewrite block tables; no K/V is copied.

Sharing. Identical prompt rows (``num_return_sequences`` and ``num_beams`` repeat the prompt before prefill) are
detected at prefill by bitwise-equal keys and values, checked on every layer, and stored once: their tables point at
the same blocks. A row about to write into a shared, partly filled block gets its own copy first.

Left padding. ``generate()`` left-pads a batch to one length. When the cache knows each row's padding (a
:class:`~hf_kvcache.layers._common.PaddingTracker` fed by the model's forward hook), a row's leading blocks that hold
only padding become :data:`~hf_kvcache.paging.PAD_BLOCK` table entries at prefill: nothing is written or allocated
for them, and reads of their (masked) positions return a zero-filled slot.

Storage per layer (:class:`PagedStorage`): one ``(num_blocks * block_size, H, D)`` tensor for keys and one for values,
zero-initialized; an on-demand pool grows geometrically (the tensors are reallocated, block ids stay valid). A
forward returns contiguous ``(B, H, T, D)`` K/V gathered through the block tables, which works with any attention
implementation; under the ``hf_kvcache`` attention implementation (:mod:`hf_kvcache.attention`) it returns a
:class:`~hf_kvcache.kernels.KVHandle` of one :class:`~hf_kvcache.kernels.PagedSegment` (the pool and the block
table) instead, and the kernels read the blocks in place.

Ownership runs one way: the cache owns its layers and one state; the state owns the allocator, the tables and every
layer's storage; nothing points back (the allocator's and tables' callbacks hold the state weakly), so a dropped
cache frees its pool at once, without waiting for the cycle collector.
"""

from __future__ import annotations

import weakref

import torch

from .._config import LayerSpec
from ..kernels import KVHandle, PagedSegment
from ..paging import PAD_BLOCK, BlockAllocator, BlockTables
from ._common import AttentionMode, KVLayer, PaddingTracker, as_index, tokens_to_crop


def _weak_method(method):
    """A callable that forwards to a bound method without keeping its object alive."""
    ref = weakref.WeakMethod(method)

    def call(*args):
        target = ref()
        return None if target is None else target(*args)

    return call


class PagedStorage:
    """One layer's K/V slots: ``(slots, H, Dk)`` and ``(slots, H, Dv)`` tensors, slot ``b * block_size + i`` being
    token ``i`` of block ``b``."""

    def __init__(self, spec: LayerSpec, dtype: torch.dtype, device: torch.device, num_slots: int):
        self.spec = spec
        self.keys = torch.zeros((num_slots, spec.num_kv_heads, spec.key_dim), dtype=dtype, device=device)
        self.values = torch.zeros((num_slots, spec.num_kv_heads, spec.value_dim), dtype=dtype, device=device)

    @property
    def num_slots(self) -> int:
        return self.keys.shape[0]

    def grow(self, num_slots: int) -> None:
        """Cover ``num_slots`` slots; existing slots keep their ids and contents."""
        if num_slots <= self.num_slots:
            return
        for name in ("keys", "values"):
            old = getattr(self, name)
            new = old.new_zeros((num_slots, *old.shape[1:]))
            new[: old.shape[0]].copy_(old)
            setattr(self, name, new)

    def write(self, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor, keep: torch.Tensor | None) -> None:
        """Store tokens ``(B, H, q, D)`` at ``(B, q)`` ``slots`` (``keep``: the ``(B * q,)`` tokens to store)."""
        flat = slots.to(self.keys.device).flatten()
        k_rows = k.transpose(1, 2).reshape(-1, *self.keys.shape[1:])  # (B * q, H, Dk)
        v_rows = v.transpose(1, 2).reshape(-1, *self.values.shape[1:])
        if keep is not None:  # tokens in padding blocks are not stored
            keep = keep.to(self.keys.device)
            flat, k_rows, v_rows = flat[keep], k_rows[keep], v_rows[keep]
        self.keys.index_copy_(0, flat, k_rows)
        self.values.index_copy_(0, flat, v_rows)

    def read(self, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K/V ``(B, H, n, D)`` of the ``(B, n)`` ``slots``."""
        b, t = slots.shape
        flat = slots.to(self.keys.device).flatten()
        k = self.keys.index_select(0, flat).view(b, t, *self.keys.shape[1:])  # (B, T, H, Dk)
        v = self.values.index_select(0, flat).view(b, t, *self.values.shape[1:])
        return k.transpose(1, 2), v.transpose(1, 2)

    def copy_block(self, src: int, dst: int, block_size: int) -> None:
        for t in (self.keys, self.values):
            t[dst * block_size : (dst + 1) * block_size].copy_(t[src * block_size : (src + 1) * block_size])

    @property
    def block_nbytes_per_slot(self) -> int:
        return self.keys[0].numel() * self.keys.element_size() + self.values[0].numel() * self.values.element_size()

    @property
    def reserved_nbytes(self) -> int:
        return self.num_slots * self.block_nbytes_per_slot


class PagedState:
    """Block pool, block tables, every full-attention layer's storage and the slot indices of the current forward."""

    def __init__(
        self,
        block_size: int,
        num_blocks: int | None,
        grow_blocks: int,
        padding: PaddingTracker | None = None,
    ):
        self.padding = padding or PaddingTracker()
        self.block_size, self.fixed_blocks, self.grow_blocks = block_size, num_blocks, grow_blocks
        self.storages: dict[int, PagedStorage] = {}  # rank -> storage, created at each layer's first forward
        self._new_pool()

    def _new_pool(self) -> None:
        self.allocator = BlockAllocator(
            self.block_size, self.fixed_blocks, grow_blocks=self.grow_blocks, on_grow=_weak_method(self._on_grow)
        )
        self.tables = BlockTables(self.allocator, _weak_method(self._copy_block))
        self.write_slots: torch.Tensor | None = None  # (B, q) slots of the tokens of the current forward
        self.write_keep: torch.Tensor | None = None  # (B * q,) tokens to write (None: all; padding blocks are not)
        self.read_slots: torch.Tensor | None = None  # (B, T) slots of every token after it
        self.groups: list[list[int]] = []  # rows found identical at the current prefill

    def reset(self) -> None:
        """Free every block and every layer's storage: the next forward starts a fresh pool."""
        self.storages.clear()
        self._new_pool()

    def storage(self, rank: int, spec: LayerSpec, dtype: torch.dtype, device: torch.device) -> PagedStorage:
        if rank not in self.storages:
            self.storages[rank] = PagedStorage(spec, dtype, device, self.allocator.num_blocks * self.block_size)
        return self.storages[rank]

    def _on_grow(self, num_blocks: int) -> None:
        for storage in self.storages.values():
            storage.grow(num_blocks * self.block_size)

    def _copy_block(self, src: int, dst: int) -> None:
        for storage in self.storages.values():
            storage.copy_block(src, dst, self.block_size)

    def begin_forward(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Allocate slots for the new tokens of every row (first full-attention layer of a forward)."""
        batch, _, q, _ = key_states.shape
        prefill = self.tables.num_tokens == 0
        self.groups = _identical_rows(key_states, value_states) if prefill and batch > 1 else []
        mirror = {row: group[0] for group in self.groups for row in group[1:]}
        pad = self.padding.pad if prefill else None
        pad_blocks = [p // self.block_size for p in pad] if pad is not None and len(pad) == batch else None
        self.tables.append_slots(q, batch, mirror, pad_blocks)
        self._index(q)

    def unshare(self, row: int) -> None:
        """Give ``row`` private copies of all its blocks (a later layer found it differs from its group)."""
        table = self.tables.tables[row]
        real = [b for b in table if b != PAD_BLOCK]
        copies = iter(self.allocator.allocate(len(real)))
        new = [b if b == PAD_BLOCK else next(copies) for b in table]
        for src, dst in zip(table, new):
            if src != PAD_BLOCK:
                self._copy_block(src, dst)
        self.allocator.decref(real)
        self.tables.tables[row] = new
        self.groups = [[r for r in g if r != row] for g in self.groups]
        self._index(self.write_slots.shape[1])

    def _index(self, q: int) -> None:
        bs, total = self.block_size, self.tables.num_tokens
        blocks = torch.tensor(self.tables.tables, dtype=torch.long)  # (B, n_blocks)
        slots = (blocks.unsqueeze(-1) * bs + torch.arange(bs)).flatten(1)[:, :total]  # (B, T)
        # Padding entries lead a row's table, so its first entry tells; no (B, T) scan on unpadded batches.
        if any(table and table[0] == PAD_BLOCK for table in self.tables.tables):
            padding = slots < 0
            # Padding positions are masked out of attention: read them from slot 0 (storage is zero-initialized and
            # only ever holds finite K/V, so a masked weight of 0 times it stays 0) and never write them.
            self.read_slots = slots.masked_fill(padding, 0)
            self.write_keep = ~padding[:, total - q :].flatten()
        else:
            self.read_slots, self.write_keep = slots, None
        self.write_slots = self.read_slots[:, total - q :]

    def block_table(self, device: torch.device) -> torch.Tensor:
        """``(B, blocks)`` int32 block table on ``device`` (PAD_BLOCK entries kept: the kernels mask them)."""
        return torch.tensor(self.tables.tables, dtype=torch.int32, device=device)

    def blocks_in_use(self) -> int:
        return self.allocator.num_used_blocks

    def report(self) -> dict:
        """Pool size, blocks used and shared, and waste (allocated slots past each row's last token; left-padding
        slots are stored and count as filled)."""
        bs, tokens = self.block_size, self.tables.num_tokens
        distinct: dict[int, int] = {}
        for table in self.tables.tables:
            for i, b in enumerate(table):
                if b != PAD_BLOCK:
                    distinct[b] = max(distinct.get(b, 0), min(bs, tokens - i * bs))
        used = len(distinct)
        filled = sum(distinct.values())
        return {
            "block_size": bs,
            "num_blocks": self.allocator.num_blocks,
            "blocks_used": used,
            "blocks_free": self.allocator.num_free_blocks,
            "blocks_shared": self.allocator.num_shared_blocks,
            "allocated_slots": used * bs,
            "waste_slots": used * bs - filled,
            "waste": (used * bs - filled) / (used * bs) if used else 0.0,
        }


def _same_rows(k: torch.Tensor, v: torch.Tensor, a: int, b: int) -> bool:
    """Rows ``a`` and ``b`` hold bitwise-equal keys and values."""
    return torch.equal(k[a], k[b]) and torch.equal(v[a], v[b])


def _identical_rows(k: torch.Tensor, v: torch.Tensor) -> list[list[int]]:
    """Groups (of two or more) of rows whose keys and values are bitwise equal."""
    leaders: list[list[int]] = []
    for row in range(k.shape[0]):
        for group in leaders:
            if _same_rows(k, v, row, group[0]):
                group.append(row)
                break
        else:
            leaders.append([row])
    return [g for g in leaders if len(g) > 1]


class PagedLayer(KVLayer):
    """A full-attention layer whose K/V live in the blocks of a :class:`PagedState`."""

    is_sliding = False

    def __init__(
        self,
        spec: LayerSpec,
        layer_idx: int,
        owner: str,
        state: PagedState,
        rank: int,
        mode: AttentionMode | None = None,
    ):
        super().__init__(spec, layer_idx, owner, mode)
        self.state = state
        self.rank = rank  # 0: this layer does the bookkeeping of each forward

    @property
    def storage(self) -> PagedStorage | None:
        return self.state.storages.get(self.rank)

    # -- lifecycle ------------------------------------------------------------------------------------------------

    def _initialize(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.state.storage(self.rank, self.spec, self.dtype, self.device)

    def _release(self) -> None:
        if self.rank == 0:
            self.state.reset()

    # -- CacheLayerMixin ------------------------------------------------------------------------------------------

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs
    ) -> tuple[torch.Tensor, torch.Tensor]:
        self._begin_update(key_states, value_states)
        state = self.state
        if self.rank == 0:
            state.begin_forward(key_states, value_states)
        else:
            for group in state.groups:
                for row in group[1:]:
                    if not _same_rows(key_states, value_states, row, group[0]):
                        state.unshare(row)
        self.storage.write(state.write_slots, key_states, value_states, state.write_keep)
        q, total = key_states.shape[-2], state.tables.num_tokens
        if self.mode.handles(q, total - q):
            storage, table = self.storage, state.block_table(self.device)
            segment = PagedSegment(storage.keys, storage.values, table, state.block_size, total)
            handle = KVHandle((segment,))
            return handle, handle
        return self.storage.read(state.read_slots)

    def get_seq_length(self) -> int:
        return self.state.tables.num_tokens

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.state.tables.num_tokens + query_length, 0

    def get_max_length(self) -> int:
        return -1

    def crop(self, tokens_to_remove: int) -> None:
        n = tokens_to_crop(tokens_to_remove)
        if self.rank == 0 and n:
            self.state.tables.truncate(n)

    def _select_rows(self, pick, batch: int | None) -> None:
        """Row bookkeeping happens once, on the first layer: ``pick(rows)`` maps old row ids to the new rows."""
        tables = self.state.tables
        if self.rank == 0 and tables.tables:
            tables.select_rows(pick(torch.arange(len(tables.tables))).tolist())
        self._set_batch(batch)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self._select_rows(lambda rows: rows[beam_idx.cpu()], len(beam_idx))

    def batch_repeat_interleave(self, repeats: int) -> None:
        batch = None if self.batch_size is None else self.batch_size * repeats
        self._select_rows(lambda rows: rows.repeat_interleave(repeats), batch)

    def batch_select_indices(self, indices) -> None:
        index = as_index(indices)
        self._select_rows(lambda rows: rows[index], len(index))

    def offload(self) -> None:
        """Paged storage stays on its device (blocks are shared across rows and forwards)."""

    def prefetch(self) -> None:
        """See :meth:`offload`."""

    # -- reporting ------------------------------------------------------------------------------------------------

    @property
    def stored_tokens(self) -> int:
        return self.state.tables.num_tokens

    @property
    def nbytes(self) -> int:
        """Bytes of the blocks in use (a shared block counts once), not of the free pool."""
        storage = self.storage
        if storage is None:
            return 0
        return self.state.blocks_in_use() * self.state.block_size * storage.block_nbytes_per_slot

    @property
    def reserved_nbytes(self) -> int:
        """Bytes of the whole pool on this layer."""
        storage = self.storage
        return 0 if storage is None else storage.reserved_nbytes

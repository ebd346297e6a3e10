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

Storage per layer: chunks of ``(blocks * block_size, H, D)`` tensors (one per pool growth, so growing never moves a
block). A forward returns contiguous ``(B, H, T, D)`` K/V gathered through the block tables, which works with any
attention implementation; under the ``hf_kvcache_paged`` attention implementation (:mod:`hf_kvcache.attention`) it
returns a reference to the blocks instead and attention reads them page group by page group.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import CacheLayerMixin

from ..paging import PAD_BLOCK, BlockAllocator, BlockTables
from ._common import PaddingTracker, tokens_to_crop


class PagedState:
    """Block pool, block tables and the slot indices of the current forward, shared by the paged layers."""

    def __init__(
        self,
        block_size: int,
        num_blocks: int | None,
        grow_blocks: int,
        config=None,
        padding: PaddingTracker | None = None,
    ):
        self.config = config  # read per forward: under paged attention, layers skip the gather
        self.padding = padding or PaddingTracker()
        self.layers: list[PagedLayer] = []
        self.allocator = BlockAllocator(block_size, num_blocks, grow_blocks=grow_blocks, on_grow=self._on_grow)
        self.tables = BlockTables(self.allocator, self._copy_block)
        self.write_slots: torch.Tensor | None = None  # (B, q) slots of the tokens of the current forward
        self.write_keep: torch.Tensor | None = None  # (B * q,) tokens to write (None: all; padding blocks are not)
        self.read_slots: torch.Tensor | None = None  # (B, T) slots of every token after it
        self.groups: list[list[int]] = []  # rows found identical at the current prefill

    @property
    def block_size(self) -> int:
        return self.allocator.block_size

    def _on_grow(self, num_blocks: int) -> None:
        for layer in self.layers:
            layer.grow(num_blocks)

    def _copy_block(self, src: int, dst: int) -> None:
        for layer in self.layers:
            layer.copy_block(src, dst)

    def begin_forward(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Allocate slots for the new tokens of every row (first full-attention layer of a forward)."""
        batch, _, q, _ = key_states.shape
        prefill = self.tables.num_tokens == 0
        self.groups = _identical_rows(key_states, value_states) if prefill and batch > 1 else []
        mirror = {row: group[0] for group in self.groups for row in group[1:]}
        pad = self.padding.pad if prefill else None
        pad_blocks = (pad // self.block_size).tolist() if pad is not None and pad.shape[0] == batch else None
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

    @property
    def paged_attention(self) -> bool:
        from ..attention import PAGED_ATTENTION

        return getattr(self.config, "_attn_implementation", None) == PAGED_ATTENTION

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


class PagedLayer(CacheLayerMixin):
    """A full-attention layer whose K/V live in the blocks of a :class:`PagedState`."""

    is_sliding = False
    is_croppable = True

    def __init__(self, state: PagedState, rank: int):
        super().__init__()
        self.state = state
        self.rank = rank  # 0: this layer does the bookkeeping of each forward
        self.k_chunks: list[torch.Tensor] = []  # (blocks * block_size, H, D) each
        self.v_chunks: list[torch.Tensor] = []
        self.chunk_starts: list[int] = []  # first slot of each chunk
        state.layers.append(self)

    # -- storage --------------------------------------------------------------------------------------------------

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        self.num_heads, self.head_dim = key_states.shape[1], key_states.shape[-1]
        self.is_initialized = True
        self.grow(self.state.allocator.num_blocks)

    @property
    def num_slots(self) -> int:
        return sum(c.shape[0] for c in self.k_chunks)

    def grow(self, num_blocks: int) -> None:
        """Add a chunk so that the storage covers ``num_blocks`` blocks (existing blocks stay where they are)."""
        if not self.is_initialized:
            return
        new = num_blocks * self.state.block_size - self.num_slots
        if new <= 0:
            return
        self.chunk_starts.append(self.num_slots)
        shape = (new, self.num_heads, self.head_dim)
        self.k_chunks.append(torch.zeros(shape, dtype=self.dtype, device=self.device))
        self.v_chunks.append(torch.zeros(shape, dtype=self.dtype, device=self.device))

    def _locate(self, slots: torch.Tensor) -> list[tuple[int, torch.Tensor, torch.Tensor]]:
        """``(chunk, mask, local slot)`` for the chunks ``slots`` (flat, on this device) touch."""
        if len(self.k_chunks) == 1:
            return [(0, None, slots)]
        out = []
        for c, start in enumerate(self.chunk_starts):
            stop = start + self.k_chunks[c].shape[0]
            mask = (slots >= start) & (slots < stop)
            if bool(mask.any()):
                out.append((c, mask, slots[mask] - start))
        return out

    def _write(self, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor, keep: torch.Tensor | None = None) -> None:
        flat = slots.to(self.device).flatten()
        k_rows = k.transpose(1, 2).reshape(-1, self.num_heads, self.head_dim)  # (B * q, H, D)
        v_rows = v.transpose(1, 2).reshape(-1, self.num_heads, self.head_dim)
        if keep is not None:  # tokens in padding blocks are not stored
            keep = keep.to(self.device)
            flat, k_rows, v_rows = flat[keep], k_rows[keep], v_rows[keep]
        for c, mask, local in self._locate(flat):
            self.k_chunks[c].index_copy_(0, local, k_rows if mask is None else k_rows[mask])
            self.v_chunks[c].index_copy_(0, local, v_rows if mask is None else v_rows[mask])

    def read(self, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K/V ``(B, H, n, D)`` of the ``(B, n)`` storage ``slots`` (the gather path, and what paged attention
        reads one page group at a time)."""
        b, t = slots.shape
        flat = slots.to(self.device).flatten()
        parts = self._locate(flat)
        if len(parts) == 1 and parts[0][1] is None:
            k = self.k_chunks[0].index_select(0, flat)
            v = self.v_chunks[0].index_select(0, flat)
        else:
            k = torch.empty((b * t, self.num_heads, self.head_dim), dtype=self.dtype, device=self.device)
            v = torch.empty_like(k)
            for c, mask, local in parts:
                k[mask] = self.k_chunks[c].index_select(0, local)
                v[mask] = self.v_chunks[c].index_select(0, local)
        # (B * T, H, D) -> (B, H, T, D)
        return k.view(b, t, self.num_heads, self.head_dim).transpose(1, 2), v.view(
            b, t, self.num_heads, self.head_dim
        ).transpose(1, 2)

    def copy_block(self, src: int, dst: int) -> None:
        if not self.is_initialized:
            return
        bs = self.state.block_size
        src_slots = torch.arange(src * bs, (src + 1) * bs, device=self.device)
        dst_slots = torch.arange(dst * bs, (dst + 1) * bs, device=self.device)
        k, v = self.read(src_slots.view(1, -1))
        self._write(dst_slots.view(1, -1), k, v)

    # -- CacheLayerMixin ------------------------------------------------------------------------------------------

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        state = self.state
        if self.rank == 0:
            state.begin_forward(key_states, value_states)
        else:
            for group in state.groups:
                for row in group[1:]:
                    if not _same_rows(key_states, value_states, row, group[0]):
                        state.unshare(row)
        self._write(state.write_slots, key_states, value_states, state.write_keep)
        if state.paged_attention:
            from ..attention import PagedKV

            k, v = key_states.new_empty(0), value_states.new_empty(0)
            k.hf_kvcache_pages = v.hf_kvcache_pages = PagedKV(self, state.read_slots, state.block_size)
            return k, v
        return self.read(state.read_slots)

    def get_seq_length(self) -> int:
        return self.state.tables.num_tokens

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.state.tables.num_tokens + query_length, 0

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        if self.rank == 0:
            self.state.tables.release()

    def crop(self, tokens_to_remove: int) -> None:
        n = tokens_to_crop(tokens_to_remove)
        if self.rank == 0 and n:
            self.state.tables.truncate(n)

    def _select_rows(self, pick) -> None:
        """Row bookkeeping happens once, on the first layer: ``pick(rows)`` maps old row ids to the new rows."""
        tables = self.state.tables
        if self.rank == 0 and tables.tables:
            tables.select_rows(pick(torch.arange(len(tables.tables))).tolist())

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self._select_rows(lambda rows: rows[beam_idx.cpu()])

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._select_rows(lambda rows: rows.repeat_interleave(repeats))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._select_rows(lambda rows: rows[indices.cpu() if isinstance(indices, torch.Tensor) else indices])

    def offload(self) -> None:
        """Paged storage stays on its device (blocks are shared across rows and forwards)."""

    def prefetch(self) -> None:
        """See :meth:`offload`."""

    # -- reporting ------------------------------------------------------------------------------------------------

    @property
    def _block_nbytes(self) -> int:
        if not self.is_initialized:
            return 0
        return 2 * self.state.block_size * self.num_heads * self.head_dim * self.k_chunks[0].element_size()

    @property
    def stored_tokens(self) -> int:
        return self.state.tables.num_tokens

    @property
    def nbytes(self) -> int:
        """Bytes of the blocks in use (a shared block counts once), not of the free pool."""
        return self.state.blocks_in_use() * self._block_nbytes

    @property
    def reserved_nbytes(self) -> int:
        """Bytes of the whole pool on this layer."""
        return sum(c.numel() * c.element_size() for c in self.k_chunks + self.v_chunks)

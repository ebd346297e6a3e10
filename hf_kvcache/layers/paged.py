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

import copy
import weakref

import torch

from .._config import LayerSpec
from ..formats import DenseSegment, Int8Codec, KVHandle, PagedSegment, codec_for
from ..formats.paged import gather_rows
from ..kernels.append import append_kv
from ..paging import PAD_BLOCK, BlockAllocator, BlockTables
from ._common import AttentionMode, KVLayer, PaddingTracker, as_index, tokens_to_crop
from ._storage import loaded_device, saved_tensor


class _WeakMethod:
    """A callable that forwards to a bound method without keeping its object alive. Pickled with its object (a
    saved cache's pool calls its own state once loaded)."""

    def __init__(self, method) -> None:
        self.__setstate__((method,))

    def __call__(self, *args):
        target = self._ref() if self._ref is not None else None
        return None if target is None else target(*args)

    def __getstate__(self) -> tuple:
        return (self._ref() if self._ref is not None else None,)  # the bound method, pickled as (object, name)

    def __setstate__(self, state: tuple) -> None:
        (method,) = state
        self._ref = weakref.WeakMethod(method) if method is not None else None


def page_codec(bits: int | None) -> Int8Codec | None:
    """How pages store K/V: ``None`` (the model's dtype) or int8 codes with one float32 scale per token and head, as
    the int8 cache encodes them."""
    return codec_for(bits)


def page_bytes_per_token(spec: LayerSpec, bits: int | None, dtype: torch.dtype) -> float:
    """Bytes one slot of a page holds (keys and values, all heads)."""
    codec = page_codec(bits)
    if codec is None:
        return spec.bytes_per_token_factor * dtype.itemsize
    return codec.bytes_per_token(spec.num_kv_heads, spec.key_dim, spec.value_dim)


def _pool(slots: int, heads: int, rest: tuple[int, ...], dtype: torch.dtype, device) -> torch.Tensor:
    """A zeroed pool ``(slots, H, ...)`` laid out head-major in memory (each head's slots contiguous): a gather of one
    row's tokens then comes out ``(H, n, D)``, the layout attention takes, in one copy (slot-major pools needed a
    second, transposing one; kernels read either through the strides)."""
    return torch.zeros((heads, slots, *rest), dtype=dtype, device=device).transpose(0, 1)


class PagedStorage:
    """One layer's K/V slots, slot ``b * block_size + i`` being token ``i`` of block ``b``: ``keys`` ``(slots, H, Dk)``
    and ``values`` ``(slots, H, Dv)`` in the model's dtype, or (``bits=8``) int8 codes with one float32 scale per
    token and head in ``key_scales`` / ``value_scales`` ``(slots, H)``, as the int8 cache encodes them. Each is a
    view of a head-major tensor (:func:`_pool`)."""

    def __init__(self, spec: LayerSpec, dtype: torch.dtype, device: torch.device, num_slots: int, bits: int | None):
        self.spec, self.dtype, self.bits = spec, dtype, bits
        code = torch.int8 if bits == 8 else dtype
        heads = spec.num_kv_heads
        self.tensors = {
            "keys": _pool(num_slots, heads, (spec.key_dim,), code, device),
            "values": _pool(num_slots, heads, (spec.value_dim,), code, device),
        }
        if bits == 8:
            self.tensors["key_scales"] = _pool(num_slots, heads, (), torch.float32, device)
            self.tensors["value_scales"] = _pool(num_slots, heads, (), torch.float32, device)
        self.codec = page_codec(bits)

    @property
    def keys(self) -> torch.Tensor:
        return self.tensors["keys"]

    @property
    def values(self) -> torch.Tensor:
        return self.tensors["values"]

    @property
    def num_slots(self) -> int:
        return self.keys.shape[0]

    def saved(self, slots: torch.Tensor) -> PagedStorage:
        """A copy holding only ``slots`` (a 1-D index) of each tensor, in host memory (:func:`saved_tensor`): what a
        saved pool keeps (:meth:`PagedState.__getstate__`); :meth:`restore` puts them back into a whole pool."""
        clone = copy.copy(self)
        clone.tensors = {name: saved_tensor(t.index_select(0, slots.to(t.device))) for name, t in self.tensors.items()}
        clone.saved_device = self.keys.device
        return clone

    def restore(self, slots: torch.Tensor, num_slots: int) -> None:
        """Back from :meth:`saved`: zeroed pools of ``num_slots`` on the saved device, ``slots`` filled."""
        device = loaded_device(self.__dict__.pop("saved_device"))
        for name, saved in self.tensors.items():
            pool = _pool(num_slots, saved.shape[1], saved.shape[2:], saved.dtype, device)
            pool[slots.to(device)] = saved.to(device)
            self.tensors[name] = pool

    def grow(self, num_slots: int) -> None:
        """Cover ``num_slots`` slots; existing slots keep their ids and contents."""
        if num_slots <= self.num_slots:
            return
        for name, old in self.tensors.items():
            new = _pool(num_slots, old.shape[1], old.shape[2:], old.dtype, old.device)
            new[: old.shape[0]].copy_(old)
            self.tensors[name] = new

    def write(self, table: torch.Tensor, start: int, block_size: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store tokens ``(B, H, q, D)`` at positions ``start ..`` of each row's blocks in ``table`` (``(B, blocks)``,
        on this storage's device; none under a padding entry): one launch on CUDA, int8 pages encoded on the way."""
        t = self.tensors
        append_kv(
            k,
            v,
            t["keys"],
            t["values"],
            t.get("key_scales"),
            t.get("value_scales"),
            table,
            start,
            block_size,
            None,
            None,
        )

    def read(self, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K/V ``(B, H, n, D)`` of the ``(B, n)`` ``slots``, in the model's dtype."""
        slots = slots.to(self.keys.device)
        out = []
        for name in ("keys", "values"):
            x = gather_rows(self.tensors[name], slots)
            if self.codec is not None:
                x = (x.float() * gather_rows(self.tensors[name[:-1] + "_scales"], slots).unsqueeze(-1)).to(self.dtype)
            out.append(x)
        return out[0], out[1]

    def segment(self, block_table: torch.Tensor, block_size: int, length: int) -> PagedSegment:
        scales = (self.tensors.get("key_scales"), self.tensors.get("value_scales"))
        return PagedSegment(self.keys, self.values, block_table, block_size, length, *scales)

    def copy_block(self, src: int, dst: int, block_size: int) -> None:
        for t in self.tensors.values():
            t[dst * block_size : (dst + 1) * block_size].copy_(t[src * block_size : (src + 1) * block_size])

    @property
    def block_nbytes_per_slot(self) -> int:
        return sum(t[0].numel() * t.element_size() for t in self.tensors.values())

    @property
    def reserved_nbytes(self) -> int:
        return self.num_slots * self.block_nbytes_per_slot


class DeviceTables:
    """The block tables as one ``(B, capacity)`` int32 tensor on a device, for the kernels and for computing slots on
    the device. The Python tables of :mod:`hf_kvcache.paging` stay the source of truth; this copy follows them
    incrementally: :meth:`sync` compares them with what the device holds from the first column an operation may have
    changed (``dirty_from``) and uploads only the cells that differ, so a decode step uploads nothing except when a
    row enters a new block (or copies one on write); row reorders run on the device."""

    def __init__(self, device: torch.device):
        self.device = device
        self.table = torch.full((0, 0), PAD_BLOCK, dtype=torch.int32, device=device)
        self.mirror: list[list[int]] = []  # what the device holds, row by row (entries past a row's end are PAD)
        self.dirty_from = 0  # first column that may differ from the Python tables

    def mark(self, column: int) -> None:
        self.dirty_from = min(self.dirty_from, column)

    def sync(self, tables: list[list[int]]) -> torch.Tensor:
        width = max((len(t) for t in tables), default=0)
        if len(tables) != len(self.mirror) or width > self.table.shape[1]:
            capacity = max(width, 2 * self.table.shape[1], 1)
            fresh = torch.full((len(tables), capacity), PAD_BLOCK, dtype=torch.int32, device=self.device)
            if len(tables) == len(self.mirror):
                fresh[:, : self.table.shape[1]].copy_(self.table)
            else:
                self.mirror, self.dirty_from = [[] for _ in tables], 0
            self.table = fresh
        rows, cols, values = [], [], []
        for r, (table, held) in enumerate(zip(tables, self.mirror)):
            for c in range(self.dirty_from, max(len(table), len(held))):
                want = table[c] if c < len(table) else PAD_BLOCK
                if (held[c] if c < len(held) else PAD_BLOCK) != want:
                    rows.append(r)
                    cols.append(c)
                    values.append(want)
            if len(held) != len(table) or self.dirty_from < len(table):
                self.mirror[r] = list(table)
        if rows:
            index = torch.tensor([rows, cols], dtype=torch.long).to(self.device, non_blocking=True)
            update = torch.tensor(values, dtype=torch.int32).to(self.device, non_blocking=True)
            self.table.index_put_((index[0], index[1]), update)
        self.dirty_from = width
        return self.table

    def select_rows(self, rows: list[int]) -> None:
        """New row ``i`` is old row ``rows[i]``: a gather on the device."""
        if len(self.mirror) == 0:
            return
        index = torch.tensor(rows, dtype=torch.long).to(self.device, non_blocking=True)
        self.table = self.table.index_select(0, index)
        self.mirror = [list(self.mirror[r]) for r in rows]


class PagedState:
    """Block pool, block tables, every full-attention layer's storage and the slot indices of the current forward."""

    def __init__(
        self,
        block_size: int,
        num_blocks: int | None,
        grow_blocks: int,
        padding: PaddingTracker | None = None,
        bits: int | None = None,
    ):
        self.padding = padding or PaddingTracker()
        self.bits = bits
        self.block_size, self.fixed_blocks, self.grow_blocks = block_size, num_blocks, grow_blocks
        self.storages: dict[int, PagedStorage] = {}  # rank -> storage, created at each layer's first forward
        self._new_pool()

    def _new_pool(self) -> None:
        self.allocator = BlockAllocator(
            self.block_size, self.fixed_blocks, grow_blocks=self.grow_blocks, on_grow=_WeakMethod(self._on_grow)
        )
        self.tables = BlockTables(self.allocator, _WeakMethod(self._copy_block))
        self.device_tables: dict[torch.device, DeviceTables] = {}  # one copy per device holding layers
        self.new_tokens = 0  # tokens of the current forward
        self._slots: dict[tuple, torch.Tensor] = {}  # per forward: (device, kind) -> slots, shared by its layers
        self.groups: list[list[int]] = []  # rows found identical at the current prefill

    def reset(self) -> None:
        """Free every block and every layer's storage: the next forward starts a fresh pool."""
        self.storages.clear()
        self._new_pool()

    def __deepcopy__(self, memo: dict) -> PagedState:
        # The pool's callbacks hold this state weakly; a copy's pool must call the copy (a plain deepcopy keeps
        # them pointing at the original: the copy's storage would stop growing once the original is gone).
        clone = self.__class__.__new__(self.__class__)
        memo[id(self)] = clone
        for name, value in self.__dict__.items():
            clone.__dict__[name] = copy.deepcopy(value, memo)
        clone.allocator.on_grow = _WeakMethod(clone._on_grow)
        clone.tables.copy_block = _WeakMethod(clone._copy_block)
        return clone

    def __getstate__(self) -> dict:
        # Saved (pickle, torch.save), the pool keeps its blocks in use only: a fixed pool sized for a server and
        # holding one prompt saves the prompt's blocks. Loaded, the pool has its full size again (the free blocks
        # zeroed, as a new pool's) and every block keeps its id, so the tables and counts are saved as they are.
        state = self.__dict__.copy()
        blocks = [b for b, count in enumerate(self.allocator.ref_cnt) if count > 0]
        slots = self._block_slots(blocks)
        state["storages"] = {rank: s.saved(slots) for rank, s in self.storages.items()}
        state["saved_blocks"] = blocks
        state["_slots"] = {}  # the current forward's
        return state

    def __setstate__(self, state: dict) -> None:
        slots = self._block_slots(state.pop("saved_blocks"), state["block_size"])
        self.__dict__.update(state)
        for storage in self.storages.values():
            storage.restore(slots, self.allocator.num_blocks * self.block_size)

    def _block_slots(self, blocks: list[int], block_size: int | None = None) -> torch.Tensor:
        """The slots of ``blocks``, in their order (1-D, long)."""
        size = self.block_size if block_size is None else block_size
        return (torch.tensor(blocks, dtype=torch.long)[:, None] * size + torch.arange(size)).reshape(-1)

    def storage(self, rank: int, spec: LayerSpec, dtype: torch.dtype, device: torch.device) -> PagedStorage:
        if rank not in self.storages:
            num_slots = self.allocator.num_blocks * self.block_size
            self.storages[rank] = PagedStorage(spec, dtype, device, num_slots, self.bits)
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
        self._mark(self.tables.num_tokens // self.block_size)  # the last, partly filled block may be copied on write
        self.tables.append_slots(q, batch, mirror, pad_blocks)
        self._begin(q)

    def _mark(self, column: int) -> None:
        for tables in self.device_tables.values():
            tables.mark(column)

    def _begin(self, q: int) -> None:
        self.new_tokens = q
        self._slots.clear()

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
        self._mark(0)
        self._begin(self.new_tokens)

    def truncate(self, n: int) -> None:
        self.tables.truncate(n)
        self._mark(self.tables.num_tokens // self.block_size)

    def select_rows(self, rows: list[int]) -> None:
        self.tables.select_rows(rows)
        for tables in self.device_tables.values():
            tables.select_rows(rows)

    def block_table(self, device: torch.device) -> torch.Tensor:
        """``(B, capacity)`` int32 block table on ``device``, following the Python tables (PAD_BLOCK entries, and
        columns past a row's end, are masked by the kernels)."""
        if device not in self.device_tables:
            self.device_tables[device] = DeviceTables(device)
        return self.device_tables[device].sync(self.tables.tables)

    def _slots_of(self, device: torch.device, start: int, stop: int) -> torch.Tensor:
        """``(B, stop - start)`` storage slots of tokens ``start .. stop`` computed on ``device`` from its block
        table (negative where a padding entry stands)."""
        table = self.block_table(device)
        positions = torch.arange(start, stop, device=device)
        return table[:, positions // self.block_size].long() * self.block_size + positions % self.block_size

    def read_slots(self, device: torch.device) -> torch.Tensor:
        """Slots ``(B, T)`` of every token: the gather path. Padding positions are masked out of attention, so they
        read slot 0 (storage is zero-initialized and only ever holds finite K/V: masked weight 0 times it stays 0)."""
        key = (device, "read")
        if key not in self._slots:
            self._slots[key] = self._slots_of(device, 0, self.tables.num_tokens).clamp_min(0)
        return self._slots[key]

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
    # Off CUDA the gather (one copy per row from the head-major pools) + sdpa beats the reference kernel reading the
    # pages in place at every length measured (SmolLM2, one CPU thread: 1.26x at 8k x 4, pages and int8 pages).
    CPU_HANDLE_TOKENS = None

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

    def write(self, key_states: torch.Tensor, value_states: torch.Tensor) -> torch.Tensor:
        """Write the new tokens into their blocks (allocating them on the first layer); the block table."""
        self._begin_update(key_states, value_states)
        state = self.state
        if self.rank == 0:
            state.begin_forward(key_states, value_states)
        else:
            for group in state.groups:
                for row in group[1:]:
                    if not _same_rows(key_states, value_states, row, group[0]):
                        state.unshare(row)
        table = state.block_table(self.device)
        self.storage.write(table, state.tables.num_tokens - key_states.shape[-2], state.block_size, key_states,
                           value_states)  # fmt: skip
        return table

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs
    ) -> tuple[torch.Tensor, torch.Tensor]:
        table = self.write(key_states, value_states)
        state = self.state
        q, total = key_states.shape[-2], state.tables.num_tokens
        # The forward's own tokens are attended exactly, as the quantized cache does (int8 pages store them rounded).
        if self._hands_storage(q, total - q):
            pages = self.storage.segment(table, state.block_size, total - q)
            handle = KVHandle((pages, DenseSegment(key_states, value_states)), self.mode.model_type)
            return handle, handle
        keys, values = self.storage.read(state.read_slots(self.device))
        if self.storage.codec is not None:
            keys[:, :, total - q :], values[:, :, total - q :] = key_states, value_states
        return keys, values

    def get_seq_length(self) -> int:
        return self.state.tables.num_tokens

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.state.tables.num_tokens + query_length, 0

    def decode_equivalent_tokens(self, limit: int) -> int:
        """How many of the next tokens (at most ``limit``) one forward can take with the logits and stored state of
        one forward per token (:mod:`hf_kvcache.scoring`): any number in exact pages; int8 pages are read back rounded
        by the next token (a forward reads its own exact), so one."""
        return limit if self.state.bits is None else 1

    def get_max_length(self) -> int:
        return -1

    def crop(self, tokens_to_remove: int) -> None:
        n = tokens_to_crop(tokens_to_remove)
        if self.rank == 0 and n:
            self.state.truncate(n)

    def _select_rows(self, pick, batch: int | None) -> None:
        """Row bookkeeping happens once, on the first layer: ``pick(rows)`` maps old row ids to the new rows."""
        tables = self.state.tables
        if self.rank == 0 and tables.tables:
            self.state.select_rows(pick(torch.arange(len(tables.tables))).tolist())
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
    def quantized_tokens(self) -> int:
        return self.stored_tokens if self.state.bits == 8 else 0

    def planned_nbytes(self, tokens: int, dtype: torch.dtype, prompt: int | None = None) -> float:
        """Bytes one row stores after ``tokens`` tokens of ``dtype`` K/V: whole blocks (:mod:`hf_kvcache.plan`)."""
        blocks = -(-tokens // self.state.block_size)
        return blocks * self.state.block_size * page_bytes_per_token(self.spec, self.state.bits, dtype)

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

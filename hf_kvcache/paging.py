"""Block bookkeeping for paged KV caches (PagedAttention, https://arxiv.org/abs/2309.06180): a pool of fixed-size
blocks with a free list and reference counts, and per-row block tables with fork, copy-on-write and release.

Pure Python (no torch, no transformers): the cache layer owns the K/V storage and asks this module which block to
read or write. Names follow vLLM: ``block_size``, ``num_blocks``, ``ref_cnt``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

__all__ = ["PAD_BLOCK", "BlockAllocator", "BlockTables", "PoolExhaustedError"]

# A block-table entry for a block whose slots are all left padding: nothing is stored for it and no block of the pool
# is used. Only a row's leading entries can be padding (generate() left-pads), and they are never written.
PAD_BLOCK = -1


def _real(blocks: Sequence[int]) -> list[int]:
    return [b for b in blocks if b != PAD_BLOCK]


class PoolExhaustedError(RuntimeError):
    """A fixed block pool cannot serve a request. The message says how many blocks were needed."""


class BlockAllocator:
    """A pool of ``num_blocks`` blocks of ``block_size`` token slots, with a free list and reference counts.

    ``num_blocks=None`` grows the pool on demand by at least ``grow_blocks`` and half the pool at a time; the
    ``on_grow(new_num_blocks)`` callback lets the storage add a chunk without moving existing blocks. A fixed pool
    raises :class:`PoolExhaustedError` and leaves every count unchanged.
    """

    def __init__(
        self,
        block_size: int,
        num_blocks: int | None = None,
        grow_blocks: int = 64,
        on_grow: Callable[[int], None] | None = None,
    ):
        self.block_size = block_size
        self.fixed = num_blocks is not None
        self.grow_blocks = grow_blocks
        self.on_grow = on_grow
        self.num_blocks = 0
        self.ref_cnt: list[int] = []
        self._free: list[int] = []  # a stack: the most recently freed block is reused first
        if num_blocks:
            self._grow(num_blocks)

    # -- queries --------------------------------------------------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    @property
    def num_shared_blocks(self) -> int:
        return sum(1 for c in self.ref_cnt if c > 1)

    # -- allocation -----------------------------------------------------------------------------------------------

    def _grow(self, n: int) -> None:
        start = self.num_blocks
        self.num_blocks += n
        self.ref_cnt.extend([0] * n)
        self._free.extend(range(self.num_blocks - 1, start - 1, -1))  # lowest id on top of the stack
        if self.on_grow is not None:
            self.on_grow(self.num_blocks)

    def allocate(self, n: int) -> list[int]:
        """``n`` fresh blocks with ``ref_cnt`` 1."""
        if n > len(self._free):
            missing = n - len(self._free)
            if self.fixed:
                raise PoolExhaustedError(
                    f"the block pool is exhausted: {n} blocks needed, {len(self._free)} free of num_blocks="
                    f"{self.num_blocks} (block_size={self.block_size}); raise num_blocks to at least "
                    f"{self.num_blocks + missing}, or pass num_blocks=None to grow the pool on demand"
                )
            # Geometric growth keeps the number of storage chunks logarithmic in the pool size.
            self._grow(max(missing, self.grow_blocks, self.num_blocks // 2))
        blocks = [self._free.pop() for _ in range(n)]
        for b in blocks:
            self.ref_cnt[b] = 1
        return blocks

    def incref(self, blocks: Sequence[int]) -> None:
        for b in blocks:
            if self.ref_cnt[b] <= 0:
                raise RuntimeError(f"incref of block {b}, which is free (ref_cnt {self.ref_cnt[b]})")
            self.ref_cnt[b] += 1

    def decref(self, blocks: Sequence[int]) -> list[int]:
        """Drop one reference to each block; returns the blocks that became free."""
        freed = []
        for b in blocks:
            if self.ref_cnt[b] <= 0:
                raise RuntimeError(f"decref of block {b}, which is already free (ref_cnt {self.ref_cnt[b]})")
            self.ref_cnt[b] -= 1
            if self.ref_cnt[b] == 0:
                self._free.append(b)
                freed.append(b)
        return freed

    def check_invariants(self, tables: Sequence[Sequence[int]] | None = None) -> None:
        """Raise ``RuntimeError`` with the broken state if the counts, the free list or ``tables`` disagree."""
        if len(self.ref_cnt) != self.num_blocks:
            raise RuntimeError(f"ref_cnt has {len(self.ref_cnt)} entries for num_blocks={self.num_blocks}")
        free = set(self._free)
        if len(free) != len(self._free):
            raise RuntimeError(f"the free list holds duplicates: {sorted(self._free)}")
        zero = {b for b, c in enumerate(self.ref_cnt) if c == 0}
        if free != zero:
            raise RuntimeError(
                f"num_free_blocks ({len(free)}) is out of sync with the zero ref counts ({len(zero)}): "
                f"free but referenced {sorted(free - zero)}, unreferenced but not free {sorted(zero - free)}"
            )
        if any(c < 0 for c in self.ref_cnt):
            raise RuntimeError(f"negative ref_cnt: {[(b, c) for b, c in enumerate(self.ref_cnt) if c < 0]}")
        if tables is not None:
            counts = [0] * self.num_blocks
            for table in tables:
                for b in _real(table):
                    counts[b] += 1
            if counts != self.ref_cnt:
                diff = [(b, counts[b], self.ref_cnt[b]) for b in range(self.num_blocks) if counts[b] != self.ref_cnt[b]]
                raise RuntimeError(f"block tables disagree with ref_cnt (block, in tables, ref_cnt): {diff}")


class BlockTables:
    """Per-row block tables of one cache layer over a shared :class:`BlockAllocator`.

    Every row holds the same number of tokens (``generate()`` batches are left-padded to one length), so one
    ``num_tokens`` serves all rows. A row's leading blocks that hold only padding can be :data:`PAD_BLOCK` entries
    (``pad_blocks`` at prefill): they use no block of the pool. Rows may share blocks (forks, identical prompts); a
    row that is about to write into a shared block gets its own copy first (copy-on-write), through the
    ``copy_block(src, dst)`` callback.
    """

    def __init__(self, allocator: BlockAllocator, copy_block: Callable[[int, int], None]):
        self.allocator = allocator
        self.copy_block = copy_block
        self.tables: list[list[int]] = []
        self.num_tokens = 0

    @property
    def block_size(self) -> int:
        return self.allocator.block_size

    def blocks_needed(self, n_new: int, rows: int | None = None, pad_blocks: int = 0) -> int:
        """Blocks that appending ``n_new`` tokens to ``rows`` rows (default: all) allocates at most (fresh blocks
        plus copies of shared partial tails), less ``pad_blocks`` padding entries that take no block."""
        bs = self.block_size
        fresh = -(-(self.num_tokens + n_new) // bs) - -(-self.num_tokens // bs)
        partial = self.num_tokens % bs != 0 and n_new > 0
        shared_tails = sum(1 for t in self.tables if partial and self.allocator.ref_cnt[t[-1]] > 1)
        return (len(self.tables) if rows is None else rows) * fresh + shared_tails - pad_blocks

    def append_slots(
        self,
        n_new: int,
        batch: int,
        mirror: dict[int, int] | None = None,
        pad_blocks: Sequence[int] | None = None,
    ) -> list[list[tuple[int, int, int]]]:
        """Make room for ``n_new`` tokens in each of ``batch`` rows; returns, per row, ``(block, start, stop)``
        slot runs to write, in token order (padding entries have no run). Copies shared partial tail blocks first.
        All or nothing: a fixed pool that cannot serve the whole request raises before anything changes.

        Only on empty tables (at prefill): ``mirror`` maps a row to an earlier row with identical contents, whose
        blocks it shares instead of allocating its own; ``pad_blocks[row]`` leading blocks of a row hold only left
        padding and become :data:`PAD_BLOCK` entries (the row's last block is always real)."""
        mirror = mirror or {}
        prefill = not self.tables
        if prefill:
            self.tables = [[] for _ in range(batch)]
        elif batch != len(self.tables):
            raise RuntimeError(f"append of a batch of {batch} rows to block tables of {len(self.tables)} rows")
        elif mirror or pad_blocks is not None:
            raise RuntimeError("mirror and pad_blocks apply only at prefill, when the block tables are empty")
        last_block = (n_new - 1) // self.block_size
        pads = [min(p, last_block) for p in pad_blocks] if pad_blocks is not None else [0] * batch
        if len(pads) != batch or min(pads, default=0) < 0:
            raise ValueError(f"pad_blocks must give a count >= 0 for each of the {batch} rows, got {pad_blocks}")
        needed = self.blocks_needed(n_new, batch - len(mirror), sum(p for r, p in enumerate(pads) if r not in mirror))
        if needed > self.allocator.num_free_blocks and self.allocator.fixed:
            if prefill:
                self.tables = []
            raise PoolExhaustedError(self._exhausted_message(needed, n_new, batch))  # nothing changed
        for row, table in enumerate(self.tables):
            if prefill and row not in mirror:
                table.extend([PAD_BLOCK] * pads[row])
        bs = self.block_size
        runs: list[list[tuple[int, int, int]]] = []
        for row, table in enumerate(self.tables):
            if row in mirror:
                table.extend(self.tables[mirror[row]])
                self.allocator.incref(_real(table))
                runs.append(list(runs[mirror[row]]))
                continue
            row_runs = []
            pos, end = max(self.num_tokens, len(table) * bs if prefill else 0), self.num_tokens + n_new
            while pos < end:
                index, offset = divmod(pos, bs)
                if index == len(table):
                    table.extend(self.allocator.allocate(1))
                elif offset and self.allocator.ref_cnt[table[index]] > 1:
                    (copy,) = self.allocator.allocate(1)
                    self.copy_block(table[index], copy)
                    self.allocator.decref([table[index]])
                    table[index] = copy
                stop = min(end - index * bs, bs)
                row_runs.append((table[index], offset, stop))
                pos = index * bs + stop
            runs.append(row_runs)
        self.num_tokens += n_new
        return runs

    def _exhausted_message(self, needed: int, n_new: int, batch: int) -> str:
        alloc, bs = self.allocator, self.block_size
        used, total = alloc.num_used_blocks, alloc.num_blocks
        after = self.num_tokens + n_new
        return (
            f"the block pool is exhausted: this step ({batch} rows, {self.num_tokens} -> {after} tokens each) needs "
            f"{needed} more blocks, {alloc.num_free_blocks} of num_blocks={total} are free ({used} in use, "
            f"block_size={bs}); num_blocks={used + needed} takes this step, and a whole generate() needs "
            f"rows x ceil((prompt + max_new_tokens) / block_size) blocks, here {batch} x ceil(({after} + tokens still "
            f"to come) / {bs}) (fewer with shared prompts or left padding); or pass num_blocks=None to grow the pool "
            "on demand"
        )

    def truncate(self, n: int) -> None:
        """Forget the last ``n`` tokens of every row, freeing blocks that become empty."""
        if n > self.num_tokens:
            raise ValueError(f"cannot remove {n} tokens from block tables holding {self.num_tokens}")
        keep = -(-(self.num_tokens - n) // self.block_size)
        if any(PAD_BLOCK in table[keep - 1 : keep] for table in self.tables if keep):
            raise ValueError(
                f"cannot remove {n} of {self.num_tokens} tokens: the cut falls in a row's left padding, which is not "
                "stored (its real tokens start later)"
            )
        self.num_tokens -= n
        for table in self.tables:
            self.allocator.decref(_real(table[keep:]))
            del table[keep:]

    def select_rows(self, rows: Sequence[int]) -> None:
        """New row ``i`` is old row ``rows[i]`` (reorder, repeat, select): blocks are shared, not copied."""
        new = [list(self.tables[r]) for r in rows]
        for table in new:
            self.allocator.incref(_real(table))
        for table in self.tables:
            self.allocator.decref(_real(table))
        self.tables = new

    def release(self) -> None:
        for table in self.tables:
            self.allocator.decref(_real(table))
        self.tables = []
        self.num_tokens = 0

    @property
    def num_blocks_in_use(self) -> int:
        return len({b for table in self.tables for b in _real(table)})

"""Block pool and block tables, with no model and no tensors: alloc, free, fork, copy-on-write, exhaustion,
invariants."""

from __future__ import annotations

import pytest

from hf_kvcache.paging import PAD_BLOCK, BlockAllocator, BlockTables, PoolExhaustedError


class _Copies:
    def __init__(self):
        self.calls = []

    def __call__(self, src, dst):
        self.calls.append((src, dst))


def _tables(num_blocks=None, block_size=4, grow_blocks=2):
    grown = []
    allocator = BlockAllocator(block_size, num_blocks, grow_blocks=grow_blocks, on_grow=grown.append)
    copies = _Copies()
    return allocator, BlockTables(allocator, copies), copies, grown


def test_allocate_and_free_round_trip():
    allocator = BlockAllocator(block_size=16, num_blocks=4)
    blocks = allocator.allocate(3)
    assert sorted(blocks) == [0, 1, 2] and allocator.num_free_blocks == 1
    assert allocator.decref(blocks[:2]) == blocks[:2]
    assert allocator.num_used_blocks == 1
    allocator.check_invariants([[blocks[2]]])


def test_fixed_pool_exhaustion_says_how_to_size_it_and_changes_nothing():
    allocator, tables, _, _ = _tables(num_blocks=3)
    tables.append_slots(8, batch=1)  # 2 blocks
    before = (list(allocator.ref_cnt), allocator.num_free_blocks, [list(t) for t in tables.tables], tables.num_tokens)
    with pytest.raises(
        PoolExhaustedError,
        match=r"needs 3 more blocks, 1 of num_blocks=3 are free \(2 in use.*num_blocks=5 takes this step.*"
        r"1 x ceil\(\(17 \+ tokens still to come\) / 4\).*num_blocks=None",
    ):
        tables.append_slots(9, batch=1)
    after = (list(allocator.ref_cnt), allocator.num_free_blocks, [list(t) for t in tables.tables], tables.num_tokens)
    assert before == after
    allocator.check_invariants(tables.tables)


def test_growing_pool_adds_chunks_without_moving_blocks():
    allocator, tables, _, grown = _tables(num_blocks=None, grow_blocks=2)
    tables.append_slots(4, batch=1)
    first = list(tables.tables[0])
    tables.append_slots(20, batch=1)  # needs 5 more blocks: one grow of max(missing, 2)
    assert tables.tables[0][: len(first)] == first
    assert grown and grown[-1] == allocator.num_blocks >= 6
    allocator.check_invariants(tables.tables)


def test_append_slot_runs_cover_the_new_tokens_in_order():
    _, tables, _, _ = _tables(block_size=4)
    runs = tables.append_slots(6, batch=2)
    assert [[(stop - start) for _, start, stop in row] for row in runs] == [[4, 2], [4, 2]]
    runs = tables.append_slots(3, batch=2)
    assert [[(start, stop) for _, start, stop in row] for row in runs] == [[(2, 4), (0, 1)], [(2, 4), (0, 1)]]
    assert tables.num_tokens == 9


def test_shared_rows_copy_on_write_only_partial_tail_blocks():
    allocator, tables, copies, _ = _tables(block_size=4)
    tables.append_slots(6, batch=3, mirror={1: 0, 2: 0})  # 2 blocks per row, the second half full
    assert tables.num_blocks_in_use == 2 and allocator.num_shared_blocks == 2
    allocator.check_invariants(tables.tables)
    runs = tables.append_slots(1, batch=3)
    # Rows 0 and 1 copy the shared partial block; row 2, its last holder, writes in place.
    assert len(copies.calls) == 2
    assert runs[2][0][0] == tables.tables[2][1] == copies.calls[0][0]
    assert tables.tables[0][0] == tables.tables[1][0] == tables.tables[2][0]  # the full block stays shared
    assert len({t[1] for t in tables.tables}) == 3
    allocator.check_invariants(tables.tables)


def test_full_shared_blocks_need_no_copy():
    allocator, tables, copies, _ = _tables(block_size=4)
    tables.append_slots(8, batch=2, mirror={1: 0})
    tables.append_slots(1, batch=2)
    assert copies.calls == []
    assert tables.tables[0][:2] == tables.tables[1][:2] and tables.tables[0][2] != tables.tables[1][2]
    allocator.check_invariants(tables.tables)


def test_mirrored_prefill_needs_blocks_for_one_row_only():
    allocator, tables, _, _ = _tables(num_blocks=2, block_size=4)
    tables.append_slots(8, batch=4, mirror={1: 0, 2: 0, 3: 0})
    assert allocator.num_free_blocks == 0 and tables.tables == [tables.tables[0]] * 4
    allocator.check_invariants(tables.tables)
    with pytest.raises(RuntimeError, match="only at prefill, when the block tables are empty"):
        tables.append_slots(1, batch=4, mirror={1: 0})


def test_select_rows_forks_by_reference():
    allocator, tables, _, _ = _tables(block_size=4)
    tables.append_slots(5, batch=2)
    used = allocator.num_used_blocks
    tables.select_rows([1, 1, 0, 1])  # beam reorder / repeat
    assert allocator.num_used_blocks == used
    assert tables.tables[0] == tables.tables[1] == tables.tables[3]
    allocator.check_invariants(tables.tables)
    tables.select_rows([2])  # finished rows release their blocks
    assert allocator.num_used_blocks == 2
    allocator.check_invariants(tables.tables)


def test_truncate_frees_emptied_blocks():
    allocator, tables, _, _ = _tables(block_size=4)
    tables.append_slots(9, batch=2)
    tables.truncate(5)
    assert tables.num_tokens == 4 and all(len(t) == 1 for t in tables.tables)
    assert allocator.num_used_blocks == 2
    with pytest.raises(ValueError, match="cannot remove 5"):
        tables.truncate(5)
    tables.release()
    assert allocator.num_used_blocks == 0
    allocator.check_invariants(tables.tables)


def test_invariant_checks_report_the_broken_state():
    allocator = BlockAllocator(block_size=4, num_blocks=3)
    blocks = allocator.allocate(2)
    with pytest.raises(RuntimeError, match=r"block tables disagree with ref_cnt.*\(\d, 0, 1\)"):
        allocator.check_invariants([[blocks[0]]])
    allocator.ref_cnt[blocks[0]] = 0  # corrupt: zero count but not on the free list
    with pytest.raises(RuntimeError, match="out of sync"):
        allocator.check_invariants()
    with pytest.raises(RuntimeError, match="already free"):
        BlockAllocator(4, 2).decref([0])


def test_padding_entries_take_no_block_and_survive_forks_and_crops():
    allocator, tables, _, _ = _tables(num_blocks=10, block_size=4)
    runs = tables.append_slots(10, batch=2, pad_blocks=[2, 0])  # row 0: 8 padding tokens, then 2 real
    assert tables.tables[0][:2] == [PAD_BLOCK, PAD_BLOCK] and PAD_BLOCK not in tables.tables[1]
    assert runs[0] == [(tables.tables[0][2], 0, 2)], "padding blocks are not written"
    assert allocator.num_used_blocks == 1 + 3
    allocator.check_invariants(tables.tables)
    tables.select_rows([0, 0, 1])  # a fork shares the real blocks, keeps the padding entries
    assert tables.num_blocks_in_use == 4 and allocator.ref_cnt[tables.tables[0][2]] == 2
    allocator.check_invariants(tables.tables)
    tables.append_slots(3, batch=3)  # the shared partial tail is copied for one row (copy-on-write)
    tables.truncate(3)
    allocator.check_invariants(tables.tables)
    before = ([list(t) for t in tables.tables], list(allocator.ref_cnt), tables.num_tokens)
    with pytest.raises(ValueError, match="left padding"):
        tables.truncate(9)  # would leave row 0 ending in a padding block
    assert before == ([list(t) for t in tables.tables], list(allocator.ref_cnt), tables.num_tokens)
    tables.release()
    assert allocator.num_free_blocks == 10
    allocator.check_invariants(tables.tables)


def test_padding_counts_are_capped_so_the_last_block_is_real():
    allocator, tables, _, _ = _tables(num_blocks=4, block_size=4)
    tables.append_slots(8, batch=1, pad_blocks=[5])
    assert tables.tables[0][0] == PAD_BLOCK and tables.tables[0][1] != PAD_BLOCK
    with pytest.raises(RuntimeError, match="only at prefill"):
        tables.append_slots(1, batch=1, pad_blocks=[0])
    with pytest.raises(ValueError, match="pad_blocks"):
        BlockTables(allocator, _Copies()).append_slots(4, batch=2, pad_blocks=[0])

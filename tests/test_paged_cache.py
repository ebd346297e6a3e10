"""PagedKVCache beyond the shared matrix: shared prompt blocks, waste, a fixed pool, forks, unsharing, reporting."""

from __future__ import annotations

import pytest
import torch
from models import VOCAB, prompt, tiny_model
from transformers import DynamicCache

from hf_kvcache import PagedKVCache, cache_nbytes, make_cache
from hf_kvcache._config import LayerSpec
from hf_kvcache.formats.paged import gather_rows
from hf_kvcache.layers.paged import PagedLayer, PagedState, PagedStorage
from hf_kvcache.paging import PAD_BLOCK, PoolExhaustedError


def _ids(batch, length, seed=0):
    return torch.randint(3, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))


def test_parallel_samples_share_the_prompt():
    """8 samples of a 1,024-token prompt with 128 new tokens: <= 0.25x of DynamicCache's bytes."""
    model = tiny_model("llama", "sdpa")
    ids = _ids(1, 1024)
    kwargs = dict(attention_mask=torch.ones_like(ids), max_new_tokens=128, min_new_tokens=128, do_sample=True)
    kwargs["num_return_sequences"] = 8
    dynamic = DynamicCache(config=model.config)
    torch.manual_seed(0)
    ref = model.generate(ids, past_key_values=dynamic, **kwargs)
    paged = PagedKVCache(model, block_size=16)
    torch.manual_seed(0)
    out = model.generate(ids, past_key_values=paged, **kwargs)
    assert torch.equal(out, ref)
    ratio = paged.nbytes / cache_nbytes(dynamic)
    assert ratio <= 0.25, f"paged holds {ratio:.3f}x of DynamicCache"
    report = paged.block_report()
    assert report["blocks_shared"] == 1024 // 16
    paged.check_invariants()


def test_waste_of_a_varied_length_batch_is_under_4_percent():
    model = tiny_model("qwen2", "sdpa")
    lengths = [37, 150, 301, 499, 512]
    ids = torch.zeros(len(lengths), max(lengths), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, n in enumerate(lengths):
        ids[row, -n:] = _ids(1, n, seed=row)
        mask[row, -n:] = 1
    cache = PagedKVCache(model, block_size=16)
    model.generate(input_ids=ids, attention_mask=mask, past_key_values=cache, max_new_tokens=21, do_sample=False)
    report = cache.block_report()
    assert report["waste"] <= 0.04, report
    assert report["allocated_slots"] == report["blocks_used"] * 16
    cache.check_invariants()


def test_fixed_pool_exhaustion_is_clear_and_leaves_the_cache_consistent():
    model = tiny_model("llama", "eager")
    ids = _ids(1, 20)
    cache = PagedKVCache(model, block_size=8, num_blocks=4)  # 32 slots
    with torch.no_grad():
        model(ids, past_key_values=cache, use_cache=True)
        before = (cache.get_seq_length(), cache.block_report())
        with pytest.raises(PoolExhaustedError, match=r"num_blocks=5 takes this step") as err:
            model(_ids(1, 13, seed=1), past_key_values=cache, use_cache=True)
    assert "num_blocks=None" in str(err.value)
    assert (cache.get_seq_length(), cache.block_report()) == before
    cache.check_invariants()
    with torch.no_grad():  # still usable: a forward that fits goes through
        model(_ids(1, 12, seed=2), past_key_values=cache, use_cache=True)
    assert cache.get_seq_length() == 32


def test_exhaustion_message_sizes_a_whole_generate():
    """The message's formula, rows x ceil((prompt + max_new_tokens) / block_size), is the pool a generate needs:
    exactly that many blocks run it, one fewer does not (and each failure says so before changing anything)."""
    model = tiny_model("llama", "eager")
    inputs = {"input_ids": _ids(2, 10), "attention_mask": torch.ones(2, 10, dtype=torch.long)}
    with pytest.raises(PoolExhaustedError, match=r"2 x ceil\(\(10 \+ tokens still to come\) / 4\)"):
        model.generate(**inputs, past_key_values=PagedKVCache(model, block_size=4, num_blocks=5), max_new_tokens=12)
    needed = 2 * -(-(10 + 12) // 4)
    with pytest.raises(PoolExhaustedError, match=rf"num_blocks={needed} takes this step"):
        model.generate(
            **inputs, past_key_values=PagedKVCache(model, block_size=4, num_blocks=needed - 1), max_new_tokens=12
        )
    cache = PagedKVCache(model, block_size=4, num_blocks=needed)
    out = model.generate(**inputs, past_key_values=cache, max_new_tokens=12, min_new_tokens=12, do_sample=False)
    assert out.shape == (2, 22) and cache.block_report()["blocks_used"] == needed


def test_growing_pool_keeps_block_ids_and_contents():
    model = tiny_model("llama", "eager")
    cache = PagedKVCache(model, block_size=4, grow_blocks=2)
    with torch.no_grad():
        model(_ids(1, 8), past_key_values=cache, use_cache=True)
        storage = cache.state.storages[0]
        slots, snapshot = storage.num_slots, storage.keys[:8].clone()
        table = list(cache.state.tables.tables[0])
        model(_ids(1, 40, seed=1), past_key_values=cache, use_cache=True)
    assert storage.num_slots > slots and cache.state.tables.tables[0][:2] == table
    assert torch.equal(storage.keys[:8], snapshot)


@pytest.mark.parametrize("bits", [None, 8])
def test_pools_stay_head_major_and_one_row_reads_without_a_second_copy(bits):
    """Pools are views of head-major tensors (each head's slots contiguous), kept so when they grow, so a row's gather
    comes out as attention takes it; what a read returns is contiguous, for one row or several."""
    model = tiny_model("llama", "eager")
    cache = PagedKVCache(model, block_size=4, grow_blocks=2, bits=bits)
    with torch.no_grad():
        model(_ids(2, 8), past_key_values=cache, use_cache=True)
        model(_ids(2, 40, seed=1), past_key_values=cache, use_cache=True)
    storage = cache.state.storages[0]
    for t in storage.tensors.values():
        assert t.transpose(0, 1).is_contiguous(), t.stride()
    keys, values = storage.read(cache.state.read_slots(storage.keys.device))
    assert keys.is_contiguous() and values.is_contiguous() and keys.shape[:3] == (2, storage.keys.shape[1], 48)
    one_row, _ = storage.read(cache.state.read_slots(storage.keys.device)[1:])
    assert one_row.is_contiguous() and torch.equal(one_row, keys[1:])
    slots = cache.state.read_slots(storage.keys.device)
    for pool in storage.tensors.values():  # a launch per row (one copy) or one batched gather (CUDA's way): equal
        per_row, batched = gather_rows(pool, slots, batched=False), gather_rows(pool, slots, batched=True)
        assert per_row.is_contiguous() and batched.is_contiguous() and torch.equal(per_row, batched)


def test_reorder_permutes_tables_without_copying():
    model = tiny_model("llama", "eager")
    cache = PagedKVCache(model, block_size=4)
    with torch.no_grad():
        model(_ids(3, 10), past_key_values=cache, use_cache=True)
    storage = cache.state.storages[0]
    keys, values = storage.keys.clone(), storage.values.clone()
    tables = [list(t) for t in cache.state.tables.tables]
    cache.reorder_cache(torch.tensor([2, 2, 0]))
    assert cache.state.tables.tables == [tables[2], tables[2], tables[0]]
    assert torch.equal(keys, storage.keys) and torch.equal(values, storage.values)
    assert cache.block_report()["blocks_shared"] == 3
    cache.check_invariants()


def test_forked_prefill_matches_dynamic_cache():
    """Prefill one row, fork it with batch_repeat_interleave, decode different tokens per row."""
    model = tiny_model("phi3", "eager")
    ids, nxt = _ids(1, 11), _ids(3, 1, seed=4)
    results = []
    for cache in (DynamicCache(config=model.config), PagedKVCache(model, block_size=4)):
        with torch.no_grad():
            model(ids, past_key_values=cache, use_cache=True)
            cache.batch_repeat_interleave(3)
            results.append(model(nxt, past_key_values=cache, use_cache=True).logits)
    torch.testing.assert_close(results[1], results[0], rtol=1e-5, atol=1e-5)
    cache.check_invariants()
    cache.batch_select_indices(torch.tensor([1]))
    report = cache.block_report()  # 12 tokens of one row: 3 blocks, no longer shared; the other rows' were freed
    assert (report["blocks_used"], report["blocks_shared"]) == (3, 0)
    cache.check_invariants()


def test_rows_identical_on_one_layer_only_are_unshared():
    """Sharing is decided at the first layer and checked on every layer: a row that differs later gets its own
    blocks, and each row reads back exactly what it wrote."""
    state = PagedState(block_size=4, num_blocks=None, grow_blocks=4)
    spec = LayerSpec("full_attention", None, num_kv_heads=2, key_dim=8, value_dim=8)
    first, second = PagedLayer(spec, 0, "test", state, 0), PagedLayer(spec, 1, "test", state, 1)
    k = torch.randn(1, 2, 6, 8).repeat(2, 1, 1, 1)
    v = torch.randn(1, 2, 6, 8).repeat(2, 1, 1, 1)
    first.update(k, v)
    assert state.allocator.num_shared_blocks == 2
    k2, v2 = torch.randn(2, 2, 6, 8), torch.randn(2, 2, 6, 8)
    got_k, got_v = second.update(k2, v2)
    torch.testing.assert_close(got_k, k2, rtol=0, atol=0)
    torch.testing.assert_close(got_v, v2, rtol=0, atol=0)
    again_k, _ = first.storage.read(state.read_slots(first.device))
    torch.testing.assert_close(again_k, k, rtol=0, atol=0)
    state.allocator.check_invariants(state.tables.tables)


def test_nbytes_counts_blocks_in_use_and_report_adds_up():
    model = tiny_model("llama", "sdpa")
    cache = make_cache("paged:block_size=8:num_blocks=100", model)
    model.generate(**prompt("padded"), past_key_values=cache, max_new_tokens=5, do_sample=False)
    report = cache.memory_report()
    per_block = 2 * 8 * model.config.num_key_value_heads * model.config.head_dim * 4
    # 12 prompt + 4 generated tokens cached (the last one never is): 2 blocks of 8 in each of 2 rows
    assert report["blocks"]["blocks_used"] == 2 * 2 and report["blocks"]["waste"] == 0
    assert cache.nbytes == model.config.num_hidden_layers * report["blocks"]["blocks_used"] * per_block
    assert cache.reserved_nbytes == model.config.num_hidden_layers * 100 * per_block


def test_hybrid_model_sliding_layers_keep_their_window():
    model = tiny_model("gemma3", "eager")
    cache = PagedKVCache(model, block_size=4)
    model.generate(**prompt("single"), past_key_values=cache, max_new_tokens=16, do_sample=False)
    for layer, layer_type in zip(cache.layers, model.config.layer_types):
        if layer_type == "sliding_attention":
            assert layer.is_sliding and layer.stored_tokens == model.config.sliding_window - 1
        else:
            assert isinstance(layer, PagedLayer) and layer.stored_tokens == 12 + 15


@pytest.mark.parametrize(
    "kwargs, match",
    [(dict(block_size=0), "block_size"), (dict(num_blocks=0), "num_blocks"), (dict(grow_blocks=-1), "grow_blocks")],
)
def test_bad_arguments_raise_value_error(kwargs, match):
    with pytest.raises(ValueError, match=match):
        PagedKVCache(tiny_model("llama").config, **kwargs)


def test_hf_kvcache_attention_reads_pages_in_place_when_decoding(monkeypatch):
    """Under the hf_kvcache attention a decode step reads the pool through the block table (the paged kernel), never
    a gather; only the 40-token prefill, too long for the decode kernels, takes the gather path."""
    from hf_kvcache import attention
    from hf_kvcache.formats import PagedSegment
    from hf_kvcache.kernels import torch_decode

    reads, kernel_calls = [], []
    real_read, real_partial = PagedStorage.read, torch_decode.partial
    monkeypatch.setattr(
        PagedStorage, "read", lambda self, slots: reads.append(slots.shape[1]) or real_read(self, slots)
    )

    def counting_partial(query, segment, *args, **kwargs):
        kernel_calls.append(isinstance(segment, PagedSegment))
        return real_partial(query, segment, *args, **kwargs)

    monkeypatch.setattr(torch_decode, "partial", counting_partial)
    inputs = {"input_ids": _ids(2, 40), "attention_mask": torch.ones(2, 40, dtype=torch.long)}
    inputs["attention_mask"][1, :7] = 0
    outs = []
    for attn in ("sdpa", attention.ATTENTION):
        reads.clear()  # the gather path reads through the same method: count the hf_kvcache run only
        model = tiny_model("llama", attn)
        cache = PagedKVCache(model, block_size=4)
        outs.append(
            model.generate(
                **inputs,
                past_key_values=cache,
                max_new_tokens=6,
                do_sample=False,
                output_logits=True,
                return_dict_in_generate=True,
            )
        )
    layers = tiny_model("llama").config.num_hidden_layers
    assert reads == [40] * layers  # the prefill's gather, once per layer; no decode step gathers
    assert sum(kernel_calls) == 5 * layers  # every decode step of every layer through the paged kernel
    torch.testing.assert_close(outs[1].sequences, outs[0].sequences, rtol=0, atol=0)
    for got, want in zip(outs[1].logits, outs[0].logits):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def _left_padded(lengths: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.zeros(len(lengths), max(lengths), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, n in enumerate(lengths):
        ids[row, -n:] = _ids(1, n, seed=row)
        mask[row, -n:] = 1
    return ids, mask


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_left_padding_takes_no_blocks_and_changes_nothing(attn):
    """A padded batch of very different lengths: rows' full padding blocks are not stored, outputs are exact."""
    model = tiny_model("llama", attn)
    lengths, new, bs = [9, 70, 130, 200], 12, 16
    ids, mask = _left_padded(lengths)
    kwargs = dict(attention_mask=mask, max_new_tokens=new, min_new_tokens=new, do_sample=False, output_logits=True)
    ref = model.generate(ids, past_key_values=DynamicCache(config=model.config), return_dict_in_generate=True, **kwargs)
    cache = PagedKVCache(model, block_size=bs)
    out = model.generate(ids, past_key_values=cache, return_dict_in_generate=True, **kwargs)
    assert torch.equal(out.sequences, ref.sequences)
    for got, want in zip(out.logits, ref.logits):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    total = max(lengths) + new - 1
    expected = sum(-(-total // bs) - (max(lengths) - n) // bs for n in lengths)
    assert cache.block_report()["blocks_used"] == expected
    padded_everywhere = len(lengths) * -(-total // bs)
    assert expected < 0.6 * padded_everywhere  # the point: about the sum of the real lengths, not rows x longest
    cache.check_invariants()


def test_a_config_built_cache_stores_padding_unless_told():
    model = tiny_model("qwen2", "sdpa")
    ids, mask = _left_padded([5, 60])
    blocks = {}
    for name, observe in (("untold", False), ("told", True), ("model", None)):
        cache = PagedKVCache(model if observe is None else model.config, block_size=8)
        if observe:
            cache.padding.observe(mask)
        with torch.no_grad():
            model(ids, attention_mask=mask, past_key_values=cache)
        blocks[name] = cache.block_report()["blocks_used"]
        cache.check_invariants()
    assert blocks == {"untold": 2 * 8, "told": 2 + 8, "model": 2 + 8}  # row 0: 55 padding tokens, 6 whole blocks


def _device_tables_follow_python(cache: PagedKVCache) -> None:
    """Every device copy of the block tables equals the Python tables (PAD past each row's end), and the pool's
    invariants hold."""
    cache.check_invariants()
    state = cache.state
    for device in list(state.device_tables):
        table = state.block_table(device)
        assert table.shape[0] == len(state.tables.tables)
        for r, row in enumerate(state.tables.tables):
            assert table[r, : len(row)].tolist() == row
            assert bool((table[r, len(row) :] == PAD_BLOCK).all())


@pytest.mark.parametrize("attn", ["sdpa", "hf_kvcache"])
def test_device_tables_follow_every_operation(attn):
    model = tiny_model("llama", attn)
    cache = PagedKVCache(model, block_size=4)
    ids = _ids(3, 10)
    mask = torch.ones_like(ids)
    ids[1, :5], mask[1, :5] = 0, 0  # a left-padded row: its first block is a padding entry
    with torch.no_grad():
        model(ids, attention_mask=mask, past_key_values=cache, use_cache=True)
        _device_tables_follow_python(cache)
        assert cache.state.tables.tables[1][0] == PAD_BLOCK
        for step in range(7):  # decode across block boundaries
            mask = torch.cat([mask, torch.ones(3, 1, dtype=mask.dtype)], 1)
            model(_ids(3, 1, seed=step), attention_mask=mask, past_key_values=cache, use_cache=True)
            _device_tables_follow_python(cache)
        cache.crop(-5)
        mask = mask[:, :-5]
        _device_tables_follow_python(cache)
        cache.reorder_cache(torch.tensor([2, 0, 0]))
        _device_tables_follow_python(cache)
        mask = mask[[2, 0, 0]]
        for step in range(3):  # rows 1 and 2 share every block now: the next write copies the shared tail
            mask = torch.cat([mask, torch.ones(3, 1, dtype=mask.dtype)], 1)
            model(_ids(3, 1, seed=10 + step), attention_mask=mask, past_key_values=cache, use_cache=True)
            _device_tables_follow_python(cache)
        cache.batch_select_indices((0, 2))
        _device_tables_follow_python(cache)
        cache.batch_repeat_interleave(2)
        _device_tables_follow_python(cache)
    cache.reset()
    assert cache.state.device_tables == {} and cache.get_seq_length() == 0


def test_int8_pages_share_prompt_blocks_at_about_a_quarter_of_float32_bytes():
    """bits=8 pages store int8 codes and one float32 scale per token and head: four samples still share the
    prompt's blocks (copy-on-write as with full-precision pages), in (16 + 4) / 64 of float32 pages' bytes here."""
    model = tiny_model("llama")
    inputs = {"input_ids": _ids(1, 23), "attention_mask": torch.ones(1, 23, dtype=torch.long)}
    caches = {}
    for spec in ("paged:block_size=4:bits=8", "paged:block_size=4"):
        caches[spec] = cache = make_cache(spec, model)
        torch.manual_seed(0)
        model.generate(**inputs, past_key_values=cache, max_new_tokens=8, do_sample=True, num_return_sequences=4)
        cache.check_invariants()
    paged8, paged = caches.values()
    assert paged8.block_report() == paged.block_report() and paged8.block_report()["blocks_shared"] > 0
    assert paged8.nbytes / paged.nbytes == pytest.approx((16 + 4) / 64)


def test_int8_pages_logits_match_the_int8_cache():
    """On a full-attention model (a hybrid one keeps its sliding layers in full precision in pages, not in int8)."""
    model = tiny_model("llama")
    ids = torch.randint(3, 100, (2, 30), generator=torch.Generator().manual_seed(0))
    logits = []
    for spec in ("int8", "paged:block_size=4:bits=8"):
        cache = make_cache(spec, model)
        with torch.no_grad():
            model(ids[:, :20], past_key_values=cache)
            steps = [model(ids[:, t : t + 1], past_key_values=cache).logits for t in range(20, 30)]
        logits.append(torch.cat(steps, 1))
    torch.testing.assert_close(logits[1], logits[0], rtol=1e-5, atol=1e-5)


def test_bad_bits_is_a_value_error():
    with pytest.raises(ValueError, match="bits must be None"):
        PagedKVCache(tiny_model("llama").config, bits=4)

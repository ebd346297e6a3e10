"""A cache saved (``torch.save``, ``pickle``) and loaded (``load_cache``, or ``torch.load`` then ``attach``) continues
as the saved one would, for every cache kind of the shared matrix, left-padded and evicting; it refuses a forward
until it has its model back, and a model of other layers; a file holds the live tokens, not the allocation."""

from __future__ import annotations

import copy
import io
import pickle

import pytest
import torch
from matrix import CACHE_CASES
from models import PAD, VOCAB, config_model, generate, prefilled, tiny_model
from transformers import AutoModelForCausalLM, LlamaConfig

from hf_kvcache import QuantizedKVCache, load_cache, make_cache

CASES = [
    pytest.param(case, family, id=f"{case.id}-{family}")
    for case in CACHE_CASES
    for family in (case.families or ("llama", "gemma3"))
]


@pytest.fixture(autouse=True)
def _one_thread():
    torch.set_num_threads(1)


def _inputs(length: int = 14, seed: int = 2) -> dict:
    """Two rows, the second left-padded by 4 tokens."""
    ids = torch.randint(3, VOCAB, (2, length), generator=torch.Generator().manual_seed(seed))
    mask = torch.ones_like(ids)
    ids[1, :4], mask[1, :4] = PAD, 0
    return {"input_ids": ids, "attention_mask": mask}


def _head(inputs: dict, n: int) -> dict:
    return {k: v[:, :n] for k, v in inputs.items()}


def _saved(cache) -> io.BytesIO:
    f = io.BytesIO()
    torch.save(cache, f)
    f.seek(0)
    return f


def _same(a, b) -> None:
    torch.testing.assert_close(a.sequences, b.sequences, rtol=0, atol=0)
    for x, y in zip(a.logits, b.logits):
        torch.testing.assert_close(x, y, rtol=0, atol=0)


@pytest.mark.parametrize("case, family", CASES)
def test_a_loaded_cache_continues_as_the_saved_one(case, family):
    """A prompt's first 9 tokens prefilled, saved and loaded: generate over the whole prompt gives the saved cache's
    tokens and logits bit for bit (its remaining tokens as one forward, then 6 decode steps), with the same bytes."""
    model = tiny_model(family, case.attn or "sdpa")
    inputs = _inputs()
    (cache,) = prefilled(model, _head(inputs, 9), make_cache(case.spec, model))
    loaded = load_cache(_saved(cache), model)
    assert type(loaded) is type(cache) and loaded is not cache
    assert loaded.get_seq_length() == cache.get_seq_length() == 9
    assert loaded.nbytes == cache.nbytes and loaded.padding.pad == cache.padding.pad
    _same(generate(model, loaded, inputs, new=6), generate(model, cache, inputs, new=6))


@pytest.mark.parametrize("spec", ["int2:residual_length=4:group_size=8", "sink:window=6:sinks=2", "paged:block_size=4"])
def test_a_loaded_cache_refuses_a_forward_until_attached(spec):
    """Loaded by torch.load alone (no model in the file), a forward is a ValueError that says what to do and leaves
    the cache as it was; attach(model) then serves it as load_cache would."""
    model = tiny_model("llama")
    inputs = _inputs()
    (cache,) = prefilled(model, _head(inputs, 9), make_cache(spec, model))
    loaded = torch.load(_saved(cache), weights_only=False)
    nbytes = loaded.nbytes
    with pytest.raises(ValueError, match=r"loaded without its model.*cache\.attach\(model\)"):
        generate(model, loaded, inputs, new=2)
    assert loaded.get_seq_length() == 9 and loaded.nbytes == nbytes
    loaded.attach(model)
    _same(generate(model, loaded, inputs, new=4), generate(model, cache, inputs, new=4))


def test_pickle_and_attach_serve_a_reset_cache_a_padded_prefill():
    """pickle as torch.save: a loaded cache, attached, hears its model's forwards again, so after reset() a new
    left-padded prefill places its sinks on each row's first real token, as a new cache does."""
    model = tiny_model("qwen2")
    spec = "int2:residual_length=4:group_size=8"
    (cache,) = prefilled(model, _head(_inputs(seed=3), 9), make_cache(spec, model))
    loaded = pickle.loads(pickle.dumps(cache))
    loaded.attach(model)
    loaded.reset()
    other = _inputs(seed=4)
    other["input_ids"][0, :2], other["attention_mask"][0, :2] = PAD, 0
    _same(generate(model, loaded, other, new=5), generate(model, make_cache(spec, model), other, new=5))
    assert loaded.padding.pad == (2, 4)


def test_attach_refuses_a_model_of_other_layers():
    """A cache of llama's tiny layers refuses gemma3's (another layer count) and a llama of other KV heads, naming
    the field that differs, and keeps refusing forwards until given its own model."""
    model = tiny_model("llama")
    (cache,) = prefilled(model, _head(_inputs(), 9), make_cache("int4:residual_length=4:group_size=8", model))
    loaded = torch.load(_saved(cache), weights_only=False)
    with pytest.raises(ValueError, match=r"model: this QuantizedKVCache was built for .* other layers: 3 layers where"):
        loaded.attach(tiny_model("gemma3"))
    config = copy.deepcopy(model.config)
    config.num_key_value_heads = config.num_attention_heads
    with pytest.raises(ValueError, match=rf"layer 0's num_kv_heads is {config.num_attention_heads} \(the cache's 2\)"):
        loaded.attach(AutoModelForCausalLM.from_config(config))
    with pytest.raises(ValueError, match="loaded without its model"):
        generate(model, loaded, _inputs(), new=1)
    with pytest.raises(ValueError, match="model must be the torch.nn.Module"):
        loaded.attach(model.config)


def test_load_cache_refuses_a_file_of_another_object():
    f = io.BytesIO()
    torch.save({"keys": torch.zeros(2)}, f)
    f.seek(0)
    with pytest.raises(ValueError, match="f: load_cache reads a saved hf_kvcache cache, this file holds a dict"):
        load_cache(f, tiny_model("llama"))


def test_a_cache_built_from_a_config_loads_without_a_model():
    """Built from a config, a cache never had a model: loaded, it serves as before without attach."""
    model = tiny_model("llama")
    inputs = _inputs()
    (cache,) = prefilled(model, _head(inputs, 9), QuantizedKVCache(model.config, bits=4, residual_length=4))
    loaded = pickle.loads(pickle.dumps(cache))
    _same(generate(model, loaded, inputs, new=4), generate(model, cache, inputs, new=4))


def test_a_file_holds_the_live_tokens_not_the_allocation():
    """A window that evicted a long prompt keeps the prompt's allocation until it grows again; its file holds the
    window's tokens (about nbytes), and so does a loaded copy's storage."""
    model = tiny_model("llama")
    ids = torch.randint(3, VOCAB, (1, 300), generator=torch.Generator().manual_seed(0))
    (cache,) = prefilled(model, {"input_ids": ids}, make_cache("sink:window=32:sinks=4", model))
    assert cache.reserved_nbytes > 4 * cache.nbytes  # the prompt's allocation, evicted
    size = len(_saved(cache).getvalue())
    loaded = load_cache(_saved(cache), model)
    assert loaded.nbytes == cache.nbytes < loaded.reserved_nbytes < cache.reserved_nbytes / 2  # an append's headroom
    assert size < cache.nbytes + (cache.reserved_nbytes - cache.nbytes) / 4


@pytest.mark.parametrize(
    "spec", ["paged:block_size=4", "sink:window=32:sinks=4", "int4:residual_length=4:group_size=8"]
)
def test_a_file_holds_the_model_s_own_windows_not_the_prompt(spec):
    """Gemma 3's sliding layers keep its window as a view of the prompt's K/V (transformers' layer, in the paged and
    window caches): the file holds the window."""
    model = tiny_model("gemma3")
    ids = torch.randint(3, VOCAB, (1, 300), generator=torch.Generator().manual_seed(0))
    (cache,) = prefilled(model, {"input_ids": ids}, make_cache(spec, model))
    f = _saved(cache)
    assert len(f.getvalue()) < 1.1 * cache.nbytes + 20_000
    loaded = load_cache(f, model)
    more = {"input_ids": torch.cat([ids, ids[:, :3]], 1)}
    more["attention_mask"] = torch.ones_like(more["input_ids"])
    _same(generate(model, loaded, more, new=4), generate(model, cache, more, new=4))


def test_a_copy_keeps_its_allocation():
    """copy.deepcopy (the prompt-cache recipe) copies the storage as it is, headroom included: its next tokens land
    where the original's would."""
    model = tiny_model("llama")
    (cache,) = prefilled(model, _head(_inputs(), 9), make_cache("int4:residual_length=4:group_size=8", model))
    assert copy.deepcopy(cache).reserved_nbytes == cache.reserved_nbytes > cache.nbytes


def test_a_paged_file_holds_the_blocks_in_use_and_loads_the_whole_pool():
    """A fixed pool sized for many prompts, holding one: its file holds the prompt's blocks; loaded, the pool has
    every block again (free ones zeroed), so the loaded cache takes the same rows and prompts the saved one could,
    and continues alike."""
    model = tiny_model("llama")
    inputs = _inputs()
    spec = "paged:block_size=4:num_blocks=512"
    (cache,) = prefilled(model, _head(inputs, 9), make_cache(spec, model))
    assert cache.reserved_nbytes > 20 * cache.nbytes
    f = _saved(cache)
    assert len(f.getvalue()) < 2 * cache.nbytes + 20_000
    loaded = load_cache(f, model)
    assert loaded.reserved_nbytes == cache.reserved_nbytes and loaded.nbytes == cache.nbytes
    free = [b for b, n in enumerate(loaded.state.allocator.ref_cnt) if n == 0]
    for storage in loaded.state.storages.values():
        for t in storage.tensors.values():
            assert t.stride(1) == t.shape[0] * (t[0, 0].numel())  # head-major, as a new pool
            assert not t[free[0] * 4 :].any()
    _same(generate(model, loaded, inputs, new=6), generate(model, cache, inputs, new=6))


def test_a_fragmented_pool_saves_its_blocks_in_use():
    """Rows dropped from a batch leave their blocks free below the kept row's: the file holds the blocks in use
    (their ids kept), and the loaded cache continues alike."""
    model = tiny_model("llama")
    ids = torch.randint(3, VOCAB, (4, 64), generator=torch.Generator().manual_seed(0))
    (cache,) = prefilled(model, {"input_ids": ids}, make_cache("paged:block_size=4", model))
    cache.batch_select_indices([3])
    assert cache.reserved_nbytes > 3 * cache.nbytes
    f = _saved(cache)
    assert len(f.getvalue()) < 1.1 * cache.nbytes + 20_000
    loaded = load_cache(f, model)
    loaded.check_invariants()
    assert loaded.state.tables.tables == cache.state.tables.tables
    more = {"input_ids": torch.cat([ids[3:], ids[3:, :3]], 1)}
    more["attention_mask"] = torch.ones_like(more["input_ids"])
    _same(generate(model, loaded, more, new=4), generate(model, cache, more, new=4))


def test_a_hybrid_cache_refuses_every_state_write_until_attached():
    """A hybrid model's recurrent layers write their states before any attention layer stores K/V: each of the
    cache's writes refuses a loaded cache, and leaves it as it was."""
    model = config_model("qwen3_next", "eager")
    ids = torch.randint(3, VOCAB, (1, 10), generator=torch.Generator().manual_seed(1))
    (cache,) = prefilled(model, {"input_ids": ids}, make_cache("int4:residual_length=4:group_size=8", model))
    loaded = torch.load(_saved(cache), weights_only=False)
    state = next(i for i, layer in enumerate(loaded.layers) if getattr(layer, "conv_states", None))
    before = {k: v.clone() for k, v in loaded.layers[state].conv_states.items()}
    conv = loaded.layers[state].conv_states[0]
    for write, args in [
        ("update_conv_state", (conv, state)),
        ("update_recurrent_state", (loaded.layers[state].recurrent_states[0], state)),
        ("update", (torch.zeros(1, 2, 1, 16), torch.zeros(1, 2, 1, 16), 3)),
    ]:
        with pytest.raises(ValueError, match="loaded without its model"):
            getattr(loaded, write)(*args)
    assert all(torch.equal(v, before[k]) for k, v in loaded.layers[state].conv_states.items())
    assert loaded.get_seq_length() == 10


def test_a_file_of_other_releases_is_refused(monkeypatch):
    """A saved cache pickles this package's and transformers' layer classes: a file saved by other releases (or
    another layout) is refused by name before any of its state is read."""
    from hf_kvcache.caches import _base

    model = tiny_model("llama")
    (cache,) = prefilled(model, _head(_inputs(), 9), make_cache("int4:residual_length=4:group_size=8", model))
    with monkeypatch.context() as m:
        m.setattr(_base, "_stamp", lambda: {"hf_kvcache": "0.0.1", "transformers": "5.23.0", "format": 1})
        f = _saved(cache)
    with pytest.raises(ValueError, match=r"was saved with hf_kvcache 0\.0\.1, transformers 5\.23\.0, format 1; this"):
        load_cache(f, model)


def test_a_file_from_a_device_this_process_lacks_is_refused(monkeypatch):
    """The file names the devices its tensors were on; a process without one refuses it by name, before torch
    would fail to place a tensor there."""
    from hf_kvcache.caches import _base

    model = tiny_model("llama")
    (cache,) = prefilled(model, _head(_inputs(), 9), make_cache("int8", model))
    with monkeypatch.context() as m:
        m.setattr(_base, "_tensor_devices", lambda layers: iter([torch.device("cuda", 7)]))
        f = _saved(cache)
    with pytest.raises(ValueError, match=r"saved from cuda:7, which this process cannot reach"):
        load_cache(f, model)


def _device_records(obj, found: set, seen: set) -> None:
    """Every device a loaded cache names: its tensors' and the torch.device values and keys it keeps beside them."""
    from transformers import PretrainedConfig

    if id(obj) in seen or isinstance(obj, (torch.nn.Module, PretrainedConfig, type)):
        return
    seen.add(id(obj))
    if isinstance(obj, torch.Tensor):
        found.add(str(obj.device))
    elif isinstance(obj, torch.device):
        found.add(str(obj))
    elif isinstance(obj, dict):
        for key, value in obj.items():
            _device_records(key, found, seen)
            _device_records(value, found, seen)
    elif isinstance(obj, (list, tuple, set)):
        for value in obj:
            _device_records(value, found, seen)
    elif hasattr(obj, "__dict__"):
        _device_records(vars(obj), found, seen)


@pytest.mark.parametrize("family", ["llama", "gemma3", "qwen3_next"])
@pytest.mark.parametrize("spec", ["int8", "int2:residual_length=4:group_size=8", "paged:block_size=4",
                                  "paged:block_size=4:bits=8", "sink:window=6:sinks=2", "fp8"])  # fmt: skip
def test_map_location_sends_every_tensor_and_device_record_there(family, spec):
    """map_location as a device: every tensor of the loaded cache is there, and so is every device the cache records
    beside them (its layers', the model's own sliding layers', the block tables' per device, a hybrid's recurrent
    layers'), so that its next forward on that device is served, not refused as another device's. The meta device
    stands for a device this machine does not have."""
    model = config_model(family) if family == "qwen3_next" else tiny_model(family)
    (cache,) = prefilled(model, _head(_inputs(), 9), make_cache(spec, model))
    found: set = set()
    loaded = load_cache(_saved(cache), model, map_location="meta")
    _device_records(loaded, found, set())
    assert found == {"meta"}
    with pytest.raises(ValueError, match=r"torch\.float32 on meta; this forward pass(es|ed) .* on cpu"):
        generate(model, loaded, _inputs(), new=2)  # the model stayed on the CPU: refused, not read across devices
    found.clear()
    _device_records(load_cache(_saved(cache), model, map_location={"cpu": "meta"}), found, set())
    assert found == {"meta"}


@pytest.mark.parametrize("spec", ["int2:residual_length=4:group_size=8", "paged:block_size=4", "sink:window=6:sinks=2"])
def test_a_file_from_another_device_loads_where_map_location_sends_it(monkeypatch, spec):
    """Saved from a device this process lacks (cuda:7 here), a file loads with map_location naming where it goes,
    and continues as the saved cache would; map_location as a device does the same."""
    from hf_kvcache.caches import _base

    model = tiny_model("llama")
    inputs = _inputs()
    (cache,) = prefilled(model, _head(inputs, 9), make_cache(spec, model))
    with monkeypatch.context() as m:
        m.setattr(_base, "_tensor_devices", lambda layers: iter([torch.device("cuda", 7)]))
        f = _saved(cache)
    want = generate(model, copy.deepcopy(cache), inputs, new=4)
    for where in ({"cuda:7": "cpu"}, "cpu", torch.device("cpu")):
        f.seek(0)
        _same(generate(model, load_cache(f, model, map_location=where), inputs, new=4), want)
    f.seek(0)
    with pytest.raises(ValueError, match=r"saved from cuda:7, which this process cannot reach.*map_location="):
        load_cache(f, model)


@pytest.mark.parametrize("where", ["nowhere", {0: "cpu"}, {"cuda:0": None}, 3.5, ["cpu"]])
def test_a_map_location_that_names_no_device_is_refused(where):
    model = tiny_model("llama")
    (cache,) = prefilled(model, _head(_inputs(), 9), make_cache("int8", model))
    with pytest.raises(ValueError, match=r"map_location must be None .* or a dict of saved device names to devices"):
        load_cache(_saved(cache), model, map_location=where)


def test_a_loaded_cache_stores_nothing_until_attached():
    """A handed-over prefill and assisted decoding's recording are refused too; attached, an int8 cache (which needs
    no row's padding) adds no hook to the model."""
    from hf_kvcache._hooks import hook_count
    from hf_kvcache.prefill import SharedPrefill

    model = tiny_model("llama")
    inputs = _inputs()
    loaded = torch.load(_saved(make_cache("int8", model)), weights_only=False)
    with pytest.raises(ValueError, match="loaded without its model"):
        SharedPrefill(model, inputs["input_ids"], inputs["attention_mask"]).into(loaded)
    with pytest.raises(ValueError, match="loaded without its model"):
        loaded.activate_past_recording()
    assert loaded.get_seq_length() == 0
    hooks = hook_count(model)
    loaded.attach(model)
    assert hook_count(model) == hooks


def test_a_cache_saved_before_its_first_forward_serves_as_a_new_one():
    model = tiny_model("gemma3")
    inputs = _inputs()
    for spec in ("int2:residual_length=4:group_size=8", "paged:block_size=4", "sink:window=6:sinks=2"):
        loaded = load_cache(_saved(make_cache(spec, model)), model)
        _same(generate(model, loaded, inputs, new=4), generate(model, make_cache(spec, model), inputs, new=4))


def test_attach_refuses_a_model_of_other_rope():
    """Same layers, another RoPE base: the stored keys were rotated for the cache's, so the model is refused by
    field."""
    model = tiny_model("llama")
    (cache,) = prefilled(model, _head(_inputs(), 9), make_cache("int2:residual_length=4:group_size=8", model))
    config = copy.deepcopy(model.config)
    config.rope_parameters = {**config.rope_parameters, "rope_theta": 500.0}
    other = AutoModelForCausalLM.from_config(config).eval()
    loaded = torch.load(_saved(cache), weights_only=False)
    with pytest.raises(ValueError, match=r"other RoPE parameters than this model's \(rope_parameters"):
        loaded.attach(other)


@pytest.mark.parametrize("model_type", ["qwen3_next", "deepseek_v32"])
def test_hybrid_and_sparse_attention_caches_save_and_load(model_type):
    """A hybrid model's recurrent / convolution states and a sparse-attention model's indexer keys travel too."""
    model = config_model(model_type, "eager", **({"index_topk": 4} if model_type == "deepseek_v32" else {}))
    ids = torch.randint(3, VOCAB, (1, 14), generator=torch.Generator().manual_seed(1))
    inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    for spec in ("int4:residual_length=4:group_size=8", "paged:block_size=4"):
        (cache,) = prefilled(model, _head(inputs, 9), make_cache(spec, model))
        loaded = load_cache(_saved(cache), model)
        _same(generate(model, loaded, inputs, new=4), generate(model, cache, inputs, new=4))


def test_a_copy_follows_its_model_to_another_attention():
    """A copy serves the model its original serves: switched from the hf_kvcache attention to sdpa, the model gets
    materialized K/V from the copy too (a copy that kept a config of its own handed sdpa a storage handle), and a
    loaded cache reads the config of the model it is attached to."""
    torch.manual_seed(0)
    model = tiny_model("llama", "hf_kvcache")
    inputs = _inputs()
    spec = "int4:residual_length=4:group_size=8"
    (cache,) = prefilled(model, _head(inputs, 9), make_cache(spec, model))
    clone, f = copy.deepcopy(cache), _saved(cache)
    model.set_attn_implementation("sdpa")
    try:
        loaded = load_cache(f, model)
        want = generate(model, cache, inputs, new=4)
        _same(generate(model, clone, inputs, new=4), want)
        _same(generate(model, loaded, inputs, new=4), want)
    finally:
        model.set_attn_implementation("hf_kvcache")


def test_attach_gives_a_config_built_cache_the_padding_of_its_forwards():
    """A cache built from a config reads no padding by itself (rows count as unpadded); attached, it hears each
    forward's mask as one built from the model."""
    model = tiny_model("llama")
    config = LlamaConfig(**model.config.to_dict())
    cache = make_cache("int2:residual_length=4:group_size=8", config)
    cache.attach(model)
    inputs = _inputs()
    want = generate(model, make_cache("int2:residual_length=4:group_size=8", model), inputs, new=4)
    _same(generate(model, cache, inputs, new=4), want)
    assert cache.padding.pad == (0, 4)


def _transformers_attributes() -> set[str]:
    """What transformers' own bases set on an instance (their layout moves with transformers' release, which the
    file records apart)."""
    from transformers.cache_utils import DynamicCache, DynamicLayer, DynamicSlidingWindowLayer, LinearAttentionLayer

    bases = (DynamicCache(), DynamicLayer(), DynamicSlidingWindowLayer(sliding_window=4), LinearAttentionLayer())
    return {name for base in bases for name in vars(base)}


def _layout(obj, seen: set, found: set) -> None:
    """(class, attribute names) of every object of this package's classes a cache holds, through containers: the
    attributes this package sets."""
    if id(obj) in seen or isinstance(obj, (torch.Tensor, torch.nn.Module, type)):
        return
    seen.add(id(obj))
    if isinstance(obj, dict):
        for value in obj.values():
            _layout(value, seen, found)
    elif isinstance(obj, (list, tuple, set)):
        for value in obj:
            _layout(value, seen, found)
    elif hasattr(obj, "__dict__"):
        if type(obj).__module__.startswith("hf_kvcache"):
            names = sorted(set(vars(obj)) - _TRANSFORMERS_ATTRIBUTES)
            found.add(f"{type(obj).__module__}.{type(obj).__qualname__}:{','.join(names)}")
        for value in vars(obj).values():
            _layout(value, seen, found)


# What a saved file holds of this package's classes, by SAVED_FORMAT (the sha256 of their sorted layouts, which the
# test prints when it fails). A change to it is a change of the file's layout: bump
# hf_kvcache.caches._base.SAVED_FORMAT (files of the old layout are then refused by name) and record the new digest.
SAVED_LAYOUT = {2: "3d946d1d89ab536a", 3: "112aa8e3b9dca25a"}  # 3: RowSinks keeps its sinks' mask positions


_TRANSFORMERS_ATTRIBUTES = _transformers_attributes()


def test_the_saved_layout_is_the_format_s():
    """A saved cache's classes and their attributes are the ones its format number stands for."""
    import hashlib

    from hf_kvcache.caches._base import SAVED_FORMAT

    found: set = set()
    for family in ("llama", "gemma3"):
        model = tiny_model(family)
        for spec in ("int8", "int2:residual_length=4:group_size=8", "int4:residual_length=4:group_size=8",
                     "paged:block_size=4", "paged:block_size=4:bits=8", "sink:window=6:sinks=2",
                     "sink:window=6:sinks=2:bits=8", "fp8"):  # fmt: skip
            (cache,) = prefilled(model, _inputs(), make_cache(spec, model))
            _layout(pickle.loads(pickle.dumps(cache)), set(), found)
    digest = hashlib.sha256("\n".join(sorted(found)).encode()).hexdigest()[:16]
    assert SAVED_LAYOUT.get(SAVED_FORMAT) == digest, f"layout {digest}:\n" + "\n".join(sorted(found))

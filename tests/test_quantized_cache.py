"""QuantizedKVCache beyond the shared matrix: storage, encode-once, crop, batch ops, non-finite input, backends,
hybrid windows, validation."""

from __future__ import annotations

import pytest
import torch
from models import tiny_model
from transformers import DynamicCache, LlamaConfig

from hf_kvcache import QuantizedKVCache, cache_nbytes, dynamic_bytes_per_token
from hf_kvcache.layers import _storage


def _config(head_dim=16, layers=2, kv_heads=2):
    return LlamaConfig(
        vocab_size=64,
        hidden_size=4 * head_dim,
        num_attention_heads=4,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        num_hidden_layers=layers,
        intermediate_size=64,
    )


def _kv(tokens, heads=2, head_dim=16, batch=1, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    shape = (batch, heads, tokens, head_dim)
    return torch.randn(shape, generator=g).to(dtype), torch.randn(shape, generator=g).to(dtype)


def _feed(cache, k, v, chunks=(None,)):
    """Feed (B, H, T, D) through every layer, as one forward per chunk length (None = the rest)."""
    out, start = None, 0
    for n in chunks:
        end = k.shape[2] if n is None else start + n
        for layer_idx in range(len(cache.layers)):
            out = cache.update(k[:, :, start:end], v[:, :, start:end], layer_idx)
        start = end
    return out


@pytest.mark.parametrize(("bits", "limit"), [(8, 0.52), (4, 0.30), (2, 0.19)])
def test_storage_ratio_at_head_dim_128_bf16(bits, limit):
    """Stored bytes vs DynamicCache on a head_dim-128 bf16 model shape, 8k context (much longer than the residual)."""
    config = _config(head_dim=128, kv_heads=2)
    k, v = _kv(8192, head_dim=128, dtype=torch.bfloat16)
    steps = [8192 - 16] + [1] * 16  # prefill, then decode steps
    ours, ref = QuantizedKVCache(config, bits=bits), DynamicCache(config=config)
    _feed(ours, k, v, steps)
    _feed(ref, k, v, steps)
    ratio = ours.nbytes / cache_nbytes(ref)
    assert ratio <= limit, f"{bits}-bit cache holds {ratio:.3f}x of DynamicCache"
    assert ours.reserved_nbytes >= ours.nbytes
    analytic = ours.bytes_per_token(torch.bfloat16) / dynamic_bytes_per_token(config, torch.bfloat16)
    assert analytic <= ratio + 1e-9  # the residual only adds


def test_every_token_encoded_once_and_prompt_tail_stays_in_residual(monkeypatch):
    cache = QuantizedKVCache(_config(), bits=4, group_size=8, residual_length=16)
    encoded = []
    codec = cache.layers[0].codec
    original = codec.encode
    monkeypatch.setattr(codec, "encode", lambda k, v: encoded.append(k.shape[2]) or original(k, v))
    k, v = _kv(100)
    _feed(cache, k, v, [37] + [1] * 63)
    layer = cache.layers[0]
    assert sum(encoded) == layer.quantized_tokens  # nothing encoded twice
    assert all(n % 8 == 0 for n in encoded)
    assert 16 <= layer.residual.length <= 16 + 8 - 1
    assert layer.quantized_tokens + layer.residual.length == 100 == cache.get_seq_length()
    # After the 37-token prefill, the prompt's last tokens were still in full precision.
    assert encoded[0] == 16


def test_appends_are_amortized(monkeypatch):
    grows = []
    original = _storage.TokenBuffers._reallocate
    monkeypatch.setattr(
        _storage.TokenBuffers, "_reallocate", lambda self, cap: grows.append(cap) or original(self, cap)
    )
    cache = QuantizedKVCache(_config(layers=1), bits=8)
    k, v = _kv(3000)
    _feed(cache, k, v, [1] * 3000)
    assert len(grows) < 30, f"{len(grows)} reallocations for 3000 single-token appends"


def test_workspace_is_shared_across_layers():
    cache = QuantizedKVCache(_config(layers=2), bits=8)
    k, v = _kv(20)
    _feed(cache, k, v, [19])
    k0, _ = cache.update(k[:, :, 19:], v[:, :, 19:], 0)
    k1, _ = cache.update(k[:, :, 19:], v[:, :, 19:], 1)
    assert k0.data_ptr() == k1.data_ptr()  # one buffer serves both layers
    assert len(cache.workspace._buffers) == 1 and cache.workspace_nbytes > 0


@pytest.mark.parametrize("spec", [dict(bits=8), dict(bits=4, group_size=8, residual_length=4)])
def test_crop_equals_never_having_seen_the_tokens(spec):
    k, v = _kv(41)
    cropped, fresh = QuantizedKVCache(_config(), **spec), QuantizedKVCache(_config(), **spec)
    _feed(cropped, k[:, :, :40], v[:, :, :40], [16] + [1] * 24)
    cropped.crop(-3)  # within the residual (4-bit) / per-token codes (8-bit): exact
    _feed(fresh, k[:, :, :37], v[:, :, :37], [16] + [1] * 21)
    assert cropped.get_seq_length() == fresh.get_seq_length() == 37
    got = cropped.update(k[:, :, 40:], v[:, :, 40:], 0)
    want = fresh.update(k[:, :, 40:], v[:, :, 40:], 0)
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_crop_into_quantized_key_groups_is_bounded():
    k, v = _kv(41)
    cache = QuantizedKVCache(_config(), bits=4, group_size=8, residual_length=4)
    _feed(cache, k[:, :, :40], v[:, :, :40], [1] * 40)
    cache.crop(-13)  # more than the residual holds: reaches into quantized groups
    assert cache.get_seq_length() == 27
    keys, values = cache.update(k[:, :, 40:], v[:, :, 40:], 0)
    assert keys.shape[2] == 28
    ref_k = torch.cat([k[:, :, :27], k[:, :, 40:]], 2)
    # 4-bit over random normal data: one step is about range / 15 ~ 0.5; allow one full step.
    assert (keys - ref_k).abs().max() < 0.8


def test_positive_crop_is_a_value_error_and_crop_past_evicted_tokens_is_clear():
    cache = QuantizedKVCache(tiny_model("gemma3").config, bits=8)
    with pytest.raises(ValueError, match="negative number"):
        cache.crop(3)
    k, v = _kv(40)
    for layer_idx in range(3):
        cache.update(k, v, layer_idx)
    with pytest.raises(ValueError, match="evicted"):
        cache.crop(-20)


def test_batch_repeat_select_and_reorder():
    k, v = _kv(20, batch=2)
    cache = QuantizedKVCache(_config(), bits=4, group_size=8, residual_length=4)
    _feed(cache, k[:, :, :19], v[:, :, :19], [19])
    cache.batch_repeat_interleave(2)  # rows 0,0,1,1
    cache.reorder_cache(torch.tensor([3, 2, 1, 0]))  # rows 1,1,0,0
    cache.batch_select_indices(torch.tensor([1, 2]))  # rows 1,0
    single = QuantizedKVCache(_config(), bits=4, group_size=8, residual_length=4)
    _feed(single, k[:, :, :19].flip(0), v[:, :, :19].flip(0), [19])
    got = cache.update(k[:, :, 19:].flip(0), v[:, :, 19:].flip(0), 0)
    want = single.update(k[:, :, 19:].flip(0), v[:, :, 19:].flip(0), 0)
    torch.testing.assert_close(got, want, rtol=0, atol=0)


@pytest.mark.parametrize("bits", [8, 4, 2])
def test_non_finite_keys_do_not_poison_other_tokens(bits):
    k, v = _kv(24)
    k[0, 0, 3, 5], k[0, 1, 4, 2], v[0, 0, 6, 1] = float("inf"), float("nan"), -float("inf")
    cache = QuantizedKVCache(_config(layers=1), bits=bits, group_size=8, residual_length=0)
    _feed(cache, k, v, [16, 8])
    keys, values = cache.update(k[:, :, :1], v[:, :, :1], 0)
    assert torch.isfinite(keys[:, :, :24]).all() and torch.isfinite(values[:, :, :24]).all()
    finite = torch.isfinite(k) & torch.isfinite(v)
    step = {8: 0.05, 4: 0.8, 2: 4.0}[bits]
    assert ((keys[:, :, :24] - k).abs()[finite] < step).all()


def test_bitsandbytes_backend_agrees_with_torch_within_rounding():
    pytest.importorskip("bitsandbytes")
    k, v = _kv(32)
    torch_cache = QuantizedKVCache(_config(layers=1), bits=8)
    bnb_cache = QuantizedKVCache(_config(layers=1), bits=8, backend="bitsandbytes")
    _feed(torch_cache, k, v)
    _feed(bnb_cache, k, v)
    a, b = torch_cache.layers[0].store, bnb_cache.layers[0].store
    assert (a.view("k").int() - b.view("k").int()).abs().max() <= 1
    torch.testing.assert_close(a.view("ks"), b.view("ks"), rtol=1e-6, atol=0)
    got = bnb_cache.update(k[:, :, :1], v[:, :, :1], 0)[0]
    want = torch_cache.update(k[:, :, :1], v[:, :, :1], 0)[0]
    assert ((got - want).abs() <= a.view("ks").max() + 1e-6).all()  # within one int8 step


def test_hybrid_sliding_layers_keep_only_their_window():
    model = tiny_model("gemma3")
    window = model.config.sliding_window
    cache = QuantizedKVCache(model, bits=4, group_size=8, residual_length=4)  # a model is accepted for its config
    ids = torch.randint(3, 128, (1, 12))
    sizes = []
    for new in (40, 80):
        model.generate(ids, past_key_values=cache, max_new_tokens=new, min_new_tokens=new)
        sliding = [layer for layer in cache.layers if layer.is_sliding]
        assert sliding and all(layer.stored_tokens <= window - 1 + 8 - 1 for layer in sliding)
        sizes.append(sum(layer.nbytes for layer in sliding))
        cache = QuantizedKVCache(model, bits=4, group_size=8, residual_length=4)
    assert sizes[0] == sizes[1]  # flat: 40 vs 80 new tokens


def test_memory_report_adds_up():
    cache = QuantizedKVCache(_config(), bits=4, group_size=8, residual_length=4)
    k, v = _kv(30)
    _feed(cache, k, v)
    report = cache.memory_report()
    assert report["nbytes"] == cache.nbytes == sum(row["nbytes"] for row in report["layers"])
    assert all(row["stored_tokens"] == 30 for row in report["layers"])
    assert cache_nbytes(cache) == cache.nbytes


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (dict(bits=3), "bits must be one of"),
        (dict(bits=True), "bits must be one of"),
        (dict(bits=4.0), r"bits must be one of 2, 4, 8, got 4\.0"),
        (dict(group_size=64.0), "group_size must be an integer"),
        (dict(bits=4, group_size=5), "group_size must divide head_dim"),
        (dict(group_size=0), "group_size must be an integer >= 1"),
        (dict(residual_length=-1), "residual_length must be an integer >= 0"),
        (dict(residual_length=2.5), "residual_length must be an integer"),
        (dict(backend="cuda"), "backend must be one of"),
        (dict(bits=4, backend="bitsandbytes"), "supports bits=8 only"),
        (dict(scale_dtype="int8"), "scale_dtype must be one of"),
    ],
)
def test_bad_arguments_are_value_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        QuantizedKVCache(_config(), **kwargs)


def test_crop_past_a_full_attention_layer_says_what_it_holds_not_evicted():
    cache = QuantizedKVCache(tiny_model("llama").config, bits=8)
    k, v = _kv(10)
    for layer_idx in range(2):
        cache.update(k, v, layer_idx)
    with pytest.raises(ValueError, match="cannot crop 12 tokens: this layer holds 10") as err:
        cache.crop(-12)
    assert "evicted" not in str(err.value)


def test_config_must_be_a_config_or_model():
    with pytest.raises(ValueError, match="config must be a transformers PretrainedConfig"):
        QuantizedKVCache({"num_hidden_layers": 2})


@pytest.mark.gpu
def test_layers_split_across_devices_keep_storage_on_their_device():
    """accelerate device_map: each layer's storage lives on that layer's device."""
    model = tiny_model("llama").to("cpu")
    from accelerate import dispatch_model

    device_map = {
        "model.embed_tokens": 0,
        "model.layers.0": 0,
        "model.layers.1": "cpu",
        "model.norm": "cpu",
        "model.rotary_emb": 0,
        "lm_head": "cpu",
    }
    dispatched = dispatch_model(model, device_map=device_map)
    cache = QuantizedKVCache(dispatched, bits=4, group_size=8, residual_length=4)
    ids = torch.randint(3, 128, (1, 12), device="cuda:0")
    dispatched.generate(ids, past_key_values=cache, max_new_tokens=20)
    assert cache.layers[0].store.view("k").device.type == "cuda"
    assert cache.layers[1].store.view("k").device.type == "cpu"


@pytest.mark.parametrize("spec", ["int8", "int4:group_size=8:residual_length=4"])
def test_hf_kvcache_decode_allocates_no_history_sized_workspace(spec):
    """Under the hf_kvcache attention decode steps hand the kernels views of the storage: the full-precision
    workspace the sdpa path decodes into is never allocated (memory_report shows it)."""
    from hf_kvcache import make_cache

    outputs = {}
    for attn in ("sdpa", "hf_kvcache"):
        model = tiny_model("llama", attn)
        cache = make_cache(spec, model)
        ids = torch.randint(3, 100, (1, 12), generator=torch.Generator().manual_seed(0))
        outputs[attn] = model.generate(input_ids=ids, past_key_values=cache, max_new_tokens=8, do_sample=False)
        report = cache.memory_report()
        assert report["workspace_nbytes"] == (0 if attn == "hf_kvcache" else cache.workspace_nbytes)
        if attn == "sdpa":
            assert report["workspace_nbytes"] > 0
    torch.testing.assert_close(outputs["hf_kvcache"], outputs["sdpa"], rtol=0, atol=0)

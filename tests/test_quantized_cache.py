"""QuantizedKVCache beyond the shared matrix: storage, encode-once, crop, batch ops, non-finite input, backends,
hybrid windows, validation."""

from __future__ import annotations

import itertools

import pytest
import torch
from models import VOCAB, prompt, rotary, tiny_model
from transformers import DynamicCache, LlamaConfig

from hf_kvcache import QuantizedKVCache, cache_nbytes, dynamic_bytes_per_token, make_cache, quant
from hf_kvcache.formats import Int8Codec, codec_for
from hf_kvcache.kernels import cpu_native
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


# KIVI's own layout (the "auto" defaults add a rotation and sinks at 4/3/2 bits): the tests of its storage mechanics
# (what is encoded when, crop arithmetic, scales per token) pin it.
KIVI = dict(rotate=None, sinks=0, pre_rope=False)
_NO_ROPE = dict(rotate=None, pre_rope=False)


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


@pytest.mark.slow
@pytest.mark.parametrize(("bits", "limit"), [(8, 0.52), (4, 0.30), (3, 0.25), (2, 0.19)])
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
    cache = QuantizedKVCache(_config(), bits=4, group_size=8, residual_length=16, **KIVI)
    encoded = []
    codec = cache.layers[0].codec
    original = codec.encode_into  # the layer encodes straight into its storage
    monkeypatch.setattr(codec, "encode_into", lambda k, v, out: encoded.append(k.shape[2]) or original(k, v, out))
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


@pytest.mark.parametrize("spec", [dict(bits=8), dict(bits=4, group_size=8, residual_length=4, **KIVI)])
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
    cache = QuantizedKVCache(_config(layers=1), bits=bits, group_size=8, residual_length=0, **KIVI)
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
        (dict(bits=5), "bits must be one of"),
        (dict(bits=True), "bits must be one of"),
        (dict(bits=4.0), r"bits must be one of 2, 3, 4, 8, 'fp8', got 4\.0"),
        (dict(bits="fp8", group_size=8), "group_size: fp8 keeps one scale per token and head"),
        (dict(bits="fp8", backend="bitsandbytes"), "supports bits=8 only, got bits='fp8'"),
        (dict(bits="fp8", key_axis="token"), "key_axis applies to the 4/3/2-bit KIVI kinds only"),
        (dict(group_size=64.0), "group_size must be an integer"),
        (dict(bits=4, group_size=5), "group_size must divide head_dim"),
        (dict(group_size=0), "group_size must be an integer >= 1"),
        (dict(residual_length=-1), "residual_length must be an integer >= 0"),
        (dict(residual_length=2.5), "residual_length must be an integer"),
        (dict(backend="cuda"), "backend must be one of"),
        (dict(bits=4, backend="bitsandbytes"), "supports bits=8 only"),
        (dict(scale_dtype="int8"), "scale_dtype must be one of float32, float16, bfloat16, got 'int8'"),
        (dict(bits=4, scale_dtype="int8"), "scale_dtype must be one of float32, float16, bfloat16, e5m3, got"),
        (dict(scale_dtype="e5m3"), "scale_dtype='e5m3' applies to the 4/3/2-bit kinds"),
        (dict(bits="fp8", scale_dtype="e5m3"), "scale_dtype='e5m3' applies to the 4/3/2-bit kinds"),
        (dict(bits=2, scale_dtype=torch.uint8), "scale_dtype must be one of float32, float16, bfloat16, e5m3"),
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


# -- key_axis="token": KIVI's ablation (keys per token like the values) ------------------------------------------


def test_per_token_keys_store_one_scale_per_token_and_channel_group():
    cache = QuantizedKVCache(_config(), bits=2, group_size=8, residual_length=4, key_axis="token", **KIVI)
    k, v = _kv(23, batch=2)
    _feed(cache, k, v, [13] + [1] * 10)
    layer = cache.layers[0]
    assert layer.codec.unit == 1  # every token leaves the residual on its own
    assert layer.residual.length == 4 and layer.quantized_tokens == 19
    assert layer.store.view("ks").shape == (2, 2, 19, 2) == layer.store.view("vs").shape  # (B, H, T, D / G)
    assert layer.store.view("k").shape == (2, 2, 19, 4)  # 2-bit codes, 4 per byte
    # Round trip within half a step of each token's own (key) group.
    keys = cache.update(k[:, :, :1], v[:, :, :1], 0)[0][:, :, :19]
    scale = layer.store.view("ks")[:, :, :19].float().repeat_interleave(8, dim=-1)
    assert ((keys - k[:, :, :19]).abs() <= scale / 2 + 1e-6).all()


def test_per_token_keys_lose_an_outlier_channels_neighbours():
    """Why KIVI quantizes keys per channel: a channel of large magnitude (as real LLM keys have) sets every token's
    step when keys are grouped per token, while per-channel groups confine it to its own channel."""
    k, v = _kv(64, head_dim=16)
    k[..., 3] = 20 + k[..., 3]  # an outlier channel
    errors = {}
    for axis in ("channel", "token"):
        cache = QuantizedKVCache(_config(layers=1), bits=2, group_size=16, residual_length=0, key_axis=axis)
        _feed(cache, k, v)
        keys = cache.update(k[:, :, :1], v[:, :, :1], 0)[0][:, :, :64]
        errors[axis] = float((keys - k).abs().mean())
    assert errors["token"] > 3 * errors["channel"], errors


def test_default_key_axis_is_channel():
    explicit = QuantizedKVCache(_config(), bits=4, group_size=8, residual_length=4, key_axis="channel")
    default = QuantizedKVCache(_config(), bits=4, group_size=8, residual_length=4)
    k, v = _kv(30)
    got, want = _feed(explicit, k, v, [17] + [1] * 13), _feed(default, k, v, [17] + [1] * 13)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert default.key_axis == "channel" and default.layers[0].codec.unit == 8
    assert QuantizedKVCache(_config(), bits=8).key_axis is None


def test_per_token_keys_crop_anywhere_removes_exactly_those_tokens():
    """Every token is its own unit: a crop deep into the quantized tokens removes them and leaves the survivors'
    codes as they were (no decode and re-encode, unlike a partly removed per-channel key group)."""
    k, v = _kv(41)
    spec = dict(bits=2, group_size=8, residual_length=4, key_axis="token", **KIVI)
    cropped, whole = QuantizedKVCache(_config(), **spec), QuantizedKVCache(_config(), **spec)
    _feed(cropped, k[:, :, :40], v[:, :, :40], [16] + [1] * 24)
    _feed(whole, k[:, :, :40], v[:, :, :40], [16] + [1] * 24)
    cropped.crop(-13)  # the residual (4 tokens) and 9 quantized ones
    assert cropped.get_seq_length() == 27 and cropped.layers[0].quantized_tokens == 27
    got_k, got_v = cropped.update(k[:, :, 40:], v[:, :, 40:], 0)
    want_k, want_v = whole.update(k[:, :, 40:], v[:, :, 40:], 0)
    torch.testing.assert_close(got_k[:, :, :27], want_k[:, :, :27], rtol=0, atol=0)
    torch.testing.assert_close(got_v[:, :, :27], want_v[:, :, :27], rtol=0, atol=0)
    torch.testing.assert_close(got_k[:, :, 27:], k[:, :, 40:], rtol=0, atol=0)


@pytest.mark.parametrize("bits", [4, 2])
def test_per_token_keys_bytes_per_token(bits):
    """Analytic bytes equal what a long run stores per quantized token (fp32 K/V: float32 scales)."""
    config = _config(head_dim=16, kv_heads=2)
    cache = QuantizedKVCache(config, bits=bits, group_size=8, residual_length=0, key_axis="token", **KIVI)
    k, v = _kv(40)
    _feed(cache, k, v, [40])
    per_layer = 2 * ((16 + 16) * bits / 8 + 2 * (16 // 8) * 4 + 2 * (16 // 8) * 4)  # heads x (codes + k + v params)
    assert cache.bytes_per_token(torch.float32) == 2 * per_layer
    assert cache.nbytes == 40 * cache.bytes_per_token(torch.float32)


@pytest.mark.parametrize("family", ["llama", "gemma3"])
@pytest.mark.parametrize("spec", ["int2:group_size=8:residual_length=4:key_axis=token", "int4:key_axis=token"])
def test_per_token_keys_plan_equals_nbytes(family, spec):
    from hf_kvcache import make_cache
    from hf_kvcache.plan import kv_bytes

    model = tiny_model(family)
    ids = torch.randint(3, 100, (2, 9), generator=torch.Generator().manual_seed(0))
    cache = make_cache(spec, model)
    model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), past_key_values=cache, max_new_tokens=30)
    planned = kv_bytes(spec, model.config, 9 + 30 - 1, batch=2, dtype=torch.float32, prompt=9)
    assert abs(planned - cache_nbytes(cache)) <= 8 * model.config.num_hidden_layers  # DynamicSliding bookkeeping


def test_per_token_keys_reference_kernel_equals_attention_over_decoded_history():
    from hf_kvcache.formats import DenseSegment, KiviCodec
    from hf_kvcache.kernels import torch_attention

    codec = KiviCodec(2, 8, torch.float32, key_axis="token")
    k, v = _kv(37, head_dim=16)
    parts = codec.encode(k, v)
    keys, values = torch.empty_like(k), torch.empty_like(v)
    codec.decode(parts, keys, values)
    query = torch.randn(1, 4, 2, 16, generator=torch.Generator().manual_seed(1))
    mask = torch.rand(1, 2, 32, generator=torch.Generator().manual_seed(2)) > 0.3
    got = torch_attention(query, (codec.segment(parts, 5),), mask, 0.25)
    want = torch_attention(query, (DenseSegment(keys[:, :, 5:], values[:, :, 5:]),), mask, 0.25)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_per_token_keys_under_hf_kvcache_attention_match_sdpa(family):
    """Decode steps read per-token keys through the kernel op (the reference): same tokens and logits as the
    materialized path, with beams and with prompt-lookup (crop) decoding."""
    from hf_kvcache import make_cache

    spec = "int2:group_size=8:residual_length=4:key_axis=token"
    ids = torch.randint(3, 100, (1, 12), generator=torch.Generator().manual_seed(0))
    for kwargs in (dict(), dict(num_beams=3), dict(prompt_lookup_num_tokens=3)):
        outputs = {}
        for attn in ("sdpa", "hf_kvcache"):
            model = tiny_model(family, attn)
            cache = make_cache(spec, model)
            outputs[attn] = model.generate(
                input_ids=ids, past_key_values=cache, max_new_tokens=12, do_sample=False, output_logits=True,
                return_dict_in_generate=True, **kwargs,
            )  # fmt: skip
            assert cache.memory_report()["workspace_nbytes"] == (0 if attn == "hf_kvcache" else cache.workspace_nbytes)
        torch.testing.assert_close(outputs["hf_kvcache"].sequences, outputs["sdpa"].sequences, rtol=0, atol=0)
        for got, want in zip(outputs["hf_kvcache"].logits, outputs["sdpa"].logits):
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (dict(bits=2, key_axis="tokens"), "key_axis must be one of 'channel', 'token', got 'tokens'"),
        (dict(bits=4, key_axis=1), "key_axis must be one of"),
        (dict(bits=8, key_axis="token"), "key_axis applies to the 4/3/2-bit KIVI kinds only"),
        (dict(bits=8, key_axis="channel"), "key_axis applies to the 4/3/2-bit KIVI kinds only"),
    ],
)
def test_bad_key_axis_is_a_value_error(kwargs, match):
    with pytest.raises(ValueError, match=match):
        QuantizedKVCache(_config(), **kwargs)


def test_key_axis_spec_option():
    from hf_kvcache import make_cache

    cache = make_cache("int2:key_axis=token", _config())
    assert cache.key_axis == "token" and "key_axis='token'" in repr(cache)
    with pytest.raises(ValueError, match="cache kind 'int8' has no option key_axis"):
        make_cache("int8:key_axis=token", _config())


# -- rotate="hadamard": the head dimension rotated before quantizing (QuaRot) ---------------------------------------


@pytest.mark.parametrize("width", [64, 96, 16, 12])
def test_hadamard_is_orthonormal_symmetric_and_mixes_every_channel_of_its_block(width):
    from hf_kvcache.formats import hadamard

    h = hadamard(width, torch.float64, torch.device("cpu"))
    torch.testing.assert_close(h @ h, torch.eye(width, dtype=torch.float64))  # its own inverse
    block = width & -width  # 96 -> 32, 12 -> 4
    torch.testing.assert_close(h[:block, :block].abs(), torch.full((block, block), block**-0.5, dtype=torch.float64))
    assert (h[:block, block:] == 0).all()


@pytest.mark.parametrize("width, layout", [(64, "half"), (64, None), (16, "half"), (96, "half"), (64, "interleaved"),
                                           (64, "partial"), (12, None)])  # fmt: skip
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_rotating_back_equals_the_product_then_the_turn(width, layout, dtype):
    """``rotate_back``: ``x H``, then keys stored before RoPE turned to positions ``first ..``, written into a
    workspace slice (in place, too). Power-of-two widths with every channel rotary in the rotate_half layout take
    the half-width products and fold the turn into their butterfly; the others the full product, then the turn."""
    from hf_kvcache.formats import hadamard
    from hf_kvcache.formats.rotated import _splits, rotate_back
    from hf_kvcache.rope import rotate_positions

    x = torch.randn(2, 3, 40, width, generator=torch.Generator().manual_seed(width)).to(dtype)
    rope = None if layout is None else (rotary(width, layout), 7)
    want = x.double() @ hadamard(width, torch.float64, x.device)
    if rope is not None:
        want = rotate_positions(want.float(), 7, rope[0]).double()
    tolerance = dict(rtol=0, atol=2e-5) if dtype == torch.float32 else dict(rtol=2 * torch.finfo(dtype).eps, atol=1e-3)
    computes = [torch.float32] + ([dtype] if dtype == torch.bfloat16 else [])  # CUDA's bfloat16 products too
    for in_place, compute in itertools.product((False, True), computes):
        space = torch.zeros(2, 3, 48, width, dtype=dtype)  # a workspace with headroom: non-contiguous slices
        out = space[:, :, 4:44]
        source = out.copy_(x) if in_place else x
        rotate_back(source, out, compute, rope)
        loose = dict(rtol=0.02, atol=0.05) if compute == torch.bfloat16 else tolerance  # 16-bit sums: a few roundings
        torch.testing.assert_close(out.double(), want.to(dtype).double(), **loose)
        assert (space[:, :, :4] == 0).all() and (space[:, :, 44:] == 0).all()
    assert _splits(width, rope) == (width in (16, 64) and layout in (None, "half"))


@pytest.mark.parametrize("bits", [None, 8, "fp8", 4, 3, 2])
@pytest.mark.parametrize("rotate", [False, True])
def test_a_codec_turns_pre_rope_keys_as_it_decodes(bits, rotate):
    """``decode(..., rope)`` of every codec: what ``decode`` reads, the keys then turned to their positions (the
    rotated codecs fold the turn into rotating back; values untouched)."""
    from hf_kvcache.formats import IdentityCodec, codec_for
    from hf_kvcache.rope import rotate_positions

    if bits is None and rotate:
        pytest.skip("the exact residual is never rotated")
    codec = IdentityCodec() if bits is None else codec_for(bits, 16, rotate=rotate)
    k, v = _kv(32, head_dim=64, seed=3)
    parts = codec.encode(k, v)
    plain_k, plain_v, turned_k, turned_v = (torch.empty_like(k) for _ in range(4))
    codec.decode(parts, plain_k, plain_v)
    rope = (rotary(64, "half"), 5)
    codec.decode(parts, turned_k, turned_v, rope)
    torch.testing.assert_close(turned_k, rotate_positions(plain_k, 5, rope[0]), rtol=0, atol=2e-5)
    torch.testing.assert_close(turned_v, plain_v, rtol=0, atol=2e-5)


@pytest.mark.parametrize("bits", [8, "fp8", 4, 3, 2])
@pytest.mark.parametrize("rotate", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_a_codec_decodes_into_workspace_slices_what_it_decodes_into_whole_tensors(bits, rotate, dtype):
    """A layer decodes into slices of its workspace (rows of other lengths around them): the same values, bit for
    bit, as into tensors of their own (a rotated codec rotates back in place there, through a reshaping copy), and
    nothing written beside them."""
    from hf_kvcache.formats import codec_for

    codec = codec_for(bits, 16, rotate=rotate)
    k, v = _kv(32, head_dim=64, batch=2, dtype=dtype, seed=4)
    parts = codec.encode(k, v)
    rope = (rotary(64, "half"), 5)
    whole_k, whole_v = torch.empty_like(k), torch.empty_like(v)
    codec.decode(parts, whole_k, whole_v, rope)
    space_k, space_v = (torch.zeros(2, 2, 40, 64, dtype=dtype) for _ in range(2))
    codec.decode(parts, space_k[:, :, 3:35], space_v[:, :, 3:35], rope)
    for space, whole in ((space_k, whole_k), (space_v, whole_v)):
        assert torch.equal(space[:, :, 3:35], whole)
        assert not space[:, :, :3].any() and not space[:, :, 35:].any()


@pytest.mark.parametrize("bits", [2, 4, 8])
def test_rotation_spreads_an_outlier_channel(bits):
    """One channel 30x the others stretches every per-token scale it belongs to; rotated, its energy is spread over
    the head and the other channels come back closer. Keys and values both, through the cache's own codec."""
    torch.manual_seed(0)
    x = torch.randn(1, 2, 64, 64)
    x[..., 5] *= 30
    errors = {}
    for rotate in (None, "hadamard"):
        cache = QuantizedKVCache(_config(head_dim=64, layers=1), bits=bits, group_size=64, residual_length=0,
                                 rotate=rotate)  # fmt: skip
        codec = cache.layers[0].codec
        k, v = torch.empty_like(x), torch.empty_like(x)
        codec.decode(codec.encode(x, x), k, v)
        others = torch.ones(64, dtype=torch.bool)
        others[5] = False
        errors[rotate] = ((v - x)[..., others].abs().mean().item(), (k - x)[..., others].abs().mean().item())
    assert errors["hadamard"][0] < errors[None][0] / 2  # values: per token, the outlier's group
    if bits == 8:
        assert errors["hadamard"][1] < errors[None][1] / 2  # int8 keys are per token too


def test_rotate_validation_bytes_and_spec():
    from hf_kvcache import make_cache

    with pytest.raises(ValueError, match="rotate must be one of"):
        QuantizedKVCache(_config(), bits=4, rotate="random")
    model = tiny_model("llama")
    ids = torch.randint(3, 100, (2, 40))
    plain, rotated = (
        make_cache("int2:residual_length=4:rotate=none", model),
        # smoothed keys add their scales; rotated codes default to 8-bit scales
        make_cache("int2:residual_length=4:rotate=hadamard:smooth=0:scale_dtype=none", model),
    )
    for cache in (plain, rotated):
        model.generate(input_ids=ids, past_key_values=cache, max_new_tokens=5, do_sample=False)
    assert cache_nbytes(rotated) == cache_nbytes(plain) and rotated.bytes_per_token() == plain.bytes_per_token()
    assert "rotate='hadamard'" in repr(rotated) and rotated.rotate == "hadamard" and plain.rotate is None


@torch.no_grad()
def _teacher_forced(model, ids, cache, prefill=8):
    logits = [model(ids[:, :prefill], past_key_values=cache, use_cache=True).logits[:, -1]]
    for t in range(prefill, ids.shape[1]):
        logits.append(model(ids[:, t : t + 1], past_key_values=cache, use_cache=True).logits[:, -1])
    return torch.stack(logits, 1)


@pytest.mark.parametrize(
    "spec", ["int8", "int4:residual_length=4:group_size=8", "int2:residual_length=4:group_size=8:pre_rope=false"]
)
def test_rotated_cache_stores_what_it_reads(spec):
    """Through the layer's own append path (tokens encoded straight into the storage), a rotated cache stays within
    its kind's stated teacher-forced bound: the encoder rotates what the reader rotates back. (int8's in-place
    encoder once reached through the rotated codec stored unrotated codes: 2.2 x std.)"""
    from hf_kvcache.compare import LOGIT_BOUNDS

    model = tiny_model("llama")
    ids = torch.randint(3, model.config.vocab_size, (1, 40), generator=torch.Generator().manual_seed(0))
    errors = {}
    for rotate in ("none", "hadamard"):
        cache = make_cache(f"{spec}:rotate={rotate}", model)
        ref, got = _teacher_forced(model, ids, DynamicCache(config=model.config)), _teacher_forced(model, ids, cache)
        errors[rotate] = float((got - ref).abs().max() / ref.std())
    assert 0 < errors["hadamard"] <= LOGIT_BOUNDS[spec.split(":")[0]], errors


def test_rotated_cache_is_read_in_place_under_hf_kvcache(monkeypatch):
    """Under the hf_kvcache attention a rotated cache's decode steps read its codes in place (a RotatedSegment around
    the KIVI segment, the rotation folded into the query and output, in the KIVI op's one launch) and generate what
    sdpa over the decoded, rotated-back history does."""
    from hf_kvcache import attention
    from hf_kvcache.formats import KiviSegment, RotatedSegment

    seen, real_attention = [], attention.decode_attention

    def recording_attention(query, handle, *args, **kwargs):
        for segment in handle.segments:
            seen.append(type(segment).__name__)
            if isinstance(segment, RotatedSegment):
                seen.append(type(segment.inner).__name__)
        return real_attention(query, handle, *args, **kwargs)

    monkeypatch.setattr(attention, "decode_attention", recording_attention)
    ids, mask = _padded(length=40)
    outs = []
    for attn in ("sdpa", attention.ATTENTION):
        model = tiny_model("llama", attn)
        cache = make_cache("int4:residual_length=4:group_size=8:rotate=hadamard", model)
        out = model.generate(input_ids=ids, attention_mask=mask, past_key_values=cache, max_new_tokens=6,
                             do_sample=False, output_logits=True, return_dict_in_generate=True)  # fmt: skip
        outs.append(torch.stack(out.logits))
    assert RotatedSegment.__name__ in seen and KiviSegment.__name__ in seen
    std = outs[0].std().item()
    assert (outs[1] - outs[0]).abs().max().item() < 1e-4 * max(std, 1.0)


# -- pre_rope=True: keys quantized before RoPE (KVQuant) ------------------------------------------------------------


@pytest.mark.parametrize("sinks", [0, 3])
@pytest.mark.parametrize("bits", [4, 2])
def test_pre_rope_keys_that_are_steady_before_rope_come_back_exactly(bits, sinks):
    """Keys constant across tokens before RoPE (an outlier channel included) are constant per channel group once
    turned back, so KIVI encodes them exactly: the layer returns the post-RoPE keys to float rounding, through a
    prefill, single-token steps, a crop into the codes and a beam reorder. A position the encoder and the reader
    disagree on would not."""
    from hf_kvcache.rope import rotate_positions

    model = tiny_model("llama")
    cache = QuantizedKVCache(model, bits=bits, group_size=8, residual_length=4, sinks=sinks, pre_rope=True, rotate=None)
    plain = QuantizedKVCache(model, bits=bits, group_size=8, residual_length=4, sinks=sinks, **_NO_ROPE)
    rope = cache.layers[0].key_rope
    assert rope is not None and plain.layers[0].key_rope is None
    steady = torch.randn(2, 2, 1, 16).expand(2, 2, 60, 16).clone()
    steady[..., 3] *= 25
    k = rotate_positions(steady, 0, rope)
    v = torch.randn(2, 2, 60, 16)
    errors = {}
    for name, c in (("pre", cache), ("plain", plain)):
        _feed(c, k[:, :, :40], v[:, :, :40], chunks=(33, 1, 1, 1, 1, 1, 1, 1))
        c.crop(-3)  # 3 tokens off: into the last key group, whose survivors return to the residual
        c.reorder_cache(torch.tensor([1, 0]))
        keys, _ = c.update(k[[1, 0], :, 37:38], v[[1, 0], :, 37:38], 0)
        assert keys.shape[2] == 38
        errors[name] = (keys - k[[1, 0], :, :38]).abs().max().item()
    assert errors["pre"] < 1e-4 < errors["plain"], errors


def test_pre_rope_validation_spec_and_bytes():
    with pytest.raises(ValueError, match="pre_rope must be True, False or 'auto'"):
        QuantizedKVCache(_config(), bits=4, pre_rope="yes")
    with pytest.raises(ValueError, match="model_type 'gpt2' does not rotate its keys with RoPE.*pre_rope=False"):
        make_cache("int4:pre_rope=true", tiny_model("gpt2"))
    model = tiny_model("llama")
    cache = make_cache("int2:residual_length=4:pre_rope=true", model)
    assert cache.pre_rope and "pre_rope=True" in repr(cache)
    plain = make_cache("int2:residual_length=4", model)
    ids = torch.randint(3, 100, (2, 40))
    for c in (cache, plain):
        model.generate(input_ids=ids, past_key_values=c, max_new_tokens=5, do_sample=False)
    assert cache_nbytes(cache) == cache_nbytes(plain)


# -- sinks=N: the first real tokens of every row in full precision --------------------------------------------------


def _padded(batch=2, length=20, pad=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 100, (batch, length), generator=g)
    mask = torch.ones_like(ids)
    ids[-1, :pad], mask[-1, :pad] = 0, 0
    return ids, mask


def test_sinks_keep_each_rows_first_real_tokens_exact_through_left_padding():
    """Row r's sinks are its first real tokens, at its own padding p_r; every position (padding included) is quantized
    once: a padded batch stores what unpadded rows do."""
    model = tiny_model("llama")
    ids, mask = _padded(pad=3)
    ref, cache = DynamicCache(config=model.config), QuantizedKVCache(model, bits=2, group_size=4, residual_length=0,
                                                                     sinks=2)  # fmt: skip
    with torch.no_grad():
        model(input_ids=ids, attention_mask=mask, past_key_values=ref)
        model(input_ids=ids, attention_mask=mask, past_key_values=cache)
    layer = cache.layers[0]
    assert layer.sink.pads == (0, 3)
    for row, pad in enumerate((0, 3)):
        torch.testing.assert_close(layer.sink.k[row], ref.layers[0].keys[row, :, pad : pad + 2], rtol=0, atol=0)
        torch.testing.assert_close(layer.sink.v[row], ref.layers[0].values[row, :, pad : pad + 2], rtol=0, atol=0)
    assert layer.quantized_tokens == 20 and layer.stored_tokens == 20
    assert "sinks=2" in repr(cache)


@pytest.mark.parametrize("first, length, tokens", [(0, 10, 10), (0, 12, 10), (2, 8, 10), (1, 3, 4), (4, 6, 10),
                                                   (6, 4, 10), (0, 5, 3)])  # fmt: skip
def test_unpadded_sinks_patch_one_slice_as_the_rows_do(first, length, tokens, monkeypatch):
    """With no row padded and every sink held, :meth:`RowSinks.patch` writes one slice: the same as the per-row
    scatter, for positions ``first ..`` (a sliding layer's, after evictions) that start at, inside or past the sinks
    and end past them or inside them, with new tokens after the ``tokens`` stored; before every sink is held, the
    per-row scatter."""
    from hf_kvcache.layers._sinks import RowSinks

    k, v = _kv(4, batch=2, seed=1)
    sinks = RowSinks(4, (0, 0), k, v)
    sinks.fill(k, v, 0)
    got = [t.clone() for t in _kv(length, batch=2, seed=2)]
    want = [t.clone() for t in got]
    sinks.patch(*got, first, tokens)
    monkeypatch.setattr(RowSinks, "aligned", lambda self, tokens: False)
    sinks.patch(*want, first, tokens)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert not torch.equal(got[0], _kv(length, batch=2, seed=2)[0]) or first >= 4


def test_sinks_cost_their_full_precision_bytes_and_help_where_the_first_tokens_matter():
    model = tiny_model("llama")
    ids, mask = _padded(batch=1, length=40, pad=0)
    sizes, errors = {}, {}
    with torch.no_grad():
        want = model(input_ids=ids).logits[:, -1]
        for sinks in (0, 4):
            cache = QuantizedKVCache(model, bits=2, group_size=4, residual_length=0, sinks=sinks, rotate=None)
            model(input_ids=ids[:, :-1], past_key_values=cache)
            got = model(input_ids=ids[:, -1:], past_key_values=cache).logits[:, -1]
            sizes[sinks], errors[sinks] = cache.nbytes, (got - want).abs().max().item()
    per_token_fp = 2 * 2 * 16 * 4 * 2  # K and V, 2 KV heads x 16 channels x float32, 2 layers
    assert sizes[4] - sizes[0] == 4 * per_token_fp  # exact copies beside codes of every position
    assert errors[4] < errors[0]


@pytest.mark.parametrize("attn", ["sdpa", "hf_kvcache"])
def test_crop_into_the_sinks_then_continue(attn):
    model = tiny_model("llama", attn)
    ids, mask = _padded(batch=2, length=12, pad=2)
    cache = QuantizedKVCache(model, bits=4, group_size=4, residual_length=0, sinks=4)
    fresh = QuantizedKVCache(model, bits=4, group_size=4, residual_length=0, sinks=4)
    with torch.no_grad():
        model(input_ids=ids, attention_mask=mask, past_key_values=cache)
        cache.crop(-9)  # 3 tokens left: 3 of row 0's sinks, 1 of row 1's (padded by 2)
        assert cache.layers[0].stored_tokens == 3
        assert cache.layers[0].sink.filled(3).tolist() == [[True] * 3 + [False], [True] + [False] * 3]
        model(input_ids=ids[:, 3:8], attention_mask=mask[:, :8], past_key_values=cache)  # refill the sinks, go on
        got = model(input_ids=ids[:, 8:], attention_mask=mask, past_key_values=cache).logits
        model(input_ids=ids[:, :8], attention_mask=mask[:, :8], past_key_values=fresh)
        want = model(input_ids=ids[:, 8:], attention_mask=mask, past_key_values=fresh).logits
    torch.testing.assert_close(got, want)


def test_sinks_validation_and_a_cache_built_from_a_config():
    with pytest.raises(ValueError, match="sinks"):
        QuantizedKVCache(_config(), bits=2, sinks=-1)
    cache = QuantizedKVCache(_config(), bits=2, group_size=4, residual_length=0, sinks=2)
    k = torch.randn(2, 2, 10, 16)
    cache.update(k, k.clone(), 0)
    assert cache.layers[0].sink.pads == (0, 0)  # no model: rows count as unpadded


@pytest.mark.parametrize("spec", ["int2", "int3", "int2:sinks=16", "int4:sinks=4"])
def test_a_ragged_padded_batch_stores_what_plan_says(spec):
    """Two prompts of 79 and 1,000 tokens (the shorter left-padded by 921): every position is encoded once and each
    row keeps its own sinks, so the batch holds plan's bytes for 2 rows of 1,000 tokens, not DynamicCache's."""
    from hf_kvcache import load_reference_model
    from hf_kvcache.plan import kv_bytes

    model, _ = load_reference_model()
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, model.config.vocab_size, (2, 1000), generator=g)
    mask = torch.ones_like(ids)
    ids[0, :921], mask[0, :921] = 0, 0
    cache, dense = make_cache(spec, model), DynamicCache(config=model.config)
    with torch.no_grad():
        model(input_ids=ids, attention_mask=mask, past_key_values=cache)
        model(input_ids=ids, attention_mask=mask, past_key_values=dense)
    assert cache.nbytes == kv_bytes(spec, model, 1000, batch=2, dtype=torch.float32) < cache_nbytes(dense) / 3
    assert all(layer.quantized_tokens >= 1000 - 128 - 63 for layer in cache.layers)
    assert cache.layers[0].sink.pads == (921, 0)


@pytest.mark.parametrize("batch, materialized", [("single", False), ("padded", True)])
def test_hf_kvcache_prefill_takes_sdpas_causal_path_unless_padded(batch, materialized, monkeypatch):
    """An unpadded prefill under the hf_kvcache attention reaches sdpa with no mask (its ``is_causal`` path: a
    materialized mask made prefill 1.45x slower than sdpa's at 4k tokens on the real model); a padded one gets the
    mask; decode steps over the storage handle build their causal mask themselves, and the outputs stay sdpa's."""
    import transformers.integrations.sdpa_attention as sdpa_module

    seen = []
    original = sdpa_module.sdpa_attention_forward

    def spy(module, query, key, value, attention_mask, **kwargs):
        seen.append(attention_mask is not None)
        return original(module, query, key, value, attention_mask, **kwargs)

    monkeypatch.setattr(sdpa_module, "sdpa_attention_forward", spy)
    model = tiny_model("llama", "hf_kvcache")
    out = model.generate(**prompt(batch), past_key_values=make_cache("int8", model), max_new_tokens=4, do_sample=False)
    assert seen and set(seen) == {materialized}  # the prefill's layers: the only forwards sdpa serves
    ref = tiny_model("llama", "sdpa")
    want = ref.generate(**prompt(batch), past_key_values=make_cache("int8", ref), max_new_tokens=4, do_sample=False)
    torch.testing.assert_close(out, want, rtol=0, atol=0)


# -- "auto": the measured best setting at each width -----------------------------------------------------------------


def _ablation() -> dict[str, float]:
    """Perplexity change per cache spec of the saved ablation run (docs/results/eval-ablation.json)."""
    import json
    from pathlib import Path

    saved = json.loads((Path(__file__).resolve().parent.parent / "docs/results/eval-ablation.json").read_text())
    return {row["cache"]: row["perplexity"]["perplexity_change"] for row in saved["results"]["results"]}


def _options_spec(bits: int, options: dict) -> str:
    rotate = options["rotate"] or "none"
    return f"int{bits}:rotate={rotate}:sinks={options['sinks']}:pre_rope={str(options['pre_rope']).lower()}"


@pytest.mark.parametrize("bits", [4, 3, 2])
def test_auto_defaults_are_the_measured_best(bits):
    """Each width's defaults were measured in the saved ablation, and no other setting measured there beats them by
    more than the run's noise (0.5 points of perplexity change; at 4 bits every setting is within it, and the
    defaults are then the cheapest)."""
    from hf_kvcache.caches.quantized import MEASURED_DEFAULTS

    changes = _ablation()
    mine = changes[_options_spec(bits, MEASURED_DEFAULTS[bits])]
    best = min(v for k, v in changes.items() if k.startswith(f"int{bits}:"))
    assert mine <= best + 0.005, (bits, mine, best)


def test_auto_defaults_resolve_per_width_and_model():
    from hf_kvcache.caches.quantized import MEASURED_DEFAULTS

    model = tiny_model("llama")
    for bits, options in MEASURED_DEFAULTS.items():
        cache = QuantizedKVCache(model, bits=bits)
        assert (cache.rotate, cache.sinks, cache.pre_rope) == (options["rotate"], options["sinks"], options["pre_rope"])
        assert cache.smooth == options["smooth"] and cache.scale_dtype == options["scale_dtype"]
        assert cache.residual_bits == options["residual_bits"]
        spec = "fp8" if bits == "fp8" else f"int{bits}"
        assert make_cache(spec, model).layers[0].codec.__class__ is cache.layers[0].codec.__class__
    kivi = make_cache("int2:rotate=none:sinks=0:pre_rope=false", model)
    assert (kivi.rotate, kivi.sinks, kivi.pre_rope, kivi.smooth) == (None, 0, False, 0.0)  # nothing rotated to smooth
    assert kivi.scale_dtype is None and "scale_dtype" not in repr(kivi)  # 16-bit scales without a rotation
    assert make_cache("int2:scale_dtype=none", model).scale_dtype is None
    # a full-precision residual by default ("auto"), int8 when asked
    assert kivi.residual_bits is None and make_cache("int2:residual_bits=8", model).residual_bits == 8
    assert "residual_bits=8" in repr(make_cache("int2:residual_bits=8", model)) and "residual_bits" not in repr(kivi)
    # "auto" smooths 2-bit keys, layer by layer: not 3-bit keys beside 2-bit values, nor int8 boundary layers
    assert make_cache("int2:key_bits=3", model).smooth == 0 and make_cache("int3:key_bits=2", model).smooth == 1
    widths = QuantizedKVCache(model, bits=2, key_bits=(3, 2))
    assert widths.smooth == "auto" and [widths.layer_smooth(i) for i in range(2)] == [0.0, 1.0]
    assert "smooth='auto'" in repr(widths)
    # "auto" leaves pre-RoPE quantization off where the model has no RoPE; True is refused there.
    assert QuantizedKVCache(tiny_model("gpt2"), bits=2, pre_rope="auto").pre_rope is False
    with pytest.raises(ValueError, match="sinks must be an integer >= 0 or 'auto'"):
        QuantizedKVCache(model, bits=2, sinks="some")


def test_three_bit_head_widths_must_fill_whole_bytes():
    """3-bit codes pack 8 to 3 bytes: a head width that is not a multiple of 8 is refused by name."""
    with pytest.raises(ValueError, match=r"3-bit codes pack 8 per whole bytes: head widths \[12\] must be multiples"):
        QuantizedKVCache(_config(head_dim=12), bits=3, group_size=4)


@pytest.mark.parametrize(
    "spec, dtype, magnitude",
    [("int8", torch.float16, 6e4), ("int4", torch.float16, 3e4), ("int3", torch.float16, 3e4),
     ("int2", torch.float16, 3e4), ("int2:rotate=none:sinks=0:pre_rope=false", torch.float16, 6e4),
     ("int4:rotate=none:sinks=0", torch.float16, 6e4), ("int4:rotate=none:scale_dtype=float16", torch.bfloat16, 1e5)],
    ids=["int8-fp16", "int4-fp16", "int3-fp16", "int2-fp16", "int2-kivi-fp16", "int4-kivi-fp16",
         "int4-fp16-scales-bf16"],
)  # fmt: skip
@pytest.mark.parametrize("attn", ["sdpa", "hf_kvcache"])
def test_values_at_the_edge_of_the_16_bit_range_stay_finite(spec, dtype, magnitude, attn):
    """K/V up to float16's limits (and float16 scales under bfloat16 K/V past them) read back finite on both attention
    paths: dequantized in float32, rotated in float32 (rotated codes get bfloat16 scales), scales that would not fit
    their dtype saturate (the group's extremes clipped), never inf or NaN."""
    from hf_kvcache.formats import decode_attention
    from hf_kvcache.prefill import store_prefill

    config = LlamaConfig(
        num_hidden_layers=1, hidden_size=128, num_attention_heads=2, num_key_value_heads=1, head_dim=64
    )
    g = torch.Generator().manual_seed(0)
    k, v = ((torch.rand(1, 1, 300, 64, generator=g) * 2 - 1) * magnitude for _ in range(2))
    cache = store_prefill(make_cache(spec, config), [(k.to(dtype), v.to(dtype))])
    config._attn_implementation = attn
    keys, values = cache.update(torch.zeros(1, 1, 1, 64, dtype=dtype), torch.zeros(1, 1, 1, 64, dtype=dtype), 0)
    if attn == "sdpa":
        assert torch.isfinite(keys).all() and torch.isfinite(values).all()
        clipped = max(0.0, 1 - float(torch.finfo(torch.float16).max) / magnitude)  # float16 scales of 1e5 values
        step = 2 / ((1 << int(spec[3])) - 1)  # a KIVI step over the range [-1, 1] (int8's is far finer)
        error = float((values[:, :, :300].float() - v).abs().max()) / magnitude
        assert error <= max(2 * step, step / 2 + clipped + 0.01)  # rotated codes spread a step over a block
    else:
        out = decode_attention(torch.randn(1, 2, 1, 64, generator=g).to(dtype) * 1e-2, keys, None, 0.125)
        assert torch.isfinite(out).all()


def test_boundary_layers_store_int8_as_bits_8_does():
    """The first and last ``boundary_layers`` layers hold what a ``bits=8`` cache's layers hold (bytes, codes), the
    others what the ``bits`` cache holds; ``bytes_per_token`` and ``plan`` count each layer's own layout."""
    from hf_kvcache.plan import kv_bytes

    config = _config(layers=6)
    k, v = _kv(300)
    mixed = QuantizedKVCache(config, bits=2, boundary_layers=2)
    int8, int2 = QuantizedKVCache(config, bits=8), QuantizedKVCache(config, bits=2)
    for cache in (mixed, int8, int2):
        _feed(cache, k, v, (200, 1, 1))
    assert [mixed.is_boundary(i) for i in range(6)] == [True, True, False, False, True, True]
    for i, layer in enumerate(mixed.layers):
        same = int8.layers[i] if mixed.is_boundary(i) else int2.layers[i]
        assert type(layer.codec) is type(same.codec) and layer.residual_length == same.residual_length
        assert layer.nbytes == same.nbytes and layer.stored_tokens == same.stored_tokens
    # the next token's keys handed to attention: a boundary layer's are int8's, bit for bit
    step = k[:, :, 202:203], v[:, :, 202:203]
    assert torch.equal(mixed.layers[0].update(*step)[0], int8.layers[0].update(*step)[0])
    assert torch.equal(mixed.layers[2].update(*step)[0], int2.layers[2].update(*step)[0])
    per_layer = {8: int8.bytes_per_token() / 6, 2: int2.bytes_per_token() / 6}
    assert mixed.bytes_per_token() == pytest.approx(4 * per_layer[8] + 2 * per_layer[2])
    planned = {s: kv_bytes(s, config, tokens=4096) for s in ("int8", "int2", "int2:boundary_layers=2")}
    assert planned["int2:boundary_layers=2"] == pytest.approx((4 * planned["int8"] + 2 * planned["int2"]) / 6, abs=6)
    assert "boundary_layers=2" in repr(mixed)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(bits=8, boundary_layers=1), "boundary_layers applies to the 4/3/2-bit kinds"),
        (dict(bits=2, boundary_layers=-1), "boundary_layers must be an integer >= 0, got -1"),
        (dict(bits=2, boundary_layers=True), "boundary_layers must be an integer, got True"),
        (dict(bits=4, boundary_layers=2), "leaving none at 4 bits: use at most 1, or bits=8"),
    ],
)
def test_boundary_layers_refusals(kwargs, match):
    with pytest.raises(ValueError, match=match):
        QuantizedKVCache(_config(layers=4), **kwargs)
    with pytest.raises(ValueError, match="cache kind 'fp8' has no option boundary_layers"):
        make_cache("fp8:boundary_layers=1", _config(layers=4))


def test_key_bits_store_keys_and_values_at_their_own_widths():
    """``bits=2, key_bits=4``: keys stored and read as a 4-bit cache stores them, values as a 2-bit cache's, bit for
    bit (keys and values are encoded apart; the options follow ``bits``); bytes, ``bytes_per_token`` and ``plan``
    count each width."""
    from hf_kvcache.plan import kv_bytes

    config = _config(layers=2)
    k, v = _kv(300)
    int2_options = dict(rotate="hadamard", sinks=4, pre_rope=True, scale_dtype="e5m3")  # int2's, which key_bits keeps
    mixed = QuantizedKVCache(config, bits=2, key_bits=4)
    keys4, values2 = QuantizedKVCache(config, bits=4, **int2_options), QuantizedKVCache(config, bits=2, smooth=0)
    for cache in (mixed, keys4, values2):
        _feed(cache, k, v, (200, 1, 1))
    assert (mixed.key_bits, mixed.bits, mixed.rotate, mixed.sinks, mixed.pre_rope) == (4, 2, "hadamard", 4, True)
    assert mixed.smooth == 0  # "auto" smooths 2-bit keys only
    stored, want_k, want_v = (c.layers[1].store.views() for c in (mixed, keys4, values2))
    assert stored["k"].shape[-1] == 16 * 4 // 8 and stored["v"].shape[-1] == 16 * 2 // 8
    for name in ("k", "ks", "kz"):
        assert torch.equal(stored[name], want_k[name]), name
    for name in ("v", "vs", "vz"):
        assert torch.equal(stored[name], want_v[name]), name
    step = k[:, :, 202:203], v[:, :, 202:203]
    got, four, two = (c.layers[1].update(*step) for c in (mixed, keys4, values2))
    assert torch.equal(got[0], four[0]) and torch.equal(got[1], two[1])
    assert mixed.bytes_per_token() == pytest.approx((keys4.bytes_per_token() + values2.bytes_per_token()) / 2)
    assert mixed.nbytes == (keys4.nbytes + values2.nbytes) // 2
    planned = {
        s: kv_bytes(s, config, tokens=4096)
        for s in ("int4:rotate=hadamard:sinks=4:pre_rope=true:scale_dtype=e5m3", "int2:smooth=0")
    }
    assert kv_bytes("int2:key_bits=4", config, tokens=4096) == pytest.approx(sum(planned.values()) / 2, abs=2)
    assert "key_bits=4" in repr(mixed) and "key_bits" not in repr(values2)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(bits=2, key_bits=8), r"key_bits must be one of 4, 3, 2 \(or one per layer\), got 8"),
        (dict(bits=2, key_bits="4"), r"key_bits: no file '4' \(key_bits takes a width, 4, 3 or 2"),
        (dict(bits=8, key_bits=4), "key_bits applies to the 4/3/2-bit kinds"),
        (dict(bits=2, key_bits=3, head_dim=12), r"3-bit codes pack 8 per whole bytes: head widths \[12\]"),
    ],
)
def test_key_bits_refusals(kwargs, match):
    head_dim = kwargs.pop("head_dim", 16)
    with pytest.raises(ValueError, match=match):
        QuantizedKVCache(_config(head_dim=head_dim), group_size=4, **kwargs)
    with pytest.raises(ValueError, match="cache kind 'fp8' has no option key_bits"):
        make_cache("fp8:key_bits=4", _config())


def _int8_round_trip(x: torch.Tensor, rotate: str | None = None) -> torch.Tensor:
    codec = codec_for(8, rotate=rotate)
    out = torch.empty_like(x), torch.empty_like(x)
    codec.decode(codec.encode(x, x), *out)
    return out[0]


@pytest.mark.parametrize("rotate", [None, "hadamard"])
def test_residual_bits_8_holds_the_residual_in_int8(rotate, monkeypatch):
    """``residual_bits=8``: the residual holds int8 codes (``bits=8``'s, Hadamard-rotated where the codes are), so
    the cache is exactly a full-precision-residual cache fed int8-rounded tokens wherever they passed through the
    residual (codes, residual and what attention reads); a prefill's tokens encoded straight away are encoded exact;
    a later forward reads its own new tokens int8-rounded, as the residual holds them; ``nbytes`` counts int8's
    bytes for the residual. In torch: the CPU kernel's rotated decode equals it to float32 rounding
    (tests/test_cpu_native.py), not bit for bit."""
    monkeypatch.setattr(cpu_native, "NATIVE_CPU", "never")
    config = _config(layers=2)
    k, v = _kv(203)
    options = dict(
        bits=2, sinks=0, residual_length=24, group_size=8, smooth=0, rotate=rotate
    )  # nbytes: codes, residual
    coded, plain = (QuantizedKVCache(config, residual_bits=bits, **options) for bits in (8, None))
    steps = (150,) + (1,) * 52
    _feed(coded, k[:, :, :202], v[:, :, :202], steps)
    # the 150-token prefill encodes its first (150 - 24) // 8 * 8 = 120 tokens as they are; every later token passes
    # through the residual (a forward of more tokens than the residual holds encodes its surplus as it is, too)
    rounded = [torch.cat([x[:, :, :120], _int8_round_trip(x[:, :, 120:202], rotate)], dim=2) for x in (k, v)]
    _feed(plain, *rounded, steps)
    layer, want = coded.layers[1], plain.layers[1]
    assert layer.residual.view("k").dtype == torch.int8 and layer.residual.length == want.residual.length > 24
    for name, t in want.store.views().items():
        assert torch.equal(layer.store.views()[name], t), name
    step = k[:, :, 202:203], v[:, :, 202:203]
    got, ref = layer.update(*step), want.update(*(_int8_round_trip(x, rotate) for x in step))
    assert torch.equal(got[0], ref[0]) and torch.equal(got[1], ref[1])
    assert torch.equal(got[0][:, :, -1:], _int8_round_trip(step[0], rotate))  # the new token, as the residual holds it
    residual = layer.residual.length
    int8_bytes = Int8Codec(None, torch.float32).bytes_per_token(2, 16, 16, torch.float32)
    assert layer.nbytes == layer.store.nbytes + residual * int8_bytes
    assert want.nbytes - layer.nbytes == residual * (2 * 2 * 16 * 4 - int8_bytes)
    assert "residual_bits=8" in repr(coded)


@pytest.mark.parametrize("rotate", [None, "hadamard"])
def test_an_int8_residual_encodes_a_decode_steps_tokens_once(rotate, monkeypatch):
    """A forward whose tokens only join an int8 residual stores them first and reads them back from it (what
    :func:`test_residual_bits_8_holds_the_residual_in_int8` checks it reads): no second encode just to read them."""
    config = _config(layers=1)
    cache = QuantizedKVCache(config, bits=2, residual_bits=8, sinks=0, residual_length=24, group_size=8, rotate=rotate)
    k, v = _kv(41)
    _feed(cache, k[:, :, :40], v[:, :, :40], (30,) + (1,) * 10)
    layer = cache.layers[0]

    def refused(*args):
        raise AssertionError("a token joining the residual was encoded a second time to be read")

    monkeypatch.setattr(layer.residual_codec, "encode", refused)
    keys, _ = layer.update(k[:, :, 40:41], v[:, :, 40:41])
    assert torch.equal(keys[:, :, -1:], _int8_round_trip(k[:, :, 40:41], rotate))


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(bits=2, residual_bits=4), "residual_bits must be one of 8, None, .auto., got 4"),
        (dict(bits=8, residual_bits=8), "residual_bits applies to the 4/3/2-bit kinds"),
    ],
)
def test_residual_bits_refusals(kwargs, match):
    with pytest.raises(ValueError, match=match):
        QuantizedKVCache(_config(), **kwargs)
    with pytest.raises(ValueError, match="cache kind 'int8' has no option residual_bits"):
        make_cache("int8:residual_bits=8", _config())


def test_lloyd_codebook_stores_the_nearest_level_in_the_same_bytes():
    """``codebook="lloyd"``: the same scales and zero points as the uniform grid, each code the index of its nearest
    Lloyd-Max level; what attention reads is those levels (under sdpa from the decoded workspace, under hf_kvcache
    from the codes in place), closer to normally distributed K/V than the uniform grid's; the bytes are the same."""
    from hf_kvcache.plan import kv_bytes

    config = _config(layers=2)
    k, v = _kv(300)
    options = dict(bits=2, group_size=16, residual_length=16, **KIVI)
    lloyd, uniform = QuantizedKVCache(config, codebook="lloyd", **options), QuantizedKVCache(config, **options)
    for cache in (lloyd, uniform):
        _feed(cache, k[:, :, :299], v[:, :, :299], (200, 1, 98))
    stored, plain = lloyd.layers[1].store.views(), uniform.layers[1].store.views()
    for name in ("ks", "kz", "vs", "vz"):
        assert torch.equal(stored[name], plain[name]), name
    assert not torch.equal(stored["k"], plain["k"]) and not torch.equal(stored["v"], plain["v"])
    step = k[:, :, 299:], v[:, :, 299:]
    read, read_uniform = lloyd.layers[1].update(*step), uniform.layers[1].update(*step)
    quantized = read[0].shape[2] - lloyd.layers[1].residual.length
    errors = [(r[0][:, :, :quantized] - k[:, :, :quantized]).pow(2).mean() for r in (read, read_uniform)]
    assert errors[0] < 0.8 * errors[1]
    levels = quant.codebook_levels(2, 16)
    codec = lloyd.layers[1].codec
    want = torch.empty_like(read[1][:, :, :quantized]), torch.empty_like(read[1][:, :, :quantized])
    codec.decode(stored, *want)
    assert torch.equal(read[1][:, :, :quantized], want[1])
    scale, zero = stored["vs"][0, 0, 0, 0], stored["vz"][0, 0, 0, 0]  # the first token's one value group (16 channels)
    assert set(((want[1][0, 0, 0] - zero) / scale).round(decimals=3).tolist()) <= set(levels.tolist())
    assert lloyd.nbytes == uniform.nbytes and lloyd.bytes_per_token() == uniform.bytes_per_token()
    assert kv_bytes("int2:codebook=lloyd", config, tokens=4096) == kv_bytes("int2", config, tokens=4096)
    assert "codebook='lloyd'" in repr(lloyd) and "codebook" not in repr(uniform)
    assert make_cache("int3:codebook=lloyd", config).codebook == "lloyd"


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(bits=2, codebook="nf4"), "codebook must be one of 'uniform', 'lloyd', got 'nf4'"),
        (dict(bits=8, codebook="lloyd"), "codebook applies to the 4/3/2-bit kinds"),
        (dict(bits="fp8", codebook="lloyd"), "codebook applies to the 4/3/2-bit kinds"),
    ],
)
def test_codebook_refusals(kwargs, match):
    with pytest.raises(ValueError, match=match):
        QuantizedKVCache(_config(), **kwargs)
    with pytest.raises(ValueError, match="cache kind 'int8' has no option codebook"):
        make_cache("int8:codebook=lloyd", _config())


def test_smooth_stores_scaled_keys_and_reads_them_back():
    """``smooth``: each layer's first encode measures per-pair scales ``(E[k^2] / Var k) ** (smooth / 4)`` (a RoPE
    pair's two channels share one, geometric mean 1 per head) and stores ``k * s``; reads divide. A channel with a
    large offset and little spread before RoPE, what a query reads most, gets the largest scale and loses less to
    the rotation's mixing: scores along it err less than without smoothing, for the same bytes (and the scales' own
    float32 tensor)."""
    from hf_kvcache.plan import kv_bytes
    from hf_kvcache.rope import rotate_positions

    config = _config(head_dim=32, layers=1)
    pre, v = _kv(300, head_dim=32, seed=3)
    pre[..., 6] = 40.0 + 0.05 * pre[..., 6]  # an offset channel before RoPE; its pair is channel 22 (rotate_half)
    options = dict(bits=2, group_size=16, residual_length=16, sinks=0)
    smooth, plain = QuantizedKVCache(config, smooth=1, **options), QuantizedKVCache(config, smooth=0, **options)
    k = rotate_positions(pre, 0, smooth.key_ropes["full_attention"])  # what the model hands the cache
    reads = [_feed(cache, k[:, :, :299], v[:, :, :299], (200, 1, 98)) for cache in (smooth, plain)]
    scale = smooth.layers[0].key_scale
    assert scale.shape == (1, 2, 32) and scale.dtype == torch.float32 and plain.layers[0].key_scale is None
    scale = scale[0]  # the one row's
    assert torch.equal(scale[:, :16], scale[:, 16:])  # one scale per RoPE pair: it commutes with RoPE
    torch.testing.assert_close(scale.log().mean(-1), torch.zeros(2), atol=1e-5, rtol=0)
    assert (scale.argmax(-1) % 16 == 6).all() and (scale.max(-1).values > 2).all()
    quantized = smooth.layers[0].quantized_tokens
    assert quantized == plain.layers[0].quantized_tokens > 0
    errors = []  # on the offset pair after RoPE (its energy is the same at every angle)
    for read in reads:
        got = torch.stack([read[0][..., :quantized, 6], read[0][..., :quantized, 22]], -1)
        want = torch.stack([k[..., :quantized, 6], k[..., :quantized, 22]], -1)
        errors.append((got - want).pow(2).mean())
    assert errors[0] < 0.5 * errors[1], errors
    assert smooth.nbytes == plain.nbytes + 2 * scale.nbytes  # the scales and their inverses (float32 K/V here)
    for batch in (1, 3):  # every row its own scales
        with_scales, without = (kv_bytes(f"int2:smooth={s}", config, 4096, batch) for s in (1, 0))
        assert with_scales == without + batch * 2 * 32 * 6
    assert "smooth=1.0" in repr(smooth) and "smooth" not in repr(plain)
    assert make_cache("int3:smooth=0.5", config).smooth == 0.5
    smooth.reset()
    assert smooth.layers[0].key_scale is None  # a reset cache measures its next prompt's keys anew


@pytest.mark.parametrize("residual_bits", [None, 8])
def test_smoothing_scales_are_measured_on_every_token_the_layer_holds_at_its_first_encode(residual_bits):
    """A row's scales come from the chunk a layer first encodes and the residual's tokens after it: a prompt's
    every token, and for a short prompt, the residual and the group a decode step encodes (32 tokens here, not the
    16 encoded), whether the residual holds them exactly or in int8 (then as it decodes them)."""
    from hf_kvcache.formats.scaled import smoothing_scales
    from hf_kvcache.rope import rotate_positions

    config = _config(head_dim=32, layers=1)
    pre, v = _kv(200, head_dim=32, seed=3)
    pre[..., 6] = 40.0 + 0.05 * pre[..., 6]
    options = dict(bits=2, group_size=16, residual_length=16, sinks=0, smooth=1, residual_bits=residual_bits)
    rope = QuantizedKVCache(config, **options).key_ropes["full_attention"]
    k = rotate_positions(pre, 0, rope)
    tolerance = dict(rtol=1e-4, atol=1e-5) if residual_bits is None else dict(rtol=2e-2, atol=2e-2)
    prompt = QuantizedKVCache(config, **options)
    _feed(prompt, k, v)
    assert prompt.layers[0].quantized_tokens == 176
    torch.testing.assert_close(prompt.layers[0].key_scale, smoothing_scales(pre, 1.0, rope), **tolerance)
    decoded = QuantizedKVCache(config, **options)
    _feed(decoded, k[:, :, :40], v[:, :, :40], (10,) + (1,) * 30)
    assert decoded.layers[0].quantized_tokens == 16  # the first group left when the layer held 32 tokens
    held = smoothing_scales(pre[:, :, :32], 1.0, rope)
    torch.testing.assert_close(decoded.layers[0].key_scale, held, **tolerance)
    assert not torch.allclose(held, smoothing_scales(pre[:, :, :16], 1.0, rope), rtol=1e-2, atol=1e-2)


def _offset_keys(tokens, channel, seed, head_dim=32):
    """Keys before RoPE with an offset channel (its RoPE pair's scale the largest), turned as the model hands them."""
    from hf_kvcache.rope import rotate_positions

    pre, v = _kv(tokens, head_dim=head_dim, seed=seed)
    pre[..., channel] = 40.0 + 0.05 * pre[..., channel]
    config = _config(head_dim=head_dim, layers=1)
    return rotate_positions(pre, 0, QuantizedKVCache(config, bits=2).key_ropes["full_attention"]), v


SMOOTHED = dict(bits=2, group_size=16, residual_length=16, sinks=4, smooth=1)


def test_smoothed_keys_scales_are_each_rows_own():
    """A row's scales are measured on its own keys: in a batch, each row stores (and reads back) what it stores
    alone, whatever the rows beside it hold (pooled scales would move row 0's with row 1's offset channel); the
    batch-axis operations carry each row's scales with it."""
    config = _config(head_dim=32, layers=1)
    rows = [_offset_keys(216, channel, seed) for channel, seed in ((6, 3), (3, 4))]
    k, v = torch.cat([r[0] for r in rows]), torch.cat([r[1] for r in rows])
    chunks = (200, 1, 15)
    batch = QuantizedKVCache(config, **SMOOTHED)
    read = _feed(batch, k, v, chunks)
    for i, (ki, vi) in enumerate(rows):
        alone = QuantizedKVCache(config, **SMOOTHED)
        own = _feed(alone, ki, vi, chunks)
        assert torch.equal(batch.layers[0].key_scale[i], alone.layers[0].key_scale[0])
        torch.testing.assert_close(read[0][i], own[0][0], rtol=1e-5, atol=1e-5)
    scales = batch.layers[0].key_scale
    assert (scales[0].argmax(-1) % 16 == 6).all() and (scales[1].argmax(-1) % 16 == 3).all()
    plain = QuantizedKVCache(config, **{**SMOOTHED, "smooth": 0})
    _feed(plain, k, v, chunks)
    assert batch.nbytes == plain.nbytes + 2 * 2 * 2 * 32 * 4  # per row: a (heads, head_dim) tensor and its inverse
    batch.reorder_cache(torch.tensor([1, 0]))
    assert torch.equal(batch.layers[0].key_scale, scales.flip(0))
    batch.batch_select_indices(torch.tensor([1]))
    assert torch.equal(batch.layers[0].key_scale, scales[:1])
    batch.batch_repeat_interleave(2)
    assert batch.layers[0].key_scale.shape == (2, 2, 32) and torch.equal(batch.layers[0].query_scale[1],
                                                                            scales[0].reciprocal())  # fmt: skip


@pytest.mark.parametrize("family", ["llama", "gpt2"])  # keys smoothed before RoPE, and a model without RoPE
def test_an_int2_row_generates_in_a_batch_what_it_generates_alone(family):
    """Through ``generate``, int2's smoothed keys (its default) give each row of an unpadded batch the logits it
    gets alone, to float rounding (scales pooled over the batch moved them by ~3e-4 here)."""
    torch.set_num_threads(1)
    model = tiny_model(family)
    ids = torch.randint(3, VOCAB, (2, 60), generator=torch.Generator().manual_seed(0))

    def logits(rows: torch.Tensor) -> torch.Tensor:
        cache = make_cache("int2:residual_length=8:group_size=16", model)
        assert cache.smooth == 1
        out = model.generate(rows, attention_mask=torch.ones_like(rows), past_key_values=cache, max_new_tokens=12,
                             do_sample=False, output_logits=True, return_dict_in_generate=True)  # fmt: skip
        return torch.stack(out.logits, 1)

    together = logits(ids)
    for i in range(2):
        torch.testing.assert_close(together[i], logits(ids[i : i + 1])[0], rtol=0, atol=1e-5)


def test_a_padded_rows_scales_leave_its_padding_out_and_wait_for_its_own_tokens():
    """Left padding never enters a row's statistics: a row padded by whole key groups gets the scales it gets
    alone (its real tokens are the same ones; pre-RoPE keys only turn by the padding's angle, which a RoPE pair's
    statistics do not see). A short row whose padding fills the first encoded chunk keeps scales of 1 (its codes
    are padding, never read) until a chunk brings its own tokens; then it gets scales of its own, and the other
    rows keep theirs."""
    config = _config(head_dim=32, layers=1)
    (ka, va), (kb, vb) = _offset_keys(240, 6, 3), _offset_keys(240, 3, 4)
    pad = 32
    garbage = torch.full((1, 2, pad, 32), 1e3)  # row 1: the first 176 tokens after 32 of padding
    kb_padded, vb_padded = (
        torch.cat([garbage, kb[:, :, : 208 - pad]], 2),
        torch.cat([garbage, vb[:, :, : 208 - pad]], 2),
    )
    mask = torch.ones(2, 208, dtype=torch.long)
    mask[1, :pad] = 0
    batch = QuantizedKVCache(config, **SMOOTHED)
    batch.padding.observe(mask)
    _feed(batch, torch.cat([ka[:, :, :208], kb_padded]), torch.cat([va[:, :, :208], vb_padded]))
    alone = QuantizedKVCache(config, **SMOOTHED)
    _feed(alone, kb[:, :, : 208 - pad], vb[:, :, : 208 - pad])
    torch.testing.assert_close(batch.layers[0].key_scale[1], alone.layers[0].key_scale[0], rtol=1e-4, atol=1e-5)

    short = QuantizedKVCache(config, **SMOOTHED)  # row 1: 12 tokens beside row 0's 200
    mask = torch.ones(2, 200, dtype=torch.long)
    mask[1, :188] = 0
    short.padding.observe(mask)
    k, v = torch.cat([ka, kb]), torch.cat([va, vb])
    _feed(short, k[:, :, :200], v[:, :, :200])  # encodes positions 0 .. 175: row 1's padding only
    layer = short.layers[0]
    assert layer.quantized_tokens == 176 and torch.equal(layer.key_scale[1], torch.ones(2, 32))
    first = layer.key_scale[0].clone()
    _feed(short, k[:, :, 200:208], v[:, :, 200:208], (1,) * 8)  # positions 176 .. 191: padding, then its 4 sinks
    assert layer.quantized_tokens == 192 and torch.equal(layer.key_scale[1], torch.ones(2, 32))
    _feed(short, k[:, :, 208:224], v[:, :, 208:224], (1,) * 16)  # 192 .. 207: its first ordinary tokens
    assert layer.quantized_tokens == 208 and torch.equal(layer.key_scale[0], first)
    assert (layer.key_scale[1].argmax(-1) % 16 == 3).all()


@pytest.mark.parametrize("spec", ["int4", "int3:sinks=0", "int2:sinks=0:smooth=0"])
def test_what_padding_holds_never_moves_a_real_tokens_codes(spec):
    """Without sinks too, a row's left padding never sets the range of a key group it shares with the row's own
    tokens (it is never read): the stored keys and values of the real tokens are the same to the bit whatever the
    padding's positions hold (a pad token's keys can be anything; here +-1e3)."""
    config = _config(head_dim=32, layers=1)
    k, v = _kv(200, head_dim=32, batch=2, seed=5)
    mask = torch.ones(2, 200, dtype=torch.long)
    mask[1, :37] = 0  # not a whole number of 16-token groups: row 1's first group holds padding and its own tokens
    reads = []
    for fill in (1e3, -1e3):
        padded_k, padded_v = k.clone(), v.clone()
        padded_k[1, :, :37], padded_v[1, :, :37] = fill, fill
        cache = make_cache(f"{spec}:group_size=16:residual_length=16", config)
        cache.padding.observe(mask)
        reads.append(_feed(cache, padded_k, padded_v, (180, 1, 19)))
        assert cache.layers[0].quantized_tokens == 176
    for got, other in zip(*reads):
        assert torch.equal(got[:, :, 37:], other[:, :, 37:]) and torch.equal(got[0], other[0])


def test_smoothing_scales_do_not_depend_on_the_layout_and_stay_finite():
    """The scales are the same bit for bit for a tensor and its transposed copy (a forward's keys are a view, a
    handed-over prefill's contiguous: both must store the same codes) and, row by row, for each row alone; finite,
    with a geometric mean of 1, for a constant channel (no spread), non-finite keys and a head of nothing finite."""
    from hf_kvcache.formats.scaled import smoothing_scales
    from tests.models import rotary

    k = torch.randn(2, 12, 3, 64).transpose(1, 2)  # (B, H, T, D) as a view
    for rope in (None, rotary(64), rotary(64, "interleaved"), rotary(64, "partial")):
        scales = smoothing_scales(k, 0.5, rope)
        assert scales.shape == (2, 3, 64) and torch.equal(scales, smoothing_scales(k.contiguous(), 0.5, rope))
        assert torch.equal(scales[1], smoothing_scales(k[1:], 0.5, rope)[0])
    interleaved = smoothing_scales(k, 1.0, rotary(64, "interleaved"))
    assert torch.equal(interleaved[..., 0::2], interleaved[..., 1::2])
    partial_rope = smoothing_scales(k, 1.0, rotary(64, "partial"))  # channels 32.. pass through: each its own
    assert torch.equal(partial_rope[..., :16], partial_rope[..., 16:32])
    odd = k.clone()
    odd[..., 0] = 5.0  # constant
    odd[0, 0, 0, 1] = float("inf")
    odd[:, 2] = float("nan")  # head 2: nothing finite
    scales = smoothing_scales(odd, 2.0)
    assert torch.isfinite(scales).all()
    torch.testing.assert_close(scales.log().mean(-1), torch.zeros(2, 3), atol=1e-5, rtol=0)
    assert torch.equal(scales[:, 2], torch.ones(2, 64))


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(bits=2, smooth=-0.5), "smooth must be a number from 0 \\(off\\) to 2.0 or 'auto', got -0.5"),
        (dict(bits=2, smooth=3), "smooth must be a number from 0 \\(off\\) to 2.0 or 'auto', got 3"),
        (dict(bits=2, smooth=True), "smooth must be a number"),
        (dict(bits=2, smooth="max"), "smooth must be a number"),
        (
            dict(bits=4, rotate=None, smooth=1),
            "smooth=1 scales the keys before the Hadamard rotation .* set rotate='hadamard'",
        ),
        (dict(bits=8, smooth=1), "smooth applies to the 4/3/2-bit kinds"),
        (dict(bits="fp8", smooth=1), "smooth applies to the 4/3/2-bit kinds"),
    ],
)
def test_smooth_refusals(kwargs, match):
    with pytest.raises(ValueError, match=match):
        QuantizedKVCache(_config(), **kwargs)
    with pytest.raises(ValueError, match="cache kind 'int8' has no option smooth"):
        make_cache("int8:smooth=1", _config())

"""Per-layer key widths: ``QuantizedKVCache(key_bits=[...] | file)``, the widths file, the search
(:func:`hf_kvcache.calibrate.search_key_bits`) and ``hf-kvcache calibrate``."""

from __future__ import annotations

import functools
import itertools
import json

import pytest
import torch
from models import prompt, tiny_model
from transformers import DynamicCache, LlamaConfig

from hf_kvcache import QuantizedKVCache, calibrate, make_cache
from hf_kvcache.calibrate import auto_key_bits, copy_rows, random_copy_rows, search_key_bits
from hf_kvcache.cli import main
from hf_kvcache.layer_widths import LayerKeyWidths
from hf_kvcache.plan import kv_bytes
from hf_kvcache.tools.tiny import tiny_llama


def _config(layers=3, head_dim=16):
    return LlamaConfig(
        vocab_size=64,
        hidden_size=4 * head_dim,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=head_dim,
        num_hidden_layers=layers,
        intermediate_size=64,
    )


def _feed(cache, k, v, chunks):
    start = 0
    for n in chunks:
        for layer_idx in range(len(cache.layers)):
            out = cache.update(k[:, :, start : start + n], v[:, :, start : start + n], layer_idx)
        start += n
    return out


def _widths(key_bits, sensitivity=(), elements=()) -> LayerKeyWidths:
    return LayerKeyWidths(key_bits=key_bits, bits=2, budget=2.5, sensitivity=sensitivity, key_elements=elements)


def test_each_layer_stores_its_keys_as_a_cache_of_its_width(tmp_path):
    """``key_bits=[2, 4, 3]``: layer i's stored keys and values and what it hands attention are, bit for bit, those
    of ``key_bits=w_i`` for every layer; bytes are the per-layer sum; a widths file and a spec give the same cache."""
    config = _config(layers=3)
    g = torch.Generator().manual_seed(0)
    k, v = torch.randn(1, 2, 300, 16, generator=g), torch.randn(1, 2, 300, 16, generator=g)
    widths = [2, 4, 3]
    mixed = QuantizedKVCache(config, bits=2, group_size=4, key_bits=widths)
    uniform = {w: QuantizedKVCache(config, bits=2, group_size=4, key_bits=w) for w in set(widths)}
    for cache in (mixed, *uniform.values()):
        _feed(cache, k, v, (200, 1, 1))
    assert mixed.key_bits == (2, 4, 3) and [mixed.layer_key_bits(i) for i in range(3)] == widths
    for i, w in enumerate(widths):
        got, want = mixed.layers[i].store.views(), uniform[w].layers[i].store.views()
        assert got.keys() == want.keys()
        for name in got:
            assert torch.equal(got[name], want[name]), (i, name)
        step = k[:, :, 202:203], v[:, :, 202:203]
        for a, b in zip(mixed.layers[i].update(*step), uniform[w].layers[i].update(*step)):
            assert torch.equal(a, b), i
    per_layer = [uniform[w].bytes_per_token() / 3 for w in widths]
    assert mixed.bytes_per_token() == pytest.approx(sum(per_layer))
    path = _widths(widths).save(tmp_path / "w.json")
    from_file = make_cache(f"int2:group_size=4:key_bits={path}", config)
    assert from_file.key_bits == mixed.key_bits and "key_bits=(2, 4, 3)" in repr(from_file)
    planned = {w: kv_bytes(f"int2:group_size=4:key_bits={w}", config, tokens=4096) / 3 for w in set(widths)}
    assert kv_bytes(f"int2:group_size=4:key_bits={path}", config, tokens=4096) == pytest.approx(
        sum(planned[w] for w in widths), abs=2
    )
    assert QuantizedKVCache(config, bits=2, key_bits=[3, 3, 3]).key_bits == 3  # all equal: one width


@pytest.mark.parametrize("attn", ["eager", "sdpa", "hf_kvcache"])
def test_generate_with_per_layer_key_widths(attn):
    """Greedy generation through a per-layer cache equals a run through the same cache rebuilt (deterministic), and
    under eager and hf_kvcache (each layer's codes read in place at its own width) gives sdpa's tokens on this tiny
    model, left-padded."""
    torch.set_num_threads(1)
    model = tiny_model("llama", attn)
    inputs = prompt("padded", length=40)
    n = len(model.model.layers)
    widths = [(2, 4, 3)[i % 3] for i in range(n)]
    spec = dict(bits=2, group_size=8, residual_length=8, key_bits=widths)
    outs = [
        model.generate(**inputs, past_key_values=QuantizedKVCache(model, **spec), max_new_tokens=12, do_sample=False)
        for _ in range(2)
    ]
    assert torch.equal(outs[0], outs[1])
    reference = tiny_model("llama", "sdpa")
    want = reference.generate(
        **inputs, past_key_values=QuantizedKVCache(reference, **spec), max_new_tokens=12, do_sample=False
    )
    assert torch.equal(outs[0], want)


@pytest.mark.parametrize(
    "key_bits, match",
    [
        ([2, 3], "key_bits gives 2 per-layer widths for a model of 3 decoder layers"),
        ([2, 3, 5], r"key_bits\[2\] must be one of 4, 3, 2, got 5"),
        ([2, 3.0, 2], r"key_bits\[1\] must be one of 4, 3, 2, got 3.0"),
        ([], "key_bits must be a non-empty sequence"),
        ("missing.json", "key_bits: no file 'missing.json'"),
        (8, "key_bits must be one of 4, 3, 2"),
    ],
)
def test_per_layer_key_bits_refusals(key_bits, match):
    with pytest.raises(ValueError, match=match):
        QuantizedKVCache(_config(layers=3), bits=2, group_size=4, key_bits=key_bits)


def test_widths_file_refusals(tmp_path):
    config = _config(layers=3)
    (tmp_path / "other.json").write_text(json.dumps({"key_bits": [2, 2, 2]}))
    (tmp_path / "broken.json").write_text("{")
    for name, match in (("other.json", "is not a per-layer key widths file"), ("broken.json", "is not JSON")):
        with pytest.raises(ValueError, match=match):
            QuantizedKVCache(config, bits=2, key_bits=str(tmp_path / name))
    with pytest.raises(ValueError, match="key_bits applies to the 4/3/2-bit kinds"):
        QuantizedKVCache(config, bits=8, key_bits=[2, 2, 2])
    four_layers = _widths((2, 3, 4, 2)).save(tmp_path / "four.json")
    with pytest.raises(ValueError, match="4 per-layer widths for a model of 3 decoder layers"):
        make_cache(f"int2:key_bits={four_layers}", config)


def test_widths_file_round_trip(tmp_path):
    record = _widths((2, 4, 3), sensitivity=({"2": 0.5, "3": 0.2, "4": 0.1},) * 3, elements=(32, 32, 32))
    assert LayerKeyWidths.load(record.save(tmp_path / "w.json")) == record


def test_with_budget_is_the_exact_optimum():
    """The knapsack's answer is the best of every assignment within the budget (brute force), for equal and
    unequal layer sizes, and never over the budget."""
    g = torch.Generator().manual_seed(3)
    for elements in ((64, 64, 64, 64, 64), (64, 128, 64, 32, 128)):
        sensitivity = []
        for _ in elements:  # losses that fall with width, with noise that can reverse a step
            two, three, four = sorted(torch.rand(3, generator=g).tolist(), reverse=True)
            sensitivity.append({"2": two, "3": three, "4": four})
        record = _widths((4,) * 5, tuple(sensitivity), elements)
        for budget in (2, 2.2, 2.5, 3, 3.7, 4):
            chosen = record.with_budget(budget).key_bits
            limit = budget * sum(elements) + 1e-6

            def loss(ws):
                return sum(row[str(w)] for row, w in zip(sensitivity, ws))

            feasible = [
                ws for ws in itertools.product((2, 3, 4), repeat=5) if sum(w * e for w, e in zip(ws, elements)) <= limit
            ]
            assert sum(w * e for w, e in zip(chosen, elements)) <= limit
            assert loss(chosen) == pytest.approx(min(loss(ws) for ws in feasible))
    with pytest.raises(ValueError, match="budget must be a number of bits between 2 and 4, got 5"):
        record.with_budget(5)
    with pytest.raises(ValueError, match="needs the measurements of a search"):
        _widths((2, 2)).with_budget(3)


def test_copy_rows_repeat_their_beginning():
    ids = torch.arange(1000)
    rows = copy_rows(ids, rows=3, tokens=100, scored_tokens=20)
    assert rows.shape == (3, 100)
    assert torch.equal(rows[1, :80], torch.arange(80, 160)) and torch.equal(rows[1, 80:], torch.arange(80, 100))
    with pytest.raises(ValueError, match="3 rows of 80 tokens of text need 240 tokens"):
        copy_rows(torch.arange(200), rows=3, tokens=100, scored_tokens=20)


def test_random_copy_rows_repeat_random_ids_of_the_vocabulary():
    rows = random_copy_rows(vocab_size=50, rows=2, tokens=40, scored_tokens=10, seed=3)
    assert rows.shape == (2, 40) and 0 <= int(rows.min()) and int(rows.max()) < 50
    assert torch.equal(rows[:, 30:], rows[:, :10]) and not torch.equal(rows[0], rows[1])
    assert torch.equal(rows, random_copy_rows(50, 2, 40, 10, seed=3))
    assert not torch.equal(rows, random_copy_rows(50, 2, 40, 10, seed=4))
    with pytest.raises(ValueError, match="tokens must be an integer >= 20"):
        random_copy_rows(50, 2, 19, 10)


def test_search_measures_each_layer_and_keeps_the_budget():
    """On a tiny model: the baseline is the all-widest cache's KL, each layer's row the KL with that layer alone at
    the narrower width (recomputed here from the caches), the widths are within the budget, and the saved record
    builds the cache; bad arguments are refused before any forward."""
    torch.set_num_threads(1)
    model = tiny_llama(head_dim=16, layers=3)
    ids = torch.randint(3, model.config.vocab_size, (2, 120), generator=torch.Generator().manual_seed(0))
    options = dict(group_size=8, residual_length=16)
    calls = []
    found = search_key_bits(model, ids, bits=2, budget=3, scored_tokens=24, progress=calls.append, **options)
    assert len(calls) == 1 + 3 * 2 and found.mean_bits <= 3 and len(found.key_bits) == 3
    assert (found.scored_tokens, found.calibration_tokens, found.key_elements) == (48, 240, (32, 32, 32))

    def kl(key_bits):
        with torch.no_grad():
            ref = DynamicCache()
            model(input_ids=ids[:, :96], past_key_values=ref)
            want = torch.log_softmax(model(input_ids=ids[:, 96:], past_key_values=ref).logits, -1)
            cache = QuantizedKVCache(model, bits=2, key_bits=key_bits, **options)
            model(input_ids=ids[:, :96], past_key_values=cache)
            got = torch.log_softmax(model(input_ids=ids[:, 96:], past_key_values=cache).logits, -1)
        return (want.exp() * (want - got)).sum(-1).mean().item()

    assert found.baseline == pytest.approx(kl([4, 4, 4]), rel=1e-4, abs=1e-9)
    assert found.sensitivity[1]["2"] == pytest.approx(kl([4, 2, 4]), rel=1e-4, abs=1e-9)
    assert found == found.with_budget(3)  # the widths are the knapsack's over the measurements
    for kwargs, match in (
        (dict(budget=5), "budget must be a number of bits between 2 and 4"),
        (dict(bits=8), "bits must be one of 4, 3, 2"),
        (dict(scored_tokens=110), "leave nothing quantized"),
        (dict(key_bits=3), "key_bits sets layers' key widths, which the search chooses"),
        (dict(boundary_layers=1), "boundary_layers sets layers' key widths"),
    ):
        with pytest.raises(ValueError, match=match):
            search_key_bits(model, ids, **{"scored_tokens": 24, **options, **kwargs})


@pytest.mark.parametrize("family", ["llama", "gpt2", "gemma3"])
def test_search_replays_the_layers_before_the_one_it_narrows(family, monkeypatch):
    """Each configuration's forward runs the layers from the narrowed one on and replays the baseline's outputs
    before it: the measurements are those of a search that runs every layer, to the bit; a forward set on a layer
    instance is put back; a model where layers share keys and values runs every layer."""
    torch.set_num_threads(1)
    model = tiny_model(family)
    layers = calibrate._LayerReplay.of(model, model.config.num_hidden_layers).layers
    assert layers is not None and len(layers) == model.config.num_hidden_layers
    n = len(layers)
    ids = torch.randint(3, model.config.vocab_size, (2, 64), generator=torch.Generator().manual_seed(0))
    options = dict(group_size=8, residual_length=8)
    computed = []
    forward = type(layers[0]).forward

    def counted(self, *args, **kwargs):
        computed.append(layers.index(self))
        return forward(self, *args, **kwargs)

    monkeypatch.setattr(type(layers[0]), "forward", counted)
    wrapped = functools.partial(counted, layers[0])  # as accelerate's hooks set a module's forward
    layers[0].forward = wrapped
    with torch.no_grad():
        replayed = search_key_bits(model, ids, bits=2, budget=3, scored_tokens=16, **options)
        # the prefill, the exact forward and the baseline run every layer; layer i the configurations of layers <= i
        assert [computed.count(i) for i in range(n)] == [3 + 2 * (i + 1) for i in range(n)]
        assert layers[0].forward is wrapped and not any("forward" in layer.__dict__ for layer in layers[1:])
        computed.clear()
        model.config.num_kv_shared_layers = 1
        every = search_key_bits(model, ids, bits=2, budget=3, scored_tokens=16, **options)
        assert [computed.count(i) for i in range(n)] == [3 + 2 * n] * n
    assert replayed.sensitivity == every.sensitivity and replayed.baseline == every.baseline


def test_auto_widths_are_the_search_on_random_rows_kept_once_per_model_and_cache(tmp_path, monkeypatch):
    """``key_bits="auto"``: the widths are search_key_bits' on random_copy_rows (4 rows of the model's context, 128
    scored) under bits + 0.25; the record is kept under $HF_KVCACHE_CACHE and read back by the next cache (no search),
    through the class and the spec alike; another model's weights or another cache's options search again."""
    torch.set_num_threads(1)
    monkeypatch.setenv("HF_KVCACHE_CACHE", str(tmp_path))
    model = tiny_llama(head_dim=16, layers=4)
    model.config.max_position_embeddings = 384  # rows of the model's context where it is under 1,024 tokens
    rows = random_copy_rows(model.config.vocab_size, 4, 384, 128)
    want = search_key_bits(model, rows, bits=2, budget=2.25, scored_tokens=128, residual_length=16)
    calls = []
    found = auto_key_bits(model, 2, progress=calls.append, residual_length=16)
    assert len(calls) == 1 + 4 * 2 and found.calibration_rows == "random tokens"
    assert found.key_bits == want.key_bits and found.sensitivity == want.sensitivity and found.budget == 2.25
    (saved,) = (tmp_path / "key_bits").glob("*.json")
    assert LayerKeyWidths.load(saved) == found

    def no_search(*args, **kwargs):
        raise AssertionError("searched again")

    monkeypatch.setattr(calibrate, "search_key_bits", no_search)
    monkeypatch.setattr(calibrate, "_FOUND", {})  # a new process: only the file
    for cache in (
        QuantizedKVCache(model, bits=2, key_bits="auto", residual_length=16),
        make_cache("int2:key_bits=auto:residual_length=16", model),
    ):
        assert (
            cache.key_bits == QuantizedKVCache(model, bits=2, key_bits=list(want.key_bits), residual_length=16).key_bits
        )
    for other, options in ((tiny_llama(head_dim=16, layers=4, seed=1), {}), (model, {"residual_length": 32})):
        with pytest.raises(AssertionError, match="searched again"):
            auto_key_bits(other, 2, **{"residual_length": 16, **options})


def test_auto_widths_refusals(tmp_path, monkeypatch):
    torch.set_num_threads(1)
    model = tiny_llama(head_dim=16, layers=2)
    for kwargs, match in (
        (dict(bits=4), "bits must be 3 or 2, got 4"),
        (dict(bits=8), "key_bits applies to the 4/3/2-bit kinds"),
        (dict(bits=2, boundary_layers=1), "boundary_layers: key_bits='auto' chooses every layer's key width"),
    ):
        with pytest.raises(ValueError, match=match):
            QuantizedKVCache(model, key_bits="auto", **kwargs)
    with pytest.raises(ValueError, match="build the cache from the model"):
        make_cache("int2:key_bits=auto", model.config)
    with pytest.raises(ValueError, match="key_bits sets layers' key widths"):
        auto_key_bits(model, 2, key_bits=3)
    blocked = tmp_path / "file"
    blocked.write_text("")  # the cache folder's parent is a file: nothing can be kept, the widths still come back
    monkeypatch.setenv("HF_KVCACHE_CACHE", str(blocked))
    model.config.max_position_embeddings = 320
    with pytest.warns(UserWarning, match="could not keep the widths"):
        assert len(auto_key_bits(model, 3, residual_length=16).key_bits) == 2


def test_calibrate_cli_writes_a_widths_file_and_reuses_it(tmp_path, capsys):
    """``hf-kvcache calibrate`` on the embedded model writes a file a cache spec reads; ``--reuse`` re-chooses under
    another budget from the same measurements without a model; expected failures are one line, exit 2."""
    torch.set_num_threads(1)
    out = tmp_path / "w" / "key_bits.json"
    args = ["--model", "reference", "--threads", "1", "--quiet", "--rows", "1", "--tokens", "400"]
    assert main(["calibrate", *args, "--scored-tokens", "64", "--budget", "3", "--output", str(out)]) == 0
    printed = capsys.readouterr().out
    saved = LayerKeyWidths.load(out)
    assert saved.budget == 3 and saved.mean_bits <= 3 and f"use it as key_bits={out}" in printed
    assert "| layer | KL at 2 bits | KL at 3 bits | KL at 4 bits | key bits |" in printed
    config = json.loads((tmp_path / "w" / "key_bits.json").read_text())
    assert config["format"] == "hf_kvcache.key_bits/1" and len(config["sensitivity"]) == len(saved.key_bits)
    narrow = tmp_path / "narrow.json"
    assert main(["calibrate", "--reuse", str(out), "--budget", "2", "--output", str(narrow)]) == 0
    assert set(LayerKeyWidths.load(narrow).key_bits) == {2}
    assert LayerKeyWidths.load(narrow).sensitivity == saved.sensitivity
    capsys.readouterr()
    free = tmp_path / "random.json"  # from the model alone: rows of random token ids
    assert main(["calibrate", *args, "--scored-tokens", "64", "--random-tokens", "--output", str(free)]) == 0
    assert "(rows of random tokens)" in capsys.readouterr().out
    assert LayerKeyWidths.load(free).calibration_rows == "random tokens" and saved.calibration_rows == "text"
    for bad, message in (
        (["--random-tokens", "--dataset", "reference", "--output", "x.json"], "--random-tokens reads no text"),
        (["--budget", "2.5"], "--output: name the widths file to write"),
        (["--cache", "int8", "--output", "x.json"], "--cache must be an int4, int3 or int2 spec, got 'int8'"),
        (["--cache", "int2:key_bits=3", "--output", "x.json"], "key_bits sets layers' key widths"),
        (["--budget", "5", "--output", "x.json"], "--budget must be between 2 and 4 bits, got 5.0"),
        (["--reuse", "nope.json", "--output", "x.json"], "key_bits: no file 'nope.json'"),
    ):
        assert main(["calibrate", *bad]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and message in err, err

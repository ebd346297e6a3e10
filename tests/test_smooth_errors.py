"""benchmarks/smooth_errors.py (hf_kvcache.tools.smooth_errors): attention through smoothed, quantized keys against
exact keys, on the embedded reference model."""

from __future__ import annotations

import json

import torch
from transformers import DynamicCache

from hf_kvcache.models import load_reference_model
from hf_kvcache.tools import smooth_errors


def test_the_recorded_keys_are_what_a_cache_is_handed():
    """One entry per layer: post-RoPE queries of every query head, keys and values as a forward hands a cache; the
    model's attention is restored."""
    torch.set_num_threads(1)
    model, _ = load_reference_model()
    ids = torch.randint(0, model.config.vocab_size, (1, 40), generator=torch.Generator().manual_seed(0))
    before = model.config._attn_implementation
    seen = smooth_errors.record(model, ids)
    assert model.config._attn_implementation == before and len(seen) == model.config.num_hidden_layers
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(ids, past_key_values=cache)
    for (query, key, value), layer in zip(seen, cache.layers):
        assert query.shape == (model.config.num_attention_heads, 40, key.shape[-1])
        torch.testing.assert_close(key, layer.keys[0].float(), rtol=0, atol=0)
        torch.testing.assert_close(value, layer.values[0].float(), rtol=0, atol=0)


def test_errors_vanish_for_exact_keys_and_grow_with_fewer_bits(tmp_path, capsys):
    """The error measures are 0 for the exact keys and larger at 2 bits than at 4; scales of 1 read back what no
    scaling does; the CLI prints every scaling's row and writes the JSON."""
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(1)
    query, keys, value = (
        torch.randn(4, 140, 16, generator=g),
        torch.randn(2, 140, 16, generator=g),
        torch.randn(2, 140, 16, generator=g),
    )
    assert smooth_errors.attention_errors(query, keys, keys, value, 70) == (0.0, 0.0)
    ones = torch.ones(2, 16)
    coarse = smooth_errors.attention_errors(query, keys, smooth_errors.quantized_keys(keys, ones, 2, 16), value, 70)
    fine = smooth_errors.attention_errors(query, keys, smooth_errors.quantized_keys(keys, ones, 4, 16), value, 70)
    assert all(c > 4 * f > 0 for c, f in zip(coarse, fine))
    out = tmp_path / "errors.json"
    assert smooth_errors.main(["--tokens", "256", "--group", "16", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert set(result["scalings"]) == {"none", "keys 0.5", "keys 1", "keys 1.5", "keys 2", "queries"}
    assert all(row["kl"] > 0 and row["output_error"] > 0 for row in result["scalings"].values())
    assert "| queries |" in capsys.readouterr().out
    assert smooth_errors.main(["--tokens", "64"]) == 2
    assert "--tokens must hold two key groups" in capsys.readouterr().err

"""benchmarks/codebook_errors.py (hf_kvcache.tools.codebook_errors): each codebook's reconstruction of the K/V a cache
encodes, on the embedded reference model."""

from __future__ import annotations

import json

import torch

from hf_kvcache.models import load_reference_model
from hf_kvcache.tools import codebook_errors


def test_lloyd_levels_trade_the_extremes_for_the_mean(tmp_path, capsys):
    """What docs/caches/quantized.md explains the codebook's loss with: on the K/V an int2 cache stores (rotated,
    keys before RoPE), Lloyd-Max levels lower the mean squared error and raise the error of the elements furthest from
    their group's mean several times over, keys and values alike; the CLI prints the table and writes the JSON."""
    torch.set_num_threads(1)
    out = tmp_path / "errors.json"
    assert codebook_errors.main(["--tokens", "256", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["bits"] == 2 and result["encodes"] > 0 and set(result["codebooks"]) == {"uniform", "lloyd"}
    uniform, lloyd = result["codebooks"]["uniform"], result["codebooks"]["lloyd"]
    for part in ("keys", "values"):
        assert lloyd[part] < 0.8 * uniform[part], part
        assert lloyd[f"{part}_tail"] > 2 * uniform[f"{part}_tail"], part
    assert "| lloyd |" in capsys.readouterr().out


def test_the_recorded_kv_are_what_the_cache_encodes():
    """The recorder sees every token of every layer once (no residual), in the codec's groups, and leaves the codec as
    it found it."""
    model, tokenizer = load_reference_model()
    ids = torch.randint(0, model.config.vocab_size, (1, 128), generator=torch.Generator().manual_seed(0))
    encode_into = codebook_errors.kivi.KiviCodec.encode_into
    seen, bits, group = codebook_errors.stored_kv(model, ids, "int3")
    assert codebook_errors.kivi.KiviCodec.encode_into is encode_into
    assert bits == 3 and len(seen) == model.config.num_hidden_layers
    assert sum(k.shape[2] for k, _ in seen) == 128 * model.config.num_hidden_layers


def test_a_kind_without_kivi_codes_is_a_one_line_error(capsys):
    assert codebook_errors.main(["--spec", "int8", "--tokens", "16"]) == 2
    assert capsys.readouterr().err == "error: spec: one of the int4/int3/int2 kinds (KIVI codes), got 'int8'\n"

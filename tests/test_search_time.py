"""benchmarks/search_time.py (hf_kvcache.tools.search_time): key_bits="auto"'s search with the layer replay and
without, on the embedded reference model."""

from __future__ import annotations

import json

import torch

from hf_kvcache.tools import search_time


def test_both_searches_measure_the_same_and_bad_flags_are_one_line(tmp_path, capsys):
    torch.set_num_threads(1)
    out = tmp_path / "search.json"
    assert (
        search_time.main(["--cache", "int2:residual_length=16:group_size=16", "--rows", "1", "--json", str(out)]) == 0
    )
    result = json.loads(out.read_text())
    assert result["same_record"] and result["rows"][0] == 1 and len(result["key_bits"]) == 4
    assert result["seconds_replay"] > 0 and result["ratio"] == result["seconds_replay"] / result["seconds_every_layer"]
    assert "| every layer |" in capsys.readouterr().out
    for argv, message in ((["--cache", "int4"], "int2 or int3 spec"), (["--rows", "0"], "--rows must be >= 1")):
        assert search_time.main(argv) == 2
        assert message in capsys.readouterr().err

"""benchmarks/window_kl.py (hf_kvcache.tools.window_kl): each cache's next-token distributions against
DynamicCache's, on the embedded reference model."""

from __future__ import annotations

import json

import torch

from hf_kvcache.tools import window_kl


def test_exact_caches_measure_zero_and_coarser_ones_more(tmp_path, capsys):
    """A lossless cache is at 0 in every window; int2 moves the distributions further than int8; the CLI prints a
    row per cache and writes the JSON; bad flags are one line and exit code 2."""
    torch.set_num_threads(1)
    out = tmp_path / "kl.json"
    argv = ["--caches", "paged,int8,int2:residual_length=8:group_size=8", "--windows", "2", "--window", "96"]
    assert window_kl.main([*argv, "--prefill", "48", "--chunk", "8", "--json", str(out)]) == 0
    caches = json.loads(out.read_text())["caches"]
    assert caches["paged"]["windows"] == [0.0, 0.0]
    int8, int2 = caches["int8"]["kl"], caches["int2:residual_length=8:group_size=8"]["kl"]
    assert 0 < int8 < int2 and len(caches["int8"]["windows"]) == 2
    assert "| int8 |" in capsys.readouterr().out
    assert window_kl.main(["--caches", "int8", "--prefill", "2000"]) == 2
    assert "--prefill inside the window" in capsys.readouterr().err

"""benchmarks/saved_cache.py (hf_kvcache.tools.saved_cache): file bytes, save / load time and the loaded caches
continuing, on the embedded reference model."""

from __future__ import annotations

import json

import torch

from hf_kvcache.tools import saved_cache


def test_files_hold_what_the_caches_hold_and_loaded_caches_continue(tmp_path, capsys):
    """Every loaded cache continues with the saved one's tokens; a file is about its cache's nbytes (no allocation
    headroom, no free blocks of a paged pool), int8's under half of DynamicCache's; the CLI prints a row per cache and
    writes the JSON; bad flags are one line and exit code 2."""
    torch.set_num_threads(1)
    out = tmp_path / "saved.json"
    argv = ["--tokens", "200", "--caches", "int8,int2:residual_length=16:group_size=16,paged", "--new-tokens", "4"]
    assert saved_cache.main([*argv, "--json", str(out)]) == 0
    caches = json.loads(out.read_text())["caches"]
    assert list(caches) == ["dynamic", "int8", "int2:residual_length=16:group_size=16", "paged"]
    assert all(row["continues_alike"] for row in caches.values())
    for row in caches.values():  # pickle's own bytes aside
        assert row["nbytes"] <= row["file_bytes"] < 1.1 * row["nbytes"] + 20_000
    assert caches["int8"]["file_ratio"] < 0.5 and caches["dynamic"]["file_ratio"] == 1
    assert "| int8 |" in capsys.readouterr().out
    assert saved_cache.main(["--tokens", "1"]) == 2
    assert "--tokens must be >= 2" in capsys.readouterr().err

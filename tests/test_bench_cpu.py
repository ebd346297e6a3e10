"""The CPU benchmark (``benchmarks/bench_cpu.py``, :mod:`hf_kvcache.tools.bench_cpu`): its flags checked before the
model loads, and one tiny run of both protocols on the reference model with the tables it promises."""

from __future__ import annotations

import json

import pytest

from hf_kvcache.tools import bench_cpu


@pytest.mark.parametrize("decode", ["4096", "4096x0", "ax1", "1x2x3"])
def test_a_bad_decode_cell_is_one_line_naming_the_flag(decode, tmp_path, capsys):
    assert bench_cpu.main(["--output", str(tmp_path), "--decode", decode]) == 2
    out = capsys.readouterr().out.strip()
    assert "\n" not in out and out.startswith("bench_cpu: --decode must be CONTEXTxROWS cells") and repr(decode) in out


@pytest.mark.slow
def test_a_tiny_run_writes_both_protocols(tmp_path):
    argv = ["--output", str(tmp_path), "--model", "reference", "--decode", "128x1", "--steps", "2", "--windows", "1"]
    assert bench_cpu.main([*argv, "--rounds", "1", "--caches", "int8,int2"]) == 0
    results = json.loads((tmp_path / "bench-cpu.json").read_text())
    decoded = {(r["cache"], r["attn"]) for r in results["decode"]}
    assert decoded == {("dynamic", "sdpa"), *((c, a) for c in ("int8", "int2") for a in ("sdpa", "hf_kvcache"))}
    assert all(r["step_ms"] > 0 for r in results["decode"])
    chunks = {r["cache"]: r for r in results["chunks"]}
    assert set(chunks) == {"dynamic", "int8", "int2", "quanto int4", "hqq int4"}
    assert chunks["dynamic"]["x_dynamic_time"] == 1.0
    assert abs(chunks["int8"]["perplexity"] / chunks["dynamic"]["perplexity"] - 1) < 0.01  # int8's stated bound
    assert "Decode step (median):" in (tmp_path / "bench-cpu.md").read_text()

"""benchmarks/kivi_ablation.py: its fake quantizer, a short run end to end, the docs page against its saved output."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
from hf_kvcache.tools import kivi_ablation  # noqa: E402


@pytest.mark.parametrize("axis", ["token", "channel"])
def test_fake_quantize_groups_along_the_stated_axis(axis):
    torch.manual_seed(0)
    x = torch.randn(2, 3, 40, 16)
    # A constant along the grouped axis quantizes exactly (its min equals its max).
    dim = -1 if axis == "token" else 2
    flat = x.mean(dim=dim, keepdim=True).expand_as(x).contiguous()
    torch.testing.assert_close(kivi_ablation.fake_quantize(flat, 2, axis), flat, atol=1e-5, rtol=0)
    # Error per element is at most half a step of its group's range.
    for bits in (2, 4):
        out = kivi_ablation.fake_quantize(x, bits, axis)
        step = (x.amax(dim=dim, keepdim=True) - x.amin(dim=dim, keepdim=True)) / (2**bits - 1)
        assert ((out - x).abs() <= step / 2 + 1e-5).all()
    # The two axes are different groupings.
    assert not torch.allclose(kivi_ablation.fake_quantize(x, 2, "token"), kivi_ablation.fake_quantize(x, 2, "channel"))


def test_short_run_on_the_reference_model(tmp_path):
    torch.set_num_threads(1)
    out_file = tmp_path / "ablation.json"
    argv = ["--model", "reference", "--max-tokens", "256", "--context", "256", "--prefill", "32", "--threads", "1"]
    out = kivi_ablation.main([*argv, "--json", str(out_file)])
    rows = out["rows"]
    assert [r["row"] for r in rows[:5]] == list(kivi_ablation.CACHE_SPECS)
    assert len(rows) == 5 + 1 + 8
    # The fake rows' unquantized row scores what the cache baseline scores: the two protocols agree.
    fake_fp = next(r for r in rows if r["row"] == "kivi_fake_fp")
    assert fake_fp["perplexity"] == pytest.approx(rows[0]["perplexity"], rel=1e-4)
    # Past the 128-token residual, 2 bits cost more than 4 in every layout.
    for r in rows:
        if r["bits"] == 2:
            twin = next(
                t
                for t in rows
                if (t["kind"], t["keys"], t["values"], t["bits"]) == (r["kind"], r["keys"], r["values"], 4)
            )
            assert r["perplexity"] > twin["perplexity"]
    assert json.loads(out_file.read_text())["rows"] == json.loads(json.dumps(rows))


def test_docs_page_is_the_rendering_of_its_saved_output():
    saved = json.loads((ROOT / "docs" / "data" / "kivi-ablation.json").read_text())
    page = (ROOT / "docs" / "kivi-ablation.md").read_text()
    begin, end = "<!-- kivi-ablation:table -->\n", "<!-- /kivi-ablation:table -->"
    body = page[page.index(begin) + len(begin) : page.index(end)]
    assert body.strip() == kivi_ablation.table(saved).split("\n\n")[0].strip()
    assert saved["settings"]["model"] == "smollm2"

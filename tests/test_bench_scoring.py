"""The scoring benchmark (``benchmarks/bench_scoring.py``, :mod:`hf_kvcache.tools.bench_scoring`): merged forwards
against one token per forward on the same windows, the same perplexities, and one-line errors for bad flags."""

from __future__ import annotations

import pytest

from hf_kvcache.tools.bench_scoring import main


def _rows(text: str) -> dict[str, list[str]]:
    lines = [line for line in text.splitlines() if line.startswith("| ") and not line.startswith("| cache")]
    return {cells[0]: cells[1:] for cells in ([c.strip() for c in line.strip("|").split("|")] for line in lines)}


def test_merged_and_stepwise_side_by_side(capsys):
    code = main(["--tokens", "400", "--context", "200", "--prefill", "80", "--caches", "dynamic,int4,int8"])
    assert code == 0
    rows = _rows(capsys.readouterr().out)
    assert set(rows) == {"dynamic", "int4", "int8"}
    for cache, (_, _, _, forwards, perplexities) in rows.items():
        merged, stepwise = (int(n) for n in forwards.split(" / "))
        assert stepwise == 1 + 119  # the windows' prefill, then one forward per scored position
        assert (merged < stepwise) is (cache != "int8")  # int8 encodes every token: one per forward either way
        a, b = (float(p) for p in perplexities.split(" / "))
        assert a == pytest.approx(b, rel=1e-5)


@pytest.mark.parametrize(
    "args, message",
    [
        (["--caches", "int5"], "int5"),
        (["--rounds", "0"], "--rounds"),
        (["--prefill", "300", "--context", "200"], "prefill"),
    ],
)
def test_bad_flags_are_one_line_errors(capsys, args, message):
    assert main(args) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1

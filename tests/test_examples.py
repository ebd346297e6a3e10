"""Every script in examples/ runs end to end at small sizes and prints what it promises.

Each example runs as a user would run it: ``python examples/NAME.py`` in a fresh process, from an empty folder, with
``HF_KVCACHE_EXAMPLES_SMALL=1``. Examples are found by glob, so a new one is run and must exit 0 and print something;
the checks below read the key lines of the known ones.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from tables import table_rows

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = {path.stem: path for path in sorted((ROOT / "examples").glob("*.py"))}
TIMEOUT_S = 300


def _number(pattern: str, text: str) -> float:
    match = re.search(pattern, text)
    assert match, f"no line matches {pattern!r} in:\n{text}"
    return float(match.group(1).replace(",", ""))


def check_int8_generation(out: str, cwd: Path) -> None:
    assert "tokens equal: True" in out
    # int8 codes + one float32 scale per token and head: 1,088 bytes per token against float32's 4,096 (0.266) and
    # bf16's 2,048 (0.531) at head_dim 64.
    assert 0.25 < _number(r"\nratio: ([\d.]+)", out) < 0.3
    assert 0.5 < _number(r"ratio against a bf16 DynamicCache: ([\d.]+)", out) < 0.55


def check_streaming_sinks(out: str, cwd: Path) -> None:
    rows = re.findall(r"(\d+) generated \| +(\d+) of +(\d+) tokens .*?\| +([\d,]+) bytes \| .*? ([\d,]+)\n", out)
    rows = [[int(x.replace(",", "")) for x in row] for row in rows]
    assert len(rows) >= 4, out
    cap_tokens = int(re.search(r"at most (\d+) tokens per layer", out).group(1))
    assert all(stored <= cap_tokens for _, stored, _, _, _ in rows)
    assert rows[-1][2] > 512  # past the model's training context
    full = [nbytes for _, stored, seen, nbytes, _ in rows if seen > cap_tokens]
    assert len(full) >= 2 and len(set(full)) == 1, rows  # flat once the window is full
    assert rows[-1][4] > 5 * rows[-1][3]  # a DynamicCache would hold far more by the end
    assert "memory flat once the window is full: True" in out


def check_parallel_sampling_paged(out: str, cwd: Path) -> None:
    assert len(re.findall(r"\n  \d: \S", out)) == 8  # the 8 samples
    assert "samples equal DynamicCache's: True" in out
    assert _number(r"shared blocks: (\d+)", out) > 0
    assert _number(r"\nratio: ([\d.]+)", out) < 0.5


def check_compare_caches(out: str, cwd: Path) -> None:
    folder = cwd / "results" / "compare-caches"
    results = {r["cache"]: r for r in json.loads((folder / "results.json").read_text())["results"]}
    assert list(results) == ["dynamic", "int8", "int4", "sink:window=128:sinks=4", "paged"]
    ppl = {spec: r["perplexity"] for spec, r in results.items()}
    assert ppl["paged"]["perplexity"] == pytest.approx(ppl["dynamic"]["perplexity"], rel=1e-6)  # lossless
    assert ppl["int8"]["bytes_ratio"] < 0.3
    assert abs(ppl["int8"]["perplexity_change"]) < 0.005
    repeat = {spec: r["repeat"]["summary"]["second_copy_perplexity"] for spec, r in results.items()}
    assert repeat["paged"] == pytest.approx(repeat["dynamic"], rel=1e-5)
    report = (folder / "report.md").read_text()
    for spec in results:
        assert spec in table_rows(out) and spec in table_rows(report)


def check_device_map_split(out: str, cwd: Path) -> None:
    devices = dict(re.findall(r"\n  (model\.\S+|lm_head) +(\S+)", out))
    assert len(devices) == 8, out
    if torch.cuda.device_count() == 0:
        assert devices["model.layers.3"] == "disk" and devices["model.layers.0"] == "cpu"
    assert out.count("split-model tokens equal whole-model tokens: True") == 2
    assert "all tokens equal: True" in out


def check_hybrid_model(out: str, cwd: Path) -> None:
    assert "paged tokens equal DynamicCache's: True" in out
    states = re.findall(r"StateLayer: +0 tokens, +([\d,]+) bytes", out)
    assert len(states) == 6 and all(int(n.replace(",", "")) > 0 for n in states)  # Qwen3-Next's linear layers
    assert len(re.findall(r"QuantizedLayer: +\d+ tokens", out)) == 2
    # the attention layers' history in int4 (the 128-token residual in float32 aside) against float32
    assert _number(r"attention ratio: ([\d.]+)", out) < 0.7
    # plan's per-row states are the ones the caches hold, and int4 fits more rows than DynamicCache
    planned, measured = re.search(r"plan: ([\d,]+) bytes of states per row \(measured here: ([\d,]+)\)", out).groups()
    assert planned == measured and int(planned.replace(",", "")) > 0
    rows = dict(re.findall(r"plan: +(\w+) fits (\d+) rows", out))
    assert int(rows["int4"]) > int(rows["dynamic"]) > 0


def check_auto_key_widths(out: str, cwd: Path) -> None:
    widths = json.loads(re.search(r"key widths per layer: (\[[\d, ]+\])", out).group(1))
    assert len(widths) == 4 and set(widths) <= {2, 3, 4} and sum(widths) / 4 <= 2.25  # the reference model's layers
    assert "same widths the second time: True" in out
    rows = dict(re.findall(r"\n  (.+?) +copy perplexity +[\d.]+ \(.+?\) +([\d,]+) bytes", out))
    assert list(rows) == ["DynamicCache", "int2", 'int2, key_bits="auto", residual_bits=8'], out
    nbytes = [int(n.replace(",", "")) for n in rows.values()]
    assert nbytes[2] < nbytes[1] < nbytes[0]  # an int8 residual under int2's, both under full precision


def check_saved_prompt_cache(out: str, cwd: Path) -> None:
    rows = re.findall(r"\n  (\S+) +file +([\d,]+) bytes \(([\d.]+)x\).*continuations equal: (\w+)", out)
    assert [r[0] for r in rows] == ["dynamic", "int8", "int4", "int2"], out
    assert all(r[3] == "True" for r in rows)  # the other process continued each cache as this one did
    ratios = {r[0]: float(r[2]) for r in rows}
    assert ratios["int8"] < 0.3 and ratios["int2"] < 1  # the codes, not float32 K/V


CHECKS = {
    "int8_generation": check_int8_generation,
    "streaming_sinks": check_streaming_sinks,
    "parallel_sampling_paged": check_parallel_sampling_paged,
    "compare_caches": check_compare_caches,
    "device_map_split": check_device_map_split,
    "hybrid_model": check_hybrid_model,
    "auto_key_widths": check_auto_key_widths,
    "saved_prompt_cache": check_saved_prompt_cache,
}


@pytest.fixture(scope="module")
def started(request, tmp_path_factory):
    """Starts the selected examples all at once (each runs on one thread, so together they share the cores; one
    after another they would spend most of their time importing torch and transformers), keyed by name."""
    env = os.environ | {
        "HF_KVCACHE_EXAMPLES_SMALL": "1",
        "HF_HUB_OFFLINE": "1",
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
    }
    # Only the examples this session runs (``-k`` may pick a few).
    selected = {
        item.callspec.params["name"]
        for item in request.session.items
        if item.module is request.module and hasattr(item, "callspec")
    }
    runs = {}
    for name in sorted(selected):
        cwd = tmp_path_factory.mktemp(name)
        # Output goes to files, not pipes: a pipe nobody reads yet could fill up and stall the example.
        with open(cwd / "stdout.txt", "w") as stdout, open(cwd / "stderr.txt", "w") as stderr:
            proc = subprocess.Popen(
                [sys.executable, str(EXAMPLES[name])], cwd=cwd, env=env, stdout=stdout, stderr=stderr
            )
        runs[name] = (proc, cwd)
    yield runs
    for proc, _ in runs.values():
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.mark.parametrize("name", sorted(EXAMPLES))
def test_example_runs(name, started):
    proc, cwd = started[name]
    proc.wait(timeout=TIMEOUT_S)
    out = (cwd / "stdout.txt").read_text()
    err = (cwd / "stderr.txt").read_text()
    assert proc.returncode == 0, f"examples/{name}.py exited with {proc.returncode}:\n{out[-3000:]}\n{err[-3000:]}"
    assert out.strip(), f"examples/{name}.py printed nothing"
    if name in CHECKS:  # a new example is run by the glob above; give it a check of its key lines here
        CHECKS[name](out, cwd)

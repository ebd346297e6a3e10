"""hf-kvcache eval / bench: offline defaults on the reference model, results.json schema, data parallelism, flags."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from models import tiny_model
from tables import table_rows

from hf_kvcache.cli import main
from hf_kvcache.eval import EvalConfig, load_text, merge_results, metric_path, run_bench, run_eval

SMALL = ["--task", "perplexity", "--max-tokens", "1024", "--context", "256", "--prefill", "128", "--quiet"]
SMALL += ["--threads", "1", "--model", "reference"]
RESULT_KEYS = {
    "task",
    "summary",
    "perplexity",
    "tokens_scored",
    "nll",
    "cache_bytes",
    "bytes_per_token",
    "decode_tokens_per_s",
    "peak_memory_bytes",
    "perplexity_change",
    "bytes_ratio",
}


def test_eval_writes_results_report_and_plots(tmp_path, capsys):
    out = tmp_path / "run"
    assert main(["eval", *SMALL, "--caches", "dynamic,int8,sink:window=64:sinks=4", "--output", str(out)]) == 0
    assert "int8" in table_rows(capsys.readouterr().out)
    results = json.loads((out / "results.json").read_text())
    assert {"config", "versions", "results", "device"} <= set(results)
    assert results["config"]["model"] == "reference" and results["config"]["dataset"] == "reference"
    assert {"transformers", "torch", "hf_kvcache"} <= set(results["versions"])
    for entry in results["results"]:
        assert RESULT_KEYS <= set(entry["perplexity"]), RESULT_KEYS - set(entry["perplexity"])
        assert entry["perplexity"]["peak_memory_bytes"] is None  # CPU: not measured, not invented
    report = (out / "report.md").read_text()
    assert report.count("| sink:window=64:sinks=4 ") == 1 and "sink:window=64:sinks=4" in table_rows(report)
    assert (out / "perplexity_bytes.png").stat().st_size > 1000


@pytest.mark.slow
def test_the_cache_matters_on_the_reference_model(reference):
    model, tokenizer = reference
    config = EvalConfig(
        task=("perplexity",),
        caches=("dynamic", "paged:block_size=16", "int8", "int2:residual_length=0"),
        max_tokens=2048,
        context=512,
        prefill=256,
        quiet=True,
    )
    ppl = {r["cache"]: r["perplexity"]["perplexity"] for r in run_eval(config, model, tokenizer)["results"]}
    assert ppl["paged:block_size=16"] == pytest.approx(ppl["dynamic"], rel=1e-6)
    # int8's rounding moves perplexity by a few 1e-4 either way; int2 without its residual costs clearly more.
    assert ppl["int2:residual_length=0"] > ppl["int8"] * 1.002
    assert abs(ppl["int8"] / ppl["dynamic"] - 1) < 1e-3


@pytest.mark.slow
def test_long_stream_mode_reports_buckets(reference, tmp_path):
    model, tokenizer = reference
    config = EvalConfig(
        task=("stream",), caches=("dynamic", "sink:window=128:sinks=4"), stream_tokens=700, bucket=200, quiet=True
    )
    results = run_eval(config, model, tokenizer)
    for entry in results["results"]:
        assert len(entry["stream"]["perplexity"]) == 4 and sum(entry["stream"]["tokens"]) == 700 - 16
    sink = results["results"][1]["stream"]["cache_bytes"]
    assert sink[-1] == sink[-2]  # flat once the window is full


@pytest.mark.slow
def test_sharded_windows_merge_to_the_single_process_result(reference):
    model, tokenizer = reference
    config = EvalConfig(
        task=("perplexity",),
        caches=("dynamic", "int4"),
        max_tokens=1500,
        context=256,
        prefill=128,
        batch_size=3,
        quiet=True,
    )
    whole = run_eval(config, model, tokenizer)
    parts = [run_eval(config, model, tokenizer, shard=(i, 2)) for i in range(2)]
    merged = merge_results(parts)
    for a, b in zip(merged["results"], whole["results"]):
        a, b = a["perplexity"], b["perplexity"]
        assert a["tokens_scored"] == b["tokens_scored"] and a["windows"] == b["windows"]
        assert a["nll"] == pytest.approx(b["nll"], rel=1e-6)


@pytest.mark.slow
def test_accelerate_two_cpu_processes_equal_one(tmp_path):
    env = os.environ | {"HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    args = [*SMALL, "--caches", "dynamic,int8"]
    launch = [
        sys.executable,
        "-m",
        "accelerate.commands.launch",
        "--multi_gpu",
        "--num_processes",
        "2",
        "--num_machines",
        "1",
        "--mixed_precision",
        "no",
        "--dynamo_backend",
        "no",
        "-m",
        "hf_kvcache",
        "eval",
    ]
    subprocess.run([*launch, *args, "--output", str(tmp_path / "dp")], check=True, env=env, capture_output=True)
    subprocess.run(
        [sys.executable, "-m", "hf_kvcache", "eval", *args, "--output", str(tmp_path / "one")],
        check=True,
        env=env,
        capture_output=True,
    )
    dp = json.loads((tmp_path / "dp" / "results.json").read_text())
    one = json.loads((tmp_path / "one" / "results.json").read_text())
    assert dp["processes"] == 2
    for a, b in zip(dp["results"], one["results"]):
        assert a["perplexity"]["tokens_scored"] == b["perplexity"]["tokens_scored"]
        # Equal up to float summation order: each process scores batches of another shape, and sdpa's CPU kernel
        # blocks by batch. A lost or repeated window (a wrong shard or merge) would move perplexity by percents.
        assert a["perplexity"]["perplexity"] == pytest.approx(b["perplexity"]["perplexity"], rel=1e-4)


@pytest.mark.slow
def test_evaluate_metric_loads_by_path(reference):
    import evaluate

    metric = evaluate.load(metric_path())
    text = load_text()[:3000]
    got = metric.compute(predictions=[text], cache="int8", context=256, prefill=64, chunk=16, device="cpu")
    assert got["tokens_scored"] > 0 and 1 < got["perplexity"] < 1000


def test_bench_rows_side_by_side():
    model = tiny_model("llama")
    bench = run_bench(model, ["dynamic", "int8"], [16, 32], new_tokens=4, repeats=1)
    assert [(r["context"], r["cache"]) for r in bench["rows"]] == [
        (16, "dynamic"),
        (16, "int8"),
        (32, "dynamic"),
        (32, "int8"),
    ]
    from hf_kvcache.memory import model_nbytes

    weights = model_nbytes(model)
    assert all(r["decode_tokens_per_s"] > 0 and r["peak_memory_bytes"] > weights for r in bench["rows"])


def test_peak_tensor_bytes_sees_the_cache_grow():
    """Measured on CPU: what a DynamicCache holds after a generation is exactly what the tracker still counts live,
    and the peak grows by at least the cache's growth between two prompt lengths."""
    from transformers import DynamicCache

    from hf_kvcache import cache_nbytes
    from hf_kvcache.memory import PeakTensorBytes

    model = tiny_model("llama")
    peaks, sizes = [], []
    for n in (64, 256):
        cache = DynamicCache(config=model.config)
        with PeakTensorBytes() as tracker, torch.inference_mode():
            model.generate(input_ids=torch.randint(3, 100, (2, n)), past_key_values=cache, max_new_tokens=3)
        assert tracker.live == cache_nbytes(cache)
        peaks.append(tracker.peak_bytes)
        sizes.append(cache_nbytes(cache))
    assert peaks[1] - peaks[0] >= sizes[1] - sizes[0] > 0


def test_budget_search_is_measured_monotone_and_respected():
    from hf_kvcache.eval.bench import BUDGET_RESOLUTION, largest_context

    model = tiny_model("llama")
    found = {}
    for budget_mib in (6, 12):
        gen = torch.Generator().manual_seed(0)
        found[budget_mib] = r = largest_context(model, "int8", None, budget_mib * 2**20, 2, 3, gen)
        peaks = {int(k): v for k, v in r["peaks"].items()}
        assert peaks[r["measured"]] <= budget_mib * 2**20  # the answer was measured, and fits
        if not r["capped"]:  # and a probe within the resolution above it did not fit
            assert any(r["measured"] < k <= r["measured"] + BUDGET_RESOLUTION and v > budget_mib * 2**20
                       for k, v in peaks.items())  # fmt: skip
        assert r["planned"] >= r["measured"]  # the plan counts no activations
    assert found[12]["measured"] >= found[6]["measured"] > 0


def test_load_text_sources(tmp_path):
    (tmp_path / "a.txt").write_text("plain text")
    (tmp_path / "b.jsonl").write_text('{"text": "one", "body": "x"}\n{"body": "y", "text": "two"}\n')
    assert load_text(str(tmp_path / "a.txt")) == "plain text"
    assert load_text(str(tmp_path / "b.jsonl")) == "one\n\ntwo"
    assert load_text(str(tmp_path / "b.jsonl") + ":body") == "x\n\ny"
    with pytest.raises(ValueError, match="neither a known name nor an existing file"):
        load_text(str(tmp_path / "missing.txt"))
    assert load_text().startswith("Persuasion")


@pytest.mark.parametrize(
    "args, message",
    [
        (["--caches", "nope"], "unknown cache kind 'nope'"),
        (["--prefill", "600", "--context", "512"], "--prefill (600) must be smaller than --context (512)"),
        (["--chunk", "0"], "--chunk must be an integer >= 1"),
        (["--device", "tpu"], "--device must be cpu, cuda or auto"),
        (["--load-in-8bit", "--load-in-4bit"], "exclusive"),
        (["--caches", "int8:bogus=1"], "has no option bogus"),
        (["--task", "stream", "--stream-tokens", "-1"], "--stream-tokens must be an integer >= 17"),
        (["--task", "stream", "--bucket", "0"], "--bucket must be an integer >= 1"),
        (["--device-map", "balanced"], "--device-map must be 'auto'"),
    ],
)
def test_bad_flags_give_clear_errors(args, message, capsys, monkeypatch):
    import hf_kvcache.eval.runner as runner

    monkeypatch.setattr(runner, "load_configured_model", lambda config: pytest.fail("the model was loaded"))
    assert main(["eval", "--quiet", *args]) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1 and "Traceback" not in err


def test_bench_rejects_too_few_new_tokens():
    with pytest.raises(ValueError, match="new_tokens must be >= 2"):
        run_bench(tiny_model("llama"), ["dynamic"], [16], new_tokens=1)


@pytest.mark.parametrize(
    "args, message",
    [
        (["--caches", "int9"], "unknown cache kind"),
        (["--caches", "int4:group=3"], "group"),
        (["--contexts", "1k"], "--contexts must be comma-separated int values"),
        (["--contexts", "0,16"], "--contexts must all be >= 1"),
        (["--new-tokens", "1"], "--new-tokens must be an integer >= 2"),
        (["--model", "/nope"], "no such directory"),
    ],
)
def test_bench_checks_its_flags_before_loading_the_model(args, message, capsys, monkeypatch):
    import hf_kvcache.eval.runner as runner

    monkeypatch.setattr(runner, "load_configured_model", lambda config: pytest.fail("the model was loaded"))
    assert main(["bench", *args]) == 2
    assert message in capsys.readouterr().err


def test_bench_rejects_a_bad_option_value_before_timing(capsys):
    assert main(["bench", "--caches", "dynamic,int4:group_size=5", "--contexts", "16", "--new-tokens", "2"]) == 2
    assert "group_size" in capsys.readouterr().err


def test_an_unwritable_output_fails_before_the_model_loads(tmp_path, capsys, monkeypatch):
    import hf_kvcache.eval.runner as runner

    monkeypatch.setattr(runner, "load_configured_model", lambda config: pytest.fail("the model was loaded"))
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    assert main(["eval", *SMALL, "--output", str(blocker / "run")]) == 2
    err = capsys.readouterr().err
    assert f"--output '{blocker / 'run'}' cannot be written" in err and len(err.strip().splitlines()) == 1


def test_ctrl_c_is_one_line_exit_130_and_leaves_no_results(tmp_path, capsys, monkeypatch):
    import hf_kvcache.eval.runner as runner

    def interrupted(config):
        raise KeyboardInterrupt

    monkeypatch.setattr(runner, "run_eval_distributed", interrupted)
    out = tmp_path / "run"
    assert main(["eval", *SMALL, "--output", str(out)]) == 130
    err = capsys.readouterr().err
    assert err.strip() == "hf-kvcache: interrupted"
    assert list(out.iterdir()) == []  # created and checked before the work, and nothing written into it


def test_ctrl_c_while_writing_leaves_no_results_json(tmp_path, capsys, monkeypatch):
    import hf_kvcache.eval.report as report

    replace = report.os.replace

    def interrupted(src, dst):
        if str(dst).endswith("results.json"):
            raise KeyboardInterrupt
        replace(src, dst)

    monkeypatch.setattr(report.os, "replace", interrupted)
    out = tmp_path / "run"
    assert main(["eval", *SMALL, "--caches", "dynamic", "--output", str(out)]) == 130
    assert capsys.readouterr().err.strip() == "hf-kvcache: interrupted"
    assert sorted(p.name for p in out.iterdir()) == ["perplexity_bytes.png", "report.md"]  # no results.json, no temp


def test_decode_rate_comes_from_the_steps_own_times(monkeypatch):
    """TTFT is the time to the first token and the decode rate the later steps' tokens over their own time, both
    from one generation per repeat: a slow prefill cannot make the rate absurd (it used to be a clamped difference of
    two separately timed generations, which printed 6.2e10 tok/s when prefill noise exceeded the decode time)."""
    import itertools

    from hf_kvcache import compare, make_cache

    torch.set_num_threads(1)
    model = tiny_model("llama")
    ticks = itertools.count()
    # A fake clock: 1 s per reading, so every step of a generation takes exactly 1 s after the first token.
    monkeypatch.setattr(compare.time, "perf_counter", lambda: float(next(ticks)))
    ids = torch.randint(3, 100, (3, 8))
    timing = compare.time_decode(model, {"input_ids": ids}, lambda: make_cache("int8", model), new_tokens=5, repeats=2)
    assert timing.rates == [3 * 4 / 4.0] * 2  # 3 rows x 4 steps after the first, over 4 s
    assert timing.ttft_s == 1.0 and timing.spread == 0.0
    assert timing.output.shape == (3, 13)


def test_a_saved_run_reports_again_against_any_of_its_caches(reference, tmp_path, capsys):
    """A run's caches chosen afterwards, another one the baseline, give what a run of only those caches gives:
    every number relative to the baseline (perplexity and copy changes, bytes ratios, retrieval points and their
    paired intervals) recomputed from what each cache measured, with no model run."""
    from hf_kvcache.eval import get_task, select_caches

    model, tokenizer = reference
    config = EvalConfig(task=("perplexity", "repeat", "passkey", "ruler"), caches=("dynamic", "int8", "int2"),
                        max_tokens=768, context=256, prefill=128, distances=(0,), passage=32, samples=2,
                        lengths=(256,), depths=(0.5,), ruler_tasks=("niah_single", "vt"), ruler_lengths=(512,),
                        ruler_samples=2, quiet=True)  # fmt: skip
    whole = run_eval(config, model, tokenizer)
    pair = run_eval(config.replace(caches=("int2", "int8")), model, tokenizer)
    selected = select_caches(whole, ["int2", "int8"])
    assert [e["cache"] for e in selected["results"]] == ["int2", "int8"] == selected["config"]["caches"]
    assert "seconds" not in selected  # the run's wall times were over three caches
    for mine, theirs in zip(selected["results"], pair["results"]):
        for key in ("perplexity_change", "bytes_ratio", "perplexity"):
            assert mine["perplexity"][key] == theirs["perplexity"][key]
        assert mine["repeat"]["second_copy_change"] == theirs["repeat"]["second_copy_change"]
        assert mine["ruler"]["summary"] == theirs["ruler"]["summary"]
        assert mine["ruler"]["cells"] == theirs["ruler"]["cells"]
    for name in ("passkey", "ruler", "repeat"):
        assert get_task(name).table(selected) == get_task(name).table(pair)
    assert whole["results"][0]["perplexity"]["perplexity_change"] == 0  # the run itself is left as it was
    assert [e["cache"] for e in whole["results"]] == ["dynamic", "int8", "int2"]

    saved = tmp_path / "run"
    saved.mkdir()
    (saved / "results.json").write_text(json.dumps(whole))
    out = tmp_path / "again"
    assert main(["report", str(saved), "--caches", "int2,int8", "--output", str(out)]) == 0
    printed = capsys.readouterr().out
    assert list(table_rows(printed)) == ["cache", "int2", "int8"]  # every table: the baseline first
    again = json.loads((out / "results.json").read_text())
    assert [e["cache"] for e in again["results"]] == ["int2", "int8"]
    assert (out / "report.md").read_text().count("| int8 ") >= 1
    for where in (saved, out):  # never written over the run it reads
        assert main(["report", str(where), "--caches", "int8", "--output", str(where)]) == 2
        assert f"holds {where}, which this report would replace" in capsys.readouterr().err
    assert main(["report", str(saved), "--caches", "int8", "--output", str(tmp_path)]) == 0  # beside the run: allowed
    assert json.loads((tmp_path / "results.json").read_text())["config"]["caches"] == ["int8"]
    capsys.readouterr()
    kept = json.loads((saved / "results.json").read_text())["results"]
    assert [e["cache"] for e in kept] == ["dynamic", "int8", "int2"]
    record = tmp_path / "saved.json"  # a run as scripts/build_results.py saves it
    record.write_text(json.dumps({"command": "hf-kvcache eval ...", "kind": "eval", "results": whole}))
    assert main(["report", str(record)]) == 0
    assert list(table_rows(capsys.readouterr().out)) == ["cache", "dynamic", "int8", "int2"]


@pytest.mark.parametrize(
    "args, message",
    [
        (["--caches", "int4"], "--caches 'int4' is not a cache of this run; it has: dynamic, int8"),
        (["--caches", "int8,int8"], "--caches names 'int8' twice"),
        (["--caches", ","], "--caches must name at least one cache of the run"),
    ],
)
def test_report_names_what_it_cannot_select(args, message, tmp_path, capsys):
    results = {"config": {"task": ["perplexity"], "caches": ["dynamic", "int8"]}, "device": "cpu", "versions": {},
               "results": [{"cache": "dynamic", "perplexity": {}}, {"cache": "int8", "perplexity": {}}]}  # fmt: skip
    path = tmp_path / "results.json"
    path.write_text(json.dumps(results))
    assert main(["report", str(path), *args]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err, err


def test_report_refuses_what_is_not_an_eval_run(tmp_path, capsys):
    bench = tmp_path / "bench.json"
    bench.write_text(json.dumps({"command": "hf-kvcache bench", "kind": "bench", "results": {"rows": []}}))
    broken = tmp_path / "broken.json"
    broken.write_text("{")
    other = tmp_path / "other.json"
    other.write_text("[1, 2]")
    for path, message in [
        (bench, "holds a bench run; only eval runs have these tables"),
        (broken, "is not JSON"),
        (other, "is not an eval run's results.json"),
        (tmp_path / "missing", "cannot be read: No such file or directory"),
    ]:
        assert main(["report", str(path)]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and f"hf-kvcache: error: results {str(path)!r} {message}" in err, err


def test_runs_of_other_lengths_pool_their_retrieval_cells(reference, tmp_path, capsys):
    """Runs of one length each read as one: every cell of every run side by side, the averages and the paired
    intervals over all of them (what a run's own table computes over its cells); refused where a cell could be
    counted twice or a task cannot pool."""
    from hf_kvcache.eval import get_task, pool_runs
    from hf_kvcache.eval.tasks.base import paired_difference

    model, tokenizer = reference
    config = EvalConfig(task=("passkey", "ruler"), caches=("dynamic", "int2", "int8"), lengths=(256,), depths=(0.5,),
                        samples=2, ruler_tasks=("niah_single", "vt"), ruler_lengths=(512,), ruler_samples=2,
                        quiet=True)  # fmt: skip
    short = run_eval(config, model, tokenizer)
    long = run_eval(config.replace(caches=("int2", "dynamic"), lengths=(384,), ruler_lengths=(640,)), model, tokenizer)
    pooled = pool_runs([short, long])
    assert [e["cache"] for e in pooled["results"]] == ["dynamic", "int2"]  # the caches both runs have
    assert pooled["runs"] == [short["config"], long["config"]] and "seconds" not in pooled
    for mine, a, b in zip(pooled["results"], short["results"], [long["results"][1], long["results"][0]]):
        assert mine["ruler"]["cells"] == a["ruler"]["cells"] + b["ruler"]["cells"]
        assert mine["passkey"]["cells"] == a["passkey"]["cells"] + b["passkey"]["cells"]
        scores = [c["score"] for c in mine["ruler"]["cells"]]
        assert mine["ruler"]["summary"]["score"] == pytest.approx(sum(scores) / 4)
        found = sum(c["correct"] for c in mine["passkey"]["cells"])
        assert mine["passkey"]["summary"]["accuracy"] == found / 4
    base, int2 = (e["ruler"]["cells"] for e in pooled["results"])
    difference, low, high = paired_difference(int2, base)
    assert f"{difference:+.1f} [{low:+.1f}, {high:+.1f}]" in table_rows(get_task("ruler").table(pooled))["int2"]
    assert pooled["results"][1]["ruler"]["summary"]["points_vs_first"] == pytest.approx(
        100 * (pooled["results"][1]["ruler"]["summary"]["score"] - pooled["results"][0]["ruler"]["summary"]["score"])
    )

    paths = []
    for name, run in (("short", short), ("long", long)):
        (tmp_path / name).mkdir()
        (tmp_path / name / "results.json").write_text(json.dumps(run))
        paths.append(str(tmp_path / name))
    assert main(["report", *paths, "--caches", "int2,dynamic"]) == 0
    printed = capsys.readouterr().out
    assert list(table_rows(printed)) == ["cache", "int2", "dynamic"]
    assert "niah_single 512" in printed and "niah_single 640" in printed
    assert main(["report", *paths, "--caches", "int8"]) == 2  # the long run has no int8
    assert "--caches 'int8' is not a cache of this run; it has: int2, dynamic" in capsys.readouterr().err
    other = json.loads(json.dumps(short))  # the same documents, read otherwise: pooled, they would count twice
    other["config"]["separate_prefill"] = True
    (tmp_path / "other.json").write_text(json.dumps(other))
    assert main(["report", paths[0], str(tmp_path / "other.json")]) == 2
    assert "two runs hold the passkey cell 256 0.5 over the same documents" in capsys.readouterr().err
    ppl = run_eval(EvalConfig(task=("perplexity",), caches=("dynamic",), max_tokens=300, context=256, prefill=128,
                              quiet=True), model, tokenizer)  # fmt: skip
    with pytest.raises(ValueError, match="runs of other tasks cannot pool: passkey, ruler and perplexity"):
        pool_runs([short, ppl])
    with pytest.raises(ValueError, match="the perplexity task's results cannot be pooled across runs"):
        pool_runs([ppl, ppl])


def test_runs_of_other_seeds_pool_as_one_run_of_their_documents(reference):
    """A cell two runs of other --seed values hold becomes one cell over both runs' documents: seeds 0 and 2 with two
    documents a cell are one run of seed 0 with four (RULER's documents are the same ones; a passkey run's filler
    span grows with its documents, so there the documents pool without being that run's)."""
    from hf_kvcache.eval import pool_runs

    model, tokenizer = reference
    config = EvalConfig(task=("passkey", "ruler"), caches=("dynamic", "int2"), lengths=(256,), depths=(0.5,),
                        samples=2, ruler_tasks=("niah_single", "fwe"), ruler_lengths=(384,), ruler_samples=2,
                        quiet=True)  # fmt: skip
    first = run_eval(config, model, tokenizer)
    second = run_eval(config.replace(seed=2), model, tokenizer)
    whole = run_eval(config.replace(ruler_samples=4, task=("ruler",)), model, tokenizer)
    pooled = pool_runs([first, second])
    for mine, a, b, one in zip(pooled["results"], first["results"], second["results"], whole["results"]):
        assert mine["ruler"]["cells"] == one["ruler"]["cells"]
        assert mine["ruler"]["summary"] == one["ruler"]["summary"]
        (cell,) = mine["passkey"]["cells"]
        assert (
            cell["samples"] == 4
            and cell["scores"] == a["passkey"]["cells"][0]["scores"] + b["passkey"]["cells"][0]["scores"]
        )
        assert mine["passkey"]["summary"]["accuracy"] == sum(cell["scores"]) / 4
    with pytest.raises(ValueError, match="two runs hold the passkey cell 256 0.5 over the same documents"):
        pool_runs([first, second | {"config": second["config"] | {"seed": 1}}])  # seeds 1-2 meet 0-1
    with pytest.raises(ValueError, match="runs of another dtype cannot pool: 'float32' and 'bfloat16'"):
        pool_runs([first, second | {"config": second["config"] | {"dtype": "bfloat16"}}])


def test_runs_of_the_same_documents_join_as_one_run(reference, tmp_path, capsys):
    """A cache run later on another run's documents reads as one of that run's caches: two runs of the same settings
    joined equal one run of all their caches, on every task and every number relative to the baseline; a cache both
    runs hold must have measured the same in each (else the documents or the code were not the same)."""
    from hf_kvcache.eval import combine_runs, get_task, join_runs, select_caches, write_report

    model, tokenizer = reference
    config = EvalConfig(task=("perplexity", "passkey", "ruler"), caches=("dynamic", "int8"), max_tokens=768,
                        context=256, prefill=128, samples=2, lengths=(256,), depths=(0.5,), ruler_tasks=("fwe",),
                        ruler_lengths=(384,), ruler_samples=2, quiet=True)  # fmt: skip
    earlier = run_eval(config, model, tokenizer)
    later = run_eval(config.replace(caches=("dynamic", "int2"), threads=1), model, tokenizer)
    whole = run_eval(config.replace(caches=("dynamic", "int8", "int2")), model, tokenizer)
    joined = join_runs([earlier, later])
    assert [e["cache"] for e in joined["results"]] == ["dynamic", "int8", "int2"] == joined["config"]["caches"]
    assert joined["joined"] == [["dynamic", "int8"], ["dynamic", "int2"]] and "seconds" not in joined
    for mine, theirs in zip(joined["results"], whole["results"]):
        for key in ("perplexity_change", "bytes_ratio"):
            assert mine["perplexity"][key] == pytest.approx(theirs["perplexity"][key], rel=1e-6)
        assert mine["ruler"]["cells"] == theirs["ruler"]["cells"]
        assert mine["passkey"]["cells"] == theirs["passkey"]["cells"]
    for name in ("passkey", "ruler"):
        assert get_task(name).table(joined) == get_task(name).table(whole)
    assert combine_runs([earlier, later], ["int2", "int8"]) == select_caches(joined, ["int2", "int8"])

    moved = json.loads(json.dumps(later))  # dynamic found a passkey in one run and not the other
    cell = moved["results"][0]["passkey"]["cells"][0]
    cell["scores"][0] = 1.0 - cell["scores"][0]
    with pytest.raises(
        ValueError, match="run 2 holds 'dynamic' as an earlier run does, but its passkey numbers differ"
    ):
        join_runs([earlier, moved])
    with pytest.raises(ValueError, match="run 1 is a report of several runs"):
        combine_runs([joined, later])

    # runs of the same documents at each of two seeds: each pair joins, the pairs pool, as two runs of all the
    # caches at those seeds pool
    ruler = config.replace(task=("ruler",))
    pairs = [[run_eval(ruler.replace(caches=c, seed=seed), model, tokenizer) for c in (("dynamic", "int8"), ("int2",))]
             for seed in (0, 2)]  # fmt: skip
    alone = [
        run_eval(ruler.replace(caches=("dynamic", "int8", "int2"), seed=seed), model, tokenizer) for seed in (0, 2)
    ]
    both = combine_runs([*pairs[0], *pairs[1]], ["dynamic", "int2"])
    assert both["results"] == combine_runs(alone, ["dynamic", "int2"])["results"]
    assert both["joined_groups"] == [[["dynamic", "int8"], ["int2"]]] * 2 and "joined" not in both
    write_report(both, tmp_path / "pooled")
    assert (
        "Pooled from 2 sets of documents, each joined from runs of them" in (tmp_path / "pooled/report.md").read_text()
    )

    paths = []
    for name, run in (("earlier", earlier), ("later", later)):
        (tmp_path / name).mkdir()
        (tmp_path / name / "results.json").write_text(json.dumps(run))
        paths.append(str(tmp_path / name))
    out = tmp_path / "joined"
    assert main(["report", *paths, "--caches", "int8,int2", "--output", str(out)]) == 0
    assert list(table_rows(capsys.readouterr().out)) == ["cache", "int8", "int2"]
    report = (out / "report.md").read_text()
    assert "Joined from 2 runs of the same documents (their caches: dynamic, int8; dynamic, int2)." in report
    record = tmp_path / "saved.json"  # a report as scripts/build_results.py saves it: rendered again, never re-joined
    record.write_text(json.dumps({"command": "hf-kvcache report ...", "kind": "report", "results": joined}))
    assert main(["report", str(record)]) == 0
    assert list(table_rows(capsys.readouterr().out)) == ["cache", "dynamic", "int8", "int2"]
    assert main(["report", str(record), paths[1]]) == 2
    assert "run 1 is a report of several runs (pooled or joined)" in capsys.readouterr().err

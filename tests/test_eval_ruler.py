"""RULER's synthetic tasks in the harness: documents of the asked length with the needles where the answers say,
RULER's scoring, intervals that can fail to separate caches, one prefill per document for every cache."""

from __future__ import annotations

import collections

import pytest
import torch

from hf_kvcache.cli import main
from hf_kvcache.eval import EvalConfig, run_eval
from hf_kvcache.eval.tasks.base import paired_difference
from hf_kvcache.eval.tasks.ruler import RULER_TASKS, build_ruler_document, interval, string_match_all

torch.set_num_threads(1)


@pytest.mark.parametrize("task", [t for t in RULER_TASKS if t not in ("cwe", "fwe")])
@pytest.mark.parametrize("length", [400, 1500])
def test_documents_have_the_length_and_state_every_answer(reference, ids, task, length):
    _, tokenizer = reference
    doc = build_ruler_document(tokenizer, ids[4000:], task, length, seed=3)
    assert len(doc.context) + len(doc.question) == length
    context, question = tokenizer.decode(doc.context), tokenizer.decode(doc.question)
    expected = {"niah_single": 1, "niah_multikey": 1, "niah_multivalue": 4, "niah_multiquery": 4, "vt": 5}[task]
    assert len(doc.answers) == len(set(doc.answers)) == expected
    if task == "vt":  # each answer is a variable of the chain that holds the asked value, assigned once
        value = question.split("assigned the value ")[1].split(" ")[0]
        assert f"VAR {doc.answers[0]} = {value}." in context
        for a, b in zip(doc.answers, doc.answers[1:]):
            assert context.count(f"VAR {b} = VAR {a}.") == 1
            assert context.index(f"VAR {b} = VAR {a}.") > context.index(f"VAR {a} =")  # hops in order
        assert context.count(" = ") == 2 * 5  # and a second chain of distractors
    else:
        for answer in doc.answers:
            assert context.count(f"is: {answer}.") == 1
            key = context.split(f"is: {answer}.")[0].rsplit("numbers for ", 1)[1].rstrip(" ")
            assert key in question  # the question asks for the key that holds the answer
        distractors = context.count("One of the special magic numbers") - expected
        assert distractors == (3 if task == "niah_multikey" else 0)
    # the same seed, the same document; another seed, another one
    assert build_ruler_document(tokenizer, ids[4000:], task, length, seed=3) == doc
    assert build_ruler_document(tokenizer, ids[4000:], task, length, seed=4).answers != doc.answers


@pytest.mark.parametrize("length", [1024, 2048])
def test_common_words_lists_ten_words_six_times_and_the_others_once(reference, ids, length):
    _, tokenizer = reference
    doc = build_ruler_document(tokenizer, ids[100:], "cwe", length, seed=5)
    assert length - 32 <= len(doc.context) + len(doc.question) <= length
    listed = tokenizer.decode(doc.context).split("Question: What are the 10 most common")[-2].split("\n")[-2]
    words = [w for w in listed.split() if not w.rstrip(".").isdigit()]
    counts = {w: words.count(w) for w in words}
    assert sorted(doc.answers) == sorted(w for w, n in counts.items() if n == 6) and len(doc.answers) == 10
    assert all(n == 1 for w, n in counts.items() if w not in doc.answers) and len(counts) > 40
    assert "The top 10 words that appear most often in the list are:" in tokenizer.decode(doc.question)


@pytest.mark.parametrize("length", [400, 2048])
def test_frequent_words_asks_for_the_three_most_frequent_after_the_noise(reference, ids, length):
    _, tokenizer = reference
    doc = build_ruler_document(tokenizer, ids, "fwe", length, seed=7)
    assert length - 32 <= len(doc.context) + len(doc.question) <= length
    text = tokenizer.decode(doc.context).split("three most frequently appeared coded words. ")[1]
    counts = collections.Counter(text.split("\nQuestion:")[0].split())
    ranked = [w for w, _ in counts.most_common()]
    assert ranked[0] == "..." and ranked[1:4] == doc.answers and len(ranked) >= 5
    assert counts[ranked[1]] > counts[ranked[2]] > counts[ranked[3]] > counts[ranked[4]]  # no tie at the answer's edge
    assert counts["..."] > 3 * counts[ranked[1]]  # Zeta(2): rank 1 four times rank 2 (floors aside)
    assert all(len(w) == 6 and w.isalpha() for w in ranked[1:])
    assert "the three most frequently appeared words are:" in tokenizer.decode(doc.question)
    assert build_ruler_document(tokenizer, ids, "fwe", length, seed=7) == doc
    assert build_ruler_document(tokenizer, ids, "fwe", length, seed=8).answers != doc.answers


def test_a_document_too_short_for_its_needles_is_a_clear_error(reference, ids):
    _, tokenizer = reference
    with pytest.raises(ValueError, match="--ruler-lengths 120 is too short for a niah_multiquery document"):
        build_ruler_document(tokenizer, ids, "niah_multiquery", 120, seed=0)
    with pytest.raises(ValueError, match="--ruler-lengths 300 is too short for a cwe document"):
        build_ruler_document(tokenizer, ids, "cwe", 300, seed=0)
    with pytest.raises(ValueError, match="--ruler-lengths 256 is too short for an fwe document: its 52 words leave"):
        build_ruler_document(tokenizer, ids, "fwe", 256, seed=3)


def test_string_match_all_counts_the_share_of_expected_strings():
    assert string_match_all(" 1234567, 7654321 and X", ["1234567", "7654321"]) == 1.0
    assert string_match_all("VAR abcde", ["ABCDE", "FGHIJ"]) == 0.5  # case-insensitive
    assert string_match_all("nothing", ["1234567"]) == 0.0


def test_intervals_are_wilson_for_all_or_nothing_scores_and_narrow_with_samples():
    low, high = interval([1.0] * 5 + [0.0] * 5)
    assert low == pytest.approx(0.2366, abs=1e-4) and high == pytest.approx(0.7634, abs=1e-4)  # Wilson, n = 10
    assert interval([1.0] * 10)[1] == 1.0 and interval([1.0] * 10)[0] < 0.75  # 10 of 10 still carries doubt
    wide, narrow = interval([0.5, 0.25, 0.75, 1.0]), interval([0.5, 0.25, 0.75, 1.0] * 25)
    assert narrow[1] - narrow[0] < (wide[1] - wide[0]) / 4
    low, high = interval([0.5, 0.5])  # two equal fractions: no spread seen, yet two documents prove little
    assert low < 0.15 and high > 0.85 and (low, high) == pytest.approx(interval([1.0, 0.0]))


def _cells(*per_cell: list[float]) -> list[dict]:
    return [{"task": "t", "length": 100 * i, "scores": scores} for i, scores in enumerate(per_cell)]


def test_a_cache_against_the_baseline_is_measured_document_by_document():
    base = _cells([1.0, 0.0, 1.0, 0.0] * 5, [0.5, 1.0] * 10)
    # the same scores: no difference, and the rule of three's +-3/N where no document disagrees
    assert paired_difference(base, base) == pytest.approx((0.0, -7.5, 7.5))
    # one cell loses every document it found (10 of 20), the other keeps all: -25 points, paired normal interval
    lost = _cells([0.0] * 20, [0.5, 1.0] * 10)
    difference, low, high = paired_difference(lost, base)
    spread = (0.5 * 0.5 * 20 / 19) ** 0.5  # the first cell's per-document differences: -1 or 0, half each
    assert difference == pytest.approx(-25.0)
    assert high - difference == pytest.approx(100 * 1.96 * spread / 20**0.5 / 2)
    assert low < difference < high < 0
    # the cells' own intervals overlap (0-16% against 30-70%) yet the paired difference is clear: the same documents
    assert interval([0.0] * 20)[1] > 0.15
    with pytest.raises(ValueError):
        paired_difference(base, _cells([1.0] * 20, [0.5] * 19))  # not the same documents


def test_the_suite_scores_every_cache_on_the_same_documents_with_one_prefill(reference):
    model, tokenizer = reference
    caches = ("dynamic", "int2", "sink:window=64:sinks=4")
    config = EvalConfig(task=("ruler",), caches=caches, ruler_tasks=("niah_single", "vt"), ruler_lengths=(512,),
                        ruler_samples=2, quiet=True)  # fmt: skip
    shared = run_eval(config, model, tokenizer)
    separate = run_eval(config.replace(separate_prefill=True), model, tokenizer)
    assert [r["ruler"] for r in shared["results"]] == [r["ruler"] for r in separate["results"]]
    first = shared["results"][0]["ruler"]
    assert [(c["task"], c["length"], c["samples"]) for c in first["cells"]] == [("niah_single", 512, 2), ("vt", 512, 2)]
    assert first["summary"]["points_vs_first"] == 0.0
    for entry in shared["results"]:
        for cell in entry["ruler"]["cells"]:
            assert cell["low"] <= cell["score"] <= cell["high"]


def test_documents_answered_in_batches_score_as_one_at_a_time_where_padding_changes_nothing(reference):
    """``--generate-batch``: a cell's documents answered several at a time (left-padded) through caches whose state
    padding cannot move score every document as one at a time; the run says so, and joins no run of another batch
    size nor pools with one (its lossy caches' answers may differ), while a run saved before the option existed joins
    a run at 1."""
    from hf_kvcache.eval import combine_runs, get_task
    from hf_kvcache.eval.runner import same_documents

    model, tokenizer = reference
    config = EvalConfig(task=("ruler", "passkey"), caches=("dynamic", "int8"), ruler_tasks=("fwe", "vt"),
                        ruler_lengths=(384,), ruler_samples=3, lengths=(256,), depths=(0.5,), samples=3,
                        quiet=True)  # fmt: skip
    one = run_eval(config, model, tokenizer)
    batched = run_eval(config.replace(generate_batch=2), model, tokenizer)
    for name in ("ruler", "passkey"):
        assert [r[name]["cells"] for r in batched["results"]] == [r[name]["cells"] for r in one["results"]]
        assert "at a time" in get_task(name).describe(EvalConfig.from_dict(batched["config"]))
        assert "at a time" not in get_task(name).describe(EvalConfig.from_dict(one["config"]))
    assert batched["config"]["generate_batch"] == 2 and one["config"]["generate_batch"] == 1
    assert not same_documents([one, batched])
    with pytest.raises(ValueError, match="runs of another generate_batch cannot pool: 1 and 2"):
        combine_runs([one, batched])
    older = one | {"config": {k: v for k, v in one["config"].items() if k != "generate_batch"}}
    assert same_documents([older, one]) and not same_documents([older, batched])


def test_ruler_flags_are_checked_before_the_model_loads(capsys):
    assert main(["eval", "--task", "ruler", "--ruler-tasks", "niah_single,bogus", "--quiet"]) == 2
    assert "--ruler-tasks: unknown task 'bogus'" in capsys.readouterr().err
    assert main(["eval", "--task", "ruler", "--ruler-lengths", "100", "--quiet"]) == 2
    assert "--ruler-lengths must be an integer >= 256" in capsys.readouterr().err
    assert main(["eval", "--task", "ruler", "--generate-batch", "0", "--quiet"]) == 2
    assert "--generate-batch must be an integer >= 1" in capsys.readouterr().err
    for flag, value, message in (
        ("--ruler-tasks", "vt,niah_single,vt", "--ruler-tasks names 'vt' twice; name each once"),
        ("--ruler-lengths", "512,512", "--ruler-lengths names 512 twice; name each once"),
    ):
        assert main(["eval", "--task", "ruler", flag, value, "--quiet"]) == 2
        assert message in capsys.readouterr().err
    for flag, value, message in (
        ("--lengths", "256,256", "--lengths names 256 twice"),
        ("--depths", "0.5,0.5", "--depths names 0.5 twice"),
    ):
        assert main(["eval", "--task", "passkey", flag, value, "--quiet"]) == 2
        assert message in capsys.readouterr().err


def test_ruler_through_the_cli_writes_its_table_and_heatmap(tmp_path, capsys):
    code = main(["eval", "--model", "reference", "--task", "ruler", "--ruler-tasks", "niah_multikey",
                 "--ruler-lengths", "300", "--ruler-samples", "1", "--caches", "dynamic,int4", "--threads", "1",
                 "--quiet", "--output", str(tmp_path)])  # fmt: skip
    assert code == 0
    report = (tmp_path / "report.md").read_text()
    assert "RULER retrieval and tracing" in report and "niah_multikey 300" in report and "95% interval" in report
    assert (tmp_path / "ruler_heatmap.png").stat().st_size > 0


def test_a_ruler_length_past_the_model_context_fails_before_the_first_document(capsys, monkeypatch):
    import hf_kvcache.eval.tasks.ruler as ruler

    monkeypatch.setattr(ruler, "answer_cell", lambda *a, **k: pytest.fail("a document ran"))
    args = ["eval", "--model", "reference", "--quiet", "--task", "ruler", "--ruler-lengths", "1024,4096"]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert "--ruler-lengths 4096: longer than the model's context (2048 tokens" in err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err

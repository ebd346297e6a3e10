"""The harness's long-context tasks: passkey documents, repeat against a full forward, and what caches cost there."""

from __future__ import annotations

import functools
import typing

import pytest
import torch
from models import VOCAB, tiny_model
from transformers import DynamicCache

from hf_kvcache.cli import main
from hf_kvcache.eval import EvalConfig, build_passkey_document, format_eval_table, repeat_nll, run_eval
from hf_kvcache.eval.tasks.passkey import needle

torch.set_num_threads(1)


@pytest.mark.parametrize("length", [128, 512, 1900])
@pytest.mark.parametrize("depth", [0.0, 0.3, 1.0])
def test_passkey_document_states_the_key_once_at_its_depth(reference, ids, length, depth):
    _, tokenizer = reference
    doc = build_passkey_document(tokenizer, ids[5000:], length, depth, "48213")
    assert len(doc.context) + len(doc.question) == length
    text = tokenizer.decode(doc.context + doc.question, skip_special_tokens=True)
    assert text.count("48213") == 2 and text.count(needle("48213").strip()) == 1  # one needle (it says the key twice)
    assert text.rstrip().endswith("What is the pass key? The pass key is")
    middle = tokenizer(needle("48213"), add_special_tokens=False)["input_ids"]
    assert doc.context[doc.needle_start : doc.needle_start + len(middle)] == middle
    if depth == 0.0:
        assert text.index("48213") < 250  # right after the instruction
    if depth == 1.0:
        assert len(text) - text.rindex("48213") < 80  # right before the question


def test_passkey_document_too_short_is_a_clear_error(reference, ids):
    _, tokenizer = reference
    with pytest.raises(ValueError, match="too short for a passkey document"):
        build_passkey_document(tokenizer, ids, 40, 0.5, "12345")


@pytest.mark.parametrize("chunk", [1, 5])
def test_repeat_through_dynamic_cache_equals_a_full_forward(reference, ids, chunk):
    model, _ = reference
    passages = torch.stack([ids[1000:1064], ids[9000:9064]])
    gaps = torch.stack([ids[3000:3200], ids[20000:20200]])
    first, second = repeat_nll(model, passages, gaps, DynamicCache(config=model.config), chunk)
    whole = torch.cat([passages, gaps, passages], dim=1)
    with torch.no_grad():
        logits = model(input_ids=whole).logits
    nll = torch.nn.functional.cross_entropy(logits[:, :-1].transpose(1, 2), whole[:, 1:], reduction="none")
    n, g = passages.shape[1], gaps.shape[1]
    torch.testing.assert_close(first, nll[:, : n - 1], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(second, nll[:, n + g : n + g + n - 1], rtol=1e-4, atol=1e-4)


# 2 bits without smoothed keys: on the reference model int2's default costs second copies only 0.2% over int8
INT2 = "int2:smooth=0"


@pytest.mark.slow
def test_int2_costs_more_than_int8_on_repeat(reference):
    model, tokenizer = reference
    config = EvalConfig(
        task=("repeat",), caches=("dynamic", "int8", INT2), distances=(0, 512), samples=4, passage=128, quiet=True
    )
    second = {
        r["cache"]: r["repeat"]["summary"]["second_copy_perplexity"]
        for r in run_eval(config, model, tokenizer)["results"]
    }
    assert second[INT2] > second["int8"] * 1.002
    assert abs(second["int8"] / second["dynamic"] - 1) < 0.002


def test_a_sink_window_shorter_than_the_key_distance_loses_the_passkey(reference):
    model, tokenizer = reference
    config = EvalConfig(
        task=("passkey",),
        caches=("dynamic", "sink:window=128:sinks=4"),
        lengths=(1024,),
        depths=(0.0, 0.25, 0.5),  # the key is 500 to 1,000 tokens before the question: outside a 128-token window
        samples=2,
        quiet=True,
    )
    results = {r["cache"]: r["passkey"]["summary"]["accuracy"] for r in run_eval(config, model, tokenizer)["results"]}
    assert results["dynamic"] >= 5 / 6
    assert results["sink:window=128:sinks=4"] <= 1 / 6


@pytest.mark.parametrize(
    "args, message",
    [
        (["--task", "nope"], "--task"),
        (["--task", "passkey", "--lengths", "32"], "--lengths must be an integer >= 64"),
        (["--task", "passkey", "--lengths", "a,b"], "--lengths"),
        (["--task", "passkey", "--depths", "1.5"], "--depths must be numbers from 0 to 1"),
        (["--task", "passkey", "--samples", "0"], "--samples must be an integer >= 1"),
        (["--task", "passkey", "--key-digits", "0"], "--key-digits"),
        (["--task", "repeat", "--distances", "-3"], "--distances must be an integer >= 0"),
        (["--task", "repeat", "--passage", "1"], "--passage must be an integer >= 2"),
        (["--task", "repeat", "--repeat-chunk", "0"], "--repeat-chunk must be an integer >= 1"),
    ],
)
def test_task_flags_are_checked_before_the_model_loads(args, message, capsys, monkeypatch):
    import hf_kvcache.eval.runner as runner

    monkeypatch.setattr(runner, "load_configured_model", lambda config: pytest.fail("the model was loaded"))
    assert main(["eval", "--quiet", *args]) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1 and "Traceback" not in err


def test_a_passkey_length_past_the_model_context_fails_before_the_first_document(capsys, monkeypatch):
    import hf_kvcache.eval.tasks.passkey as passkey

    monkeypatch.setattr(passkey, "answers_of", lambda *a, **k: pytest.fail("a document ran"))
    assert main(["eval", "--model", "reference", "--quiet", "--task", "passkey", "--lengths", "512,5000"]) == 2
    err = capsys.readouterr().err
    assert "--lengths 5000: longer than the model's context (2048 tokens" in err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err


def test_repeat_past_the_model_context_fails_before_the_first_document(capsys, monkeypatch):
    import hf_kvcache.eval.tasks.repeat as repeat

    monkeypatch.setattr(repeat, "repeat_nll", lambda *a, **k: pytest.fail("a document ran"))
    assert main(["eval", "--model", "reference", "--quiet", "--task", "repeat", "--distances", "0,2000"]) == 2
    assert "more than the model's context (2048 tokens)" in capsys.readouterr().err


SHARED_SPECS = ["dynamic", "int8", "int2", "sink:window=128:sinks=4", "paged:block_size=16", "int4:residual_length=32"]


def test_passkey_shares_each_documents_prefill_and_answers_as_each_cache_alone(reference, ids, monkeypatch):
    """One prefill per document, its K/V handed to every cache (a sliding window evicting inside it, pages, codes):
    every cache answers exactly what it answers after its own prefill, for one forward over the document instead of
    one per cache."""
    from hf_kvcache.eval.tasks import EvalData
    from hf_kvcache.eval.tasks.passkey import answers_of

    model, tokenizer = reference
    data = EvalData(model, tokenizer, ids)
    doc = build_passkey_document(tokenizer, ids[3000:], 600, 0.4, "70431")
    long_forwards = []
    forward = type(model).forward

    @functools.wraps(forward)  # the signature kept: caches check that the forward takes past_key_values
    def counting(self, *args, **kwargs):
        ids_ = kwargs.get("input_ids")
        if ids_ is not None and ids_.shape[1] >= len(doc.context):
            long_forwards.append(ids_.shape[1])
        return forward(self, *args, **kwargs)

    monkeypatch.setattr(type(model), "forward", counting)
    separate = answers_of(data, [doc], SHARED_SPECS, separate=True)
    assert len(long_forwards) == len(SHARED_SPECS)  # the context through each cache (generate forwards the question)
    long_forwards.clear()
    shared = answers_of(data, [doc], SHARED_SPECS, separate=False)
    assert len(long_forwards) == 1
    assert shared == separate
    assert separate[0][0].strip().startswith("70431")  # the model finds it through DynamicCache: a real comparison


def _long_forwards(model, monkeypatch, columns: int) -> list[int]:
    """The widths of the model's forwards of at least ``columns`` columns, recorded as they run."""
    seen: list[int] = []
    forward = type(model).forward

    @functools.wraps(forward)  # the signature kept: caches check that the forward takes past_key_values
    def counting(self, *args, **kwargs):
        ids_ = kwargs.get("input_ids")
        if ids_ is not None and ids_.shape[1] >= columns:
            seen.append(ids_.shape[1])
        return forward(self, *args, **kwargs)

    monkeypatch.setattr(type(model), "forward", counting)
    return seen


def test_documents_of_one_length_answered_together_answer_as_each_alone(reference, ids, monkeypatch):
    """Documents of one length and question share no padding: answered as one batch (one prefill for every cache),
    every cache gives each document the answer it gives it alone: its rows are their own, int4's groups and int2's
    smoothed keys' scales (measured per row) included."""
    from hf_kvcache.eval.tasks import EvalData
    from hf_kvcache.eval.tasks.passkey import answers_of

    model, tokenizer = reference
    data = EvalData(model, tokenizer, ids)
    docs = [build_passkey_document(tokenizer, ids[3000 + 700 * i :], 500, 0.3 + 0.2 * i, key)
            for i, key in enumerate(["70431", "2291", "86003"])]  # fmt: skip
    specs = SHARED_SPECS
    assert "int2" in specs
    alone = [[answers_of(data, [doc], [spec], separate=False)[0][0] for doc in docs] for spec in specs]
    long_forwards = _long_forwards(model, monkeypatch, 400)
    together = answers_of(data, docs, specs, separate=False)
    assert long_forwards == [len(docs[0].context)]  # one prefill, the three documents' contexts in it
    assert together == alone
    assert sum(answer.strip().startswith(doc.key) for answer, doc in zip(together[0], docs)) >= 2  # found: a real test


class _Document(typing.NamedTuple):
    context: list[int]
    question: list[int]


class _Tokens:
    """What generate_answers reads of a tokenizer: the pad id, and a decode that shows the ids."""

    pad_token_id, eos_token_id = 0, None

    def decode(self, ids, skip_special_tokens=True):
        return " ".join(map(str, ids.tolist()))


@pytest.mark.parametrize("family", ["llama", "gpt2", "gemma3"])
def test_left_padded_documents_answer_as_alone_through_the_caches_padding_cannot_move(family):
    """Documents of other lengths and one question length, left-padded into one batch: where padding changes nothing
    a cache stores (lossless caches, int8's per-token codes, a window whose sinks are each row's first real tokens,
    evicting here), every answer is the one the document gets alone. int4 / int3 / int2 group tokens, so padding
    shifts their groups and can move their answers (not tested equal)."""
    from hf_kvcache.eval.tasks import EvalData
    from hf_kvcache.eval.tasks.passkey import answers_of, padded_batch

    model = tiny_model(family)
    g = torch.Generator().manual_seed(0)

    def tokens(n: int) -> list[int]:
        return torch.randint(3, VOCAB, (n,), generator=g).tolist()

    docs = [_Document(tokens(n), tokens(5)) for n in (40, 33, 47)]
    batch, mask, context = padded_batch(docs, "cpu")
    assert context == 47 and mask.sum(1).tolist() == [45, 38, 52]  # each row's whole context is the prefill
    data = EvalData(model, _Tokens(), torch.zeros(1))
    specs = ["dynamic", "int8", "sink:window=16:sinks=2", "paged:block_size=8"]
    together = answers_of(data, docs, specs, separate=False, answer_tokens=6)
    alone = [[answers_of(data, [doc], [spec], False, 6)[0][0] for doc in docs] for spec in specs]
    assert together == alone
    assert answers_of(data, docs, specs, separate=True, answer_tokens=6) == together


def test_a_cell_is_answered_in_batches_of_one_question_length_and_read_back_in_its_order(monkeypatch):
    """A batch holds documents of one question length (so no row puts context through the cache with its question),
    at most --generate-batch of them; the answers come back in the cell's order."""
    from hf_kvcache.eval.tasks import passkey

    seen = []

    def answering(data, docs, specs, separate, answer_tokens):
        seen.append([len(doc.question) for doc in docs])
        return [[f"{spec}:{doc.context[0]}" for doc in docs] for spec in specs]

    monkeypatch.setattr(passkey, "answers_of", answering)
    docs = [_Document([j], [0] * q) for j, q in enumerate([5, 7, 5, 5, 7, 5, 9])]
    config = EvalConfig(task=("ruler",), generate_batch=2)
    answers = passkey.answer_cell(None, docs, ["a", "b"], config, 4)
    assert answers == [[f"{spec}:{j}" for j in range(len(docs))] for spec in ("a", "b")]
    assert seen == [[5, 5], [5, 5], [7, 7], [9]]


def test_a_cache_that_refuses_a_handed_over_prefill_prefills_itself(reference, ids, monkeypatch):
    from hf_kvcache import prefill
    from hf_kvcache.eval.tasks import EvalData
    from hf_kvcache.eval.tasks.passkey import answers_of

    model, tokenizer = reference
    data = EvalData(model, tokenizer, ids)
    doc = build_passkey_document(tokenizer, ids[1000:], 300, 0.5, "5512")
    into = prefill.SharedPrefill.into

    def refusing(self, cache):
        if type(cache).__name__ == "QuantizedKVCache":
            cache.layers[0].write(*self.key_values[0])  # half-written, then refused: the task must not use it
            raise ValueError("cannot take a handed-over prefill")
        return into(self, cache)

    monkeypatch.setattr(prefill.SharedPrefill, "into", refusing)
    specs = ["dynamic", "int8"]
    assert answers_of(data, [doc], specs, separate=False) == answers_of(data, [doc], specs, separate=True)


def test_eval_results_are_the_same_with_a_shared_or_a_separate_prefill(reference):
    model, tokenizer = reference
    config = EvalConfig(task=("passkey",), caches=("dynamic", "int2", "sink:window=128:sinks=4"), lengths=(512,),
                        depths=(0.2, 0.8), samples=2, quiet=True)  # fmt: skip
    shared = run_eval(config, model, tokenizer)
    separate = run_eval(config.replace(separate_prefill=True), model, tokenizer)
    assert [r["passkey"] for r in shared["results"]] == [r["passkey"] for r in separate["results"]]
    assert shared["config"]["separate_prefill"] is False and separate["config"]["separate_prefill"] is True


def test_repeat_shares_each_distances_prefill_with_the_same_numbers(reference):
    """The passages and the text after them prefilled once per distance for every cache: every number (first copy
    from the shared logits, second copy through each cache) as with each cache's own prefill."""
    model, tokenizer = reference
    config = EvalConfig(task=("repeat",), caches=("dynamic", "int2", "sink:window=128:sinks=4", "paged:block_size=16"),
                        distances=(0, 300), passage=48, samples=2, quiet=True)  # fmt: skip
    shared = run_eval(config, model, tokenizer)
    separate = run_eval(config.replace(separate_prefill=True), model, tokenizer)
    assert [r["repeat"] for r in shared["results"]] == [r["repeat"] for r in separate["results"]]
    ratios = [r["repeat"]["summary"]["ratio"] for r in shared["results"]]
    assert ratios[0] < 0.5 and ratios[2] > ratios[0]  # the model copies; a window shorter than 300 tokens loses it


def test_passkey_table_gives_each_rate_its_interval():
    """Every passkey rate comes with its 95% Wilson interval (the intervals of a few documents are wide: 2 of 2 is
    34-100%), so a reader sees which differences between caches the sample count can carry."""
    from hf_kvcache.eval.tasks.base import wilson
    from hf_kvcache.eval.tasks.passkey import PasskeyTask

    cells = [
        {"length": 512, "depth": 0.5, "correct": 2, "samples": 2},
        {"length": 1024, "depth": 0.5, "correct": 0, "samples": 2},
    ]
    table = PasskeyTask().table({"results": [{"cache": "dynamic", "passkey": {"cells": cells}}]})
    row = next(line for line in table.splitlines() if line.startswith("| dynamic"))
    cells_shown = [cell.strip() for cell in row.strip("|").split("|")]
    assert cells_shown == ["dynamic", "50% [15-85]", "100% [34-100]", "0% [0-66]"]
    assert "2 documents per length" in table
    low, high = wilson(5, 10)
    assert 0.23 < low < 0.24 and 0.76 < high < 0.77 and wilson(10, 10)[1] == 1.0 and wilson(0, 10)[0] == 0.0
    with pytest.raises(ValueError, match="n must be at least 1"):
        wilson(0, 0)


def test_scoring_tasks_give_the_same_numbers_stepwise_in_fewer_forwards(reference, monkeypatch):
    """perplexity, repeat and stream feed their scored tokens in the forwards each cache allows
    (:mod:`hf_kvcache.scoring`): every number as with one token per forward, to float rounding, in fewer forwards
    for the caches that allow more than one token."""
    from hf_kvcache import scoring

    model, tokenizer = reference
    caches = ("dynamic", "int8", "int2", "sink:window=128:sinks=4", "paged:block_size=16")
    config = EvalConfig(task=("perplexity", "repeat", "stream"), caches=caches, max_tokens=256, context=256,
                        prefill=64, distances=(0, 200), passage=48, samples=2, stream_tokens=400, bucket=200,
                        quiet=True)  # fmt: skip
    sizes = []
    original = scoring.decode_equivalent_tokens
    monkeypatch.setattr(scoring, "decode_equivalent_tokens", lambda c, n: sizes.append(original(c, n)) or sizes[-1])
    merged = run_eval(config, model, tokenizer)
    assert max(sizes) > 64 and sizes.count(1) < len(sizes)
    sizes.clear()
    stepwise = run_eval(config.replace(stepwise=True), model, tokenizer)
    assert not sizes and stepwise["config"]["stepwise"] is True
    assert list(merged["seconds"]) == ["perplexity", "repeat", "stream"]  # each task's wall time, every cache
    assert all(s >= 0 for s in merged["seconds"].values())
    assert "Wall time" in format_eval_table(merged)
    for a, b in zip(merged["results"], stepwise["results"]):
        assert a["perplexity"]["tokens_scored"] == b["perplexity"]["tokens_scored"]
        assert a["perplexity"]["cache_bytes"] == b["perplexity"]["cache_bytes"]
        assert a["perplexity"]["nll"] == pytest.approx(b["perplexity"]["nll"], rel=1e-5)
        for x, y in zip(a["repeat"]["cells"], b["repeat"]["cells"]):
            assert x["second_copy_perplexity"] == pytest.approx(y["second_copy_perplexity"], rel=1e-5)
        assert a["stream"]["cache_bytes"] == b["stream"]["cache_bytes"]  # read after each bucket's last token
        assert a["stream"]["nll"] == pytest.approx(b["stream"]["nll"], rel=1e-5)


def test_passkey_table_compares_caches_document_by_document_when_it_has_their_answers():
    """Runs keep each document's answer (1 or 0), so the table adds each cache's accuracy against the first cache's
    over the same documents with the paired interval; runs saved without them keep the table they had."""
    from hf_kvcache.eval.tasks.passkey import PasskeyTask

    def cache(name, scores):
        cells = [{"length": 512, "depth": 0.5, "correct": int(sum(scores)), "samples": len(scores), "scores": scores}]
        return {"cache": name, "passkey": {"cells": cells}}

    base = [1.0] * 10 + [0.0] * 10
    lost = [1.0] * 5 + [0.0] * 15  # five documents the baseline found, this cache did not
    table = PasskeyTask().table({"results": [cache("dynamic", base), cache("int2", lost), cache("int8", base)]})
    rows = {line.split("|")[1].strip(): [c.strip() for c in line.strip("|").split("|")] for line in table.splitlines()
            if line.startswith("| ")}  # fmt: skip
    assert rows["cache"][:3] == ["cache", "accuracy", "vs first"]
    assert rows["dynamic"][2] == "" and rows["int8"][2] == "+0 [-15, +15]"  # the same answers: 3/N = 15 points
    assert rows["int2"][2].startswith("-25 [-")
    assert "paired" in table

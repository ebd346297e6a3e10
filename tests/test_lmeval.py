"""The ``hf-kvcache`` lm-eval model: scores through the cache, equal to lm-eval's ``hf`` model with DynamicCache."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

pytest.importorskip("lm_eval")

from lm_eval.api.instance import Instance  # noqa: E402
from lm_eval.models.huggingface import HFLM  # noqa: E402

import hf_kvcache.lmeval as lmeval  # noqa: E402
from hf_kvcache import reference_model_path, reference_text  # noqa: E402

torch.set_num_threads(1)
PATH = str(reference_model_path())
TEXT = reference_text()


def _lm(cls=lmeval.HFKVCacheLM, **kwargs):
    return cls(pretrained=PATH, device="cpu", dtype="float32", batch_size=kwargs.pop("batch_size", 3), **kwargs)


@pytest.fixture(scope="module")
def hf():
    return _lm(HFLM)


def _requests(kind: str, pairs) -> list[Instance]:
    return [Instance(request_type=kind, doc={}, arguments=args, idx=i) for i, args in enumerate(pairs)]


# Contexts of different lengths (left padding inside a batch), continuations of 1 to many tokens.
PAIRS = [
    (TEXT[1000:1400], TEXT[1400:1460]),
    (TEXT[5000:5100], " Anne"),
    (TEXT[9000:10500], TEXT[10500:10530]),
    (TEXT[20000:20050], TEXT[20050:20200]),
    (TEXT[30000:30300], "."),
]


@pytest.mark.parametrize("chunk", [1, 7])
def test_dynamic_cache_equals_lm_evals_hf_model(hf, chunk):
    ours = _lm(chunk=chunk).loglikelihood(_requests("loglikelihood", PAIRS))
    theirs = hf.loglikelihood(_requests("loglikelihood", PAIRS))
    for (a, greedy_a), (b, greedy_b) in zip(ours, theirs):
        assert a == pytest.approx(b, abs=2e-3, rel=1e-4)
        assert greedy_a == greedy_b


def test_rolling_loglikelihood_equals_lm_evals_hf_model(hf):
    docs = [(TEXT[40000:46000],), (TEXT[50000:50500],)]  # the first spans several max_length windows
    ours = _lm(max_length=512).loglikelihood_rolling(_requests("loglikelihood_rolling", docs))
    theirs = _lm(HFLM, max_length=512).loglikelihood_rolling(_requests("loglikelihood_rolling", docs))
    assert ours == pytest.approx(theirs, abs=5e-3, rel=1e-4)


def test_lossy_caches_change_the_scores_within_bounds(hf):
    requests = _requests("loglikelihood", PAIRS[:3])
    base = [ll for ll, _ in hf.loglikelihood(requests)]
    int8 = [ll for ll, _ in _lm(cache="int8").loglikelihood(requests)]
    int2 = [ll for ll, _ in _lm(cache="int2:residual_length=0:sinks=0").loglikelihood(requests)]
    drift8 = max(abs(a - b) for a, b in zip(int8, base))
    drift2 = max(abs(a - b) for a, b in zip(int2, base))
    assert 0 < drift8 < drift2  # the cache is really read: a forward over context + continuation would give 0


@pytest.mark.parametrize("cache", ["int2:residual_length=16:group_size=16", "sink:window=64:sinks=4", "int8"])
def test_scores_are_decodings_in_the_forwards_each_cache_allows(cache):
    """Continuations go through the cache in the forwards :mod:`hf_kvcache.scoring` allows (left-padded rows
    included): the scores of one token per forward, to rounding."""
    requests = _requests("loglikelihood", PAIRS)
    merged = _lm(cache=cache).loglikelihood(requests)
    stepwise = _lm(cache=cache, stepwise=True).loglikelihood(requests)
    for (a, greedy_a), (b, greedy_b) in zip(merged, stepwise):
        assert a == pytest.approx(b, abs=1e-3, rel=1e-5)
        assert greedy_a == greedy_b


def test_generate_until_passes_a_fresh_cache_each_call(monkeypatch, hf):
    made = []
    real = lmeval.make_cache

    def spy(spec, model):
        made.append(spec)
        return real(spec, model)

    lm = _lm(cache="int8", batch_size=1)
    monkeypatch.setattr(lmeval, "make_cache", spy)
    prompts = [(TEXT[100:600], {"until": ["\n\n"], "max_gen_toks": 12, "do_sample": False}), (TEXT[700:900], {})]
    ours = lm.generate_until(_requests("generate_until", prompts))
    assert made == ["int8", "int8"]
    dynamic = _lm(batch_size=1).generate_until(_requests("generate_until", prompts))
    theirs = hf.generate_until(_requests("generate_until", prompts))
    assert dynamic == theirs and len(ours) == 2


@pytest.mark.parametrize(
    "args,message",
    [
        ({"cache": "int5"}, "int5"),
        ({"chunk": 0}, "chunk"),
        ({"prefill_chunk": 0}, "prefill_chunk"),
        ({"stepwise": "yes"}, "stepwise"),
        ({"cache": "int4:group_size=7"}, "group_size"),
    ],
)
def test_bad_model_args_are_clear(args, message):
    with pytest.raises(ValueError, match=message):
        _lm(**args)


def test_local_passkey_task_through_lm_evals_cli(tmp_path):
    """The documented command: write the local task, run lm-eval's CLI with the hf-kvcache model, read the score."""
    name = lmeval.write_passkey_task(tmp_path / "tasks", lengths=(256,), depths=(0.0, 0.9), samples=2)
    rows = [json.loads(line) for line in (tmp_path / "tasks" / f"{name}.jsonl").read_text().splitlines()]
    assert len(rows) == 4 and all(len(r["choices"]) == 4 and r["choices"][r["answer"]] in r["context"] for r in rows)
    assert all(sum(c in r["context"] for c in r["choices"]) == 1 for r in rows)  # only the true key is stated
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "hf_kvcache.lmeval", "--model", "hf-kvcache"]
    cmd += ["--model_args", f"pretrained={PATH},cache=sink:window=64:sinks=4,dtype=float32", "--device", "cpu"]
    cmd += ["--tasks", name, "--include_path", str(tmp_path / "tasks"), "--output_path", str(out)]
    env = os.environ | {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"|{name}" in proc.stdout.replace(" ", "") or name in proc.stdout
    (results,) = list(out.rglob("results_*.json"))
    acc = json.loads(results.read_text())["results"][name]["acc,none"]
    assert 0 <= acc <= 1

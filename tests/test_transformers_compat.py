"""The name a cache travels under across the transformers releases we support: ``past_key_values`` (5.23; remote
code; a caller's deprecated spelling on 5.24) and ``cache`` (5.24). Every name a release accepts must reach the
cache's padding hook and give the same tokens; the package's own calls use the name the model takes."""

from __future__ import annotations

import inspect
import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from models import generate, prompt, tiny_model
from transformers import DynamicCache, LlamaForCausalLM

from hf_kvcache import make_cache
from hf_kvcache._compat import (
    CACHE_ARG,
    CACHE_NAMES,
    TESTED_MINORS,
    cache_arg,
    passed_cache,
    returned_cache,
    untested_release,
    with_cache,
)
from hf_kvcache.layers._common import AttentionMode
from hf_kvcache.plan import kv_bytes

# The names this release's generate() and forwards accept: the deprecated one keeps working on 5.24 (with a
# FutureWarning, until 5.40 for forwards and 6.0 for generate), the new one does not exist before.
ACCEPTED = ("past_key_values",) if CACHE_ARG == "past_key_values" else ("cache", "past_key_values")


class _RemoteCode(torch.nn.Module):
    """A forward written for transformers before 5.24 (as trust_remote_code models are)."""

    def forward(self, input_ids, attention_mask=None, past_key_values=None):
        return past_key_values


class _NoCache(torch.nn.Module):
    def forward(self, input_ids, attention_mask=None):
        return input_ids


def test_release_name_is_the_one_its_models_take():
    assert CACHE_ARG in inspect.signature(LlamaForCausalLM.forward).parameters
    assert cache_arg(tiny_model("llama", "sdpa")) == CACHE_ARG


def test_with_cache_uses_the_name_the_forward_takes():
    marker = object()
    assert with_cache(_RemoteCode(), marker) == {"past_key_values": marker}
    assert _RemoteCode()(torch.zeros(1, 1), **with_cache(_RemoteCode(), marker)) is marker
    assert with_cache(tiny_model("llama", "sdpa"), marker) == {CACHE_ARG: marker}
    assert cache_arg(_NoCache()) is None
    assert with_cache(_NoCache(), marker) == {CACHE_ARG: marker}  # nothing to go by: the release's name


def test_passed_and_returned_cache_read_either_name():
    a, b = object(), object()
    assert passed_cache({"cache": a}) is a
    assert passed_cache({"past_key_values": b}) is b
    assert passed_cache({"cache": None, "past_key_values": b}) is b
    assert passed_cache({"input_ids": 1}) is None
    assert returned_cache(SimpleNamespace(cache=a)) is a
    assert returned_cache(SimpleNamespace(past_key_values=b)) is b
    assert returned_cache(SimpleNamespace(logits=1)) is None
    assert set(CACHE_NAMES) == {"cache", "past_key_values"}


def test_a_model_without_a_cache_argument_is_refused_by_name():
    config = tiny_model("llama", "sdpa").config
    with pytest.raises(ValueError, match=r"takes no cache argument \(neither cache nor past_key_values"):
        AttentionMode(config, model=_NoCache())
    AttentionMode(config, model=_RemoteCode())  # the old name alone is a cache argument


def test_plan_refuses_a_model_without_a_cache_argument_as_the_caches_do():
    """Reformer (transformers 5.24 generates it, with state of its own): ``plan`` must not size a cache for it."""
    model = _NoCache()
    model.config = tiny_model("llama", "sdpa").config
    with pytest.raises(ValueError, match=r"_NoCache \(model_type 'llama'\) takes no cache argument"):
        kv_bytes("int8", model, tokens=8)
    assert kv_bytes("int8", tiny_model("llama", "sdpa"), tokens=8) > 0


@pytest.mark.parametrize("name", ACCEPTED)
def test_each_accepted_name_reaches_the_padding_hook(name):
    """A forward passed the cache under either name tells it each row's left padding (the model's pre-hook reads
    the forward's keyword arguments, before transformers renames a deprecated one)."""
    torch.set_num_threads(1)
    model = tiny_model("llama", "sdpa")
    cache = make_cache("int4:group_size=4:residual_length=4:sinks=2", model)  # sinks: it reads the padding
    with torch.no_grad():
        out = model(**prompt("padded"), **{name: cache})
    assert returned_cache(out) is cache
    assert cache.padding.pad == (0, 5)


@pytest.mark.parametrize(
    "spec", ["int4:group_size=4:residual_length=4:sinks=2", "sink:window=8:sinks=2", "paged:block_size=4"]
)
@pytest.mark.parametrize("name", ACCEPTED)
def test_generate_gives_the_same_tokens_under_every_accepted_name(spec, name):
    """Left-padded greedy generation through our caches: whichever name the cache is passed by, the tokens and logits
    of a cache told the padding directly (built from the config, ``padding.observe``: no hook involved); lossless
    kinds equal DynamicCache's."""
    torch.set_num_threads(1)
    model = tiny_model("llama", "sdpa")
    inputs = prompt("padded")
    with torch.no_grad():
        got = model.generate(
            **inputs, **{name: make_cache(spec, model)}, max_new_tokens=8, min_new_tokens=8, do_sample=False,
            output_logits=True, return_dict_in_generate=True,
        )  # fmt: skip
    told = make_cache(spec, model.config)
    told.padding.observe(inputs["attention_mask"])
    want = generate(model, told, inputs)
    torch.testing.assert_close(got.sequences, want.sequences, rtol=0, atol=0)
    for a, b in zip(got.logits, want.logits):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    if spec.startswith("paged"):
        ref = generate(model, DynamicCache(config=model.config), inputs)
        torch.testing.assert_close(got.sequences, ref.sequences, rtol=0, atol=0)


def test_untested_minors_are_named_and_tested_ones_pass():
    assert untested_release("5.23.0") is None and untested_release("5.24.1") is None
    for version in ("5.22.2", "5.25.0", "5.25.0.dev0", "6.0.0"):
        message = untested_release(version)
        assert f"tested with transformers 5.23 and 5.24; this is {version}." in message and "\n" not in message


def test_the_tested_minors_are_pyprojects_range():
    text = (Path(__file__).resolve().parent.parent / "pyproject.toml").read_text()
    low, high = re.search(r'"transformers>=(\d+\.\d+),<(\d+\.\d+)"', text).groups()
    first, last = TESTED_MINORS[0], TESTED_MINORS[-1]
    assert low == f"{first[0]}.{first[1]}" and high == f"{last[0]}.{last[1] + 1}"
    assert [minor[1] for minor in TESTED_MINORS] == list(range(first[1], last[1] + 1))


@pytest.mark.slow
def test_importing_under_an_untested_minor_warns_once():
    code = (
        "import warnings, transformers\n"
        "transformers.__version__ = '5.25.0'\n"
        "with warnings.catch_warnings(record=True) as seen:\n"
        "    warnings.simplefilter('always', UserWarning)\n"
        "    import hf_kvcache\n"
        "print([str(w.message) for w in seen if 'tested with transformers' in str(w.message)])\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert "this is 5.25.0." in out.stdout and out.stdout.count("tested with transformers") == 1, out.stderr[-2000:]

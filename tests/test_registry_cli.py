"""make_cache spec strings and the hf-kvcache command line."""

from __future__ import annotations

import pytest
from models import tiny_model
from tables import table_rows
from transformers import DynamicCache

from hf_kvcache import QuantizedKVCache, available_caches, make_cache, parse_spec
from hf_kvcache.cli import main


def test_spec_parsing():
    assert parse_spec("int4:group_size=32:residual_length=64") == ("int4", {"group_size": 32, "residual_length": 64})
    assert parse_spec(" int8:backend=bitsandbytes:scale_dtype=none ") == (
        "int8",
        {"backend": "bitsandbytes", "scale_dtype": None},
    )


def test_make_cache_builds_each_kind():
    config = tiny_model("llama").config
    assert isinstance(make_cache("dynamic", config), DynamicCache)
    cache = make_cache("int4:group_size=8:residual_length=16", config)
    assert isinstance(cache, QuantizedKVCache) and (cache.bits, cache.group_size, cache.residual_length) == (4, 8, 16)
    assert make_cache("int2", tiny_model("llama")).bits == 2  # a model works too
    assert {"dynamic", "int8", "int4", "int2"} <= set(available_caches())


@pytest.mark.parametrize(
    ("spec", "match"),
    [
        ("int3", "unknown cache kind 'int3'.*known kinds: dynamic, int8, int4, int2"),
        ("int4:group_size", "must look like name=value"),
        ("int4:window=4", "has no option window; its options: group_size"),
        ("dynamic:bits=4", "has no option bits; its options: none"),
        ("", "non-empty string"),
        ("int4:group_size=7", "group_size must divide head_dim"),
        ("int8:group_size=32:group_size=64", "option 'group_size' is given twice"),
        ("int4:bits=4", "has no option bits"),
        ("int4:group_size=8.0", "group_size must be an integer"),
        ("sink:window=64.0", "window must be an integer"),
        ("sink:bits=8.0", "bits must be None"),
    ],
)
def test_bad_specs_are_value_errors(spec, match):
    with pytest.raises(ValueError, match=match):
        make_cache(spec, tiny_model("llama").config)


def test_cli_list(capsys):
    assert main(["list"]) == 0
    out = capsys.readouterr().out
    assert "int4" in out and "residual_length" in out


def test_cli_demo_runs_offline(capsys):
    args = ["demo", "--prompt-tokens", "32", "--new-tokens", "4", "--repeats", "1"]
    assert main([*args, "--caches", "dynamic,int8,int4:group_size=8:residual_length=4,sink:window=8:sinks=2"]) == 0
    out = capsys.readouterr().out
    rows = table_rows(out)
    assert "int8" in rows and rows["dynamic"][1] == "4" and "sink:window=8:sinks=2" in rows
    assert "Columns: same tokens" in out and "Continuations of the prompt" in out


def test_cli_reports_bad_spec(capsys):
    assert main(["demo", "--caches", "nope", "--prompt-tokens", "8", "--new-tokens", "2", "--repeats", "1"]) == 2
    assert "unknown cache kind 'nope'" in capsys.readouterr().err

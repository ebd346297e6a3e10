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
        ("int5", "unknown cache kind 'int5'.*known kinds: dynamic, int8, fp8, int4, int3, int2"),
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
    args = ["demo", "--model", "reference", "--document-tokens", "96", "--new-tokens", "4", "--threads", "1"]
    assert main([*args, "--caches", "dynamic,int8,int4:group_size=8:residual_length=4,sink:window=8:sinks=2"]) == 0
    out = capsys.readouterr().out
    rows = table_rows(out)
    assert set(rows) - {"cache"} == {"dynamic", "int8", "int4:group_size=8:residual_length=4", "sink:window=8:sinks=2"}
    assert rows["dynamic"][4] == "1.000" and rows["dynamic"][2] in ("yes", "no")
    assert "Columns: answer" in out and "Chat answers" in out and out.count("Q: ") == 3
    assert "keeps 10 tokens (sinks + window)" in out  # the sink cache is explained


@pytest.mark.parametrize(
    "args, message",
    [
        (["--caches", "nope"], "unknown cache kind 'nope'"),
        (["--document-tokens", "10"], "--document-tokens"),
        (["--new-tokens", "1"], "--new-tokens"),
        (["--model", "reference", "--document-tokens", "4000"], "does not fit the model's context (2048 tokens)"),
        (["--model", "/no/such/folder"], "--model '/no/such/folder': no such file or folder"),
        (["--model", "./nope"], "--model './nope': no such file or folder"),
    ],
)
def test_cli_demo_refuses_bad_flags(capsys, args, message):
    assert main(["demo", *args]) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1

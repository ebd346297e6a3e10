"""`hf-kvcache plan` and `hf_kvcache.plan`: the planned bytes equal what the caches store after real forwards."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import LlamaConfig

from hf_kvcache import cache_nbytes, make_cache
from hf_kvcache.cli import main as cli
from hf_kvcache.compare import LLAMA3_8B
from hf_kvcache.plan import kv_bytes, parse_memory, plan_memory, weight_bytes
from tests.models import EXTRA_FAMILIES, FAMILIES, tiny_model

torch.set_num_threads(1)

# transformers' DynamicSlidingWindowLayer keeps a 0-d int64 tensor of its window next to its K/V: not planned.
BOOKKEEPING = 8

# Small residuals, groups and windows so that a 40-token run crosses every boundary (encoding, eviction, blocks).
SPECS = [
    "dynamic",
    "int8",
    "int8:residual_length=8",
    "int4:group_size=8:residual_length=8",
    "int2:group_size=16:residual_length=4",
    "int2:group_size=8:residual_length=4:sinks=3",  # the first 3 tokens of each row in full precision
    "int2:group_size=8:residual_length=12:residual_bits=8:key_bits=4",  # an int8 residual beside 4-bit keys
    "int4:group_size=8:residual_length=8:rotate=hadamard",
    "int2:group_size=8:residual_length=4:smooth=1",  # one (heads, head_dim) float32 scale tensor per layer, not per row
    "int3:group_size=8:residual_length=4:scale_dtype=e5m3",  # 1-byte scales; int8 zero points for values only
    "int4",  # default residual (128): all of a short run stays in full precision
    "sink:window=16:sinks=2",
    "sink:window=16:sinks=2:bits=8",
    "paged:block_size=5",
    "paged:block_size=16:bits=8",
]


def _generate(model, spec: str, prompt: int, new: int, rows: int = 2, **kwargs):
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, model.config.vocab_size, (rows, prompt), generator=g)
    cache = make_cache(spec, model)
    model.generate(
        input_ids=ids,
        attention_mask=torch.ones_like(ids),
        past_key_values=cache,
        max_new_tokens=new,
        min_new_tokens=new,
        **({"do_sample": False} | kwargs),
    )
    return cache


@pytest.mark.parametrize("family", ["llama", "gemma3", "mistral"])  # full only, hybrid, all sliding
@pytest.mark.parametrize("spec", SPECS)
@pytest.mark.parametrize("prompt,new", [(7, 4), (23, 18)])
def test_planned_bytes_equal_the_caches_nbytes(family, spec, prompt, new):
    model = tiny_model(family)
    cache = _generate(model, spec, prompt, new)
    tokens = prompt + new - 1  # the last generated token is never fed back
    planned = kv_bytes(spec, model.config, tokens, batch=2, dtype=torch.float32, prompt=prompt)
    assert abs(planned - cache_nbytes(cache)) <= BOOKKEEPING * model.config.num_hidden_layers


# learned sinks + alternating windows; latent widths; multi-query layouts (1 KV head; KV heads expanded before caching)
@pytest.mark.parametrize("family", ["gpt_oss", "deepseek_v2", "falcon_mq", "falcon_new", "gpt_bigcode"])
def test_planned_bytes_on_more_families(family):
    from tests.models import extra_model

    model = extra_model(family)
    for spec in ("dynamic", "int8:residual_length=4", "paged:block_size=4"):
        cache = _generate(model, spec, 9, 6)
        planned = kv_bytes(spec, model.config, 14, batch=2, dtype=torch.float32, prompt=9)
        assert abs(planned - cache_nbytes(cache)) <= BOOKKEEPING * model.config.num_hidden_layers, spec
    assert family in EXTRA_FAMILIES


def test_paged_sharing_counts_the_prompt_blocks_once():
    model = tiny_model("llama")
    cache = _generate(model, "paged:block_size=4", 22, 7, rows=1, num_return_sequences=4, do_sample=True)
    planned = kv_bytes("paged:block_size=4:share=4:generated=6", model.config, 28, batch=4, dtype=torch.float32)
    assert planned == cache_nbytes(cache)
    unshared = kv_bytes("paged:block_size=4", model.config, 28, batch=4, dtype=torch.float32)
    assert planned < 0.5 * unshared


def test_weights_from_the_config_alone():
    model = tiny_model("llama")
    counted = sum(p.numel() for p in model.parameters())
    assert weight_bytes(model.config, torch.float32, 32)["parameters"] == counted
    assert weight_bytes(model.config, torch.bfloat16, 16)["bytes"] == 2 * counted
    assert (
        weight_bytes(model.config, torch.bfloat16, 4)["bytes"] < weight_bytes(model.config, torch.bfloat16, 8)["bytes"]
    )


def test_plan_of_llama3_8b_on_80_gib():
    plan = plan_memory(LlamaConfig(**LLAMA3_8B), "80GiB", context=32768, batch=1)
    dynamic, int4 = plan.row("dynamic"), plan.row("int4")
    assert dynamic.bytes_per_token == 131072  # 32 layers x 8 heads x 256 x 2 bytes
    assert 15.0e9 < plan.weights_bytes < 16.1e9  # 8.03B parameters in bf16
    # the largest context really is the largest: one more token does not fit
    budget = plan.budget_bytes
    assert kv_bytes("dynamic", LlamaConfig(**LLAMA3_8B), dynamic.max_context, 1) <= budget
    assert kv_bytes("dynamic", LlamaConfig(**LLAMA3_8B), dynamic.max_context + 1, 1) > budget
    assert int4.max_context > 3 * dynamic.max_context
    assert plan.row("sink:window=1024:sinks=4").max_context is None  # bounded: any context
    assert plan.row("paged:share=8").max_batch > 4 * plan.row("paged").max_batch
    text = plan.table()
    assert "max context" in text and "reserve" in text and "decode scratch" in text


def test_plan_counts_a_hybrid_models_sliding_layers_at_their_window():
    gemma = FAMILIES["gemma3"]()  # sliding, full, sliding (window 10)
    all_full = FAMILIES["gemma3"]()
    all_full.layer_types = ["full_attention"] * all_full.num_hidden_layers
    assert kv_bytes("dynamic", gemma, 1024) < 0.4 * kv_bytes("dynamic", all_full, 1024)
    plan = plan_memory(gemma, "64MiB", context=1024, caches=("dynamic",), reserve="16MiB", weights_bits=16)
    twin = plan_memory(all_full, "64MiB", context=1024, caches=("dynamic",), reserve="16MiB", weights_bits=16)
    assert plan.row("dynamic").max_context > 2 * twin.row("dynamic").max_context


@pytest.mark.parametrize(
    "value,expected", [("24GiB", 24 * 2**30), ("80GB", 80 * 10**9), ("512 MiB", 512 * 2**20), ("1e3", None)]
)
def test_parse_memory(value, expected):
    if expected is None:
        with pytest.raises(ValueError, match="memory must be a positive size"):
            parse_memory(value)
    else:
        assert parse_memory(value) == expected


def test_cli_plan_from_a_config_json(tmp_path, capsys):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"model_type": "llama", **LLAMA3_8B}))
    assert cli(["plan", "--model", str(path), "--memory", "24GiB", "--context", "8192", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert {r["cache"] for r in out["rows"]} >= {"dynamic", "int4", "paged:share=8"}
    assert out["budget_bytes"] < 24 * 2**30


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--memory", "lots"], "--memory"),
        (["--memory", "24GiB", "--context", "0"], "--context"),
        (["--memory", "24GiB", "--weights-bits", "3"], "--weights-bits"),
        (["--memory", "24GiB", "--caches", "int5"], "int5"),
        (["--memory", "24GiB", "--model", "/no/such/folder"], "--model"),
        (["--memory", "24GiB", "--batch", "0"], "--batch"),
        (["--memory", "24GiB", "--dtype", "int3"], "--dtype"),
        (["--memory", "24GiB", "--reserve", "lots"], "--reserve"),
        (["--memory", "24GiB", "--caches", "int8:share=2"], "share= is a plan option of paged specs only"),
        (["--memory", "24GiB", "--caches", "int8:generated=3"], "generated= is a plan option of paged specs only"),
        (["--memory", "24GiB", "--caches", "paged:generated=3"], "add share=N"),
        (["--memory", "24GiB", "--model", "EMPTY"], "EMPTY is not a JSON config file"),
        (["--memory", "24GiB", "--model", "LIST"], "LIST is not a config"),
    ],
)
def test_cli_plan_bad_input_is_one_line(argv, message, capsys, tmp_path):
    files = {"EMPTY": "", "LIST": "[1, 2]"}
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    argv = [str(tmp_path / a) if a in files else a for a in argv]
    message = next((message.replace(n, str(tmp_path / n)) for n in files if message.startswith(n)), message)
    assert cli(["plan", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and "Traceback" not in err and len(err.splitlines()) == 1


@pytest.mark.parametrize("spec", ["dynamic", "int8", "int4", "int2", "sink:window=64:sinks=4", "paged:share=2"])
def test_tensor_parallel_plan_is_one_ranks_share_of_the_heads(spec):
    """One rank of tp=2 stores what the same model with half the KV heads stores on one device."""
    kw = dict(num_hidden_layers=2, hidden_size=128, num_attention_heads=8, max_position_embeddings=4096)
    full, half = LlamaConfig(num_key_value_heads=4, **kw), LlamaConfig(num_key_value_heads=2, **kw)
    assert kv_bytes(spec, full, 1000, batch=3, tp=2) == kv_bytes(spec, half, 1000, batch=3)
    plan = plan_memory(full, "1GiB", context=1000, caches=(spec,), reserve="100MiB", tp=2)
    assert plan.row(spec).kv_bytes == kv_bytes(spec, half, 1000, batch=1)
    with pytest.raises(ValueError, match="tensor-parallel degree of 3 does not divide .* 4 KV heads"):
        kv_bytes(spec, full, 1000, tp=3)


def test_cli_plan_tp(capsys):
    assert cli(["plan", "--memory", "24GiB", "--model", "reference", "--tp", "0"]) == 2
    assert "--tp must be" in capsys.readouterr().err
    assert cli(["plan", "--memory", "24GiB", "--model", "reference", "--tp", "2", "--caches", "dynamic"]) == 0
    assert "tensor parallel: one rank of 2" in capsys.readouterr().out


def test_scratch_follows_the_attention_that_decodes():
    """Under eager / sdpa every quantized kind (int3 included) dequantizes one layer's history per step into a
    workspace, counted as scratch; under the hf_kvcache attention none reads through one."""
    config = LlamaConfig(**LLAMA3_8B)
    specs = ("dynamic", "int8", "int4", "int3", "int2", "paged:bits=8")
    sdpa = plan_memory(config, "80GiB", context=32768, caches=specs)
    ours = plan_memory(config, "80GiB", context=32768, caches=specs, attn="hf_kvcache")
    workspace = 36880  # the workspace's tokens: the history, the new token and 12.5% headroom, aligned to 16
    for spec in ("int8", "int4", "int3", "int2"):
        assert sdpa.row(spec).scratch_bytes == workspace * 8 * (128 + 128) * 2, spec
        assert ours.row(spec).scratch_bytes == 0 and ours.row(spec).max_batch >= sdpa.row(spec).max_batch
    for spec in ("dynamic", "paged:bits=8"):
        assert sdpa.row(spec).scratch_bytes == ours.row(spec).scratch_bytes == 0
    with pytest.raises(ValueError, match="attn must be one of eager, sdpa, hf_kvcache, got 'flash'"):
        plan_memory(config, "80GiB", attn="flash")
    assert cli(["plan", "--model", "reference", "--memory", "1GiB", "--attn", "flash"]) == 2


def test_default_caches_leave_out_those_the_model_refuses(tmp_path, capsys):
    """Latent attention (DeepSeek-V3) refuses the sink window's re-rotation: a plan with the default caches plans
    the others and names the two left out with the reason (it had failed whole); a sink spec asked for by name is its
    ValueError, as any refused spec."""
    from hf_kvcache.plan import DEFAULT_PLAN_CACHES
    from hf_kvcache.tools.supported_models import tiny_config

    config = tiny_config("deepseek_v3")
    plan = plan_memory(config, "1GiB", context=256, reserve="64MiB")
    sinks = [c for c in DEFAULT_PLAN_CACHES if c.startswith("sink")]
    assert [r.cache for r in plan.rows] == [c for c in DEFAULT_PLAN_CACHES if c not in sinks]
    for spec in sinks:
        assert any(a.startswith(f"not planned: {spec} (SlidingWindowKVCache") for a in plan.assumptions)
    with pytest.raises(ValueError, match=r"cannot serve model_type 'deepseek_v3'"):
        plan_memory(config, "1GiB", context=256, reserve="64MiB", caches=("dynamic", sinks[0]))
    path = tmp_path / "config.json"
    path.write_text(config.to_json_string())
    assert cli(["plan", "--model", str(path), "--memory", "1GiB", "--context", "256", "--reserve", "64MiB"]) == 0
    out = capsys.readouterr().out
    assert "| int4 " in out and "not planned: sink:window=1024:sinks=4" in out
    assert "| sink:" not in out

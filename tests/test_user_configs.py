"""Configurations users load, not the ones the matrix builds: each works through ``generate()`` or is refused in one
line."""

from __future__ import annotations

import importlib
import subprocess
import sys

import pytest
import torch
from models import VOCAB, prompt
from transformers import AutoConfig, AutoModelForCausalLM, DynamicCache, GPTBigCodeConfig

from hf_kvcache import make_cache
from hf_kvcache.cli import main as cli
from hf_kvcache.plan import kv_bytes, plan_memory
from hf_kvcache.registry import parse_spec
from hf_kvcache.tools.supported_models import PUBLISHED

COMMON = dict(vocab_size=VOCAB, pad_token_id=0, bos_token_id=1, eos_token_id=2)


def _generate(model, spec: str, batch: str = "padded", length: int = 12):
    model.generation_config.pad_token_id = 0
    model.generation_config.eos_token_id = None
    with torch.no_grad():
        return model.generate(
            **prompt(batch, length), past_key_values=make_cache(spec, model), max_new_tokens=4, do_sample=False
        )


def test_multi_query_starcoder_set_after_construction_is_served_and_planned():
    """StarCoder / SantaCoder: one cached head from multi_query, even where num_key_value_heads kept the value of the
    config's construction (multi_query set afterwards, or a checkpoint's config that names both)."""
    config = GPTBigCodeConfig(n_embd=64, n_layer=2, n_head=4, multi_query=False, **COMMON)
    config.multi_query = True
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()
    reference = _generate(model, "dynamic")
    for spec in ("int8", "int4:residual_length=4:group_size=8", "paged", "sink:window=8:sinks=2"):
        assert _generate(model, spec).shape == reference.shape, spec
    assert kv_bytes("int8", config, 100) < kv_bytes("dynamic", config, 100) == 2 * 100 * 16 * 2 * 2  # 1 head x 16


@pytest.mark.parametrize("model_type", ["bert", "roberta", "electra", "ernie", "xlm-roberta", "camembert"])
@pytest.mark.parametrize("batch", ["single", "padded"])
def test_bert_style_decoders_under_a_window_shorter_than_the_prompt(model_type, batch):
    """Encoder families run as decoders (is_decoder) evicting inside a 13-token prompt, padded or not."""
    config = AutoConfig.for_model(
        model_type, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
        is_decoder=True, **COMMON,
    )  # fmt: skip
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()
    out = _generate(model, "sink:window=8:sinks=2", batch, length=13)
    assert out.shape == (2 if batch == "padded" else 1, 17)


LEGACY = {  # modeling files that pick their attention classes from their own dicts
    "gptj": dict(n_embd=64, n_layer=2, n_head=4, rotary_dim=8, n_positions=512),
    "gpt_neo": dict(hidden_size=64, num_layers=2, num_heads=4, attention_types=[[["global", "local"], 1]]),
    "falcon": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, multi_query=True,
                   new_decoder_architecture=False),
}  # fmt: skip


def _builds_its_own_attention(model_type: str) -> bool:
    """Whether the installed release's modeling file picks attention classes from its own dict (GPT-J did until
    transformers 5.24, which routes it through the AttentionInterface)."""
    module = importlib.import_module(f"transformers.models.{model_type}.modeling_{model_type}")
    return any(name.endswith("_ATTENTION_CLASSES") for name in vars(module))


@pytest.mark.parametrize("model_type", list(LEGACY))
def test_loading_a_model_that_cannot_use_the_hf_kvcache_attention_is_refused_in_one_line(model_type):
    config = AutoConfig.for_model(model_type, **LEGACY[model_type], **COMMON)
    if not _builds_its_own_attention(model_type):  # served like any other model: loads and generates
        model = AutoModelForCausalLM.from_config(config, attn_implementation="hf_kvcache").eval()
        assert _generate(model, "int8").shape == (2, 16)
        return
    with pytest.raises(ValueError, match=f"model_type '{model_type}' builds its attention from its own classes"):
        AutoModelForCausalLM.from_config(config, attn_implementation="hf_kvcache")
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval()  # other names untouched
    assert _generate(model, "int8").shape == (2, 16)


@pytest.mark.slow
def test_the_refusal_reaches_modules_imported_before_hf_kvcache():
    code = (
        "import transformers.models.gpt_neo.modeling_gpt_neo as m\n"
        "import hf_kvcache\n"
        "from transformers import GPTNeoConfig, AutoModelForCausalLM\n"
        "c = GPTNeoConfig(hidden_size=64, num_layers=1, num_heads=4, attention_types=[[['global'], 1]],\n"
        "                 vocab_size=64)\n"
        "try:\n    AutoModelForCausalLM.from_config(c, attn_implementation='hf_kvcache')\n"
        "except ValueError as e:\n    print(e)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert "model_type 'gpt_neo' builds its attention from its own classes" in out.stdout, out.stderr[-2000:]


def test_spec_integers_are_parsed_strictly():
    assert parse_spec("int2:sinks=4_0:group_size=32:x=1e3") == ("int2", {"sinks": "4_0", "group_size": 32, "x": 1e3})
    with pytest.raises(ValueError, match="sinks must be an integer >= 0 or 'auto', got '4_0'"):
        make_cache("int2:sinks=4_0", AutoConfig.for_model("llama", num_hidden_layers=1, hidden_size=64,
                                                          num_attention_heads=4))  # fmt: skip


def test_plan_refuses_a_reserve_that_leaves_nothing(capsys):
    with pytest.raises(ValueError, match="reserve .* must be smaller than memory"):
        plan_memory(AutoConfig.for_model("llama", num_hidden_layers=2), "8GiB", reserve="9GiB")
    assert cli(["plan", "--model", "reference", "--memory", "1GiB", "--reserve", "2GiB"]) == 2
    err = capsys.readouterr().err
    assert "must be smaller than memory" in err and err.count("\n") == 1
    assert "int3" in plan_memory(AutoConfig.for_model("llama", num_hidden_layers=2), "8GiB").table()


@pytest.mark.parametrize(
    "flags, message",
    [(["--memory-budget-gib", "inf"], "--memory-budget-gib must be a finite number of GiB > 0, got inf"),
     (["--memory-budget-gib", "nan"], "--memory-budget-gib must be a finite number of GiB > 0, got nan"),
     (["--output", "/proc/no-such-dir"], "--output '/proc/no-such-dir' cannot be written")],
)  # fmt: skip
def test_bench_flags_fail_in_one_line_before_any_work(capsys, flags, message):
    assert cli(["bench", "--model", "reference", "--contexts", "8", "--caches", "dynamic", *flags]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1


@pytest.mark.parametrize("named", [False, True], ids=["module-default-sections", "config-names-them"])
def test_multimodal_rope_is_never_replayed_from_the_cache_index(named):
    """Qwen3.5 (and the Qwen-VL / GLM-4V families) turn keys by 3-D positions whose image tokens, and the text after
    them, are not the cache's token index. Its rotary module carries default sections even where the config names
    none (transformers' default Qwen3.5 config), so both spellings are refused for what would replay positions:
    pre-RoPE keys (int2's "auto" falls back to keys stored after RoPE) and the sink window's re-rotation."""
    from hf_kvcache.tools.supported_models import tiny_config

    config = tiny_config("qwen3_5_text")
    if named:  # a checkpoint's config.json names them
        config.rope_parameters = dict(config.rope_parameters, mrope_section=[1, 1])
    model = AutoModelForCausalLM.from_config(config).eval()
    assert ("mrope_section" in model.config.rope_parameters) == named
    assert make_cache("int2", model).pre_rope is False
    message = r"model_type 'qwen3_5_text' uses multimodal RoPE \(mrope_section\).*use pre_rope=False"
    with pytest.raises(ValueError, match=message):
        make_cache("int2:pre_rope=true", model)
    with pytest.raises(ValueError, match=r"uses multimodal RoPE \(mrope_section\).*use rerotate=False"):
        make_cache("sink:window=8:sinks=2", model)
    make_cache("sink:window=8:sinks=2:rerotate=false", model)


def test_rope_keyed_by_the_models_own_name_for_a_layer_kind():
    """ZAYA's attention layers hold states too (layer type ``"hybrid"``, served as full attention) and its rotary
    module keys its RoPE by that name: the caches that replay RoPE (int2's pre-RoPE keys, the sink window's
    re-rotation) read the model's own rotation for it (a KeyError on 'full_attention' before), and reproduce
    DynamicCache (the window holding every token) or stay within int2's bound."""
    from models import assert_generation_matches, config_model, generate
    from transformers import DynamicCache

    from hf_kvcache.compare import LOGIT_BOUNDS
    from hf_kvcache.rope import rotary_spec

    torch.set_num_threads(1)
    model = config_model("zaya")
    assert model.config.layer_types == ["hybrid"] * len(model.config.layer_types)
    spec = rotary_spec(model, model.config)
    torch.testing.assert_close(spec.inv_freq, model.model.rotary_emb.hybrid_inv_freq.float())
    inputs = prompt("padded")
    ref = generate(model, DynamicCache(config=model.config), inputs)
    assert make_cache("int2", model).pre_rope is True
    assert_generation_matches(generate(model, make_cache("int2", model), inputs), ref, False, LOGIT_BOUNDS["int2"])
    window = make_cache("sink:window=64:sinks=2", model)
    assert_generation_matches(generate(model, window, inputs), ref, True, 0.0)


@pytest.mark.parametrize("spec", ["int8", "paged", "sink", "plan"])
def test_compressed_attention_is_refused_by_what_it_keeps(spec):
    """DeepSeek-V4's compressed layers keep compressed entries that the model writes and reads through transformers'
    own layer classes: every cache, and plan, refuse the config by name and point to DynamicCache."""
    from hf_kvcache.tools.supported_models import tiny_config

    config = tiny_config("deepseek_v4")
    refusal = (
        r"model_type 'deepseek_v4': its compressed_sparse_attention, heavily_compressed_attention layers .*DynamicCache"
    )
    with pytest.raises(ValueError, match=refusal):
        if spec == "plan":
            kv_bytes("int8", config, 100)
        else:
            make_cache(spec, config)


@pytest.mark.parametrize("label", list(PUBLISHED))
def test_published_configs_are_served_under_the_hf_kvcache_attention(label):
    """A published checkpoint's config fields, shrunk: int8, int3 at its defaults (Hadamard-rotated codes, keys
    quantized before RoPE where the RoPE allows, 4 sinks; a small residual so that tokens are encoded) and exact pages,
    each under the hf_kvcache attention against DynamicCache under eager (every model has it), left-padded; plan
    reads the config. (The supported-models matrix runs these rows under every cache and attention: this is the suite's
    check of them.)"""
    from models import assert_generation_matches, generate

    from hf_kvcache.compare import LOGIT_BOUNDS
    from hf_kvcache.tools.supported_models import build

    torch.set_num_threads(1)
    model_type, fields = PUBLISHED[label]
    model = build(model_type, "eager", fields)
    config = model.config
    # The checkpoint's fields reached the config (a dict-valued one too: RoPE scaling is a field, not a sub-config).
    params = config.rope_parameters
    per_kind = list(params.values()) if "rope_type" not in params else [params]  # Gemma 3: one per layer kind
    for name, value in fields.items():
        if name == "rope_scaling":
            assert value.get("rope_type", value.get("type")) in {p["rope_type"] for p in per_kind}, params
        elif name in ("rope_theta", "rope_local_base_freq"):  # folded into rope_parameters
            assert value in {p["rope_theta"] for p in per_kind}, (name, params)
        elif name == "sliding_window" and fields.get("use_sliding_window") is False:
            assert config.sliding_window is None  # Qwen2's config drops an unused window, as loading Qwen2.5 does
        else:
            assert getattr(config, name) == value, name
    inputs = prompt("padded", 24)
    ref = generate(model, DynamicCache(config=config), inputs, new=6)
    model.set_attn_implementation("hf_kvcache")
    for spec, lossless, bound in [
        ("int8", False, LOGIT_BOUNDS["int8"]),
        ("int3:residual_length=4:group_size=8", False, LOGIT_BOUNDS["int3"]),
        ("paged:block_size=4", True, 0.0),
    ]:
        assert_generation_matches(generate(model, make_cache(spec, model), inputs, new=6), ref, lossless, bound)
    assert 0 < kv_bytes("int2", config, 4096) < kv_bytes("int8", config, 4096) < kv_bytes("dynamic", config, 4096)

"""The supported-models matrix: every causal-LM type of the installed transformers, built tiny, under every cache.

For each model type of ``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES`` a tiny random model is built from its own config class
(a generic shrink: 2 layers, hidden 64, 4 heads; per-family overrides where the generic one cannot build), loaded with
each attention implementation, and run under ``generate()`` on a left-padded batch of 2 with transformers'
``DynamicCache`` (the baseline) and with each cache kind. Every cell is exactly one of:

- ``equal``: a lossless cache's tokens and logits equal the baseline's;
- ``bound``: a lossy cache's teacher-forced logits stay within the stated bound of the baseline's;
- ``refused``: a one-line ``ValueError`` naming the model type and the reason, at construction or the first forward;
- ``n/a``: the model itself cannot run this way (no tiny build, the attention implementation unsupported by
  transformers for it, or the baseline's generation fails); the reason is recorded;
- ``FAIL``: anything else (another exception, a multi-line error, a wrong answer). The matrix must have none.

Usage::

    python scripts/supported_models.py --run            # the whole matrix (about 15 minutes on one core)
    python scripts/supported_models.py --run llama gpt2 # some model types (merged into the saved results)
    python scripts/supported_models.py --write          # render docs/supported-models.md from the saved results

``docs/data/supported-models.json`` holds the results (committed on purpose); the test suite checks that the page
renders from it, that it covers every model type of the installed transformers, and re-runs a fixed spread of it.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import io
import json
import math
import re
import sys
import time
import warnings
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]  # the repository (a checkout: tools read and write its docs)
SAVED = ROOT / "docs" / "data" / "supported-models.json"
PAGE = ROOT / "docs" / "supported-models.md"

VOCAB = 128
PAD = 0
NEW_TOKENS = 6
# How the model gets its attention: loaded with each implementation, and loaded with sdpa then switched to hf_kvcache
# with set_attn_implementation (what a user with an already loaded model does).
ATTENTION = ("eager", "sdpa", "hf_kvcache", "hf_kvcache-later")
LATER = "hf_kvcache-later"
# (column, spec, lossless, logit bound as a multiple of the baseline logits' std; the test matrix's bounds)
CACHES = (
    ("int8", "int8", False, 0.06),
    ("fp8", "fp8", False, 0.25),
    ("int4", "int4:residual_length=2:group_size=8", False, 0.35),
    # int2's defaults (Hadamard rotation, 4 exact sinks, keys stored before RoPE): the model's own RoPE replayed
    ("int2", "int2:residual_length=2:group_size=8", False, 1.0),
    ("sink", "sink:window=256:sinks=4", True, 0.0),  # larger than the text: nothing evicted, so exact
    ("paged", "paged:block_size=4", True, 0.0),
    ("sink-evict", "sink:window=6:sinks=2", None, 0.0),  # evicts: must run (eviction's exactness: test_sliding_cache)
)

# Sizes applied to every config that has the attribute (through its attribute_map too), then to its sub-configs.
SHRINK = {
    "num_hidden_layers": 2,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "vocab_size": VOCAB,
    "unpadded_vocab_size": VOCAB,  # Inkling 2: its head's width (the embeddings' is vocab_size)
    "max_position_embeddings": 512,
    "moe_intermediate_size": 32,
    "shared_expert_intermediate_size": 32,
    "num_experts": 4,
    "num_local_experts": 4,
    "n_routed_experts": 4,
    "num_experts_per_tok": 2,
    "n_shared_experts": 1,
    "kv_lora_rank": 32,
    "q_lora_rank": 32,
    "qk_rope_head_dim": 8,
    "qk_nope_head_dim": 16,
    "v_head_dim": 16,
    "sliding_window": 8,
    "attention_chunk_size": 8,
    "n_group": 1,
    "topk_group": 1,
    "first_k_dense_replace": 1,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 2,
    "linear_key_head_dim": 16,
    "linear_value_head_dim": 16,
    "mamba_n_heads": 4,
    "mamba_d_head": 32,  # heads x head width = expand x hidden
    "mamba_d_state": 8,
    "mamba_n_groups": 1,
    "state_size": 8,
    "d_state": 8,
    "n_groups": 1,
    "num_heads": 4,
    "expand": 2,
    "conv_kernel": 4,
    "time_step_rank": 8,
    "rotary_dim": 8,
    "ffn_hidden_size": 128,
    "encoder_layers": 2,
    "decoder_layers": 2,
    "num_encoder_layers": 2,
    "num_decoder_layers": 2,
    "encoder_attention_heads": 4,
    "decoder_attention_heads": 4,
    "encoder_ffn_dim": 128,
    "decoder_ffn_dim": 128,
    "pad_token_id": PAD,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "decoder_start_token_id": 1,
    "is_decoder": True,
    "tie_word_embeddings": False,
}
DROP = object()  # an override that removes a generic size the class refuses
# Qwen4-Exp's QSA indexer sizes, which the class's defaults leave unset (its default config does not build).
_QSA = {
    "indexer_n_heads": 2,
    "indexer_kv_heads": 1,
    "indexer_head_dim": 16,
    "indexer_budget": 8,
    "indexer_compress_ratio": 4,
}
# Dots 3 Note: latent attention whose sliding layers have their own sizes (``swa_*``, the released checkpoint's
# names; twice the latent width here, as there), every layer's KV heads equal to its query heads (its validator).
_DOTS3 = {
    "num_attention_heads": 4, "num_key_value_heads": 4, "q_lora_rank": 16, "kv_lora_rank": 16, "head_dim": 24,
    "qk_rope_head_dim": 8, "qk_nope_head_dim": 16, "v_head_dim": 16, "index_head_dim": 16, "index_n_heads": 2,
    "n_routed_experts": 4, "num_experts_per_tok": 2, "sliding_window": 6,
    "swa_num_attention_heads": 4, "swa_num_key_value_heads": 4, "swa_q_lora_rank": 16, "swa_kv_lora_rank": 32,
    "swa_head_dim": 24, "swa_qk_nope_head_dim": 16, "swa_v_head_dim": 16,
}  # fmt: skip
# Per-family overrides where the generic shrink cannot build or run (the reason in a comment).
OVERRIDES: dict[str, dict] = {
    "lfm2_moe": {"layer_types": ["conv", "full_attention"], "num_hidden_layers": 2},  # no default layer kinds
    "xmod": {"default_language": "en_XX"},  # a language's adapters must be chosen before a forward
    # Hybrids whose layer kinds derive from periods or block lists: one attention layer among two or three.
    "jamba": {"attn_layer_period": 2, "attn_layer_offset": 1, "expert_layer_period": 2, "expert_layer_offset": 1},
    "recurrent_gemma": {"num_hidden_layers": 3},  # block_types: recurrent, recurrent, attention
    "bamba": {"attn_layer_indices": [1]},
    "granitemoehybrid": {"layer_types": ["linear_attention", "full_attention"], "mamba_n_heads": 4},
    "zamba2": {"layers_block_type": ["linear_attention", "hybrid"], "n_mamba_heads": 4},
    "falcon_h1": {"mamba_d_ssm": 128, "mamba_n_heads": 4},
    "mamba2": {"head_dim": 32},  # its validator: heads x head width = expand x hidden (4 x 32 = 2 x 64)
    "gpt_neo": {"attention_types": [[["global", "local"], 1]]},  # one global and one local layer
    "gpt_bigcode": {"num_key_value_heads": DROP},  # a declared field real checkpoints leave unset (multi_query)
    "dots1": {"n_routed_experts": 4, "n_shared_experts": 1},
    "gemma3n_text": {"num_kv_shared_layers": 0},
    # A drafter whose every layer reads the main model's cache (KV sharing); its class's defaults fail its validator.
    "gemma4_assistant": {"text_config": {"hidden_size_per_layer_input": 0, "vocab_size_per_layer_input": 0}},
    "prophetnet": {"num_hidden_layers": DROP},  # sized by num_encoder_layers / num_decoder_layers
    "reformer": {"axial_pos_embds_dim": [32, 32], "attn_layers": ["local", "local"]},
    # Its width and KV heads by its own names, as its checkpoints give them: hidden_size (an alias) is set after the
    # FFN sub-config copied d_model's default (2048: experts 32x too wide), and num_key_value_heads given beside
    # attn_config's kv_n_heads would disagree with the heads its attention projects.
    "dbrx": {
        "attn_config": {"rope_theta": 10000.0, "clip_qkv": 8.0, "kv_n_heads": 2},
        "hidden_size": DROP,
        "d_model": SHRINK["hidden_size"],
        "num_key_value_heads": DROP,
    },
    # its rotary module turns head_dim channels, which its checkpoints set to qk_rope_head_dim (64 both)
    "longcat_flash": {"head_dim": SHRINK["qk_rope_head_dim"]},
    "zaya": {"num_experts_per_tok": 1},  # its validator: one expert per token
    # A recurrent-depth model (Dory: input, recurrent and output sections, the recurrent one run twice); its sections
    # must add up to the layers, and a full-attention layer in the recurrent section, as the released model has
    # (every fourth layer full), so that each loop's cache layers are of both kinds.
    "dory": {
        "num_hidden_layers": 4,
        "n_input_layers": 1,
        "n_output_layers": 1,
        "layer_types": ["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
    },
    # its default config names no RoPE per layer kind, which its rotary module reads (set after construction: a
    # dict-valued field is not a sub-config)
    "cohere_compass_text": {"later:rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 1e4}}},
    "qwen4_exp": {"text_config": _QSA},
    "qwen4_exp_text": _QSA,
    "dots3_note_text": _DOTS3,
    # GLM-5-Next (image-text-to-text only, not a matrix row; tests/test_indexed.py runs its text path): its validator
    # wants NoPE sparse-attention layers; the indexer and the KDA layers at the shrink's sizes.
    "glm5_next": {
        "text_config": {
            "qk_rope_head_dim": 0,
            "index_head_dim": 16,
            "index_n_heads": 2,
            "index_kpool": 2,
            "linear_head_dim": 16,
            "linear_num_heads": 2,
            "hc_mult": 2,
            "hc_sinkhorn_iters": 4,
        }
    },
}


# Configurations popular checkpoints load that the generic shrink does not reach: extra rows of the matrix, each a
# model type with overrides (and the flag set after construction where that is how a loaded config ends up).
VARIANTS: dict[str, tuple[str, dict]] = {
    "falcon (multi-query, falcon-7b)": ("falcon", {"multi_query": True, "new_decoder_architecture": False}),
    "falcon (new decoder architecture, falcon-40b)": ("falcon", {"new_decoder_architecture": True, "num_kv_heads": 2}),
    "falcon (ALiBi)": ("falcon", {"alibi": True, "multi_query": False, "new_decoder_architecture": False}),
    "falcon (sequential attention)": ("falcon", {"parallel_attn": False, "new_decoder_architecture": False}),
    "gpt_bigcode (multi_query set later)": ("gpt_bigcode", {"multi_query": False, "later:multi_query": True}),
    "gpt_neox (sequential residual)": ("gpt_neox", {"use_parallel_residual": False}),
    "phi (partial rotary)": ("phi", {"partial_rotary_factor": 0.5}),
    "mpt (ALiBi)": ("mpt", {"attn_config": {"alibi": True}}),
    "roberta (decoder)": ("roberta", {"is_decoder": True}),
    # one cache layer for every loop, written by the last and read in place by the others (not through update)
    "dory (last_loop KV cache)": ("dory", {"recurrent_kv_cache_mode": "last_loop"}),
}
# Published checkpoints' fields, as their config.json spells them: RoPE scaling (the pre-RoPE keys of int3 / int2 are
# turned with the scaled frequencies, or not quantized before RoPE where the frequencies change with the length),
# attention scalars other than 1/sqrt(head_dim), NoPE layers. Rows of the matrix, and tests/test_user_configs.py's.
PUBLISHED: dict[str, tuple[str, dict]] = {
    "llama (llama3 RoPE scaling, Llama-3.1)": ("llama", {"rope_theta": 500000.0, "max_position_embeddings": 131072,
        "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 8192}}),
    "qwen2 (YaRN, Qwen2.5 past 32k)": ("qwen2", {"rope_theta": 1000000.0, "sliding_window": 131072,
        "use_sliding_window": False, "max_window_layers": 28,
        "rope_scaling": {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}}),
    "gemma2 (query_pre_attn_scalar 144, gemma-2-27b)": ("gemma2", {"query_pre_attn_scalar": 144}),
    "gemma3_text (linear RoPE scaling, gemma-3-4b)": ("gemma3_text", {"rope_theta": 1000000.0,
        "rope_local_base_freq": 10000.0, "rope_scaling": {"rope_type": "linear", "factor": 8.0}}),
    "phi3 (longrope, Phi-3.5-mini)": ("phi3", {"original_max_position_embeddings": 4096,
        "max_position_embeddings": 131072, "rope_scaling": {"type": "longrope",
        "long_factor": [1.0, 1.1, 1.3, 1.6, 2.0, 3.0, 5.0, 9.0],
        "short_factor": [1.0, 1.0, 1.0, 1.0, 1.05, 1.1, 1.2, 1.3]}}),
    "phi3 (longrope, partial rotary, Phi-4-mini)": ("phi3", {"original_max_position_embeddings": 4096,
        "max_position_embeddings": 131072, "partial_rotary_factor": 0.75, "rope_scaling": {"type": "longrope",
        "long_factor": [1.0, 1.2, 1.5, 2.0, 3.0, 6.0], "short_factor": [1.0] * 6}}),
    "smollm3 (NoPE layers, SmolLM3-3B)": ("smollm3", {"no_rope_layers": [1, 0], "use_sliding_window": False}),
    "granite (multipliers, granite-3.1)": ("granite", {"attention_multiplier": 0.015625, "embedding_multiplier": 12.0,
        "residual_multiplier": 0.22, "logits_scaling": 8.0}),
    "gpt_oss (YaRN, gpt-oss-20b)": ("gpt_oss", {"initial_context_length": 4096, "rope_scaling": {"rope_type": "yarn",
        "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
        "original_max_position_embeddings": 4096}}),
    "deepseek_v2 (YaRN with mscale, DeepSeek-V2-Lite)": ("deepseek_v2", {"rope_scaling": {"type": "yarn", "factor": 40,
        "beta_fast": 32, "beta_slow": 1, "mscale": 0.707, "mscale_all_dim": 0.707,
        "original_max_position_embeddings": 4096}}),
}  # fmt: skip
VARIANTS |= PUBLISHED
# Left-padded rows of very different lengths (short, long): a quantized cache with sinks must store what plan says
# for the long one, whatever the padding (the column `ragged`).
RAGGED = (3, 24)
RAGGED_SPEC = "int2:residual_length=4:group_size=8"

# Sizes set even where the class's default leaves them unset (None there is not "feature off").
UNSET_OK = ("head_dim", "num_key_value_heads", "num_experts_per_tok")
ALWAYS = ("pad_token_id", "bos_token_id", "eos_token_id", "decoder_start_token_id", "is_decoder")


def _has(config, name: str) -> bool:
    try:
        return getattr(config, name, None) is not None
    except Exception:  # noqa: BLE001  (per-layer attributes raise when read globally)
        return False


def _fields(config) -> set[str]:
    return {f.name for f in dataclasses.fields(config)} if dataclasses.is_dataclass(config) else set()


def _read_only(config, name: str) -> bool:
    prop = getattr(type(config), name, None)
    return isinstance(prop, property) and prop.fset is None


def _rebuilt(config, sizes: dict, overrides: dict):
    """``config``'s class built again with the sizes it has an attribute for (so derived sizes follow)."""
    kwargs = {
        name: value
        for name, value in sizes.items()
        if (name in ALWAYS or _has(config, name) or (name in UNSET_OK and name in _fields(config)))
        and not _read_only(config, name)
    }
    if _has(config, "qk_rope_head_dim"):
        # Latent attention: the head width derives from the rope and nope parts, and every query head has its own.
        kwargs.pop("head_dim", None)
        kwargs["num_key_value_heads"] = kwargs.get("num_attention_heads", 4)
    types = getattr(config, "layer_types", None) if _has(config, "layer_types") else None
    prop = getattr(type(config), "layer_types", None)
    if isinstance(types, list) and types and not isinstance(prop, property):
        # Keep one layer of each kind the full model has (a hybrid's mix is what the caches must serve).
        kept = list(dict.fromkeys(types))[:4]
        kwargs["layer_types"] = kept if len(kept) > 1 else kept * 2
        kwargs["num_hidden_layers"] = len(kwargs["layer_types"])
    subs = getattr(config, "sub_configs", {}) or {}
    for key in subs:
        sub = getattr(config, key, None)
        if sub is not None and hasattr(sub, "to_dict"):
            # As a dict, as a checkpoint's config.json passes it: the parent fills in what it shares with the child.
            kwargs[key] = _rebuilt(sub, sizes, overrides.get(key, {})).to_dict()
    # A dict for one of the class's sub-configs holds that sub-config's overrides (above); any other dict (RoPE
    # scaling) is the field's value, as a checkpoint's config.json gives it.
    kwargs.update({k: v for k, v in overrides.items() if not (isinstance(v, dict) and k in subs)})
    kwargs = {k: v for k, v in kwargs.items() if v is not DROP}
    try:
        return type(config)(**kwargs)
    except Exception:  # noqa: BLE001  (layer kinds derived from other fields: keep the class's own)
        if "layer_types" not in kwargs or "layer_types" in overrides:
            raise
        kwargs.pop("layer_types")
        kwargs["num_hidden_layers"] = overrides.get("num_hidden_layers", sizes["num_hidden_layers"])
        return type(config)(**kwargs)


def tiny_config(model_type: str, variant: dict | None = None):
    """The model type's config class built small (generic sizes, then the family's overrides, then a variant's;
    ``later:`` keys are set on the built config, as a loaded config can end up, or where a sub-config's dict is to be
    set whole rather than read as its overrides)."""
    from transformers import CONFIG_MAPPING

    overrides = dict(OVERRIDES.get(model_type, {}))
    for key, value in (variant or {}).items():
        # a sub-config's fields join the family's own for it
        both = isinstance(value, dict) and isinstance(overrides.get(key), dict) and not key.startswith("later:")
        overrides[key] = overrides[key] | value if both else value
    later = {key.removeprefix("later:"): overrides.pop(key) for key in list(overrides) if key.startswith("later:")}
    try:
        default = CONFIG_MAPPING[model_type]()
    except Exception:  # noqa: BLE001  (a class whose own defaults fail its validator: the family's overrides fix them)
        default = CONFIG_MAPPING[model_type](**{k: v for k, v in overrides.items() if v is not DROP})
    config = _rebuilt(default, SHRINK, overrides)
    for key, value in later.items():
        setattr(config, key, value)
    return config


def build(model_type: str, attn: str, variant: dict | None = None):
    from transformers import AutoModelForCausalLM

    import hf_kvcache  # noqa: F401  (registers the hf_kvcache attention)

    torch.manual_seed(0)
    config = tiny_config(model_type, variant)
    if attn != LATER:
        model = AutoModelForCausalLM.from_config(config, attn_implementation=attn).eval()
    else:  # loaded with sdpa (eager where the model has none), then switched
        try:
            model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").eval()
        except ValueError:
            model = AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval()
        model.set_attn_implementation("hf_kvcache")
        if model.config._attn_implementation != "hf_kvcache":
            raise RuntimeError(f"set_attn_implementation('hf_kvcache') kept {model.config._attn_implementation!r}")
    model.generation_config.pad_token_id = PAD
    model.generation_config.eos_token_id = None
    model.generation_config.bos_token_id = 1
    return model


def _prompt(vocab: int) -> dict:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, min(vocab, VOCAB), (2, 10), generator=g)
    mask = torch.ones_like(ids)
    ids[1, :4], mask[1, :4] = PAD, 0
    return {"input_ids": ids, "attention_mask": mask}


def _generate(model, cache):
    from hf_kvcache._compat import with_cache

    kwargs = {} if cache is None else with_cache(model, cache)
    with torch.no_grad():
        return model.generate(
            **_prompt(model.config.get_text_config().vocab_size or VOCAB),
            **kwargs,
            max_new_tokens=NEW_TOKENS,
            min_new_tokens=NEW_TOKENS,
            do_sample=False,
            output_logits=True,
            return_dict_in_generate=True,
        )


def _line(error: BaseException) -> str:
    text = f"{type(error).__name__}: {error}".strip()
    return text.splitlines()[0][:300] if text else type(error).__name__


def _compare(ref, out, lossless: bool, rows=slice(None)) -> tuple[str | None, float]:
    """(what differs, or None; the lossy error: max teacher-forced |logit error| / std of the baseline's logits)."""
    if out.sequences.shape != ref.sequences.shape:
        return f"sequence shape {tuple(out.sequences.shape)} != {tuple(ref.sequences.shape)}", float("inf")
    got, want = out.sequences[rows], ref.sequences[rows]
    if lossless:
        if not torch.equal(got, want):
            return "tokens differ from the baseline's", float("inf")
        worst = max(float((a[rows] - b[rows]).abs().max()) for a, b in zip(out.logits, ref.logits))
        scale = max(float(b[rows].abs().max()) for b in ref.logits)
        return (None if worst <= 1e-4 * max(scale, 1.0) else f"logits differ by {worst:.2e}"), 0.0
    return None, max(_step_errors(ref, out, rows))


def _step_errors(ref, out, rows=slice(None)) -> list[float]:
    """Per step the lossy error of ``rows``, up to the first step whose token differs from the baseline's (teacher-
    forced: past it the two read different tokens)."""
    prompt_len = ref.sequences.shape[1] - NEW_TOKENS
    differ = (out.sequences[rows] != ref.sequences[rows]).any(0).nonzero()
    last = int(differ[0]) - prompt_len if len(differ) else NEW_TOKENS - 1
    return [float(_relative_error(out.logits[step][rows], ref.logits[step][rows]).max()) for step in range(last + 1)]


def _relative_error(got: torch.Tensor, want: torch.Tensor) -> torch.Tensor:
    """Per row, max |logit error| / std of the baseline's logits; where the baseline's logits are all equal (a tiny
    random XLM's are), 0 for no error and inf for any, rather than 0 / 0."""
    error, spread = (got - want).abs().amax(-1), want.std(-1)
    flat = torch.where(error == 0, 0.0, float("inf"))
    return torch.where(spread > 0, error / spread.clamp_min(torch.finfo(spread.dtype).tiny), flat)


def attends_to_padding(model) -> bool:
    """Whether the model's outputs depend on what its left-padding tokens are (GIT widens a text-only mask by its
    image tokens, so the mask no longer lines up): caches that store no padding cannot match such a model there."""
    from transformers import DynamicCache

    from hf_kvcache._compat import with_cache

    prompt = _prompt(VOCAB)
    other = dict(prompt, input_ids=prompt["input_ids"].where(prompt["attention_mask"].bool(), 5))
    logits = []
    for inputs in (prompt, other):
        with torch.no_grad():
            out = model.generate(
                **inputs,
                **with_cache(model, DynamicCache(config=model.config)),
                max_new_tokens=2,
                do_sample=False,
                output_logits=True,
                return_dict_in_generate=True,
            )
        logits.append(torch.cat(out.logits))
    return not torch.equal(*logits)


def run_family(model_type: str, variant: dict | None = None) -> dict:
    """``{attn: {"model": status, cache: {"status", "detail"}}}`` for one model type (with a variant's config)."""
    from transformers import DynamicCache

    from hf_kvcache import make_cache

    row: dict = {}
    for attn in ATTENTION:
        cells: dict = {}
        row[attn] = cells
        try:
            model = build(model_type, attn, variant)
        except ValueError as error:
            if attn.startswith("hf_kvcache") and "\n" not in str(error) and model_type_named(error, model_type):
                cells["model"] = {"status": "refused", "detail": _line(error)}
            else:
                cells["model"] = {"status": "n/a", "detail": _line(error)}
            continue
        except Exception as error:  # noqa: BLE001  (any failure to build is recorded, not raised)
            cells["model"] = {"status": "n/a", "detail": _line(error)}
            continue
        try:  # the baseline is transformers' DynamicCache (some configs default to use_cache=False: MPT)
            with recorded_choices(model, ROWS) as choices:
                ref = _generate(model, DynamicCache(config=model.config))
        except Exception as error:  # noqa: BLE001
            cells["model"] = {"status": "n/a", "detail": "reference generate: " + _line(error)}
            continue
        cells["model"] = {"status": "ok", "detail": ""}
        cells["plan"] = _plan_cell(model, model_type)
        for column, spec, lossless, bound in CACHES:
            cells[column] = _cell(model, model_type, spec, lossless, bound, (ref, choices), make_cache)
        cells["ragged"] = _ragged_cell(model, model_type)
    return row


def _ragged_cell(model, model_type: str) -> dict:
    """A batch of a short and a long row, left-padded, through ``RAGGED_SPEC`` (int2's defaults: sinks, rotation,
    pre-RoPE keys where the model has RoPE): the cache must hold what ``kv_bytes`` plans for two long rows."""
    from hf_kvcache import make_cache
    from hf_kvcache._compat import with_cache
    from hf_kvcache.plan import kv_bytes

    short, long = RAGGED
    ids = torch.randint(3, min(model.config.get_text_config().vocab_size or VOCAB, VOCAB), (2, long),
                        generator=torch.Generator().manual_seed(2))  # fmt: skip
    mask = torch.ones_like(ids)
    ids[0, : long - short], mask[0, : long - short] = PAD, 0
    try:
        cache = make_cache(RAGGED_SPEC, model)
        with torch.no_grad():
            model(input_ids=ids, attention_mask=mask, **with_cache(model, cache))
        held = cache.nbytes - cache.state_nbytes  # a hybrid's recurrent states: not per-token K/V, not planned
        planned = kv_bytes(RAGGED_SPEC, model, tokens=max(long, cache.get_seq_length()), batch=2, dtype=model.dtype)
    except Exception as error:  # noqa: BLE001
        return _failure(error, model, model_type)
    if planned != held:
        return {"status": "FAIL", "detail": f"planned {planned} bytes, the padded batch holds {held}"}
    return {"status": "equal", "detail": ""}


def _plan_cell(model, model_type: str) -> dict:
    """``kv_bytes('dynamic', model, ...)`` against the K/V bytes a DynamicCache holds after a prefill of the prompt,
    and ``state_bytes`` against the recurrent states it holds (a hybrid model's; none for the others)."""
    from transformers import DynamicCache

    from hf_kvcache._compat import with_cache
    from hf_kvcache.memory import recurrent_state_bytes
    from hf_kvcache.plan import kv_bytes, state_bytes

    inputs = _prompt(VOCAB)
    cache = DynamicCache(config=model.config)
    try:
        with torch.no_grad():
            model(**inputs, **with_cache(model, cache))
    except Exception as error:  # noqa: BLE001  (the generate above ran: a failure here is the model's, recorded)
        return {"status": "n/a", "detail": "prefill: " + _line(error)}
    layers = [layer for layer in cache.layers if getattr(layer, "keys", None) is not None]  # not linear attention
    held = sum(layer.keys.nbytes + layer.values.nbytes for layer in layers)
    held += sum(t.nbytes for layer in layers if (t := getattr(layer, "indexer_keys", None)) is not None)
    # The tokens the cache holds: a model may add its own before the prompt (CPM-Ant's 32 prompt-tuning tokens). A
    # cache of recurrent states only (Mamba, since transformers 5.24 gives it a DynamicCache) counts none.
    seen = cache.get_seq_length() if layers else 0
    batch, tokens = inputs["input_ids"].shape[0], max(inputs["input_ids"].shape[1], seen)
    held_states = recurrent_state_bytes(cache)
    try:
        planned = kv_bytes("dynamic", model, tokens=tokens, batch=batch, dtype=model.dtype)
        planned_states = batch * state_bytes(model, model.dtype)
    except Exception as error:  # noqa: BLE001
        return _failure(error, model, model_type)
    if planned != held:
        return {"status": "FAIL", "detail": f"planned {planned} bytes, DynamicCache holds {held}"}
    if planned_states != held_states:
        detail = f"planned {planned_states} bytes of states, DynamicCache holds {held_states}"
        return {"status": "FAIL", "detail": detail}
    return {"status": "equal", "detail": ""}


def _failure(error: Exception, model, model_type: str) -> dict:
    """The cell of a cache or plan that raised: a one-line ``ValueError`` naming the model's type (or its text
    config's) is a refusal; anything else, or a refusal that does not say which model, is a FAIL."""
    if isinstance(error, ValueError):
        names = (model_type, model.config.get_text_config().model_type)
        if "\n" in str(error).strip() or not model_type_named(error, *names):
            return {"status": "FAIL", "detail": "unclear refusal: " + _line(error)}
        return {"status": "refused", "detail": _line(error)}
    return {"status": "FAIL", "detail": _line(error)}


def model_type_named(error: BaseException, *model_types: str) -> bool:
    """Whether the message names the model's type (or its text config's, for a multimodal wrapper)."""
    return any(re.search(rf"'{re.escape(t)}'", str(error)) for t in model_types if t)


def _cell(model, model_type, spec, lossless, bound, baseline, make_cache) -> dict:
    """One cache's cell; ``baseline``: DynamicCache's generate output and the choices recorded while it ran."""
    ref, ref_choices = baseline
    try:
        with recorded_choices(model, ROWS) as choices:
            out = _generate(model, make_cache(spec, model))
    except Exception as error:  # noqa: BLE001
        return _failure(error, model, model_type)
    if lossless is None:
        return {"status": "runs", "detail": ""}
    rows = slice(None)
    wrong, ratio = _compare(ref, out, lossless)
    unpadded = "unpadded row (the model attends to its left padding)"
    if (wrong or ratio > bound) and attends_to_padding(model):
        rows = slice(0, 1)
        wrong, ratio = _compare(ref, out, lossless, rows=rows)
        if not wrong and lossless:
            return {"status": "equal", "detail": unpadded}
    if wrong:
        return {"status": "FAIL", "detail": wrong}
    if not lossless:
        status = "bound" if ratio <= bound else "over"
        cell = {"status": status, "detail": f"{ratio:.3f}", "error": round(ratio, 4)}
        if status == "over":
            try:
                cell.update(_causes(model, spec, ref, out, (ref_choices, choices), rows, make_cache))
            except Exception as error:  # noqa: BLE001  (a cause that cannot be measured leaves the cell as it is)
                cell["causes"] = "not measured: " + _line(error)
        return cell
    return {"status": "equal", "detail": ""}


def _causes(model, spec, ref, out, choices: tuple, rows, make_cache) -> dict:
    """What the matrix can measure of why a lossy cell is over its bound: the decode step at which a router's or
    indexer's choice first differs from the baseline's, with the error before it (``flip``, ``before``); where the
    model's prefill attention scores spread wider than ``SHARP``, that spread and the cell's error with every
    attention's scores tempered to a spread of 1 (``spread``, ``tempered``); and where a norm takes the attention's
    output before the residual add, how much it scales it and the cell's error with those norms bypassed (``gain``,
    ``unnormed``)."""
    found: dict = {}
    flip = first_flip(*choices, rows)
    errors = _step_errors(ref, out, rows)
    if flip is not None and flip < len(errors):
        found.update(flip=flip, before=round(max(errors[:flip], default=0.0), 4))
    spreads, temper = attention_spread(model), tempered_error
    if not spreads:  # attention computed in the model's own code, out of the recording function's reach
        spreads, temper = projected_spread(model), tempered_queries_error
    if spreads and max(spreads.values()) > SHARP:
        found["spread"] = round(max(spreads.values()), 2)
        tempered = temper(model, spec, spreads, make_cache, rows)
        if tempered is not None:
            found["tempered"] = round(tempered, 4)
    norms = attention_output_norms(model)
    if norms:
        found["gain"] = round(max(norms.values()), 1)
        found["unnormed"] = round(unnormed_error(model, spec, norms, make_cache, rows), 3)  # eager and sdpa agree to 3
    return found


# Modules that make a discrete choice per token and return it (the integer tensors of their output): mixture-of-
# experts routers (the experts picked) and sparse attention's indexers (the tokens attended). A KV error small enough
# to move the logits by a fraction of the bound can still flip such a choice, and a flipped choice moves them by the
# difference between two experts' outputs.
CHOOSERS = ("Router", "Indexer")
# A standard model's prefill attention scores (query . key x scaling, head_dim ** -0.5 over unit-RMS queries and
# keys) spread about 1; scores spread wider turn the same key error into a larger change of the attention weights.
SHARP = 2.0
CAUSES = ("flip", "before", "spread", "tempered", "gain", "unnormed")  # what _causes records of an over-bound cell
ROWS = 2  # the prompt's batch (_prompt)


@contextlib.contextmanager
def recorded_choices(model, rows: int):
    """Yields a list that gets, per forward of ``model``, the choices its routers and indexers made: one ``(rows, n)``
    integer tensor per call of such a module, each choice's members sorted (a top-k returned in another order is the
    same choice)."""
    steps: list[list[torch.Tensor]] = []

    def record(module, args, output):
        for t in output if isinstance(output, tuple) else (output,):
            # a choice per token: (rows x tokens, k) or (rows, tokens, k), batch-major (not, e.g., counts per expert)
            choice = torch.is_tensor(t) and t.dim() >= 2 and not (t.is_floating_point() or t.dtype == torch.bool)
            if choice and steps and t.shape[0] % rows == 0:
                steps[-1].append(t.sort(-1).values.reshape(rows, -1).clone())

    handles = [model.register_forward_pre_hook(lambda module, args: steps.append([]))]
    handles += [m.register_forward_hook(record) for m in model.modules() if type(m).__name__.endswith(CHOOSERS)]
    try:
        yield steps
    finally:
        for handle in handles:
            handle.remove()


def first_flip(want: list, got: list, rows=slice(None)) -> int | None:
    """The first forward (0: the prompt's) at which a recorded choice for one of ``rows`` differs, or None."""
    for step, (a, b) in enumerate(zip(want, got)):
        if len(a) != len(b) or any(x.shape != y.shape or not torch.equal(x[rows], y[rows]) for x, y in zip(a, b)):
            return step
    return None


_SCORES = "hf_kvcache_matrix_scores"
_spreads: dict | None = None  # where the recording attention function writes, while attention_spread runs


def _recording_scores(module, query, key, value, attention_mask, scaling=None, **kwargs):
    """An attention function that keeps the std of each module's first scores (query . key x scaling, the first row,
    key positions up to the query's) in ``_spreads``, then runs sdpa's."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if _spreads is not None and module not in _spreads:
        q, k = query[0].float(), key[0].float().repeat_interleave(query.shape[1] // key.shape[1], 0)
        s = (q @ k.transpose(-1, -2)) * (q.shape[-1] ** -0.5 if scaling is None else scaling)
        t, n = s.shape[-2:]
        causal = torch.arange(n) <= torch.arange(t)[:, None] + (n - t)
        _spreads[module] = float(s[:, causal].std())
    return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, **kwargs)


def attention_spread(model) -> dict:
    """``{attention module: std of its prefill scores}`` over the prompt's unpadded row (query . key x scaling, key
    positions up to the query's), measured by a recording attention function that then runs sdpa's; ``{}`` where the
    model cannot take another attention function, or its sub-models run different ones (which one switch and one
    switch back would not restore)."""
    global _spreads
    from transformers import AttentionInterface, DynamicCache, PreTrainedModel

    from hf_kvcache._compat import with_cache

    was = model.config._attn_implementation
    if any(m.config._attn_implementation != was for m in model.modules() if isinstance(m, PreTrainedModel)):
        return {}
    AttentionInterface.register(_SCORES, _recording_scores)  # a module-level function: it holds no model
    try:
        model.set_attn_implementation(_SCORES)
    except Exception:  # noqa: BLE001  (a model that routes no attention through the interface: nothing measured)
        return {}
    _spreads = spreads = {}
    try:
        with torch.no_grad():
            model(**_prompt(model.config.get_text_config().vocab_size or VOCAB),
                  **with_cache(model, DynamicCache(config=model.config)))  # fmt: skip
    except Exception:  # noqa: BLE001  (the recording function cannot run this model's attention: nothing measured)
        spreads = {}
    finally:
        _spreads = None
        model.set_attn_implementation(was)
    return spreads


def tempered_error(model, spec, spreads: dict, make_cache, rows=slice(None)) -> float | None:
    """The lossy error of ``spec`` on the model with each attention's ``scaling`` divided by its scores' spread
    (those wider than 1), baseline included; None where no attention module keeps its scaling as a float."""
    from transformers import DynamicCache

    kept = {m: m.scaling for m, s in spreads.items() if s > 1 and isinstance(getattr(m, "scaling", None), float)}
    if not kept:
        return None
    try:
        for module in kept:
            module.scaling = module.scaling / spreads[module]
        ref = _generate(model, DynamicCache(config=model.config))
        return _compare(ref, _generate(model, make_cache(spec, model)), False, rows)[1]
    finally:
        for module, scaling in kept.items():
            module.scaling = scaling


def _hooked_prompt(model, handles: list) -> None:
    """One forward of the prompt (:func:`_prompt`) through a ``DynamicCache``, for the hooks of ``handles`` to
    measure; they are removed after it."""
    from transformers import DynamicCache

    from hf_kvcache._compat import with_cache

    try:
        with torch.no_grad():
            model(**_prompt(model.config.get_text_config().vocab_size or VOCAB),
                  **with_cache(model, DynamicCache(config=model.config)))  # fmt: skip
    finally:
        for handle in handles:
            handle.remove()


# The query and key projections of an attention module that computes its scores itself (CPM-Ant's project_q /
# project_k, or q_proj / k_proj), with its heads and head width by the names such modules keep them under.
_PROJECTIONS = (("q_proj", "k_proj"), ("project_q", "project_k"))


def _own_projections(module) -> tuple | None:
    """``(query projection, key projection, query heads, head width)`` of an attention module, or None."""
    heads = getattr(module, "num_heads", None) or getattr(module, "num_attention_heads", None)
    width = getattr(module, "head_dim", None) or getattr(module, "dim_head", None)
    for q_name, k_name in _PROJECTIONS:
        q, k = getattr(module, q_name, None), getattr(module, k_name, None)
        linear = isinstance(q, torch.nn.Linear) and isinstance(k, torch.nn.Linear)
        sized = isinstance(heads, int) and isinstance(width, int) and width > 0
        if linear and sized and q.out_features == heads * width and k.out_features % width == 0:
            return q, k, heads, width
    return None


def projected_spread(model) -> dict:
    """``{attention module: std of its prefill scores}`` for a model whose attention modules compute their scores
    themselves (not through the AttentionInterface :func:`attention_spread` records): query . key / sqrt(head width)
    from each module's own projections of its input, over the prompt's unpadded row (key positions up to the
    query's; no RoPE or position bias: the spread the projections give). ``{}`` where no module has such
    projections."""
    spreads: dict = {}

    def measure(module, args, kwargs):
        hidden = args[0] if args else kwargs.get("hidden_states", kwargs.get("hidden_q"))
        if module in spreads or not torch.is_tensor(hidden) or hidden.dim() != 3:
            return
        q_proj, k_proj, heads, width = _own_projections(module)
        row = hidden[:1].float()

        def project(linear: torch.nn.Linear, n: int) -> torch.Tensor:
            bias = None if linear.bias is None else linear.bias.float()
            return torch.nn.functional.linear(row, linear.weight.float(), bias).view(1, -1, n, width).transpose(1, 2)

        q, k = project(q_proj, heads), project(k_proj, k_proj.out_features // width)
        k = k.repeat_interleave(heads // k.shape[1], 1)
        s = (q @ k.transpose(-1, -2)) * width**-0.5
        t = s.shape[-1]
        spreads[module] = float(s[..., torch.ones(t, t, dtype=torch.bool).tril()].std())

    attentions = [m for m in model.modules() if type(m).__name__.endswith("Attention") and _own_projections(m)]
    _hooked_prompt(model, [m.register_forward_pre_hook(measure, with_kwargs=True) for m in attentions])
    return spreads


def tempered_queries_error(model, spec, spreads: dict, make_cache, rows=slice(None)) -> float:
    """:func:`tempered_error` where the attention's scaling is in the model's code: each module's query projection
    divided by its scores' spread instead (those wider than 1), baseline included; the weights are put back."""
    from transformers import DynamicCache

    kept = {}
    try:
        with torch.no_grad():
            for module, spread in spreads.items():
                if spread > 1:
                    q_proj = _own_projections(module)[0]
                    kept[q_proj] = (q_proj.weight.clone(), None if q_proj.bias is None else q_proj.bias.clone())
                    q_proj.weight.div_(spread)
                    if q_proj.bias is not None:
                        q_proj.bias.div_(spread)
        ref = _generate(model, DynamicCache(config=model.config))
        return _compare(ref, _generate(model, make_cache(spec, model)), False, rows)[1]
    finally:
        with torch.no_grad():
            for q_proj, (weight, bias) in kept.items():
                q_proj.weight.copy_(weight)
                if bias is not None:
                    q_proj.bias.copy_(bias)


def attention_output_norms(model) -> dict:
    """``{norm module: the factor by which it scales the attention's output}`` for the norms a decoder layer applies to
    its attention module's output before adding it to the residual stream (Gemma 2 and 3's
    ``post_attention_layernorm``), found over the prompt's prefill: the modules whose first input is the very tensor an
    attention module (a class name ending in Attention) returned; the factor is the RMS of the norm's output over that
    of its input, on the unpadded row. ``{}`` where the model has none (Llama adds the attention's output to the
    stream as it is)."""
    outputs: dict[int, torch.Tensor] = {}
    found: dict = {}

    def returned(module, args, output):
        first = output[0] if isinstance(output, tuple) else output
        if torch.is_tensor(first):
            outputs[id(first)] = first

    def normed(module, args, output):
        if args and torch.is_tensor(args[0]) and id(args[0]) in outputs and outputs[id(args[0])] is args[0]:
            rms = lambda t: float(t[0].float().pow(2).mean().sqrt())  # noqa: E731  (the first row: unpadded)
            found.setdefault(module, rms(output) / max(rms(args[0]), torch.finfo(torch.float32).tiny))

    modules = list(model.modules())
    handles = [m.register_forward_hook(returned) for m in modules if type(m).__name__.endswith("Attention")]
    _hooked_prompt(model, handles + [m.register_forward_hook(normed) for m in modules if "Norm" in type(m).__name__])
    return found


def unnormed_error(model, spec, norms: dict, make_cache, rows=slice(None)) -> float:
    """The lossy error of ``spec`` on the model with the ``norms`` on its attention's output bypassed (each returns
    its input), baseline included."""
    from transformers import DynamicCache

    handles = [norm.register_forward_hook(lambda module, args, output: args[0]) for norm in norms]
    try:
        ref = _generate(model, DynamicCache(config=model.config))
        return _compare(ref, _generate(model, make_cache(spec, model)), False, rows)[1]
    finally:
        for handle in handles:
            handle.remove()


def model_types() -> list[str]:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


def rows() -> list[str]:
    """Every model type, then the configuration variants."""
    return model_types() + list(VARIANTS)


def run(types: list[str], verbose: bool = True) -> dict:
    """Rows by model type (a ``VARIANTS`` label runs that variant of its model type). The hf_kvcache columns read
    the caches' storage through the kernels at every length (``HF_KVCACHE_CPU_HANDLES=always``, as the tests do):
    on CPU the layers would otherwise take sdpa's path for these short prompts."""
    from hf_kvcache.layers import _common

    _common.CPU_HANDLES = "always"
    results = {}
    for model_type in types:
        start = time.perf_counter()
        base, variant = VARIANTS.get(model_type, (model_type, None))
        with warnings.catch_warnings(), contextlib.redirect_stderr(io.StringIO()):
            warnings.simplefilter("ignore")
            results[model_type] = run_family(base, variant)
        if verbose:
            fails = [
                f"{attn}/{c}: {cell['detail']}"
                for attn, cells in results[model_type].items()
                for c, cell in cells.items()
                if cell["status"] == "FAIL"
            ]
            status = results[model_type]["sdpa"]["model"]
            print(f"{model_type:28s} {time.perf_counter() - start:5.1f}s {status['status']:4s} {status['detail'][:80]}")
            for fail in fails:
                print("    FAIL", fail[:200])
            sys.stdout.flush()
    return results


SPREAD = (  # re-run by the test suite: one of each kind of outcome the matrix has found, and the families behind them
    "llama", "gpt2", "gemma3", "qwen3_next", "mpt", "falcon", "gpt_bigcode", "bert", "diffllama", "mllama",
    "gpt_neox_japanese", "beam", "git", "openai-gpt", "deepseek_v3", "jamba", "mimo_v2_flash", "cpmant", "gptj",
    "gemma4_text", "axk1", "gemma3_text",  # over their bounds, measured: sharp attention, a router's flip, a norm
    "inkling_text",  # a sliding window beside convolution states; refused under hf_kvcache (its position bias)
    *(v for v in VARIANTS if v.split(" ")[0] in ("falcon", "gpt_bigcode", "roberta")),  # one row per flag kind
)  # fmt: skip
LABELS = {"equal": "equal", "bound": "within bound", "over": "over bound", "runs": "runs", "refused": "refused"}


def _key(detail: str, names: set[str]) -> str:
    """A refusal's message with the model's own names taken out, so that one reason groups many model types."""
    detail = re.sub(r"\b\w+(ForCausalLM|LMHeadModel|ForConditionalGeneration|Decoder)\b", "…", detail)
    detail = re.sub(r"'([\w-]+)'", lambda m: "'…'" if m[1] in names or m[1].endswith("_text") else m[0], detail)
    # Saved messages are cut at 300 characters, where names of different lengths move the cut: group on less.
    return detail if len(detail) <= 240 else detail[:240] + "…"


def render(saved: dict) -> str:
    families = saved["families"]
    columns = [c[0] for c in CACHES] + ["plan", "ragged"]
    letters = {"eager": "e", "sdpa": "s", "hf_kvcache": "h", LATER: "l"}
    bounds = {c[0]: c[3] for c in CACHES if c[2] is False}
    reasons: dict[str, list[str]] = {}  # refusal text -> model types
    lines = [
        "# Supported models",
        "",
        "<!-- Written by scripts/supported_models.py from docs/data/supported-models.json: do not edit by hand. -->",
        "",
        f"Every causal-LM model type of transformers {saved['transformers']} (`MODEL_FOR_CAUSAL_LM_MAPPING_NAMES`, "
        f"{len(set(families) - set(VARIANTS))} types; torch {saved['torch']}), built tiny from its own config class "
        "(2 layers, hidden 64, 4 heads; per-family overrides where needed), loaded with each attention implementation "
        "and run under "
        f"`generate()` on a left-padded batch of 2 for {NEW_TOKENS} new tokens, against transformers' `DynamicCache`; "
        f"then {len(VARIANTS)} configurations popular checkpoints load that the tiny build does not reach (rows "
        "named with their flags, e.g. multi-query Falcon, ALiBi, a flag set after construction; and, named with the "
        "checkpoint, a published config.json's fields such as Llama-3.1's RoPE scaling or Phi-3.5's longrope, as the "
        "file spells them). Each cell is one of:",
        "",
        "- **equal**: tokens and logits equal `DynamicCache`'s (lossless caches);",
        "- **within bound** (the number: max teacher-forced logit error / std of the baseline's logits): lossy "
        + ", ".join(f"`{c}` ≤ {b}" for c, b in bounds.items())
        + ", the test matrix's bounds; **over bound**: the error is larger (listed below, with what the matrix "
        "measured of the cause);",
        "- **runs**: an evicting window (no baseline to equal) generates without error;",
        "- **refused (Rn)**: a one-line `ValueError` naming the model type and the reason (listed below).",
        "",
        "Column `plan`: `kv_bytes('dynamic', model, ...)` (what `hf-kvcache plan` counts) **equal** to the K/V bytes "
        "a `DynamicCache` holds after the prompt's prefill, and `state_bytes(model)` times the rows to the recurrent "
        "states it holds (a hybrid model's), or refused where the caches refuse the model. Column "
        f"`ragged`: a batch of a {RAGGED[0]}-token and a {RAGGED[1]}-token row, left-padded, through `{RAGGED_SPEC}` "
        "(int2's defaults: sinks, rotation, pre-RoPE keys), holding exactly what `kv_bytes` plans for two "
        f"{RAGGED[1]}-token rows (**equal**; a hybrid model's recurrent states, a fixed size per row, apart).",
        "",
        "Models whose attention layers sit beside recurrent ones (Mamba, gated DeltaNet, convolutions: transformers' "
        "`linear_attention` and `conv` layer types), MLP-only blocks (`dummy`), or layers with both (`hybrid`: "
        "Falcon-H1, Zamba; `hybrid_sliding`, a sliding window beside convolutions: Inkling) are served: every cache "
        "keeps the recurrent states as `DynamicCache` "
        "does (transformers' own layer classes, full precision) and its own storage for the attention's K/V, which "
        "the `hf_kvcache` attention reads in place as any other model's. Sparse attention's `indexed_attention` "
        "layers (DeepSeek-V3.2, GLM-5's `glm_moe_dsa`, Dots 3 Note, Qwen4-Exp beside gated DeltaNet) are served by the "
        "caches that keep every token: the indexer's keys beside the K/V, as `DynamicCache` keeps them; the evicting "
        "window refuses them. GLM-5-Next (image-text-to-text, so not a row here; its text path runs in "
        "`tests/test_indexed.py`) passes its NoPE latent with an empty value: the caches store the latent's halves in "
        "their key and value slots. Images through vision-language models are tested apart "
        "(`tests/test_vlm_images.py`: LLaVA, and Qwen2-VL, whose image tokens take multimodal RoPE positions; this "
        "matrix's vision-language rows run text only): pages equal, int8 / int4 / int2 within bound, keys before RoPE "
        "and the sink window's re-rotation refused where positions are multimodal. A recurrent-depth model (Dory, "
        "whose recurrent section runs several loops a forward) gets a cache layer per loop after the first, built up "
        "front (the model appends those copies to `DynamicCache`'s at its first forward), planned and counted; where "
        "one cache layer serves every loop and the earlier loops read its tensors in place "
        '(`recurrent_kv_cache_mode="last_loop"`), a cache whose layers keep their own layout refuses it. Refused by '
        "name: compressed attention (DeepSeek-V4), layers that read another layer's cache (KV sharing), and, under "
        "the `hf_kvcache` attention, models that add a position bias to their attention scores (`position_bias`: "
        "Inkling's relative-position logits), which its kernels do not read.",
        "",
        "Caches: " + ", ".join(f"`{c}` = `{spec}`" for c, spec, *_ in CACHES) + ". Reproduce with "
        "`python scripts/supported_models.py --run` (the whole matrix, a few minutes on one core); the test suite "
        "re-runs a spread of it and checks this page against the saved results.",
        "",
        "## Summary",
        "",
        "Cells (model type x attention implementation that transformers can run for it):",
        "",
        "| cache | " + " | ".join(LABELS.values()) + " | other |",
        "|---|" + "---:|" * (len(LABELS) + 1),
    ]
    for column in columns:
        counts = dict.fromkeys(LABELS, 0)
        other = 0
        for row in families.values():
            for cells in row.values():
                status = cells.get(column, {}).get("status")
                if status in counts:
                    counts[status] += 1
                elif status is not None:
                    other += 1
        lines.append(f"| `{column}` | " + " | ".join(str(v) for v in counts.values()) + f" | {other} |")
    runnable = [t for t, row in families.items() if any(c["model"]["status"] == "ok" for c in row.values())]
    lines += [
        "",
        f"{len(runnable)} of {len(families)} rows (model types and configurations) build tiny and generate with "
        f"`DynamicCache` under at least one attention implementation; the other {len(families) - len(runnable)} are "
        "listed at the end with the "
        "reason.",
        "",
        "## Per model type",
        "",
        "Attention: the implementations transformers runs for the model (e = eager, s = sdpa, h = hf_kvcache at "
        "load, l = loaded with sdpa then switched to hf_kvcache with `set_attn_implementation`; h / l refused: the "
        "model is refused by the `hf_kvcache` attention at the door). Where the attention implementations disagree, "
        "the cell says which gives what.",
        "",
        "| model type | attention | " + " | ".join(f"`{c}`" for c in columns) + " |",
        "|---|---|" + "---|" * len(columns),
    ]
    for model_type in runnable:
        row = families[model_type]
        ran = [a for a in ATTENTION if row[a]["model"]["status"] == "ok"]
        attn = "".join(letters[a] for a in ran)
        for mode in ("hf_kvcache", LATER):
            if row[mode]["model"]["status"] == "refused":
                reason = _reason(reasons, row[mode]["model"]["detail"], model_type)
                attn += f", {letters[mode]} refused (R{reason})"
        texts = []
        for column in columns:
            by_text: dict[str, list[str]] = {}
            errors: dict[str, float] = {}
            for a in ran:
                cell = row[a][column]
                text = LABELS.get(cell["status"], cell["status"])
                if cell["status"] in ("bound", "over"):
                    errors[text] = max(errors.get(text, 0.0), cell["error"])
                if cell["status"] == "refused":
                    text += f" (R{_reason(reasons, cell['detail'], model_type)})"
                if cell["status"] == "FAIL":
                    text = "**FAIL**: " + cell["detail"].replace("|", "/")
                if cell["status"] == "equal" and cell["detail"]:
                    text += f": {cell['detail']}"
                by_text.setdefault(text, []).append(letters[a])
            by_text = {(f"{t} ({errors[t]:.3f})" if t in errors else t): who for t, who in by_text.items()}
            texts.append(
                next(iter(by_text))
                if len(by_text) == 1
                else "; ".join(f"{''.join(who)}: {text}" for text, who in by_text.items())
            )
        lines.append(f"| `{model_type}` | {attn} | " + " | ".join(texts) + " |")
    # Over-bound cells, one entry per model type, cache and measurement, with the attentions it holds for
    grouped: dict[tuple, list[str]] = {}
    for t, row in families.items():
        for a, cells in row.items():
            for c, cell in cells.items():
                if cell["status"] == "over":
                    measured = tuple((k, cell[k]) for k in ("error", *CAUSES) if k in cell)
                    grouped.setdefault((t, c, measured), []).append(letters[a])
    over = [(f"`{t}` `{c}` ({''.join(who)}) {dict(m)['error']:.3f}", dict(m), bounds[c], len(who))
            for (t, c, m), who in grouped.items()]  # fmt: skip
    flipped = [
        f"{name} (step {cell['flip']}; {cell['before']:.3f} before)" for name, cell, *_ in over if "flip" in cell
    ]
    sharp = [
        f"{name} (spread {cell['spread']:.1f}; "
        + (f"{cell['tempered']:.3f} tempered)" if "tempered" in cell else "its scaling cannot be tempered)")
        for name, cell, *_ in over
        if "spread" in cell
    ]
    normed = [
        f"{name} (x{cell['gain']:.0f}; {cell['unnormed']:.3f} without the norm)"
        for name, cell, *_ in over
        if "gain" in cell
    ]
    unexplained = [name for name, cell, *_ in over if not set(CAUSES) & set(cell)]
    over_cells = sum(n for *_, n in over)
    settled = sum(
        n
        for _, cell, bound, n in over
        if min(cell.get("before", math.inf), cell.get("tempered", math.inf), cell.get("unnormed", math.inf)) <= bound
    )
    lines += [
        "",
        "## Over the bound",
        "",
        f"{over_cells} lossy cells exceed the test matrix's bound on these tiny random models (the "
        "error of a model that attends to its left padding is its unpadded row's). For each the matrix measures three "
        "causes, so that a cell over its bound says why:",
        "",
        "- **a choice flipped**: the decode step at which a mixture-of-experts router or a sparse attention's indexer "
        "(a module whose class name ends in Router or Indexer, recording the integer choices it returns) first chose "
        "otherwise than under `DynamicCache`, and the error before that step. A K/V error too small to matter can "
        "flip such a choice, and the flip moves the logits by the difference between two experts' outputs: a "
        "discontinuity of the model, not a drift of the cache;",
        f"- **sharp attention**: where the prompt's attention scores (query . key x scaling, over its unpadded row) "
        f"spread wider than {SHARP:g} (a standard model's `head_dim ** -0.5` over unit-RMS queries and keys spreads "
        "them about 1), that spread and the cell's error with each attention's scaling divided by its scores' spread, "
        "the baseline tempered alike (where a model computes its attention itself, CPM-Ant, the scores from each "
        "attention module's own query and key projections, and its query projection divided instead). Gemma 4 "
        "scales its RMS-normalized queries and keys by 1.0 and leaves the "
        "temperature to its trained `q_norm` weights, which a random model has at 1, so its scores spread about "
        "sqrt(head_dim) (its global layers' head_dim is 512): each key error moves the weights as much more. How "
        "sharp a trained Gemma 4's attention is, this matrix cannot say (no weights); measure it with `hf-kvcache "
        "eval`;",
        "- **a normalized attention output**: where a norm takes the attention's output before the residual add "
        "(Gemma 2 and 3's `post_attention_layernorm`; a module that receives the very tensor an attention module "
        "returned), the factor by which it scales that output and the cell's error with those norms bypassed, the "
        "baseline alike. A random model's attention output is small (its projections' weights have std 0.02): Llama "
        "adds it to the residual stream as it is, a small part of it, while such a norm scales it, with the cache's "
        "error, to the stream's size. How much a trained model's attention weighs, this matrix cannot say either.",
        "",
        "Each entry: model type, cache, the attentions (letters as above), the error, then what was measured.",
        "",
        "A choice flipped: " + ("; ".join(flipped) or "none") + ".",
        "",
        "Sharp attention: " + ("; ".join(sharp) or "none") + ".",
        "",
        "A normalized attention output: " + ("; ".join(normed) or "none") + ".",
        "",
        f"Of the {over_cells} cells, {settled} are within their bound before the flip, once tempered or without the "
        "norm. No cause measured: " + ("; ".join(unexplained) or "none") + ".",
    ]
    lines += ["", "## Refusals", ""]
    for n, (text, types) in enumerate(reasons.items(), 1):
        lines.append(f"- **R{n}** ({', '.join(f'`{t}`' for t in sorted(set(types)))}): {text}")
    lines += [
        "",
        "## Not run",
        "",
        "Model types that do not build tiny or do not generate with `DynamicCache` under any attention "
        "implementation (the first line of the error):",
        "",
    ]
    for model_type, row in families.items():
        if model_type not in runnable:
            detail = row["eager"]["model"]["detail"] or row["sdpa"]["model"]["detail"]
            lines.append(f"- `{model_type}`: {detail.replace('`', '')}")
    return "\n".join(lines) + "\n"


def _reason(reasons: dict, detail: str, model_type: str) -> str:
    key = _key(detail, set(model_types()))
    reasons.setdefault(key, []).append(model_type)
    return str(list(reasons).index(key) + 1)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--run", nargs="*", metavar="MODEL_TYPE", help="run these model types (default: all)")
    parser.add_argument("--write", action="store_true", help="render the page from the saved results")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.run is not None:
        types = args.run or rows()
        saved = json.loads(SAVED.read_text()) if SAVED.exists() else {}
        families = saved.get("families", {})
        families.update(run(types))
        import transformers

        saved = {"transformers": transformers.__version__, "torch": torch.__version__.split("+")[0]}
        saved["families"] = {k: families[k] for k in sorted(families)}
        SAVED.parent.mkdir(parents=True, exist_ok=True)
        SAVED.write_text(json.dumps(saved, indent=1) + "\n")
    if args.run is not None or args.write:
        PAGE.write_text(render(json.loads(SAVED.read_text())))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Tiny random models and inputs shared by the test matrix (one place to add a model family)."""

from __future__ import annotations

import copy
from functools import cache

import torch
from transformers import AutoModelForCausalLM, AutoModelForImageTextToText
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

import hf_kvcache  # noqa: F401  (registers the hf_kvcache attention implementation)
from hf_kvcache._compat import CACHE_ARG, with_cache
from hf_kvcache.tools.tiny import TINY_FAMILIES, TINY_VOCAB

VOCAB = TINY_VOCAB
PAD = 0
FAMILIES = TINY_FAMILIES  # name -> config factory (hf_kvcache.tools.tiny; the peer comparison uses them too)
ATTENTION = ("eager", "sdpa")


@cache
def rotary(width: int, layout: str = "half"):
    """A RoPE of ``width``-channel heads (base 10,000): every channel in the rotate_half layout ("half"),
    "interleaved" pairs, or the first half of the channels only ("partial")."""
    from hf_kvcache.rope import RotarySpec

    rotary_dim = width // 2 if layout == "partial" else width
    inv_freq = 1.0 / 10000 ** (torch.arange(0, rotary_dim, 2).float() / rotary_dim)
    return RotarySpec(inv_freq, rotary_dim, layout == "interleaved")


def tiny_model(family: str, attn: str = "sdpa", seed: int = 0):
    """A seeded random model; ``seed=1`` gives a different model of the same family (an assistant that disagrees).

    Each call returns a fresh model (tests may change its config or attention), a copy of the first one built, with
    the global RNG left as building it leaves it: the suite builds thousands, and a copy costs half a build."""
    model, rng = _built(family, attn, seed)
    torch.set_rng_state(rng)
    return copy.deepcopy(model)


@cache
def _built(family: str, attn: str, seed: int):
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(FAMILIES[family](), attn_implementation=attn).eval()
    model.generation_config.pad_token_id = PAD
    model.generation_config.eos_token_id = None  # generate the full length: compare equal-length outputs
    return model, torch.get_rng_state()


def prompt(batch: str, length: int = 12, seed: int = 1) -> dict[str, torch.Tensor]:
    """``batch='single'``: one row; ``batch='padded'``: two rows, the second left-padded by 5 tokens."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, VOCAB, (2 if batch == "padded" else 1, length), generator=g)
    mask = torch.ones_like(ids)
    if batch == "padded":
        ids[1, :5] = PAD
        mask[1, :5] = 0
    return {"input_ids": ids, "attention_mask": mask}


# Families beyond the matrix, each with something the caches must handle or refuse by name: latent attention (keys
# and values of different widths, RoPE in the value slot), ALiBi, sinusoidal-table RoPE (GPT-J, CodeGen), NoPE
# layers, logit softcapping, learned attention sinks, YaRN, multi-query KV heads.
def _extra_families() -> dict:
    from transformers import (
        BloomConfig,
        CodeGenConfig,
        DeepseekV2Config,
        DeepseekV3Config,
        FalconConfig,
        Gemma2Config,
        GPTBigCodeConfig,
        GPTJConfig,
        GptOssConfig,
        Llama4TextConfig,
        SmolLM3Config,
    )

    common = dict(vocab_size=VOCAB, pad_token_id=PAD, bos_token_id=1, eos_token_id=2)
    small = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, max_position_embeddings=512, **common)
    mla = dict(kv_lora_rank=32, q_lora_rank=None, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16)
    moe = dict(moe_intermediate_size=32, n_routed_experts=4, num_experts_per_tok=2, first_k_dense_replace=2)
    return {
        "deepseek_v3": lambda: DeepseekV3Config(
            num_hidden_layers=2, num_key_value_heads=4, n_group=1, topk_group=1, **mla, **moe, **small
        ),
        "deepseek_v2": lambda: DeepseekV2Config(num_hidden_layers=2, num_key_value_heads=4, **mla, **moe, **small),
        "falcon_alibi": lambda: FalconConfig(
            hidden_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            alibi=True,
            new_decoder_architecture=False,
            multi_query=False,
            **common,
        ),  # fmt: skip
        # Multi-query layouts: layers pass fewer KV heads than the config's attention heads suggest (falcon-7b's
        # multi_query caches 1 head; the new decoder architecture expands its KV heads before caching; StarCoder).
        "falcon_mq": lambda: FalconConfig(
            hidden_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            alibi=False,
            new_decoder_architecture=False,
            multi_query=True,
            **common,
        ),  # fmt: skip
        "falcon_new": lambda: FalconConfig(
            hidden_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_kv_heads=2,
            alibi=False,
            new_decoder_architecture=True,
            **common,
        ),  # fmt: skip
        "gpt_bigcode": lambda: GPTBigCodeConfig(n_embd=64, n_layer=2, n_head=4, multi_query=True, **common),
        "bloom": lambda: BloomConfig(hidden_size=64, n_layer=2, n_head=4, **common),
        "gptj": lambda: GPTJConfig(n_embd=64, n_layer=2, n_head=4, rotary_dim=8, n_positions=512, **common),
        "codegen": lambda: CodeGenConfig(
            n_embd=64, n_layer=2, n_head=4, rotary_dim=8, n_positions=512, n_ctx=512, **common
        ),
        "smollm3": lambda: SmolLM3Config(num_hidden_layers=3, num_key_value_heads=2, no_rope_layers=[1, 0, 1], **small),
        "smollm3_nope": lambda: SmolLM3Config(
            num_hidden_layers=2, num_key_value_heads=2, no_rope_layers=[0, 0], **small
        ),
        "llama4": lambda: Llama4TextConfig(
            num_hidden_layers=2,
            num_key_value_heads=2,
            head_dim=16,
            no_rope_layers=[1, 0],
            attention_chunk_size=8,
            intermediate_size_mlp=128,
            num_local_experts=2,
            **small,
        ),  # fmt: skip
        # A softcap small enough to change a tiny random model's scores (the default 50 would not).
        "gemma2": lambda: Gemma2Config(
            num_hidden_layers=2,
            num_key_value_heads=2,
            head_dim=16,
            sliding_window=8,
            attn_logit_softcapping=0.01,
            **small,
        ),  # fmt: skip
        "gpt_oss": lambda: GptOssConfig(
            num_hidden_layers=2,
            num_key_value_heads=2,
            head_dim=16,
            sliding_window=8,
            num_local_experts=2,
            num_experts_per_tok=1,
            **small,
        ),  # fmt: skip
    }


EXTRA_FAMILIES = _extra_families()


@cache
def extra_model(family: str, attn: str = "eager"):
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(EXTRA_FAMILIES[family](), attn_implementation=attn).eval()
    model.generation_config.pad_token_id = PAD
    model.generation_config.eos_token_id = None
    return model


# --- models of the supported-models matrix's tiny configs (hybrid and sparse-attention families) ------------------


@cache
def config_model(model_type: str, attn: str = "sdpa", **overrides):
    """A seeded random model of ``model_type`` at the supported-models matrix's tiny size (``overrides``: config
    fields set on top of it). A type with no causal-LM class (GLM-5-Next) is built image-text-to-text, the overrides
    set on its text config, and run on text."""
    from hf_kvcache.tools.supported_models import tiny_config

    torch.manual_seed(0)
    if model_type in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        auto, config = AutoModelForCausalLM, tiny_config(model_type, overrides)
    else:
        auto, config = AutoModelForImageTextToText, tiny_config(model_type, {"text_config": overrides})
    model = auto.from_config(config, attn_implementation=attn).eval()
    model.generation_config.pad_token_id = PAD
    model.generation_config.eos_token_id = None
    return model


def generate(model, cache, inputs: dict, new: int = 8, **kwargs):
    """``new`` tokens (greedy unless ``kwargs`` say otherwise, sampling seeded) with the logits of every step."""
    torch.manual_seed(1234)
    with torch.no_grad():
        return model.generate(
            **inputs, **{CACHE_ARG: cache}, max_new_tokens=new, min_new_tokens=new, output_logits=True,
            return_dict_in_generate=True, **({"do_sample": False} | kwargs),
        )  # fmt: skip


def assert_generation_matches(out, ref, lossless: bool, bound: float) -> None:
    """Lossless: the reference's tokens and logits. Lossy: every step's logits within ``bound`` (times the step's
    logit spread) until the first token that differs (the matrix's rule)."""
    if lossless:
        torch.testing.assert_close(out.sequences, ref.sequences, rtol=0, atol=0)
        for got, want in zip(out.logits, ref.logits):
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
        return
    differ = (out.sequences != ref.sequences).any(0).nonzero()
    steps = len(ref.logits) if not len(differ) else int(differ[0]) - (ref.sequences.shape[1] - len(ref.logits)) + 1
    for step in range(steps):
        error = (out.logits[step] - ref.logits[step]).abs().amax(-1)
        assert (error <= bound * ref.logits[step].std(-1)).all(), f"step {step}: logit error {error.tolist()}"


def prefilled(model, inputs: dict, *caches):
    """``caches`` after one forward of ``inputs`` each."""
    with torch.no_grad():
        for cache in caches:
            model(**inputs, **with_cache(model, cache))
    return caches


def handed_prefill_continues_alike(model, make, inputs: dict):
    """A prompt's prefill handed to one cache (``SharedPrefill``) against a prefill through another (``make()``
    builds each) at the same positions (a padded row's counted from its first token, as generate and
    ``SharedPrefill`` count them): the same length and bytes, then the same logits, bit for bit, for 6 more tokens.
    Returns the ``SharedPrefill`` and the cache it was handed to."""
    from hf_kvcache.prefill import SharedPrefill, padded_positions

    shared = SharedPrefill(model, inputs["input_ids"], inputs["attention_mask"])
    handed = shared.into(make())
    (own,) = prefilled(model, inputs | padded_positions(model, inputs["attention_mask"]), make())
    assert handed.get_seq_length() == own.get_seq_length() == inputs["input_ids"].shape[1]
    assert handed.nbytes == own.nbytes
    ids = torch.randint(3, VOCAB, (len(inputs["input_ids"]), 6), generator=torch.Generator().manual_seed(5))
    mask = torch.cat([inputs["attention_mask"], torch.ones_like(ids)], 1)
    with torch.no_grad():
        a = model(input_ids=ids, attention_mask=mask, **with_cache(model, handed)).logits
        b = model(input_ids=ids, attention_mask=mask, **with_cache(model, own)).logits
    torch.testing.assert_close(a, b, rtol=0, atol=0)
    return shared, handed

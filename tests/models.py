"""Tiny random models and inputs shared by the test matrix (one place to add a model family)."""

from __future__ import annotations

from functools import cache

import torch
from transformers import (
    AutoModelForCausalLM,
    Gemma3TextConfig,
    GPT2Config,
    LlamaConfig,
    MistralConfig,
    Phi3Config,
    Qwen2Config,
)

from hf_kvcache.attention import register_paged_attention

register_paged_attention()  # tiny_model(family, "hf_kvcache_paged")

VOCAB = 128
PAD = 0
COMMON = dict(vocab_size=VOCAB, pad_token_id=PAD, bos_token_id=1, eos_token_id=2)
SMALL = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, **COMMON)

# name -> config factory. head_dim 16 everywhere, so 4/2-bit groups of 8 fit; windows small enough to slide in tests.
FAMILIES = {
    "llama": lambda: LlamaConfig(num_key_value_heads=2, max_position_embeddings=512, **SMALL),
    "mistral": lambda: MistralConfig(num_key_value_heads=2, sliding_window=12, max_position_embeddings=512, **SMALL),
    "qwen2": lambda: Qwen2Config(num_key_value_heads=2, max_position_embeddings=512, **SMALL),
    "phi3": lambda: Phi3Config(num_key_value_heads=2, max_position_embeddings=512, **SMALL),
    "gpt2": lambda: GPT2Config(n_embd=64, n_layer=2, n_head=4, n_positions=512, **COMMON),
    "gemma3": lambda: Gemma3TextConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        sliding_window=10,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        max_position_embeddings=512,
        **COMMON,
    ),
}
ATTENTION = ("eager", "sdpa")


@cache
def tiny_model(family: str, attn: str = "sdpa", seed: int = 0):
    """A seeded random model; ``seed=1`` gives a different model of the same family (an assistant that disagrees)."""
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(FAMILIES[family](), attn_implementation=attn).eval()
    model.generation_config.pad_token_id = PAD
    model.generation_config.eos_token_id = None  # generate the full length: compare equal-length outputs
    return model


def prompt(batch: str, length: int = 12, seed: int = 1) -> dict[str, torch.Tensor]:
    """``batch='single'``: one row; ``batch='padded'``: two rows, the second left-padded by 5 tokens."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, VOCAB, (2 if batch == "padded" else 1, length), generator=g)
    mask = torch.ones_like(ids)
    if batch == "padded":
        ids[1, :5] = PAD
        mask[1, :5] = 0
    return {"input_ids": ids, "attention_mask": mask}

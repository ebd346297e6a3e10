"""Tiny random models for tests, benchmarks and tools: nothing downloaded, seeded, small enough for CPU.

``TINY_FAMILIES`` are the test matrix's model families (``tests/models.py``) and the peer comparison's
(:mod:`hf_kvcache.tools.peers`); ``tiny_llama`` a Llama of a chosen head width for demos and benchmarks. The
supported-models matrix (:mod:`hf_kvcache.tools.supported_models`) builds every model type tiny from its own config
class instead.
"""

from __future__ import annotations

import torch
from transformers import (
    Gemma3TextConfig,
    GPT2Config,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    Phi3Config,
    Qwen2Config,
)

__all__ = ["TINY_FAMILIES", "TINY_VOCAB", "tiny_llama"]

TINY_VOCAB = 128

_COMMON = dict(vocab_size=TINY_VOCAB, pad_token_id=0, bos_token_id=1, eos_token_id=2)
_SMALL = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, **_COMMON)

# name -> config factory of a tiny random model: head_dim 16 everywhere, so 4/2-bit groups of 8 fit; windows small
# enough to slide within short generations (Mistral 12, Gemma 3 10 on its sliding layers).
TINY_FAMILIES = {
    "llama": lambda: LlamaConfig(num_key_value_heads=2, max_position_embeddings=512, **_SMALL),
    "mistral": lambda: MistralConfig(num_key_value_heads=2, sliding_window=12, max_position_embeddings=512, **_SMALL),
    "qwen2": lambda: Qwen2Config(num_key_value_heads=2, max_position_embeddings=512, **_SMALL),
    "phi3": lambda: Phi3Config(num_key_value_heads=2, max_position_embeddings=512, **_SMALL),
    "gpt2": lambda: GPT2Config(n_embd=64, n_layer=2, n_head=4, n_positions=512, **_COMMON),
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
        **_COMMON,
    ),
}


def tiny_llama(head_dim: int = 64, layers: int = 4, seed: int = 0, dtype=torch.float32) -> LlamaForCausalLM:
    """A seeded random Llama (GQA, RoPE) for offline demos; no download."""
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=512,
        hidden_size=4 * head_dim,
        intermediate_size=8 * head_dim,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=head_dim,
        max_position_embeddings=32768,
    )
    model = LlamaForCausalLM(config).to(dtype).eval()
    model.generation_config.pad_token_id = 0
    model.generation_config.eos_token_id = None
    return model

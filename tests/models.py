"""Tiny random models and inputs shared by the test matrix (one place to add a model family)."""

from __future__ import annotations

from functools import cache

import torch
from transformers import AutoModelForCausalLM

from hf_kvcache.attention import register_paged_attention
from hf_kvcache.compare import TINY_FAMILIES, TINY_VOCAB

register_paged_attention()  # tiny_model(family, "hf_kvcache_paged")

VOCAB = TINY_VOCAB
PAD = 0
FAMILIES = TINY_FAMILIES  # name -> config factory (hf_kvcache.compare; benchmarks/compare_builtin.py uses them too)
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

"""Our caches on a model whose attention layers sit beside recurrent ones (Qwen3-Next's gated DeltaNet layers).

Three of Qwen3-Next's four layers are linear attention: they keep a fixed-size recurrent state instead of keys and
values. Every hf_kvcache cache keeps those states as ``DynamicCache`` does and its own storage (int4 codes, pages)
for the attention layers, so the same ``past_key_values=`` works: pages give ``DynamicCache``'s tokens exactly, int4
stores the attention layers' history in a fraction of the bytes. The memory report shows both kinds of layer, and
``plan_memory`` counts the states every row holds when it sizes a batch.

Run it with::

    python examples/hybrid_model.py

Everything is offline: the model is Qwen3-Next's architecture at a tiny size with random weights (nothing is
downloaded). With a real checkpoint only the loading line changes, e.g.
``AutoModelForCausalLM.from_pretrained("Qwen/Qwen3-Next-80B-A3B-Instruct", dtype="auto")``.
"""

from __future__ import annotations

import os

import torch
from transformers import AutoModelForCausalLM, DynamicCache, Qwen3NextConfig

from hf_kvcache import PagedKVCache, QuantizedKVCache, cache_nbytes
from hf_kvcache.plan import plan_memory

SMALL = os.environ.get("HF_KVCACHE_EXAMPLES_SMALL") == "1"


def tiny_qwen3_next():
    """Qwen3-Next's layer pattern (three linear-attention layers, then full attention) at a tiny size."""
    config = Qwen3NextConfig(
        vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=8, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
        linear_value_head_dim=16, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64,
        shared_expert_intermediate_size=64, max_position_embeddings=4096,
    )  # fmt: skip
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()
    model.generation_config.pad_token_id = 0
    model.generation_config.eos_token_id = None  # random weights: generate the full length
    return model


def generate(model, cache, prompt: torch.Tensor, new_tokens: int) -> torch.Tensor:
    with torch.inference_mode():
        out = model.generate(input_ids=prompt, past_key_values=cache, max_new_tokens=new_tokens, do_sample=False)
    return out[0, prompt.shape[1] :]


def main() -> None:
    torch.set_num_threads(1)
    model = tiny_qwen3_next()
    print("layer types:", ", ".join(model.config.layer_types))
    prompt = torch.randint(3, 512, (1, 256 if SMALL else 1024), generator=torch.Generator().manual_seed(1))
    new_tokens = 16 if SMALL else 64

    dynamic = DynamicCache(config=model.config)
    paged = PagedKVCache(model, block_size=16)
    int4 = QuantizedKVCache(model, bits=4)
    reference = generate(model, dynamic, prompt, new_tokens)
    print(f"paged tokens equal DynamicCache's: {torch.equal(generate(model, paged, prompt, new_tokens), reference)}")
    same = generate(model, int4, prompt, new_tokens) == reference
    print(f"int4 tokens equal DynamicCache's: {int(same.sum())} of {same.numel()}")

    print()
    for row in int4.memory_report()["layers"]:
        kind, tokens, nbytes = row["type"], row["stored_tokens"], row["nbytes"]
        print(f"int4 layer {row['layer_idx']} {kind:>14}: {tokens:>4} tokens, {nbytes:>9,} bytes")
    states = int4.state_nbytes
    attention_int4 = int4.nbytes - states
    attention_dynamic = cache_nbytes(dynamic) - states  # the recurrent states are the same size in every cache
    print(f"recurrent states (every cache):     {states:>9,} bytes")
    print(f"attention K/V, DynamicCache:        {attention_dynamic:>9,} bytes")
    print(f"attention K/V, QuantizedKVCache(4): {attention_int4:>9,} bytes")
    print(f"attention ratio: {attention_int4 / attention_dynamic:.3f}")

    # Planning memory: the states are a fixed size per row, which plan measures from the config and adds per row
    # (here for rows of 4,096 tokens in 256 MiB, the quantized caches reading their codes in place).
    plan = plan_memory(model.config, "256MiB", context=4096, dtype="float32", caches=("dynamic", "int4"),
                       reserve="8MiB", attn="hf_kvcache")  # fmt: skip
    print(f"plan: {plan.state_bytes_per_row:,} bytes of states per row (measured here: {states:,})")
    for row in plan.rows:
        print(f"plan: {row.cache:>7} fits {row.max_batch} rows of {plan.context:,} tokens in 256 MiB")


if __name__ == "__main__":
    main()

"""Why int8 uses one scale per token and head: accuracy per byte of int8 scale granularities.

For head_dim 128 and group sizes 128 (per token and head), 64, 32, 16: stored bytes vs bf16, K/V reconstruction
error (RMS error / RMS value) on keys with outlier channels (as real LLM keys have) and the teacher-forced logit error
on a random Llama (max |logit error| / logit std), side by side.

    python benchmarks/int8_granularity.py
"""

from __future__ import annotations

import torch
from transformers import DynamicCache

from hf_kvcache import QuantizedKVCache, quant
from hf_kvcache.tools.tiny import tiny_llama


def reconstruction_error(x: torch.Tensor, group: int) -> float:
    g = x.view(*x.shape[:-1], x.shape[-1] // group, group)
    codes, scale = quant.quantize_symmetric(g, dim=-1)
    back = quant.dequantize_symmetric(codes, scale, dtype=torch.float32).view_as(x)
    return float((back - x).pow(2).mean().sqrt() / x.pow(2).mean().sqrt())


@torch.no_grad()
def logit_error(model, ids, cache) -> float:
    ref_cache = DynamicCache(config=model.config)
    model(ids[:, :16], past_key_values=ref_cache)
    model(ids[:, :16], past_key_values=cache)
    worst = 0.0
    for t in range(16, ids.shape[1]):
        ref = model(ids[:, t : t + 1], past_key_values=ref_cache).logits
        got = model(ids[:, t : t + 1], past_key_values=cache).logits
        worst = max(worst, float((got - ref).abs().max() / ref.std()))
    return worst


def main():
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    keys = torch.randn(1, 8, 1024, 128, generator=g)
    keys[..., torch.randperm(128, generator=g)[:4]] *= 20  # a few outlier channels
    values = torch.randn(1, 8, 1024, 128, generator=g)
    model = tiny_llama(head_dim=128, layers=2)
    ids = torch.randint(3, 512, (1, 144), generator=g)
    print("| group | bytes vs bf16 | key RMS err | value RMS err | logit err / std |")
    print("|---|---|---|---|---|")
    for group in (128, 64, 32, 16):
        cache = QuantizedKVCache(model, bits=8, group_size=group)
        ratio = (128 + 128 // group * 4) / 256
        print(
            f"| {group} | {ratio:.3f} | {reconstruction_error(keys, group):.5f} | "
            f"{reconstruction_error(values, group):.5f} | {logit_error(model, ids, cache):.5f} |"
        )


if __name__ == "__main__":
    main()

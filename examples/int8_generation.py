"""Greedy generation with an int8 KV cache next to transformers' DynamicCache.

Shows that ``QuantizedKVCache(model)`` (int8, one scale per token and head) is a drop-in ``past_key_values`` for
``generate()``. It holds about a quarter of the full-precision cache's bytes (the reference model runs in float32;
against a bf16 cache the ratio is about a half) and keeps its tokens, except where the reference's two best
candidates are nearly tied: the script then shows how close they were and how far int8 moved the scores.

Run it with::

    python examples/int8_generation.py
    python examples/int8_generation.py --prompt "It is a truth universally acknowledged" --new-tokens 300

Everything is offline: the model is the small Llama trained on Jane Austen that ships with hf_kvcache.
"""

from __future__ import annotations

import argparse
import os

import torch
from transformers import DynamicCache

from hf_kvcache import QuantizedKVCache, cache_nbytes, dynamic_bytes_per_token, load_reference_model

SMALL = os.environ.get("HF_KVCACHE_EXAMPLES_SMALL") == "1"
# The start of the first sentence of Persuasion, the novel held out from the reference model's training.
PROMPT = "Sir Walter Elliot, of Kellynch Hall, in Somersetshire, was a man who"


def generate(model, inputs, cache, new_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy new tokens through ``cache`` and the scores each was picked from, one row per step.

    Greedy, so that any difference between two runs comes from the cache alone.
    """
    with torch.inference_mode():
        out = model.generate(
            **inputs,
            past_key_values=cache,
            max_new_tokens=new_tokens,
            do_sample=False,
            # A 4M-parameter model loops under plain greedy decoding; the penalty is deterministic, so both caches
            # still see exactly the same decoding rule.
            repetition_penalty=1.2,
            output_scores=True,
            return_dict_in_generate=True,
        )
    return out.sequences[0, inputs["input_ids"].shape[1] :], torch.cat(out.scores)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompt", default=PROMPT)
    parser.add_argument("--new-tokens", type=int, default=40 if SMALL else 200)
    args = parser.parse_args()

    model, tokenizer = load_reference_model()
    inputs = tokenizer(args.prompt, return_tensors="pt")

    dynamic = DynamicCache(config=model.config)
    int8 = QuantizedKVCache(model)  # bits=8 is the default
    reference, reference_scores = generate(model, inputs, dynamic, args.new_tokens)
    quantized, quantized_scores = generate(model, inputs, int8, args.new_tokens)

    print(f"Prompt: {args.prompt!r}\n")
    print(f"DynamicCache:     {tokenizer.decode(reference, skip_special_tokens=True)!r}\n")
    print(f"QuantizedKVCache: {tokenizer.decode(quantized, skip_special_tokens=True)!r}\n")
    same = torch.equal(reference, quantized)
    print(f"tokens equal: {same}")
    if not same:
        # int8 rounding moves the scores a little; a token flips only where the two best were closer than that.
        first = int((reference != quantized).nonzero()[0])
        top2 = reference_scores[first].topk(2).values
        error = (reference_scores[first] - quantized_scores[first]).abs().max()
        print(
            f"first different token: {first} of {reference.numel()}; there the reference's two best scores were "
            f"{top2[0] - top2[1]:.4f} apart and int8 moved the scores by up to {error:.4f}"
        )

    # Our caches count the bytes they hold (int8 codes + float32 scales); cache_nbytes() also reads DynamicCache's.
    report = int8.memory_report()
    print()
    for row in report["layers"]:
        print(f"int8 layer {row['layer_idx']}: {row['stored_tokens']} tokens, {row['nbytes']:,} bytes")
    tokens = int8.get_seq_length()
    dynamic_bytes = cache_nbytes(dynamic)
    print(f"DynamicCache bytes:     {dynamic_bytes:>9,} ({dynamic_bytes / tokens:,.0f} per token, {model.dtype})")
    print(f"QuantizedKVCache bytes: {report['nbytes']:>9,} ({report['nbytes'] / tokens:,.0f} per token)")
    print(f"ratio: {report['nbytes'] / dynamic_bytes:.3f}")
    # Against a bf16 model's DynamicCache the saving is smaller; bytes per token follow from the config alone.
    bf16_ratio = int8.bytes_per_token(torch.bfloat16) / dynamic_bytes_per_token(model.config, torch.bfloat16)
    print(f"ratio against a bf16 DynamicCache: {bf16_ratio:.3f}")


if __name__ == "__main__":
    main()

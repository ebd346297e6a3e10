"""Eight samples of one prompt that store the prompt once: ``PagedKVCache`` inside ``generate()``.

``num_return_sequences=8`` copies the prompt into 8 rows. ``DynamicCache`` then holds 8 copies of the prompt's keys
and values; ``PagedKVCache(model, block_size=16)`` keeps K/V in 16-token blocks with a block table per row, finds at
prefill that the rows' prompt blocks are identical and stores them once, shared. Each row's new tokens go into
blocks of its own. The outputs are the same as with ``DynamicCache`` (same seed, same samples): only memory changes.

Run it with::

    python examples/parallel_sampling_paged.py
    python examples/parallel_sampling_paged.py --prompt-tokens 480 --new-tokens 32

Everything is offline: the model is the small Llama trained on Jane Austen that ships with hf_kvcache.
"""

from __future__ import annotations

import argparse
import os

import torch
from transformers import DynamicCache

from hf_kvcache import PagedKVCache, cache_nbytes, load_reference_model, reference_text

SMALL = os.environ.get("HF_KVCACHE_EXAMPLES_SMALL") == "1"
SAMPLES = 8


def sample(model, inputs, cache, new_tokens: int, seed: int) -> torch.Tensor:
    """``SAMPLES`` sampled continuations of the one prompt in ``inputs``, through ``cache``."""
    torch.manual_seed(seed)  # the same seed for both caches, so that they draw the same samples
    with torch.inference_mode():
        out = model.generate(
            **inputs,
            past_key_values=cache,
            do_sample=True,
            top_p=0.9,
            num_return_sequences=SAMPLES,
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,  # rows of equal length, so the byte counts compare like for like
        )
    return out[:, inputs["input_ids"].shape[1] :]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompt-tokens", type=int, default=128 if SMALL else 384)
    parser.add_argument("--new-tokens", type=int, default=24 if SMALL else 64)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    model, tokenizer = load_reference_model()
    # The prompt: the first --prompt-tokens tokens of Persuasion, the novel held out from the model's training.
    # (16 characters per token is ample, and spares tokenizing the whole novel.)
    text = reference_text()[: 16 * args.prompt_tokens]
    inputs = tokenizer(text, truncation=True, max_length=args.prompt_tokens, return_tensors="pt")
    ids = inputs["input_ids"]

    dynamic = DynamicCache(config=model.config)
    paged = PagedKVCache(model, block_size=16)
    reference = sample(model, inputs, dynamic, args.new_tokens, args.seed)
    samples = sample(model, inputs, paged, args.new_tokens, args.seed)

    print(f"...{tokenizer.decode(ids[0, -30:])!r} + {SAMPLES} samples of {args.new_tokens} tokens:")
    for i, row in enumerate(samples):
        text = " ".join(tokenizer.decode(row, skip_special_tokens=True).split())  # one line per sample
        print(f"  {i}: {text[:90]}")
    print(f"\nsamples equal DynamicCache's: {torch.equal(samples, reference)}")

    report = paged.block_report()
    print(f"\nblock_report(): {report}")
    print(
        f"shared blocks: {report['blocks_shared']} (the {args.prompt_tokens}-token prompt's full blocks, stored once "
        f"for {SAMPLES} rows) of {report['blocks_used']} in use"
    )
    dynamic_bytes = cache_nbytes(dynamic)
    print(f"\nDynamicCache bytes: {dynamic_bytes:>10,}")
    print(f"PagedKVCache bytes: {paged.nbytes:>10,}")
    print(f"ratio: {paged.nbytes / dynamic_bytes:.3f}")


if __name__ == "__main__":
    main()

"""2-bit keys and values where the model needs them wider: ``key_bits="auto"`` finds the widths on the model.

At 2 bits a cache loses most where the model copies from far back, and most of that loss sits in a few layers'
keys. ``QuantizedKVCache(model, bits=2, key_bits="auto")`` measures each layer's keys at 2, 3 and 4 bits on rows of
random tokens (which the model can only predict by copying), gives a quarter bit more per key element to the layers
where it buys the most, and keeps the result in a file: the first cache of a model pays the search, every later
cache reads the file.

This script builds that cache twice (the search, then the file), then scores a copy task through ``DynamicCache``,
plain ``int2`` and ``int2`` with the widths: a passage, then its first tokens again, the repeat's perplexity through
each cache, and the bytes each holds.

Run it with::

    python examples/auto_key_widths.py                      # SmolLM2: its search takes ~6 minutes on 1 CPU thread
    python examples/auto_key_widths.py --model reference    # the embedded 4-layer model: seconds, but it hardly copies

Everything is offline.
"""

from __future__ import annotations

import argparse
import math
import os
import time

import torch
from transformers import DynamicCache

from hf_kvcache import QuantizedKVCache, cache_nbytes, default_model, load_model, reference_text
from hf_kvcache.prefill import SharedPrefill
from hf_kvcache.scoring import teacher_forced

SMALL = os.environ.get("HF_KVCACHE_EXAMPLES_SMALL") == "1"


def copy_perplexity(model, prefill: SharedPrefill, ids: torch.Tensor, cache) -> float:
    """Perplexity of ``ids`` (1, n), the tokens after ``prefill``'s, through ``cache``: the prompt's keys and values
    handed to the cache as its own forward would have stored them (one prefill for every cache), then ``ids`` read
    back from it as decoding reads them."""
    with torch.inference_mode():
        prefill.into(cache)
        rest = [logits for _, logits in teacher_forced(model, cache, ids[:, :-1], prefill.tokens)]
        log_probs = torch.log_softmax(torch.cat([prefill.logits[:, -1:], *rest], dim=1).float(), dim=-1)
    nll = -log_probs.gather(-1, ids[:, :, None]).mean()
    return math.exp(nll.item())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    # The real model where installed: the 4-layer reference model hardly copies (its copy perplexity is its plain one)
    parser.add_argument("--model", default="reference" if SMALL else default_model(), help="smollm2 or reference")
    parser.add_argument("--context", type=int, default=384 if SMALL else 1024, help="tokens of the passage")
    parser.add_argument("--copied", type=int, default=64 if SMALL else 128, help="its first tokens, again")
    args = parser.parse_args()
    torch.set_num_threads(1)  # the numbers do not depend on the machine's core count

    model, tokenizer = load_model(args.model)
    started = time.perf_counter()
    # residual_bits=8: the 128 most recent tokens in int8 instead of full precision (fewer bytes at short contexts)
    auto = QuantizedKVCache(model, bits=2, key_bits="auto", residual_bits=8)
    first = time.perf_counter() - started
    started = time.perf_counter()
    again = QuantizedKVCache(model, bits=2, key_bits="auto", residual_bits=8)
    second = time.perf_counter() - started
    widths = [auto.layer_key_bits(i) for i in range(len(auto.layers))]
    print(f"key widths per layer: {widths} ({sum(widths) / len(widths):.2f} bits on average)")
    print(f"first cache: {first:.1f} s (the search, unless an earlier run kept its file); second: {second:.2f} s")
    print(f"same widths the second time: {again.key_bits == auto.key_bits}")

    passage = tokenizer(reference_text()[: 8 * args.context], return_tensors="pt").input_ids[:, : args.context]
    with torch.inference_mode():
        prefill = SharedPrefill(model, passage)  # the passage's forward, once
    caches = {
        "DynamicCache": DynamicCache(config=model.config),
        "int2": QuantizedKVCache(model, bits=2),
        'int2, key_bits="auto", residual_bits=8': auto,
    }
    print(f"\nthe repeat of a {args.context}-token passage's first {args.copied} tokens:")
    baseline = None
    for name, cache in caches.items():
        ppl = copy_perplexity(model, prefill, passage[:, : args.copied], cache)
        baseline = baseline or ppl
        print(f"  {name:<40} copy perplexity {ppl:8.3f} ({ppl / baseline - 1:+7.1%})  {cache_nbytes(cache):>10,} bytes")


if __name__ == "__main__":
    main()

"""Stream thousands of tokens past the model's trained context with attention sinks and flat memory.

``SlidingWindowKVCache(model, window=..., sinks=4)`` keeps the first 4 tokens (StreamingLLM's attention sinks) and
the last ``window`` tokens of each layer, so its memory stops growing once the window is full, however long
generation runs. A streamer reads the cache while ``generate()`` runs and prints its bytes at a few checkpoints, next
to what a ``DynamicCache`` would hold by then (computed, not run: it would hold every token). The tail of the text
shows the model still writes Austen-like prose thousands of tokens past its training context.

Run it with::

    python examples/streaming_sinks.py
    python examples/streaming_sinks.py --new-tokens 10000 --window 256

Everything is offline: the model is the small Llama trained on Jane Austen that ships with hf_kvcache.
"""

from __future__ import annotations

import argparse
import os

import torch
from transformers.generation.streamers import BaseStreamer

from hf_kvcache import SlidingWindowKVCache, dynamic_bytes_per_token, load_reference_model

SMALL = os.environ.get("HF_KVCACHE_EXAMPLES_SMALL") == "1"
PROMPT = "Sir Walter Elliot, of Kellynch Hall, in Somersetshire, was a man who"


class CacheProbe(BaseStreamer):
    """Prints the cache's size at 64, 128, 256, ... generated tokens and at the last one.

    ``generate()`` calls ``put`` with the prompt first, then once per generated token, while the cache holds
    everything the model has been shown so far.
    """

    def __init__(self, cache: SlidingWindowKVCache, dynamic_per_token: int, new_tokens: int):
        self.cache, self.dynamic_per_token, self.new_tokens = cache, dynamic_per_token, new_tokens
        self.generated = -1  # the prompt's call brings it to 0
        self.next_checkpoint = 64
        self.rows: list[tuple[int, int]] = []  # (tokens the cache has seen, its bytes) at each checkpoint

    def put(self, value: torch.Tensor) -> None:
        self.generated += 1
        if self.generated < self.next_checkpoint and self.generated != self.new_tokens:
            return
        self.next_checkpoint *= 2
        seen = self.cache.get_seq_length()
        stored = self.cache.stored_tokens
        self.rows.append((seen, self.cache.nbytes))
        print(
            f"{self.generated:>6} generated | {stored:>5} of {seen:>6} tokens stored per layer | "
            f"{self.cache.nbytes:>9,} bytes | a DynamicCache would hold {seen * self.dynamic_per_token:>11,}"
        )

    def end(self) -> None:
        pass


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--new-tokens", type=int, default=640 if SMALL else 6144)
    parser.add_argument("--window", type=int, default=128 if SMALL else 252)
    parser.add_argument("--sinks", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    model, tokenizer = load_reference_model()
    inputs = tokenizer(PROMPT, return_tensors="pt")
    cache = SlidingWindowKVCache(model, window=args.window, sinks=args.sinks)
    probe = CacheProbe(cache, dynamic_bytes_per_token(model.config, model.dtype), args.new_tokens)
    trained = model.config.max_position_embeddings
    print(f"{cache!r}: at most {cache.max_stored_tokens} tokens per layer; the model was trained on {trained}.\n")

    # transformers warns once the sequence passes the model's trained positions. With re-rotated sinks (the default) no
    # query-key distance the model sees exceeds sinks + window, so it stays within what it was trained on.
    torch.manual_seed(args.seed)
    with torch.inference_mode():
        out = model.generate(
            **inputs,
            past_key_values=cache,
            streamer=probe,
            max_new_tokens=args.new_tokens,
            # Without this, generation would end at the first end-of-sequence token the model samples.
            min_new_tokens=args.new_tokens,
            do_sample=True,
            top_p=0.9,
        )

    # Once the window is full, the cache must hold exactly sinks + window tokens per layer, however long the stream.
    cap = cache.max_stored_tokens * probe.dynamic_per_token
    after_full = [nbytes for seen, nbytes in probe.rows if seen > cache.max_stored_tokens]
    flat = len(after_full) >= 2 and all(nbytes == cap for nbytes in after_full)
    print(f"\nmemory flat once the window is full: {flat} ({len(after_full)} checkpoints at {cap:,} bytes)")
    tail = tokenizer.decode(out[0, -80:], skip_special_tokens=True)
    print(f"\nThe last 80 of {out.shape[1]} tokens:\n...{tail}")


if __name__ == "__main__":
    main()

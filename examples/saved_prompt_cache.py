"""A long prompt prefilled once, saved to a file, and continued in another process.

The prefix-caching recipe of transformers' docs (prefill a shared prompt into a cache, then ``copy.deepcopy`` it for
each continuation) across processes: the prompt's cache is saved with ``torch.save`` and loaded with
``hf_kvcache.load_cache(path, model)``, which gives the loaded cache its model back. A quantized cache's file is a
fraction of ``DynamicCache``'s (it holds the codes, not the model's float K/V), and loading it costs a read instead of
the prompt's forward. The child process checks that its continuations are the tokens this process generates from the
same caches.

Run it with::

    python examples/saved_prompt_cache.py
    python examples/saved_prompt_cache.py --prompt-tokens 1500 --caches int4,int2

Everything is offline: the model is the small Llama trained on Jane Austen that ships with hf_kvcache.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from transformers import DynamicCache

from hf_kvcache import load_cache, load_reference_model, make_cache, reference_text

SMALL = os.environ.get("HF_KVCACHE_EXAMPLES_SMALL") == "1"
QUESTIONS = ["\n\nWho was Sir Walter Elliot?", "\n\nWhat did Anne think of Captain Wentworth?", "\n\nKellynch Hall"]


def continuations(model, tokenizer, prompt_ids: torch.Tensor, cache, new_tokens: int) -> list[list[int]]:
    """Greedy tokens after the prompt and each question, each from a copy of the prompt's ``cache`` (generate runs only
    the question's tokens through it)."""
    out = []
    for question in QUESTIONS:
        ids = torch.cat([prompt_ids, tokenizer(question, return_tensors="pt").input_ids], dim=1)
        with torch.inference_mode():
            seq = model.generate(
                input_ids=ids,
                attention_mask=torch.ones_like(ids),
                past_key_values=copy.deepcopy(cache),
                max_new_tokens=new_tokens,
                do_sample=False,
                repetition_penalty=1.2,  # a 4M-parameter model loops under plain greedy decoding
            )
        out.append(seq[0, ids.shape[1] :].tolist())
    return out


def child(folder: Path, new_tokens: int) -> None:
    """The other process: load each saved cache, time the load, and write its continuations."""
    torch.set_num_threads(1)
    model, tokenizer = load_reference_model()
    prompt_ids = torch.load(folder / "prompt.pt")
    results = {}
    for path in sorted(folder.glob("*.cache")):
        start = time.perf_counter()
        cache = torch.load(path, weights_only=False) if path.stem == "dynamic" else load_cache(path, model)
        seconds = time.perf_counter() - start
        tokens = continuations(model, tokenizer, prompt_ids, cache, new_tokens)
        results[path.stem] = {"load_s": seconds, "tokens": tokens}
    (folder / "child.json").write_text(json.dumps(results))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompt-tokens", type=int, default=300 if SMALL else 1500)
    parser.add_argument("--new-tokens", type=int, default=8 if SMALL else 24)
    parser.add_argument("--caches", default="int8,int4,int2", help="comma-separated cache specs beside DynamicCache")
    parser.add_argument("--child", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child is not None:
        return child(args.child, args.new_tokens)

    torch.set_num_threads(1)
    model, tokenizer = load_reference_model()
    text = reference_text()[: 16 * args.prompt_tokens]  # enough characters for the tokens, not the whole novel
    prompt_ids = tokenizer(text, return_tensors="pt").input_ids[:, : args.prompt_tokens]
    specs = ["dynamic", *args.caches.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        torch.save(prompt_ids, folder / "prompt.pt")
        here, prefill_s = {}, {}
        for spec in specs:
            cache = DynamicCache() if spec == "dynamic" else make_cache(spec, model)
            start = time.perf_counter()
            with torch.inference_mode():
                model(input_ids=prompt_ids, past_key_values=cache)
            prefill_s[spec] = time.perf_counter() - start
            torch.save(cache, folder / f"{spec.replace(':', '_')}.cache")
            here[spec] = continuations(model, tokenizer, prompt_ids, cache, args.new_tokens)

        command = [sys.executable, __file__, "--child", str(folder), "--new-tokens", str(args.new_tokens)]
        subprocess.run(command, check=True)
        there = json.loads((folder / "child.json").read_text())

        print(f"a {prompt_ids.shape[1]}-token prompt, saved after its prefill and loaded in another process:")
        sizes = {spec: (folder / f"{spec.replace(':', '_')}.cache").stat().st_size for spec in specs}
        for spec in specs:
            loaded = there[spec.replace(":", "_")]
            print(
                f"  {spec:<8} file {sizes[spec]:>10,} bytes ({sizes[spec] / sizes['dynamic']:.3f}x)  "
                f"prefill {prefill_s[spec] * 1000:7.1f} ms  load {loaded['load_s'] * 1000:6.1f} ms  "
                f"continuations equal: {loaded['tokens'] == here[spec]}"
            )
    first = tokenizer.decode(here[specs[-1]][0], skip_special_tokens=True)
    print(f"\n{specs[-1]}'s first continuation: {QUESTIONS[0].strip()!r} -> {first!r}")


if __name__ == "__main__":
    main()

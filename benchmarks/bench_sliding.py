"""Decode latency and cache bytes over a long generation: SlidingWindowKVCache vs DynamicCache, side by side.

One ``generate()`` per cache runs to the longest checkpoint; a logits processor stamps every step. At each checkpoint
(default 1k, 8k and 32k generated tokens) the table gives the median step latency over the surrounding steps and the
cache's bytes at that step. Default model: the embedded reference model (offline); ``--model`` takes a local path or
hub id. CUDA runs also report peak allocated memory.

    python benchmarks/bench_sliding.py                       # CPU, reference model, 1k/8k/32k
    python benchmarks/bench_sliding.py --device cuda --dtype bfloat16
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
from transformers import AutoModelForCausalLM, LogitsProcessor, LogitsProcessorList

from hf_kvcache import cache_nbytes, make_cache, reference_model_path
from hf_kvcache.compare import synchronize


class _Stamps(LogitsProcessor):
    """Records the time and the cache bytes at every decoding step."""

    def __init__(self, cache, device, checkpoints):
        self.cache, self.device, self.checkpoints = cache, device, set(checkpoints)
        self.times, self.nbytes = [], {}

    def __call__(self, input_ids, scores):
        synchronize(self.device)
        self.times.append(time.perf_counter())
        step = len(self.times)
        if step in self.checkpoints:
            self.nbytes[step] = cache_nbytes(self.cache)
        return scores


def run(model, spec: str, prompt_tokens: int, checkpoints: list[int], span: int) -> dict:
    device = model.device
    ids = torch.randint(3, model.config.vocab_size, (1, prompt_tokens), generator=torch.Generator().manual_seed(0))
    ids = ids.to(device)
    cache = make_cache(spec, model)
    stamps = _Stamps(cache, device, checkpoints)
    total = max(checkpoints) + span
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    with torch.inference_mode():
        model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            past_key_values=cache,
            max_new_tokens=total,
            min_new_tokens=total,
            do_sample=False,
            logits_processor=LogitsProcessorList([stamps]),
        )
    steps = [b - a for a, b in zip(stamps.times, stamps.times[1:])]  # steps[i]: step i+1 -> i+2
    rows = {}
    for c in checkpoints:
        around = steps[max(0, c - span) : c + span]
        rows[c] = {"ms_per_token": 1000 * statistics.median(around), "nbytes": stamps.nbytes.get(c)}
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
    return {"cache": spec, "checkpoints": rows, "peak_memory_bytes": peak}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="local path or hub id (default: the reference model)")
    parser.add_argument("--caches", default="dynamic,sink:window=1024:sinks=4,sink:window=1024:sinks=4:bits=8")
    parser.add_argument("--checkpoints", default="1000,8000,32000", help="generated-token counts to report")
    parser.add_argument("--span", type=int, default=32, help="steps on each side of a checkpoint in the median")
    parser.add_argument("--prompt-tokens", type=int, default=16)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", help="also write the results to this file")
    args = parser.parse_args()

    torch.set_num_threads(args.threads)
    model = AutoModelForCausalLM.from_pretrained(
        args.model or reference_model_path(), dtype=getattr(torch, args.dtype)
    ).to(args.device)
    model.eval()
    checkpoints = [int(c) for c in args.checkpoints.split(",")]
    results = [run(model, spec, args.prompt_tokens, checkpoints, args.span) for spec in args.caches.split(",")]

    print(f"{args.model or 'reference model'} on {args.device} ({args.dtype}, {args.threads} threads)")
    header = " | ".join(f"{c} tok: ms/token, bytes" for c in checkpoints)
    print(f"| cache | {header} |")
    print("|---|" + "---|" * len(checkpoints))
    base = results[0]["checkpoints"]
    for r in results:
        cells = []
        for c in checkpoints:
            row = r["checkpoints"][c]
            ratio = row["ms_per_token"] / base[c]["ms_per_token"]
            cells.append(f"{row['ms_per_token']:.2f} ({ratio:.2f}x), {row['nbytes']:,}")
        print(f"| {r['cache']} | " + " | ".join(cells) + " |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()

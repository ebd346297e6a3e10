"""CPU speed of every cache on the real model, side by side: decode steps under sdpa and under the ``hf_kvcache``
attention, and scoring text in 16-token chunks (how chunked prefill, speculative verification and the harness feed
a cache), next to transformers' quanto and HQQ caches.

Both protocols share each prompt's prefill between the caches (:func:`hf_kvcache.prefill.store_prefill`: one forward,
every cache given its K/V as that forward would), so only what differs is timed, and run the caches in interleaved
rounds (A B C ... A B C ...) so a slow spell of a shared machine falls on all of them. Reported: medians, and ratios
to ``DynamicCache`` in the same run.

* **decode**: per ``--decode`` cell (context x rows), a random prompt, then ``--steps`` single-token forwards per cache
  and attention; the median step time (the first step of each run left out).
* **chunks**: ``--windows`` windows of 1,024 tokens of the held-out text; per window the first 512 prefilled, the other
  512 scored 16 tokens per forward through the cache; the scoring time summed over windows (median over rounds).

    python benchmarks/bench_cpu.py --output results/bench-cpu-paths --rounds 3  # ~30 minutes, 1 thread, a quiet machine
    python benchmarks/bench_cpu.py --output /tmp/b --decode 512x1 --windows 1 --rounds 1 --model reference   # smoke
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
from tabulate import tabulate
from transformers import DynamicCache, QuantizedCache

from hf_kvcache import load_model, make_cache, reference_text
from hf_kvcache._compat import with_cache
from hf_kvcache.eval.runner import tokenize
from hf_kvcache.eval.tasks.perplexity import token_nll
from hf_kvcache.prefill import store_prefill

OURS = ("int8", "int4", "int3", "int2", "paged", "sink:window=1024:sinks=4")
# transformers' QuantizedCache at 4 bits with its defaults' group (64) and residual (128), as KIVI's int4 here.
PEERS = {
    "quanto int4": lambda model: QuantizedCache(backend="quanto", config=model.config, nbits=4),
    "hqq int4": lambda model: QuantizedCache(backend="hqq", config=model.config, nbits=4),
}


def _factory(name: str):
    return PEERS[name] if name in PEERS else (lambda model: make_cache(name, model))


def _prefill(model, ids: torch.Tensor) -> tuple[list, torch.Tensor]:
    """Every layer's K/V of one forward over ``ids`` (a cache that keeps every token), and its logits."""
    every = DynamicCache()
    with torch.inference_mode():
        logits = model(input_ids=ids, attention_mask=torch.ones_like(ids), **with_cache(model, every)).logits
    return [(layer.keys, layer.values) for layer in every.layers], logits


def decode_cell(model, context: int, rows: int, runs: list[tuple[str, str]], steps: int, rounds: int) -> list[dict]:
    gen = torch.Generator().manual_seed(context + rows)
    ids = torch.randint(3, model.config.vocab_size, (rows, context), generator=gen)
    kv, logits = _prefill(model, ids)
    first = logits[:, -1:].argmax(-1)
    times: dict[tuple[str, str], list[float]] = {run: [] for run in runs}
    for _ in range(rounds):
        for name, attn in runs:
            model.set_attn_implementation(attn)
            cache = store_prefill(_factory(name)(model), kv, torch.ones_like(ids))
            mask, token = torch.ones(rows, context + 1, dtype=torch.long), first
            with torch.inference_mode():
                for step in range(steps + 1):
                    start = time.perf_counter()
                    out = model(input_ids=token, attention_mask=mask, **with_cache(model, cache)).logits
                    if step:  # the first step pays one-off allocations
                        times[(name, attn)].append(time.perf_counter() - start)
                    token, mask = out[:, -1:].argmax(-1), torch.cat([mask, torch.ones(rows, 1, dtype=mask.dtype)], 1)
            del cache
    base = statistics.median(times[("dynamic", "sdpa")])
    sdpa = {name: statistics.median(t) for (name, attn), t in times.items() if attn == "sdpa"}
    return [
        {
            "protocol": "decode", "context": context, "rows": rows, "cache": name, "attn": attn,
            "step_ms": 1e3 * statistics.median(t), "x_dynamic": base / statistics.median(t),
            "x_same_cache_sdpa": sdpa[name] / statistics.median(t) if name in sdpa else None,
        }
        for (name, attn), t in times.items()
    ]  # fmt: skip


def chunk_protocol(model, tokenizer, names: list[str], windows: int, rounds: int, chunk: int = 16) -> list[dict]:
    ids = tokenize(tokenizer, reference_text()[: 40_000 * windows])[: 1024 * windows].view(windows, 1024)
    model.set_attn_implementation("sdpa")
    seconds = {name: [0.0] * rounds for name in names}
    nll = dict.fromkeys(names, 0.0)
    for w in range(windows):
        window = ids[w : w + 1]
        kv, _ = _prefill(model, window[:, :512])
        for r in range(rounds):
            for name in names:
                cache = store_prefill(_factory(name)(model), kv)
                total = 0.0
                start = time.perf_counter()
                with torch.inference_mode():
                    for a in range(512, 1023, chunk):
                        b = min(a + chunk, 1023)
                        logits = model(input_ids=window[:, a:b], **with_cache(model, cache)).logits
                        total += token_nll(logits, window[:, a + 1 : b + 1]).sum().item()
                seconds[name][r] += time.perf_counter() - start
                if r == 0:
                    nll[name] += total
                del cache
    base = statistics.median(seconds["dynamic"])
    tokens = windows * 511
    return [
        {
            "protocol": "chunks", "cache": name, "seconds": statistics.median(s), "x_dynamic_time":
            statistics.median(s) / base, "perplexity": float(torch.tensor(nll[name] / tokens).exp()),
        }
        for name, s in seconds.items()
    ]  # fmt: skip


def render(results: dict) -> str:
    decode = [
        [f"{r['context']:,} x {r['rows']}", f"{r['cache']} [{r['attn']}]", f"{r['step_ms']:.1f}",
         f"{r['x_dynamic']:.2f}", "" if r["x_same_cache_sdpa"] is None else f"{r['x_same_cache_sdpa']:.2f}"]
        for r in results["decode"]
    ]  # fmt: skip
    chunks = [[r["cache"], f"{r['seconds']:.1f}", f"{r['x_dynamic_time']:.2f}", f"{r['perplexity']:.3f}"]
              for r in results["chunks"]]  # fmt: skip
    parts = [f"{results['model']}, {results['threads']} thread(s), {results['rounds']} interleaved rounds."]
    if decode:
        parts += ["", "Decode step (median):", "", tabulate(
            decode, ["context x rows", "cache [attention]", "ms / step", "speed x dynamic", "speed x same cache, sdpa"],
            tablefmt="github", disable_numparse=True)]  # fmt: skip
    if chunks:
        parts += ["", f"Scoring {results['windows']} windows in 16-token chunks after a 512-token prefill (sdpa):", "",
                  tabulate(chunks, ["cache", "seconds", "time x dynamic", "perplexity"], tablefmt="github",
                           disable_numparse=True)]  # fmt: skip
    return "\n".join(parts)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output", type=Path, required=True, help="folder for bench-cpu.json and bench-cpu.md")
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--decode", default="4096x1,8192x1,8192x4", help="context x rows cells, comma-separated")
    parser.add_argument("--steps", type=int, default=6, help="decode steps timed per run")
    parser.add_argument("--windows", type=int, default=4, help="windows of the chunk protocol (0: skip it)")
    parser.add_argument("--rounds", type=int, default=2, help="interleaved rounds")
    parser.add_argument("--caches", default=",".join(OURS), help="our cache specs, comma-separated")
    args = parser.parse_args(argv)
    try:
        cells = [tuple(int(x) for x in cell.split("x")) for cell in args.decode.split(",") if cell]
        if any(len(c) != 2 or min(c) < 1 for c in cells):
            raise ValueError
    except ValueError:
        print(f"bench_cpu: --decode must be CONTEXTxROWS cells such as 4096x1,8192x4, got {args.decode!r}")
        return 2
    torch.set_num_threads(args.threads)
    model, tokenizer = load_model(args.model)
    ours = [c for c in args.caches.split(",") if c]
    runs = [("dynamic", "sdpa")] + [(c, attn) for c in ours for attn in ("sdpa", "hf_kvcache")]
    results = {"model": args.model, "threads": args.threads, "rounds": args.rounds, "windows": args.windows,
               "decode": [], "chunks": []}  # fmt: skip
    for context, rows in cells:
        results["decode"] += decode_cell(model, context, rows, runs, args.steps, args.rounds)
        print(f"decode {context} x {rows} done", file=sys.stderr, flush=True)
    if args.windows:
        names = ["dynamic", *ours, *PEERS]
        results["chunks"] = chunk_protocol(model, tokenizer, names, args.windows, args.rounds)
    args.output.mkdir(parents=True, exist_ok=True)
    (args.output / "bench-cpu.json").write_text(json.dumps(results, indent=1) + "\n")
    text = render(results)
    (args.output / "bench-cpu.md").write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())

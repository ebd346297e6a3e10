"""PagedKVCache vs DynamicCache, side by side: bytes held, block waste and decode speed.

Two workloads on the embedded reference model (or ``--model``):

* parallel sampling: ``--samples`` sequences from one ``--prompt-tokens`` prompt (``num_return_sequences``), where
  the paged cache stores the prompt once;
* a left-padded batch of varied prompt lengths, for waste (allocated slots that hold no token).

Caches: ``dynamic``; ``paged`` with the gather path under sdpa; ``paged`` under the registered paged attention
(``hf_kvcache_paged``), which reads blocks without gathering. Decode tokens/s = extra tokens / extra time between a
1-token and a full generation (medians of ``--repeats``), all rows together.

    python benchmarks/bench_paged.py
    python benchmarks/bench_paged.py --device cuda --dtype bfloat16 --prompt-tokens 4096
"""

from __future__ import annotations

import argparse
import statistics

import torch
from transformers import AutoModelForCausalLM, DynamicCache

from hf_kvcache import PagedKVCache, cache_nbytes, reference_model_path
from hf_kvcache.attention import PAGED_ATTENTION, register_paged_attention
from hf_kvcache.compare import timed_generate


def _generate(model, inputs, make, new_tokens, **kwargs):
    cache = make()
    _, seconds = timed_generate(model, inputs, cache, new_tokens, min_new_tokens=new_tokens, **kwargs)
    return cache, seconds


def measure(model, attn, inputs, make, new_tokens, repeats, rows, **kwargs) -> dict:
    model.set_attn_implementation(attn)
    _generate(model, inputs, make, 2, **kwargs)  # warm-up
    rates = []
    for _ in range(repeats):
        _, t1 = _generate(model, inputs, make, 1, **kwargs)
        cache, tn = _generate(model, inputs, make, new_tokens, **kwargs)
        rates.append(rows * (new_tokens - 1) / max(tn - t1, 1e-9))
    row = {"cache_bytes": cache_nbytes(cache), "decode_tokens_per_s": statistics.median(rates)}
    row["spread"] = (max(rates) - min(rates)) / row["decode_tokens_per_s"]
    if isinstance(cache, PagedKVCache):
        report = cache.block_report()
        row |= {"blocks_used": report["blocks_used"], "blocks_shared": report["blocks_shared"]}
        row["waste"] = report["waste"]
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="local path or hub id (default: the reference model)")
    parser.add_argument("--prompt-tokens", type=int, default=1024)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()

    torch.set_num_threads(args.threads)
    register_paged_attention()
    model = AutoModelForCausalLM.from_pretrained(args.model or reference_model_path(), dtype=getattr(torch, args.dtype))
    model = model.to(args.device).eval()
    device = model.device
    vocab = model.config.vocab_size
    gen = torch.Generator().manual_seed(0)

    ids = torch.randint(3, vocab, (1, args.prompt_tokens), generator=gen).to(device)
    sampling = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    lengths = [args.prompt_tokens // 8 * k for k in range(1, 9)]
    batch = torch.zeros(len(lengths), max(lengths), dtype=torch.long)
    mask = torch.zeros_like(batch)
    for row, n in enumerate(lengths):
        batch[row, -n:] = torch.randint(3, vocab, (n,), generator=gen)
        mask[row, -n:] = 1
    varied = {"input_ids": batch.to(device), "attention_mask": mask.to(device)}

    caches = [
        ("dynamic", "sdpa", lambda: DynamicCache(config=model.config)),
        ("paged (gather, sdpa)", "sdpa", lambda: PagedKVCache(model, block_size=args.block_size)),
        ("paged (paged attention)", PAGED_ATTENTION, lambda: PagedKVCache(model, block_size=args.block_size)),
    ]
    workloads = [
        (
            f"{args.samples} samples of one {args.prompt_tokens}-token prompt",
            sampling,
            args.samples,
            {"do_sample": True, "num_return_sequences": args.samples},
        ),
        (f"batch of {len(lengths)} prompts of {lengths[0]}..{lengths[-1]} tokens", varied, len(lengths), {}),
    ]
    print(
        f"{args.model or 'reference model'} on {args.device} ({args.dtype}, {args.threads} threads), "
        f"block_size {args.block_size}, {args.new_tokens} new tokens, median of {args.repeats}"
    )
    for title, inputs, rows, kwargs in workloads:
        print(f"\n{title}\n")
        print("| cache | cache bytes | x dynamic | blocks used / shared | waste | decode tok/s | x dynamic | spread |")
        print("|---|---|---|---|---|---|---|---|")
        base = None
        for label, attn, make in caches:
            r = measure(model, attn, inputs, make, args.new_tokens, args.repeats, rows, **kwargs)
            base = base or r
            blocks = f"{r['blocks_used']} / {r['blocks_shared']}" if "blocks_used" in r else "-"
            waste = f"{100 * r['waste']:.1f}%" if "waste" in r else "-"
            print(
                f"| {label} | {r['cache_bytes']:,} | {r['cache_bytes'] / base['cache_bytes']:.3f} | {blocks} | "
                f"{waste} | {r['decode_tokens_per_s']:.1f} | "
                f"{r['decode_tokens_per_s'] / base['decode_tokens_per_s']:.2f} | {100 * r['spread']:.0f}% |"
            )
    model.set_attn_implementation("sdpa")


if __name__ == "__main__":
    main()

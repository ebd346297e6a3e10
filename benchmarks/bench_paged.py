"""PagedKVCache vs DynamicCache, side by side: bytes held, block waste, decode speed and peak memory.

Three workloads on the embedded reference model (or ``--model``), each at every ``--prompt-tokens``:

* one prompt (batch 1), the plain decode case;
* parallel sampling: ``--samples`` sequences from one prompt (``num_return_sequences``), where the paged cache stores
  the prompt once;
* a left-padded batch of 8 prompts of varied lengths, for waste (allocated slots that hold no token).

Caches: ``dynamic`` under sdpa; ``paged`` with the gather path under sdpa; ``paged`` and ``paged:bits=8`` (int8
pages) under ``attn_implementation="hf_kvcache"``, which reads the pages in place through the block tables (the
Triton kernel on CUDA, the chunked pure-torch reference elsewhere). Decode tokens/s come from
:func:`hf_kvcache.compare.time_decode` (all rows together; medians of ``--repeats``); ``x dynamic`` compares within
one workload of one run.

    python benchmarks/bench_paged.py --prompt-tokens 1024
    python benchmarks/bench_paged.py --device cuda --dtype bfloat16 --shape llama3-8b --prompt-tokens 4096,16384

``--shape llama3-8b`` builds Llama-3-8B's architecture with random weights (no download; decode cost does not
depend on the weights' values, only greedy tokens do, and sampling rows are what they are); ``--layers`` cuts it.
"""

from __future__ import annotations

import argparse

import torch
from tabulate import tabulate
from transformers import AutoModelForCausalLM, DynamicCache, LlamaConfig

from hf_kvcache import PagedKVCache, cache_nbytes, reference_model_path
from hf_kvcache.attention import ATTENTION
from hf_kvcache.compare import LLAMA3_8B, time_decode

SHAPES = {"llama3-8b": LLAMA3_8B}


def load_model(args):
    dtype = getattr(torch, args.dtype)
    if args.shape:
        config = LlamaConfig(**(SHAPES[args.shape] | ({"num_hidden_layers": args.layers} if args.layers else {})))
        with torch.device(args.device):
            return AutoModelForCausalLM.from_config(config, dtype=dtype).eval()
    return (
        AutoModelForCausalLM.from_pretrained(args.model or reference_model_path(), dtype=dtype).to(args.device).eval()
    )


def workloads(prompt_tokens: int, samples: int, vocab: int, device) -> list[tuple[str, dict, dict]]:
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(3, vocab, (1, prompt_tokens), generator=gen).to(device)
    single = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    lengths = [max(1, prompt_tokens // 8 * k) for k in range(1, 9)]
    batch = torch.zeros(len(lengths), max(lengths), dtype=torch.long)
    mask = torch.zeros_like(batch)
    for row, n in enumerate(lengths):
        batch[row, -n:] = torch.randint(3, vocab, (n,), generator=gen)
        mask[row, -n:] = 1
    varied = {"input_ids": batch.to(device), "attention_mask": mask.to(device)}
    return [
        (f"one {prompt_tokens}-token prompt", single, {}),
        (
            f"{samples} samples of one {prompt_tokens}-token prompt",
            single,
            {"do_sample": True, "num_return_sequences": samples},
        ),
        (f"batch of 8 prompts of {lengths[0]}..{lengths[-1]} tokens, left-padded", varied, {}),
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="local path or hub id (default: the reference model)")
    parser.add_argument("--shape", choices=sorted(SHAPES), default=None, help="a known architecture, random weights")
    parser.add_argument("--layers", type=int, default=None, help="with --shape: number of layers (default: all)")
    parser.add_argument("--prompt-tokens", default="1024", help="comma-separated prompt lengths")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()

    torch.set_num_threads(args.threads)
    model = load_model(args)
    caches = [
        ("dynamic", "sdpa", lambda: DynamicCache(config=model.config)),
        ("paged (gather, sdpa)", "sdpa", lambda: PagedKVCache(model, block_size=args.block_size)),
        ("paged (hf_kvcache)", ATTENTION, lambda: PagedKVCache(model, block_size=args.block_size)),
        ("paged:bits=8 (hf_kvcache)", ATTENTION, lambda: PagedKVCache(model, block_size=args.block_size, bits=8)),
    ]
    where = torch.cuda.get_device_name(model.device) if model.device.type == "cuda" else f"CPU, {args.threads} threads"
    print(
        f"{args.shape or args.model or 'reference model'} on {where} ({args.dtype}), block_size {args.block_size}, "
        f"{args.new_tokens} new tokens, median of {args.repeats}"
    )
    for prompt_tokens in (int(x) for x in args.prompt_tokens.split(",")):
        for title, inputs, kwargs in workloads(prompt_tokens, args.samples, model.config.vocab_size, model.device):
            rows, base = [], None
            for label, attn, make in caches:
                model.set_attn_implementation(attn)
                timing = time_decode(model, inputs, make, args.new_tokens, args.repeats, **kwargs)
                nbytes = cache_nbytes(timing.cache)
                base = base or (nbytes, timing.decode_tokens_per_s)
                blocks = waste = "-"
                if isinstance(timing.cache, PagedKVCache):
                    report = timing.cache.block_report()
                    blocks, waste = f"{report['blocks_used']} / {report['blocks_shared']}", f"{report['waste']:.1%}"
                peak = timing.peak_memory_bytes
                rows.append(
                    [
                        label,
                        f"{nbytes:,}",
                        f"{nbytes / base[0]:.3f}",
                        blocks,
                        waste,
                        f"{timing.decode_tokens_per_s:.1f}",
                        f"{timing.decode_tokens_per_s / base[1]:.2f}",
                        f"{timing.spread:.0%}",
                        f"{peak / 2**20:,.0f} MiB" if peak is not None else "n/a",
                    ]
                )
            print(f"\n{title}\n")
            headers = ["cache", "cache bytes", "x dynamic", "blocks used / shared", "waste", "decode tok/s"]
            headers += ["x dynamic", "spread", "peak memory"]
            print(tabulate(rows, headers=headers, tablefmt="github", disable_numparse=True))
    model.set_attn_implementation("sdpa")


if __name__ == "__main__":
    main()

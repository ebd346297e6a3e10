"""QuantizedKVCache (8/4/2 bits) vs DynamicCache vs transformers' QuantizedCache (hqq, quanto), side by side.

Greedy generation on a seeded random Llama-shaped model; reports cache bytes after generation, the ratio to
DynamicCache, time to first token, decode tokens/s (median of --repeats, with spread) and the first generated token
that differs from DynamicCache. Random-weight models have near-tied logits, so "same tokens" is a weak signal here;
the logit-error bounds in tests/test_matrix.py are the accuracy evidence.

    python benchmarks/bench_quantized.py                      # CPU defaults (README numbers)
    python benchmarks/bench_quantized.py --device cuda --dtype bfloat16 --llama3-8b --prompt-tokens 4096
"""

from __future__ import annotations

import argparse
import json
import platform

import torch
from transformers import LlamaConfig, LlamaForCausalLM, QuantizedCache

from hf_kvcache import make_cache
from hf_kvcache.compare import LLAMA3_8B, compare_caches, format_table
from hf_kvcache.tools.tiny import tiny_llama

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def llama3_8b_shaped(dtype, device):
    """Llama-3-8B's shapes (32 layers, 32/8 heads, head_dim 128) with random weights."""
    config = LlamaConfig(**LLAMA3_8B)
    with torch.device(device):
        model = LlamaForCausalLM(config).to(dtype).eval()
    model.generation_config.pad_token_id = 0
    model.generation_config.eos_token_id = None
    return model


def builtin_quantized(backend, nbits, config):
    def factory():
        return QuantizedCache(backend=backend, config=config, nbits=nbits, q_group_size=64, residual_length=128)

    return factory


def backend_available(backend, config, device):
    try:
        cache = builtin_quantized(backend, 4, config)()
        k = torch.randn(1, config.num_key_value_heads, 4, config.head_dim, device=device)
        cache.update(k, k, 0)
        return True
    except Exception as err:  # an optional backend that does not install or run here is reported, not fatal
        print(f"# transformers QuantizedCache backend={backend}: unavailable ({type(err).__name__}: {err})")
        return False


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32", choices=DTYPES)
    parser.add_argument("--prompt-tokens", type=int, default=1024)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--llama3-8b", action="store_true", help="Llama-3-8B-shaped random model (GPU)")
    parser.add_argument("--no-builtin", action="store_true", help="skip transformers' QuantizedCache")
    parser.add_argument("--json", help="write rows and settings to this file")
    args = parser.parse_args()

    torch.set_num_threads(args.threads)
    dtype = DTYPES[args.dtype]
    if args.llama3_8b:
        model = llama3_8b_shaped(dtype, args.device)
    else:
        model = tiny_llama(head_dim=args.head_dim, layers=args.layers, dtype=dtype).to(args.device)
    config = model.config
    ids = torch.randint(3, config.vocab_size, (1, args.prompt_tokens), generator=torch.Generator().manual_seed(0))
    inputs = {"input_ids": ids.to(args.device), "attention_mask": torch.ones_like(ids).to(args.device)}

    caches = {spec: (lambda spec=spec: make_cache(spec, config)) for spec in ["dynamic", "int8", "int4", "int2"]}
    if not args.no_builtin:
        for backend, bits in [("hqq", 8), ("hqq", 4), ("hqq", 2), ("quanto", 4), ("quanto", 2)]:
            if backend_available(backend, config, args.device):
                caches[f"hf-{backend}-{bits}"] = builtin_quantized(backend, bits, config)

    rows = compare_caches(model, inputs, caches, max_new_tokens=args.new_tokens, repeats=args.repeats)
    if args.device.startswith("cuda"):
        peaks = {}
        for label, factory in caches.items():
            torch.cuda.reset_peak_memory_stats()
            with torch.inference_mode():
                model.generate(**inputs, past_key_values=factory(), max_new_tokens=args.new_tokens, do_sample=False)
            peaks[label] = torch.cuda.max_memory_allocated()
        print("peak allocated (GiB):", {k: round(v / 2**30, 3) for k, v in peaks.items()})
    name = torch.cuda.get_device_name() if args.device.startswith("cuda") else platform.processor()
    print(
        f"device={args.device} ({name})"
        f" dtype={args.dtype} threads={args.threads} prompt={args.prompt_tokens} new={args.new_tokens}"
        f" layers={config.num_hidden_layers} head_dim={config.head_dim} torch={torch.__version__}\n"
    )
    print(format_table(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"settings": vars(args), "rows": [r.as_dict() for r in rows]}, f, indent=2)


if __name__ == "__main__":
    main()

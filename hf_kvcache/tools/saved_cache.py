"""What a saved cache costs and saves: a prompt of the held-out text prefilled into each cache, saved with
``torch.save`` and loaded with ``load_cache``. Per cache: the file's bytes (against ``DynamicCache``'s file and the
cache's own ``nbytes``), the prefill's time, the save's and the load's (in memory: no disk in the timing), and
whether the loaded cache continues with the saved one's tokens.

    python benchmarks/saved_cache.py --model smollm2 --tokens 4096 --caches int8,int4,int2
"""

from __future__ import annotations

import argparse
import io
import time

import torch

from ._probe import add_common_flags, run_probe

__all__ = ["main", "measure"]


def _greedy(model, ids: torch.Tensor, cache, new_tokens: int) -> list[int]:
    """``new_tokens`` greedy tokens after ``ids``, whose all but last token ``cache`` holds."""
    out, step = [], ids[:, -1:]
    with torch.inference_mode():
        for _ in range(new_tokens):
            step = model(input_ids=step, past_key_values=cache).logits[:, -1].argmax(-1, keepdim=True)
            out.append(int(step))
    return out


def measure(model, ids: torch.Tensor, specs: list[str], new_tokens: int = 8) -> dict:
    """Per cache spec (``dynamic`` for transformers' ``DynamicCache``, measured first): the prompt ``ids`` but its
    last token prefilled, saved, loaded and continued for ``new_tokens`` greedy tokens beside the saved cache."""
    from transformers import DynamicCache

    from ..caches import load_cache
    from ..memory import cache_nbytes
    from ..registry import make_cache

    caches = {}
    for spec in ["dynamic", *(s for s in specs if s != "dynamic")]:
        cache = DynamicCache(config=model.config) if spec == "dynamic" else make_cache(spec, model)
        start = time.perf_counter()
        with torch.inference_mode():
            model(input_ids=ids[:, :-1], past_key_values=cache)
        prefill_s = time.perf_counter() - start
        f = io.BytesIO()
        start = time.perf_counter()
        torch.save(cache, f)
        save_s = time.perf_counter() - start
        f.seek(0)
        start = time.perf_counter()
        loaded = torch.load(f, weights_only=False) if spec == "dynamic" else load_cache(f, model)
        load_s = time.perf_counter() - start
        nbytes = cache_nbytes(cache)
        caches[spec] = {
            "file_bytes": len(f.getvalue()),
            "nbytes": int(nbytes),
            "reserved_nbytes": int(getattr(cache, "reserved_nbytes", nbytes)),
            "prefill_s": prefill_s,
            "save_s": save_s,
            "load_s": load_s,
            "continues_alike": _greedy(model, ids, loaded, new_tokens) == _greedy(model, ids, cache, new_tokens),
        }
    base = caches["dynamic"]["file_bytes"]
    for row in caches.values():
        row["file_ratio"] = row["file_bytes"] / base
    return {"tokens": ids.shape[1] - 1, "new_tokens": new_tokens, "dtype": str(model.dtype), "caches": caches}


def table(result: dict) -> str:
    lines = [
        f"A {result['tokens']}-token prompt prefilled ({result['dtype']}), saved with torch.save and loaded with "
        f"load_cache (in memory), then {result['new_tokens']} greedy tokens beside the saved cache",
        "",
        "| cache | file bytes | x DynamicCache's file | file / nbytes | prefill s | save s | load s | load / prefill "
        "| continues alike |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for spec, r in result["caches"].items():
        lines.append(
            f"| {spec} | {r['file_bytes']:,} | {r['file_ratio']:.3f} | {r['file_bytes'] / r['nbytes']:.3f} "
            f"| {r['prefill_s']:.3f} | {r['save_s']:.4f} | {r['load_s']:.4f} | {r['load_s'] / r['prefill_s']:.3f} "
            f"| {r['continues_alike']} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_common_flags(parser, 2048, "prompt tokens of the held-out text (the last is decoded, not prefilled)")
    parser.add_argument("--caches", default="int8,int4,int2", help="cache specs, comma-separated (beside dynamic)")
    parser.add_argument("--new-tokens", type=int, default=8, help="greedy tokens the loaded cache must match")
    args = parser.parse_args(argv)
    specs = [s for s in args.caches.split(",") if s]

    def check() -> None:
        if args.tokens < 2 or args.new_tokens < 1:
            raise ValueError(f"--tokens must be >= 2 and --new-tokens >= 1, got {args.tokens} and {args.new_tokens}")

    return run_probe(args, check, lambda model, ids: measure(model, ids, specs, args.new_tokens), table)

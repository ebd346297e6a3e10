"""How far each cache moves the model's next-token distributions from ``DynamicCache``'s, over several windows.

Each window of ``--window`` tokens of the held-out text is prefilled for its first ``--prefill`` tokens, then the rest
is decoded through the cache ``--chunk`` tokens per forward (every cache stores the prefill and encodes tokens as
they leave its residual, as in generation). The measure is the KL divergence of the cache's next-token distribution
from ``DynamicCache``'s at every decoded position, averaged per window, then over windows. Perplexity compares each
cache with the text, a small difference of two noisy numbers; this compares it with the exact cache position by
position, so a change of a cache's rounding that perplexity cannot separate from noise shows here (a 5% change of
KL is visible over six windows of SmolLM2; their spread is printed beside the mean).

    python benchmarks/window_kl.py --model smollm2 --caches int3:scale_dtype=none,int3
"""

from __future__ import annotations

import argparse
import statistics

import torch

from ._probe import add_common_flags, ratio_table, run_probe

__all__ = ["log_probs", "main", "measure"]


def log_probs(model, cache, ids: torch.Tensor, prefill: int, chunk: int) -> torch.Tensor:
    """Log-probabilities ``(1, n - prefill, vocab)`` of the next token at each position from ``prefill`` on, the
    first ``prefill`` tokens of ``ids`` prefilled into ``cache`` and the rest decoded ``chunk`` at a time."""
    outs = []
    with torch.no_grad():
        model(input_ids=ids[:, :prefill], past_key_values=cache, use_cache=True)
        for i in range(prefill, ids.shape[1], chunk):
            outs.append(model(input_ids=ids[:, i : i + chunk], past_key_values=cache, use_cache=True).logits)
    return torch.cat(outs, 1).float().log_softmax(-1)


def measure(model, ids: torch.Tensor, specs: list[str], windows: int, prefill: int, chunk: int) -> dict:
    """Per cache spec: the mean KL divergence from ``DynamicCache`` over ``windows`` equal windows of ``ids``, and
    each window's."""
    from transformers import DynamicCache

    from ..registry import make_cache

    width = ids.shape[1] // windows
    per_window: dict[str, list[float]] = {spec: [] for spec in specs}
    for w in range(windows):
        part = ids[:, w * width : (w + 1) * width]
        exact = log_probs(model, DynamicCache(config=model.config), part, prefill, chunk)
        for spec in specs:
            approx = log_probs(model, make_cache(spec, model), part, prefill, chunk)
            per_window[spec].append(float((exact.exp() * (exact - approx)).sum(-1).mean()))
    caches = {
        spec: {"kl": statistics.fmean(kls), "spread": max(kls) - min(kls), "windows": kls}
        for spec, kls in per_window.items()
    }
    return {"windows": windows, "window": width, "prefill": prefill, "chunk": chunk, "caches": caches}


def table(result: dict) -> str:
    title = (
        f"{result['windows']} windows of {result['window']} tokens, {result['prefill']} prefilled, the rest decoded "
        f"{result['chunk']} per forward: KL of each cache's next-token distribution from DynamicCache's"
    )
    columns = {"kl": "mean KL", "spread": "max - min over windows"}
    first = next(iter(result["caches"]))
    return ratio_table(title, "cache", columns, result["caches"], first)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_common_flags(parser, None)  # the text read is --windows x --window tokens
    parser.add_argument("--caches", required=True, help="cache specs, comma-separated (the first is the ratios' base)")
    parser.add_argument("--windows", type=int, default=6)
    parser.add_argument("--window", type=int, default=1024, help="tokens per window")
    parser.add_argument("--prefill", type=int, default=512, help="tokens of each window prefilled")
    parser.add_argument("--chunk", type=int, default=16, help="tokens per decoding forward")
    args = parser.parse_args(argv)
    specs = [s for s in args.caches.split(",") if s]
    args.tokens = args.windows * args.window

    def check() -> None:
        if not specs:
            raise ValueError("--caches must name at least one cache spec")
        if args.windows < 1 or args.chunk < 1 or not 0 < args.prefill < args.window:
            raise ValueError(
                f"--windows and --chunk must be >= 1 and --prefill inside the window, got --windows {args.windows} "
                f"--chunk {args.chunk} --prefill {args.prefill} --window {args.window}"
            )

    def run(model, ids):
        if ids.shape[1] < args.tokens:
            raise ValueError(f"the text holds {ids.shape[1]} tokens, fewer than --windows x --window ({args.tokens})")
        return measure(model, ids, specs, args.windows, args.prefill, args.chunk)

    return run_probe(args, check, run, table)

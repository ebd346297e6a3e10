"""``hf-kvcache bench``: time to first token and decode speed at several context lengths, side by side.

Per context length and cache: a random prompt of that length, one warm-up generation, then ``repeats`` pairs of
generations of 1 and ``new_tokens`` tokens (synchronized on CUDA). TTFT is the 1-token time; decode tokens/s is the
extra tokens over the extra time, all rows together. Medians and spread ((max - min) / median) over the repeats. On
CUDA also the peak allocated memory of the long generation, and, per cache, the largest context that fits in
``memory_budget`` bytes, extrapolated linearly from the measured peaks (stated as an estimate).
"""

from __future__ import annotations

import statistics

import torch

from ..compare import timed_generate

__all__ = ["run_bench"]


def _timed(model, ids, cache, new_tokens) -> float:
    inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    return timed_generate(model, inputs, cache, new_tokens, min_new_tokens=new_tokens, do_sample=False)[1]


def run_bench(
    model,
    caches: list[str],
    contexts: list[int],
    new_tokens: int = 32,
    batch: int = 1,
    repeats: int = 3,
    memory_budget: int | None = None,
    progress=None,
) -> dict:
    """Measurements per cache and context; see the module docstring."""
    from ..memory import cache_nbytes
    from ..registry import make_cache

    if new_tokens < 2:
        raise ValueError(f"new_tokens must be >= 2 (decode speed needs a token after the first), got {new_tokens}")
    if repeats < 1 or batch < 1 or not contexts or min(contexts) < 1:
        raise ValueError("repeats, batch and every context length must be >= 1")
    device = next(model.parameters()).device
    gen = torch.Generator().manual_seed(0)
    rows = []
    for context in contexts:
        ids = torch.randint(3, model.config.vocab_size, (batch, context), generator=gen).to(device)
        for spec in caches:
            _timed(model, ids, make_cache(spec, model), 2)
            ttft, rates, peak = [], [], None
            for _ in range(repeats):
                ttft.append(_timed(model, ids, make_cache(spec, model), 1))
                if device.type == "cuda":
                    torch.cuda.reset_peak_memory_stats(device)
                cache = make_cache(spec, model)
                total = _timed(model, ids, cache, new_tokens)
                if device.type == "cuda":
                    peak = torch.cuda.max_memory_allocated(device)
                rates.append(batch * (new_tokens - 1) / max(total - ttft[-1], 1e-9))
            rate = statistics.median(rates)
            rows.append(
                {
                    "cache": spec,
                    "context": context,
                    "ttft_s": statistics.median(ttft),
                    "decode_tokens_per_s": rate,
                    "spread": (max(rates) - min(rates)) / rate,
                    "cache_bytes": cache_nbytes(cache),
                    "peak_memory_bytes": peak,
                }
            )
            if progress is not None:
                progress(1)
    fits = {}
    if memory_budget and device.type == "cuda":
        for spec in caches:
            points = [(r["context"], r["peak_memory_bytes"]) for r in rows if r["cache"] == spec]
            if len(points) >= 2 and points[-1][0] != points[0][0]:
                (c0, m0), (c1, m1) = points[0], points[-1]
                slope = (m1 - m0) / (c1 - c0)
                fits[spec] = int(c1 + (memory_budget - m1) / slope) if slope > 0 else None
    return {
        "device": str(device),
        "batch": batch,
        "new_tokens": new_tokens,
        "repeats": repeats,
        "rows": rows,
        "memory_budget_bytes": memory_budget,
        "max_context_estimate": fits or None,
    }

"""``hf-kvcache bench``: time to first token and decode speed at several context lengths, side by side.

Per context length and cache: a random prompt of that length, one warm-up generation, then ``repeats`` generations
of ``new_tokens`` tokens with every step timed as it happens (synchronized on CUDA;
:func:`hf_kvcache.compare.time_decode`). TTFT is the time to the first token; decode tokens/s is the tokens of the
following steps, all rows together, over those steps' own time. Medians and spread ((max - min) / median) over the
repeats. On CUDA also the peak allocated memory of the long generation, and, per
cache, the largest context that fits in ``memory_budget`` bytes, extrapolated linearly from the measured peaks (stated
as an estimate).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .._validate import check_int
from ..compare import time_decode
from .config import ModelOptions

__all__ = ["BenchConfig", "default_contexts", "run_bench"]

BENCH_CACHES = ("dynamic", "int8", "int4", "sink:window=256:sinks=4", "paged:block_size=16")
CANDIDATE_CONTEXTS = (256, 1024, 4096)


@dataclass
class BenchConfig(ModelOptions):
    """Everything ``hf-kvcache bench`` takes."""

    caches: tuple[str, ...] = field(default=BENCH_CACHES, metadata={"help": "make_cache specs, comma-separated"})
    contexts: tuple[int, ...] | None = field(
        default=None,
        metadata={
            "help": "prompt lengths, comma-separated (default: those of 256, 1024, 4096 within the model's trained "
            "context, else the trained context)"
        },
    )
    new_tokens: int = field(default=32, metadata={"help": "tokens generated per timed run (>= 2)"})
    batch: int = field(default=1, metadata={"help": "prompts per batch"})
    repeats: int = field(default=3, metadata={"help": "timed repeats per measurement (median and spread)"})
    attn: tuple[str, ...] | None = field(
        default=None,
        metadata={
            "help": "attention implementations to compare, comma-separated, e.g. sdpa,hf_kvcache (default: the "
            "model's own)"
        },
    )
    memory_budget_gib: float | None = field(
        default=None, metadata={"help": "CUDA: report the largest context per cache within this many GiB"}
    )

    def validate(self) -> None:
        from ..registry import check_spec

        self.validate_model()
        if not self.caches:
            raise ValueError("--caches must name at least one cache spec")
        for spec in self.caches:
            check_spec(spec)
        if self.contexts is not None:
            if not self.contexts or min(self.contexts) < 1:
                raise ValueError(f"--contexts must all be >= 1, got {self.contexts!r}")
        check_int("--new-tokens", self.new_tokens, 2)
        check_int("--batch", self.batch, 1)
        check_int("--repeats", self.repeats, 1)
        if self.memory_budget_gib is not None and self.memory_budget_gib <= 0:
            raise ValueError(f"--memory-budget-gib must be > 0, got {self.memory_budget_gib}")


def trained_context(config) -> int | None:
    """The model's trained context (``max_position_embeddings``), when its config states one."""
    value = getattr(config.get_text_config(decoder=True), "max_position_embeddings", None)
    return value if isinstance(value, int) and value > 0 else None


def default_contexts(config, new_tokens: int) -> tuple[int, ...]:
    """256, 1024 and 4096 where prompt plus new tokens stay within the trained context, else the longest that does."""
    limit = trained_context(config)
    if limit is None:
        return CANDIDATE_CONTEXTS
    fits = tuple(c for c in CANDIDATE_CONTEXTS if c + new_tokens <= limit)
    return fits or (max(limit - new_tokens, 1),)


def run_bench(
    model,
    caches: list[str],
    contexts: list[int],
    new_tokens: int = 32,
    batch: int = 1,
    repeats: int = 3,
    memory_budget: int | None = None,
    progress=None,
    attns: list[str] | None = None,
) -> dict:
    """Measurements per cache and context (and attention implementation, when ``attns`` names several: rows then
    carry an ``attn`` field and the model ends set to the last); see the module docstring."""
    from ..memory import cache_nbytes
    from ..registry import make_cache

    if new_tokens < 2:
        raise ValueError(f"new_tokens must be >= 2 (decode speed needs a token after the first), got {new_tokens}")
    if repeats < 1 or batch < 1 or not contexts or min(contexts) < 1:
        raise ValueError("repeats, batch and every context length must be >= 1")
    device = next(model.parameters()).device
    gen = torch.Generator().manual_seed(0)
    rows = []
    runs = [(attn, spec) for attn in (attns or [None]) for spec in caches]
    for context in contexts:
        ids = torch.randint(3, model.config.vocab_size, (batch, context), generator=gen).to(device)
        inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
        for attn, spec in runs:
            if attn is not None:
                model.set_attn_implementation(attn)
            timing = time_decode(model, inputs, lambda spec=spec: make_cache(spec, model), new_tokens, repeats)
            rows.append(
                {
                    "cache": spec if attn is None else f"{spec} [{attn}]",
                    "attn": attn or model.config._attn_implementation,
                    "context": context,
                    "ttft_s": timing.ttft_s,
                    "decode_tokens_per_s": timing.decode_tokens_per_s,
                    "spread": timing.spread,
                    "cache_bytes": cache_nbytes(timing.cache),
                    "peak_memory_bytes": timing.peak_memory_bytes,
                }
            )
            if progress is not None:
                progress(1)
    fits = {}
    if memory_budget and device.type == "cuda":
        for spec in dict.fromkeys(r["cache"] for r in rows):
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

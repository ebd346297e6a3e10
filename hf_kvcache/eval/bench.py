"""``hf-kvcache bench``: time to first token and decode speed at several context lengths, side by side.

Per context length: a random prompt of that length, one warm-up generation per cache, then ``repeats`` rounds of one
generation of ``new_tokens`` tokens per cache in turn (interleaved, so a slow spell falls on every cache), every step
timed as it happens (synchronized on CUDA; :func:`hf_kvcache.compare.time_decode_interleaved`). TTFT is the time to
the first token; decode tokens/s is the tokens of the following steps, all rows together, over those steps' own
time. Medians and spread ((max - min) / median) over the repeats. Peak memory of a generation: CUDA's
``max_memory_allocated``; on CPU the model's bytes plus the peak of the tensors the generation creates
(:class:`hf_kvcache.memory.PeakTensorBytes`, on an untimed run). With ``memory_budget``, per cache, the largest
context whose generation peaks within it, found by running (:func:`largest_context`), next to what
``hf-kvcache plan`` predicts.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from .._validate import check_int
from ..compare import time_decode_interleaved
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
        default=None,
        metadata={"help": "also find, by running, the largest context per cache whose peak memory fits this many GiB"},
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
        budget = self.memory_budget_gib
        if budget is not None and not (isinstance(budget, (int, float)) and math.isfinite(budget) and budget > 0):
            raise ValueError(f"--memory-budget-gib must be a finite number of GiB > 0, got {budget}")


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


BUDGET_RESOLUTION = 256  # tokens: the budget search stops within this of the largest context that fits


def _generation_peak(model, spec: str, context: int, batch: int, new_tokens: int, gen: torch.Generator) -> int:
    """Measured peak memory of one generation of ``new_tokens`` from a random ``context``-token prompt."""
    from ..compare import generation_peak_bytes, timed_generate
    from ..registry import make_cache

    device = next(model.parameters()).device
    ids = torch.randint(3, model.config.vocab_size, (batch, context), generator=gen).to(device)
    inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    if device.type != "cuda":
        return generation_peak_bytes(model, inputs, lambda: make_cache(spec, model), new_tokens)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    timed_generate(model, inputs, make_cache(spec, model), new_tokens, do_sample=False, min_new_tokens=new_tokens)
    return torch.cuda.max_memory_allocated(device)


def largest_context(
    model, spec: str, attn: str | None, budget: int, batch: int, new_tokens: int, gen: torch.Generator
) -> dict:
    """The largest prompt length whose generation (``batch`` rows, ``new_tokens`` new) peaks within ``budget``
    bytes, found by running: doubling from 256 tokens, then bisection to :data:`BUDGET_RESOLUTION` tokens, capped by
    the model's trained context. Next to it, what :func:`hf_kvcache.plan.plan_memory` predicts for the same budget
    with no reserve (weights and KV only: the measured peak also holds activations, so it finds less)."""
    from ..plan import plan_memory

    if attn is not None:
        model.set_attn_implementation(attn)
    limit = (trained_context(model.config) or 2**17) - new_tokens
    peaks: dict[int, int] = {}

    def fits(n: int) -> bool:
        if n not in peaks:
            peaks[n] = _generation_peak(model, spec, n, batch, new_tokens, gen)
        return peaks[n] <= budget

    low, high = 0, None  # low fits (0: nothing yet), high does not
    n = min(256, limit)
    while high is None:
        if fits(n):
            low = n
            if n >= limit:
                break
            n = min(2 * n, limit)
        else:
            high = n
    while high is not None and high - low > BUDGET_RESOLUTION:
        mid = (low + high) // 2
        low, high = (mid, high) if fits(mid) else (low, mid)
    dtype = next(model.parameters()).dtype
    plan = plan_memory(model.config, budget, batch=batch, dtype=dtype, caches=(spec,), reserve=1, max_context=limit)
    planned = plan.rows[0].max_context
    return {
        "measured": low,
        "capped": high is None,  # the whole trained context fits
        "planned": limit if planned is None else min(planned, limit),
        "peaks": {str(k): v for k, v in sorted(peaks.items())},
    }


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

    def factory(attn: str | None, spec: str):
        def make():
            if attn is not None:
                model.set_attn_implementation(attn)
            return make_cache(spec, model)

        return make

    for context in contexts:
        ids = torch.randint(3, model.config.vocab_size, (batch, context), generator=gen).to(device)
        inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
        factories = {(attn, spec): factory(attn, spec) for attn, spec in runs}
        timings = time_decode_interleaved(model, inputs, factories, new_tokens, repeats)
        for attn, spec in runs:
            timing = timings[(attn, spec)]
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
    budget = None
    if memory_budget:
        budget = {
            label: largest_context(model, spec, attn, memory_budget, batch, new_tokens, gen)
            for attn, spec in runs
            for label in [spec if attn is None else f"{spec} [{attn}]"]
        }
    return {
        "device": str(device),
        "batch": batch,
        "new_tokens": new_tokens,
        "repeats": repeats,
        "rows": rows,
        "memory_budget_bytes": memory_budget,
        "max_context": budget,
    }

"""Side-by-side generation comparison of caches: tokens vs the baseline cache, bytes held, speed.

Used by ``hf-kvcache demo`` and ``benchmarks/bench_quantized.py``; the full evaluation harness (perplexity through
the cache, reports, plots) builds on the same measurements. The tiny random models of the tests and benchmarks are
:mod:`hf_kvcache.tools.tiny`'s.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch
from transformers import (
    StoppingCriteria,
    StoppingCriteriaList,
)
from transformers.cache_utils import Cache

from ._compat import with_cache
from .memory import cache_nbytes
from .registry import make_cache

# Bounds the shared test matrix asserts for the lossy kinds: max |logit error| / std(DynamicCache's logits) under
# teacher forcing (tests/matrix.py reads them from here; the demo quotes them).
LOGIT_BOUNDS = {"int8": 0.06, "fp8": 0.25, "int4": 0.25, "int3": 0.5, "int2": 1.0}

__all__ = [
    "LLAMA3_8B",
    "LOGIT_BOUNDS",
    "CompareRow",
    "compare_caches",
    "format_table",
    "synchronize",
    "StepClock",
    "generation_peak_bytes",
    "time_decode",
    "time_decode_interleaved",
    "timed_generate",
]

# Llama-3-8B's architecture (LlamaConfig arguments), for benchmarks with random weights and for memory plans.
LLAMA3_8B = dict(
    vocab_size=128256,
    hidden_size=4096,
    intermediate_size=14336,
    num_hidden_layers=32,
    num_attention_heads=32,
    num_key_value_heads=8,
    head_dim=128,
    max_position_embeddings=131072,
    rope_theta=500000.0,
)


@dataclass
class CompareRow:
    cache: str
    same_tokens: int  # leading generated tokens identical to the baseline's, per row minimum
    first_divergence: int | None  # generated-token index of the first difference, None if identical
    cache_bytes: int  # cache_nbytes() after generation
    bytes_ratio: float  # cache_bytes / the baseline's cache_bytes
    ttft_s: float  # median time to first token (prefill + 1 token)
    decode_tokens_per_s: float  # median decode tokens/s after the first token, all rows together
    spread: float  # (max - min) / median of the decode rate over repeats
    continuation: list[int] | None = None  # the first row's generated tokens

    def as_dict(self) -> dict:
        return asdict(self)


def synchronize(device: torch.device) -> None:
    """Wait for queued CUDA work on ``device`` (no-op elsewhere), so a timer measures the work itself."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed_generate(model, inputs, cache: Cache, max_new_tokens: int, **generate_kwargs):
    """``(output, seconds)`` of one synchronized ``model.generate`` through ``cache``."""
    synchronize(model.device)
    start = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(**inputs, **with_cache(model, cache), max_new_tokens=max_new_tokens, **generate_kwargs)
    synchronize(model.device)
    return out, time.perf_counter() - start


@dataclass
class DecodeTiming:
    """Timings of :func:`time_decode`: medians over repeats, and the last full generation's cache and output."""

    ttft_s: float  # median time to first token (prefill + 1 token)
    rates: list[float]  # decode tokens/s of each repeat, all rows together, from the steps' own times
    cache: Cache
    output: torch.Tensor
    # Peak memory of one full generation: CUDA's max_memory_allocated; elsewhere the model's bytes plus the peak
    # of the tensors the generation creates (memory.PeakTensorBytes, on one extra untimed run).
    peak_memory_bytes: int | None

    @property
    def decode_tokens_per_s(self) -> float:
        return statistics.median(self.rates)

    @property
    def spread(self) -> float:
        """``(max - min) / median`` of the decode rates."""
        return (max(self.rates) - min(self.rates)) / self.decode_tokens_per_s


class StepClock(StoppingCriteria):
    """Records when each generated token is ready (``generate`` calls its stopping criteria once per step, after
    the step's token is chosen), synchronizing CUDA first so the time is the step's work."""

    def __init__(self, device: torch.device):
        self.device, self.times = device, []

    def __call__(self, input_ids, scores, **kwargs) -> torch.Tensor:
        synchronize(self.device)
        self.times.append(time.perf_counter())
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)


def time_decode(
    model,
    inputs: dict,
    make_cache: Callable[[], Cache],
    new_tokens: int,
    repeats: int = 3,
    measure_memory: bool = True,
    **generate_kwargs,
) -> DecodeTiming:
    """One warm-up, then ``repeats`` synchronized generations of ``new_tokens`` tokens, each through a fresh cache,
    each step timed as it happens (:class:`StepClock`): TTFT is the time to the first token (prefill and the first
    step), the decode rate the tokens of the following steps, all rows, over those steps' own time. Nothing is
    derived from the difference of two separately timed runs. Peak memory: CUDA's ``max_memory_allocated`` of a
    timed run; elsewhere (``measure_memory``) :func:`generation_peak_bytes` on one more, untimed run."""
    timings = time_decode_interleaved(
        model, inputs, {"cache": make_cache}, new_tokens, repeats, measure_memory, **generate_kwargs
    )
    return timings["cache"]


def time_decode_interleaved(
    model,
    inputs: dict,
    caches: dict[str, Callable[[], Cache]],
    new_tokens: int,
    repeats: int = 3,
    measure_memory: bool = True,
    **generate_kwargs,
) -> dict[str, DecodeTiming]:
    """:func:`time_decode` for several caches side by side: every cache warmed up, then ``repeats`` rounds of one
    timed generation per cache in turn (A B C A B C ...), so a slow spell of a shared machine falls on all of them
    and their ratios hold. ``caches``: label -> zero-argument factory; a factory may also switch the model's
    attention implementation before it builds (``hf-kvcache bench --attn``)."""
    if new_tokens < 2:
        raise ValueError(f"new_tokens must be >= 2 (decode speed needs a token after the first), got {new_tokens}")
    generate_kwargs = {"do_sample": False, "min_new_tokens": new_tokens} | generate_kwargs
    rows = inputs["input_ids"].shape[0] * generate_kwargs.get("num_return_sequences", 1)
    device = model.device
    for factory in caches.values():
        timed_generate(model, inputs, factory(), 2, **(generate_kwargs | {"min_new_tokens": 2}))
    ttft: dict[str, list[float]] = {label: [] for label in caches}
    rates: dict[str, list[float]] = {label: [] for label in caches}
    last: dict[str, tuple] = {}
    for _ in range(repeats):
        for label, factory in caches.items():
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
            cache, clock = factory(), StepClock(device)
            criteria = StoppingCriteriaList([*generate_kwargs.get("stopping_criteria", []), clock])
            synchronize(device)
            start = time.perf_counter()
            with torch.inference_mode():
                out = model.generate(
                    **inputs,
                    **with_cache(model, cache),
                    max_new_tokens=new_tokens,
                    **(generate_kwargs | {"stopping_criteria": criteria}),
                )
            peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
            times = clock.times
            ttft[label].append(times[0] - start)
            rates[label].append(rows * (len(times) - 1) / (times[-1] - times[0]))
            last[label] = (cache, out, peak)
    timings = {}
    for label, factory in caches.items():
        cache, out, peak = last[label]
        if device.type != "cuda" and measure_memory:
            peak = generation_peak_bytes(model, inputs, factory, new_tokens, **generate_kwargs)
        timings[label] = DecodeTiming(statistics.median(ttft[label]), rates[label], cache, out, peak)
    return timings


def generation_peak_bytes(model, inputs: dict, make_cache: Callable[[], Cache], new_tokens: int, **kwargs) -> int:
    """Peak memory of one generation through a fresh cache, measured without CUDA: the model's parameters and
    buffers plus the peak of the tensors the generation creates (:class:`~hf_kvcache.memory.PeakTensorBytes`)."""
    from .memory import PeakTensorBytes, model_nbytes

    kwargs = {"do_sample": False, "min_new_tokens": new_tokens} | kwargs
    cache = make_cache()
    with PeakTensorBytes() as tracker, torch.inference_mode():
        model.generate(**inputs, **with_cache(model, cache), max_new_tokens=new_tokens, **kwargs)
    return model_nbytes(model) + tracker.peak_bytes


def compare_caches(
    model,
    inputs: dict[str, torch.Tensor],
    caches: dict[str, Callable[[], Cache]] | list[str],
    max_new_tokens: int = 64,
    repeats: int = 3,
    baseline: str = "dynamic",
) -> list[CompareRow]:
    """Greedy-generate with each cache and compare with ``baseline`` (the first entry if absent).

    ``caches`` maps a label to a zero-argument factory, or is a list of ``make_cache`` specs. Timing: one warm-up,
    then ``repeats`` runs of 1 and of ``max_new_tokens`` tokens; decode rate = extra tokens / extra time (medians).
    """
    if isinstance(caches, list):
        caches = {spec: (lambda spec=spec: make_cache(spec, model)) for spec in caches}
    if baseline not in caches:
        baseline = next(iter(caches))
    timings = {label: time_decode(model, inputs, factory, max_new_tokens, repeats) for label, factory in caches.items()}
    prompt = inputs["input_ids"].shape[1]
    base_tokens = timings[baseline].output[:, prompt:]
    base_bytes = cache_nbytes(timings[baseline].cache)
    rows = []
    for label, timing in timings.items():
        diff = (timing.output[:, prompt:] != base_tokens).any(0).nonzero()
        first = int(diff[0]) if len(diff) else None
        nbytes = cache_nbytes(timing.cache)
        rows.append(
            CompareRow(
                cache=label,
                same_tokens=max_new_tokens if first is None else first,
                first_divergence=first,
                cache_bytes=nbytes,
                bytes_ratio=nbytes / base_bytes if base_bytes else float("nan"),
                ttft_s=timing.ttft_s,
                decode_tokens_per_s=timing.decode_tokens_per_s,
                spread=timing.spread,
                continuation=timing.output[0, prompt:].tolist(),
            )
        )
    return rows


def format_table(rows: list[CompareRow], baseline: str = "baseline") -> str:
    """Markdown table of :func:`compare_caches` rows; ``baseline`` names the cache the ratios are against."""
    from tabulate import tabulate

    body = [
        [
            r.cache,
            str(r.same_tokens),
            f"{r.cache_bytes:,}",
            f"{r.bytes_ratio:.3f}",
            f"{1000 * r.ttft_s:.1f}",
            f"{r.decode_tokens_per_s:.1f}",
            f"{100 * r.spread:.0f}%",
        ]
        for r in rows
    ]
    headers = ["cache", "same tokens", "cache bytes", f"x {baseline}", "TTFT ms", "decode tok/s", "spread"]
    return tabulate(body, headers=headers, tablefmt="github", disable_numparse=True)

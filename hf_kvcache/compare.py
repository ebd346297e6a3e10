"""Side-by-side generation comparison of caches: tokens vs the reference, bytes held, speed.

Used by ``hf-kvcache demo`` and ``benchmarks/bench_quantized.py``; the full evaluation harness (perplexity through
the cache, reports, plots) builds on the same measurements. ``TINY_FAMILIES`` are the tiny random model configs the
test matrix and ``benchmarks/compare_builtin.py`` share.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch
from transformers import (
    Gemma3TextConfig,
    GPT2Config,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    Phi3Config,
    Qwen2Config,
)
from transformers.cache_utils import Cache

from .memory import cache_nbytes, dynamic_bytes_per_token
from .registry import make_cache

__all__ = [
    "TINY_FAMILIES",
    "TINY_VOCAB",
    "CompareRow",
    "compare_caches",
    "format_table",
    "synchronize",
    "timed_generate",
    "tiny_llama",
]

TINY_VOCAB = 128
_COMMON = dict(vocab_size=TINY_VOCAB, pad_token_id=0, bos_token_id=1, eos_token_id=2)
_SMALL = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, **_COMMON)

# name -> config factory of a tiny random model: head_dim 16 everywhere, so 4/2-bit groups of 8 fit; windows small
# enough to slide within short generations (Mistral 12, Gemma 3 10 on its sliding layers).
TINY_FAMILIES = {
    "llama": lambda: LlamaConfig(num_key_value_heads=2, max_position_embeddings=512, **_SMALL),
    "mistral": lambda: MistralConfig(num_key_value_heads=2, sliding_window=12, max_position_embeddings=512, **_SMALL),
    "qwen2": lambda: Qwen2Config(num_key_value_heads=2, max_position_embeddings=512, **_SMALL),
    "phi3": lambda: Phi3Config(num_key_value_heads=2, max_position_embeddings=512, **_SMALL),
    "gpt2": lambda: GPT2Config(n_embd=64, n_layer=2, n_head=4, n_positions=512, **_COMMON),
    "gemma3": lambda: Gemma3TextConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        sliding_window=10,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        max_position_embeddings=512,
        **_COMMON,
    ),
}


@dataclass
class CompareRow:
    cache: str
    same_tokens: int  # leading generated tokens identical to the reference, per row minimum
    first_divergence: int | None  # generated-token index of the first difference, None if identical
    cache_bytes: int  # cache_nbytes() after generation
    bytes_ratio: float  # cache_bytes / reference cache_bytes
    ttft_s: float  # median time to first token (prefill + 1 token)
    decode_tokens_per_s: float  # median decode tokens/s after the first token, all rows together
    spread: float  # (max - min) / median of the decode rate over repeats

    def as_dict(self) -> dict:
        return asdict(self)


def tiny_llama(head_dim: int = 64, layers: int = 4, seed: int = 0, dtype=torch.float32) -> LlamaForCausalLM:
    """A seeded random Llama (GQA, RoPE) for offline demos; no download."""
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=512,
        hidden_size=4 * head_dim,
        intermediate_size=8 * head_dim,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=head_dim,
        max_position_embeddings=32768,
    )
    model = LlamaForCausalLM(config).to(dtype).eval()
    model.generation_config.pad_token_id = 0
    model.generation_config.eos_token_id = None
    return model


def synchronize(device: torch.device) -> None:
    """Wait for queued CUDA work on ``device`` (no-op elsewhere), so a timer measures the work itself."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed_generate(model, inputs, cache: Cache, max_new_tokens: int, **generate_kwargs):
    """``(output, seconds)`` of one synchronized ``model.generate`` through ``cache``."""
    synchronize(model.device)
    start = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(**inputs, past_key_values=cache, max_new_tokens=max_new_tokens, **generate_kwargs)
    synchronize(model.device)
    return out, time.perf_counter() - start


def compare_caches(
    model,
    inputs: dict[str, torch.Tensor],
    caches: dict[str, Callable[[], Cache]] | list[str],
    max_new_tokens: int = 64,
    repeats: int = 3,
    reference: str = "dynamic",
) -> list[CompareRow]:
    """Greedy-generate with each cache and compare with ``reference`` (the first entry if absent).

    ``caches`` maps a label to a zero-argument factory, or is a list of ``make_cache`` specs. Timing: one warm-up,
    then ``repeats`` runs of 1 and of ``max_new_tokens`` tokens; decode rate = extra tokens / extra time (medians).
    """
    if isinstance(caches, list):
        caches = {spec: (lambda spec=spec: make_cache(spec, model)) for spec in caches}
    if reference not in caches:
        reference = next(iter(caches))
    batch = inputs["input_ids"].shape[0]
    results, sequences = {}, {}
    with torch.inference_mode():
        for label, factory in caches.items():
            timed_generate(model, inputs, factory(), 2, do_sample=False)  # warm-up
            ttft, rates = [], []
            for _ in range(repeats):
                _, t1 = timed_generate(model, inputs, factory(), 1, do_sample=False)
                cache = factory()
                out, tn = timed_generate(model, inputs, cache, max_new_tokens, do_sample=False)
                ttft.append(t1)
                rates.append(batch * (max_new_tokens - 1) / max(tn - t1, 1e-9))
            sequences[label] = out[:, inputs["input_ids"].shape[1] :]
            results[label] = (cache_nbytes(cache), statistics.median(ttft), rates)
    ref_tokens, ref_bytes = sequences[reference], results[reference][0]
    rows = []
    for label, (nbytes, ttft, rates) in results.items():
        diff = (sequences[label] != ref_tokens).any(0).nonzero()
        first = int(diff[0]) if len(diff) else None
        rate = statistics.median(rates)
        rows.append(
            CompareRow(
                cache=label,
                same_tokens=max_new_tokens if first is None else first,
                first_divergence=first,
                cache_bytes=nbytes,
                bytes_ratio=nbytes / ref_bytes if ref_bytes else float("nan"),
                ttft_s=ttft,
                decode_tokens_per_s=rate,
                spread=(max(rates) - min(rates)) / rate,
            )
        )
    return rows


def format_table(rows: list[CompareRow]) -> str:
    """Markdown table of :func:`compare_caches` rows."""
    lines = [
        "| cache | same tokens | cache bytes | x reference | TTFT ms | decode tok/s | spread |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r.cache} | {r.same_tokens} | {r.cache_bytes:,} | {r.bytes_ratio:.3f} | {1000 * r.ttft_s:.1f} "
            f"| {r.decode_tokens_per_s:.1f} | {100 * r.spread:.0f}% |"
        )
    return "\n".join(lines)


def analytic_ratio(model, spec: str, dtype: torch.dtype) -> float:
    """Stored bytes per token of ``spec`` over the full-precision cache's, from the config alone."""
    cache = make_cache(spec, model.config)
    if getattr(cache, "max_stored_tokens", None):
        return float("nan")  # bounded: bytes stop growing once the window is full
    per_token = cache.bytes_per_token(dtype) if hasattr(cache, "bytes_per_token") else None
    return per_token / dynamic_bytes_per_token(model.config, dtype) if per_token else 1.0

"""``hf-kvcache demo``: greedy generation from one prompt with every cache kind, side by side, explained.

Prints the measured table (every column explained in a legend, every bytes ratio against one baseline: the first
cache, ``dynamic``, in the model's dtype), the analytic bytes per token against the same baseline, a note on why lossy
caches may leave the baseline's tokens and by how much they are allowed to, and each cache's continuation: the whole
text for the baseline, then for every other cache either "same tokens" or where it diverges, with a few tokens of
each side.
"""

from __future__ import annotations

import json

import torch

from ._validate import dtype_name
from .compare import LOGIT_BOUNDS, CompareRow, compare_caches, format_table
from .memory import dynamic_bytes_per_token
from .registry import make_cache, parse_spec

__all__ = ["DEMO_CACHES", "analytic_ratio", "run_demo"]

DEMO_CACHES = ("dynamic", "int8", "int4", "int2", "sink:window=128:sinks=4", "paged")
CONTEXT_TOKENS = 6  # tokens of each side shown around a divergence


def analytic_ratio(model, spec: str, dtype: torch.dtype) -> float | None:
    """Stored bytes per token of ``spec`` over the full-precision cache's in ``dtype``, from the config alone; None
    for a bounded cache (its bytes stop growing at its window)."""
    cache = make_cache(spec, model.config)
    if getattr(cache, "max_stored_tokens", None):
        return None
    per_token = cache.bytes_per_token(dtype) if hasattr(cache, "bytes_per_token") else None
    return per_token / dynamic_bytes_per_token(model.config, dtype) if per_token else 1.0


def _legend(new_tokens: int, baseline: str, dtype: str) -> str:
    return (
        f"Columns: same tokens = leading generated tokens identical to {baseline}'s (of {new_tokens}); cache bytes = "
        f"what the cache holds after generating (cache.nbytes); x {baseline} = cache bytes / {baseline}'s cache "
        f"bytes, both {dtype}, this run; TTFT ms = time to first token (prefill + 1 token); decode tok/s = tokens "
        "after the first per second; spread = (max - min) / median decode rate over the repeats."
    )


def _why(rows: list[CompareRow], model, prompt_tokens: int, new_tokens: int) -> str:
    """Why the rows that diverged did, from their specs (and the bounds the test matrix asserts)."""
    lines = []
    quantized = [r.cache for r in rows[1:] if parse_spec(r.cache)[0] in LOGIT_BOUNDS and r.first_divergence is not None]
    if quantized:
        bounds = ", ".join(f"{kind} {bound}" for kind, bound in LOGIT_BOUNDS.items())
        verb = "store" if len(quantized) > 1 else "stores"
        lines.append(
            f"{', '.join(quantized)} {verb} keys and values approximately: their logits differ slightly from the "
            "baseline's, so where its top two tokens are nearly tied greedy decoding can pick the other one and "
            "continue differently from there. The shared test matrix bounds the logit error under teacher forcing at "
            f"{bounds} standard deviations of the logits (and int8 may change a token only at such a near-tie)."
        )
    for r in rows[1:]:
        cache = make_cache(r.cache, model.config)
        cap = getattr(cache, "max_stored_tokens", None)
        if cap and cap < prompt_tokens + new_tokens:
            lines.append(
                f"{r.cache} keeps only {cap} of the {prompt_tokens + new_tokens} tokens (sinks + window) by design, so "
                "it forgets most of the prompt and its continuation is expected to differ early."
            )
    exact = [r.cache for r in rows if r.first_divergence is None]
    if exact:
        lines.append(f"Identical to the baseline: {', '.join(exact)}.")
    return "\n".join(lines)


def _continuations(rows: list[CompareRow], decode, prompt_tail: str) -> list[str]:
    base = rows[0]
    lines = [f"...{prompt_tail}", "", f"{base.cache}: {decode(base.continuation).strip()}"]
    for r in rows[1:]:
        if r.first_divergence is None:
            lines.append(f"{r.cache}: same tokens as {base.cache}")
            continue
        i = r.first_divergence
        before = decode(base.continuation[max(0, i - CONTEXT_TOKENS) : i])
        ours, theirs = decode(r.continuation[i : i + CONTEXT_TOKENS]), decode(base.continuation[i : i + CONTEXT_TOKENS])
        lines.append(f"{r.cache}: leaves {base.cache} at token {i + 1}: ...{before}[{ours}] instead of [{theirs}]")
    return lines


def run_demo(
    specs: list[str],
    model_path: str | None = None,
    prompt_tokens: int = 384,
    new_tokens: int = 64,
    batch: int = 1,
    repeats: int = 3,
    threads: int = 1,
    as_json: bool = False,
) -> list[CompareRow]:
    """Run and print the demo; returns its rows."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from .eval.runner import quiet_loading, tokenize
    from .models import model_path as resolve_model
    from .reference import reference_text
    from .registry import check_spec

    if not specs:
        raise ValueError("--caches must name at least one cache spec")
    for spec in specs:  # fail on a bad spec before loading anything
        check_spec(spec)
    torch.set_num_threads(threads)
    quiet_loading()
    path = resolve_model(model_path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(path)
    ids = tokenize(tokenizer, reference_text()[: 16 * prompt_tokens])[:prompt_tokens]
    if ids.numel() < prompt_tokens:
        raise ValueError(f"--prompt-tokens {prompt_tokens} is longer than the demo text ({ids.numel()} tokens)")
    ids = ids.view(1, -1).repeat(batch, 1)
    inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    name = "the embedded reference model (a small Llama trained on Jane Austen)" if model_path is None else path
    dtype = dtype_name(model.dtype)
    plural = "s" if threads != 1 else ""
    print(
        f"Greedy generation with {name}, {dtype} on CPU ({threads} thread{plural}): a {prompt_tokens}-token prompt "
        f"from the held-out text x batch {batch}, {new_tokens} new tokens, median of {repeats} "
        f"run{'s' if repeats != 1 else ''}.\n"
    )
    rows = compare_caches(model, inputs, specs, max_new_tokens=new_tokens, repeats=repeats)
    baseline = rows[0].cache
    print(format_table(rows, baseline))
    print("\n" + _legend(new_tokens, baseline, dtype))
    print(f"\nStored bytes per token x {baseline} ({dtype}), from the config alone (4/2-bit residual excluded):")
    for spec in specs:
        ratio = analytic_ratio(model, spec, model.dtype)
        print(
            f"  {spec:<26} " + ("bounded: stops growing at sinks + window tokens" if ratio is None else f"{ratio:.3f}")
        )
    print("\n" + _why(rows, model, prompt_tokens, new_tokens))
    decode = lambda tokens: tokenizer.decode(tokens, skip_special_tokens=True)  # noqa: E731
    print(
        "\nContinuations of the prompt (first row):\n" + "\n".join(_continuations(rows, decode, decode(ids[0, -24:])))
    )
    if as_json:
        print(json.dumps([r.as_dict() for r in rows], indent=2))
    return rows

"""``hf-kvcache demo``: what each cache does to a real model's answers, and what it holds and costs, side by side.

On the default model (SmolLM2-135M-Instruct when installed, else the embedded reference model) every cache runs, with
greedy decoding:

1. **A long-context question**: a passage of the held-out novel (``--document-tokens``) with one invented fact
   stated once near its start, and a question about it at the end. Printed per cache: the answer, whether it names the
   fact, the bytes the cache holds afterwards, time to first token and decode rate of that generation (each decode
   step timed as it happens; one run, so CPU noise shows).
2. **Chat answers**: a few short questions as one left-padded batch, through the model's chat template; per question,
   the baseline's answer and, for every other cache, "same" or its own answer.

Every bytes ratio is against the first cache (``dynamic``). Lossy caches may leave the baseline's tokens where its top
two candidates are nearly tied; a sliding window forgets what fell out of it by design. ``--json`` prints the rows.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass

import torch
from transformers import StoppingCriteriaList

from ._compat import with_cache
from ._validate import check_int, dtype_name
from .compare import LOGIT_BOUNDS, StepClock, synchronize
from .memory import cache_nbytes, dynamic_bytes_per_token
from .registry import make_cache, parse_spec

__all__ = ["DEMO_CACHES", "FACT", "QUESTION", "analytic_ratio", "run_demo"]

DEMO_CACHES = ("dynamic", "int8", "int4", "int2", "sink:window=256:sinks=4", "paged")
CHAT_PROMPTS = (
    "What is the capital of France?",
    "Name three primary colors.",
    "Write one sentence about the sea.",
)
# An invented fact (not in the novel), stated once; the answer must name ANSWER. On SmolLM2 with DynamicCache it is
# found at 2,000 tokens with the fact 10% in (and at 1,000); at 3,000+ tokens this 135M model starts to miss it.
FACT = "Important note: the ship that brought Captain Wentworth home is the Esperanza. Remember: it was the Esperanza."
QUESTION = "What was the name of the ship that brought Captain Wentworth home? Answer with the name only."
ANSWER = "Esperanza"
FACT_DEPTH = 0.1  # where the fact goes, as a fraction of the passage


@dataclass
class DemoRow:
    cache: str
    answer: str  # the long-context answer
    found: bool  # it names the fact
    cache_bytes: int  # cache_nbytes() after the long-context generation
    bytes_ratio: float  # over the first cache's
    ttft_s: float  # prefill + first token of the long-context question
    decode_tokens_per_s: float  # tokens after the first over the time after the first, steps timed as they happen
    chat: list[str]  # answers to CHAT_PROMPTS


def analytic_ratio(model, spec: str, dtype: torch.dtype) -> float | None:
    """Stored bytes per token of ``spec`` over the full-precision cache's in ``dtype``, from the config alone; None
    for a bounded cache (its bytes stop growing at its window)."""
    cache = make_cache(spec, model.config)
    if getattr(cache, "max_stored_tokens", None):
        return None
    per_token = cache.bytes_per_token(dtype) if hasattr(cache, "bytes_per_token") else None
    return per_token / dynamic_bytes_per_token(model.config, dtype) if per_token else 1.0


def _prompt(tokenizer, text: str) -> str:
    """``text`` as a user turn of the chat template, or as a plain question where the tokenizer has none."""
    if getattr(tokenizer, "chat_template", None):
        messages = [{"role": "user", "content": text}]
        return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return f"{text}\nAnswer:"


def _document(tokenizer, tokens: int) -> str:
    """A ``tokens``-token passage of the held-out text with :data:`FACT` at :data:`FACT_DEPTH`, then the question."""
    from .eval.runner import tokenize
    from .reference import reference_text

    ids = tokenize(tokenizer, reference_text()[: 16 * tokens])[:tokens].tolist()
    if len(ids) < tokens:
        raise ValueError(f"--document-tokens {tokens} is longer than the held-out text ({len(ids)} tokens)")
    cut = int(tokens * FACT_DEPTH)
    passage = f"{tokenizer.decode(ids[:cut])}\n\n{FACT}\n\n{tokenizer.decode(ids[cut:])}"
    return f"Read this document.\n\n{passage}\n\n{QUESTION}"


def _generate(model, tokenizer, prompts: list[str], spec: str, new_tokens: int):
    """Greedy answers to ``prompts`` (one left-padded batch) through a fresh ``spec`` cache, the cache and the clock."""
    batch = tokenizer(prompts, return_tensors="pt", padding=True, add_special_tokens=False).to(model.device)
    cache, clock = make_cache(spec, model), StepClock(model.device)
    synchronize(model.device)
    start = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(
            **batch,
            **with_cache(model, cache),
            max_new_tokens=new_tokens,
            do_sample=False,
            stopping_criteria=StoppingCriteriaList([clock]),
            pad_token_id=tokenizer.pad_token_id,
        )
    answers = tokenizer.batch_decode(out[:, batch["input_ids"].shape[1] :], skip_special_tokens=True)
    return [" ".join(a.split()) for a in answers], cache, start, clock.times


def _rates(start: float, times: list[float]) -> tuple[float, float]:
    """(TTFT, decode tokens/s) of one row's generation from its step times."""
    ttft = times[0] - start
    if len(times) < 2:
        return ttft, float("nan")
    return ttft, (len(times) - 1) / (times[-1] - times[0])


def _table(rows: list[DemoRow], baseline: str) -> str:
    from tabulate import tabulate

    body = [
        [
            r.cache,
            r.answer if len(r.answer) <= 56 else "..." + r.answer[-53:],  # the name comes last
            "yes" if r.found else "no",
            f"{r.cache_bytes:,}",
            f"{r.bytes_ratio:.3f}",
            f"{1000 * r.ttft_s:.0f}",
            f"{r.decode_tokens_per_s:.1f}",
        ]
        for r in rows
    ]
    headers = ["cache", "answer", "found", "cache bytes", f"x {baseline}", "TTFT ms", "decode tok/s"]
    return tabulate(body, headers=headers, tablefmt="github", disable_numparse=True)


def _legend(baseline: str, dtype: str) -> str:
    return (
        f"Columns: answer = its end; found = the answer names the fact; cache bytes = what the cache holds after "
        f"answering (cache.nbytes); x {baseline} = over {baseline}'s bytes, both {dtype}; TTFT ms = prefill of the "
        "whole document + the first token; decode tok/s = tokens after the first over the time after the first, each "
        "step timed as it happens, one run (CPU timings vary by ~10-20% from run to run)."
    )


def _why(rows: list[DemoRow], model, document_tokens: int) -> str:
    lines = []
    lossy = [r.cache for r in rows[1:] if parse_spec(r.cache)[0] in LOGIT_BOUNDS]
    if lossy:
        bounds = ", ".join(f"{kind} {bound}" for kind, bound in LOGIT_BOUNDS.items())
        lines.append(
            f"{', '.join(lossy)} store keys and values approximately: where the baseline's top two tokens are nearly "
            "tied, greedy decoding may pick the other and continue differently. The test matrix bounds the logit "
            f"error under teacher forcing at {bounds} standard deviations of the logits."
        )
    for r in rows[1:]:
        cap = getattr(make_cache(r.cache, model.config), "max_stored_tokens", None)
        if cap and cap < document_tokens:
            lines.append(
                f"{r.cache} keeps {cap} tokens (sinks + window) of a document of ~{document_tokens}: the fact is "
                "outside its window by the time the question comes, by design."
            )
    return "\n".join(lines)


def run_demo(
    specs: list[str],
    model: str | None = None,
    document_tokens: int = 2000,
    new_tokens: int = 32,
    threads: int | None = None,
    as_json: bool = False,
) -> list[DemoRow]:
    """Run and print the demo; returns its rows (see the module docstring)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from .eval.runner import quiet_loading
    from .models import MODELS, default_model, model_path
    from .registry import check_spec

    if not specs:
        raise ValueError("--caches must name at least one cache spec")
    for spec in specs:  # fail on a bad spec before loading anything
        check_spec(spec)
    check_int("--document-tokens", document_tokens, 64)
    check_int("--new-tokens", new_tokens, 2)
    if threads is not None:
        check_int("--threads", threads, 1)
        torch.set_num_threads(threads)
    quiet_loading()
    name = model or default_model()
    path = model_path(name)
    lm = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(path)
    tokenizer.padding_side = "left"
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    limit = getattr(lm.config, "max_position_embeddings", None)
    if limit and document_tokens + new_tokens + 64 > limit:
        raise ValueError(f"--document-tokens {document_tokens} does not fit the model's context ({limit} tokens)")
    document = _prompt(tokenizer, _document(tokenizer, document_tokens))
    chats = [_prompt(tokenizer, q) for q in CHAT_PROMPTS]
    dtype = dtype_name(lm.dtype)
    label = f"{name} ({MODELS[name]})" if name in MODELS else name
    print(f"Greedy decoding with {label}, {dtype} on CPU ({torch.get_num_threads()} threads), through each cache.\n")
    _generate(lm, tokenizer, chats[:1], specs[0], 2)  # warm-up: first-call overheads are nobody's cost

    rows = []
    for spec in specs:
        answer, cache, start, times = _generate(lm, tokenizer, [document], spec, new_tokens)
        ttft, rate = _rates(start, times)
        nbytes = cache_nbytes(cache)
        chat = _generate(lm, tokenizer, chats, spec, new_tokens)[0]
        ratio = nbytes / rows[0].cache_bytes if rows and rows[0].cache_bytes else 1.0
        rows.append(DemoRow(spec, answer[0], ANSWER.lower() in answer[0].lower(), nbytes, ratio, ttft, rate, chat))

    baseline = rows[0].cache
    doc_tokens = len(tokenizer(document, add_special_tokens=False)["input_ids"])
    print(
        f"Long-context question: {doc_tokens} tokens of the held-out novel with one sentence added "
        f"{int(document_tokens * FACT_DEPTH)} tokens in:\n  {FACT!r}\nasked at the end: {QUESTION!r}\n"
    )
    print(_table(rows, baseline))
    print("\n" + _legend(baseline, dtype))
    print(f"\nStored bytes per token x {baseline} ({dtype}), from the config alone (4/2-bit residual excluded):")
    for spec in specs:
        ratio = analytic_ratio(lm, spec, lm.dtype)
        print(f"  {spec:<26} " + ("bounded: stops growing at sinks + window" if ratio is None else f"{ratio:.3f}"))
    why = _why(rows, lm, doc_tokens)
    if why:
        print("\n" + why)
    print(f"\nChat answers (one left-padded batch of {len(CHAT_PROMPTS)} prompts, up to {new_tokens} new tokens):")
    for i, question in enumerate(CHAT_PROMPTS):
        print(f"\nQ: {question}\n  {baseline}: {rows[0].chat[i]}")
        for r in rows[1:]:
            print(f"  {r.cache}: " + ("same" if r.chat[i] == rows[0].chat[i] else r.chat[i]))
    if as_json:
        print(json.dumps([asdict(r) for r in rows], indent=2))
    return rows

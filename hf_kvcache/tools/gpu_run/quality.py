"""Stage ``quality``: perplexity through every cache (the harness's window protocol, :func:`~hf_kvcache.eval.tasks.
perplexity.window_perplexity`) on the embedded reference model, on the GPU in bfloat16 and float32 and on this
machine's CPU in float32 in the same run, under sdpa and under the ``hf_kvcache`` attention, so the GPU's numbers
stand next to the CPU's for the same text, windows and code.

The text: the held-out novel, :data:`TOKENS` tokens in windows of 1,024 (512 prefilled, the rest scored
:data:`CHUNK` tokens per forward: a multi-token decode, within the kernels' query limit). SmolLM2, the published
model, cannot travel to a lent machine (its GGUF is 98 MB against 64 MiB of luggage), so it is left out.
"""

from __future__ import annotations

import math

import torch

from ...eval.runner import tokenize
from ...eval.tasks.perplexity import window_perplexity
from ...models import load_reference_model
from ...reference import reference_text
from ...registry import make_cache
from .record import StageRecord
from .shapes import cache_kinds

__all__ = ["headline", "run"]

TOKENS = 4096
CONTEXT, PREFILL, CHUNK = 1024, 512, 4
SMOKE = {"tokens": 300, "context": 300, "prefill": 200}  # one window: its prefill encodes a 2-bit group


def run(record: StageRecord, device: str, smoke: bool) -> None:
    dev = torch.device(device)
    tokens, context, prefill = (SMOKE["tokens"], SMOKE["context"], SMOKE["prefill"]) if smoke else (
        TOKENS, CONTEXT, PREFILL)  # fmt: skip
    record.info |= {"model": "reference (embedded 4M Llama)", "text": "reference_text()", "tokens": tokens,
                    "context": context, "prefill": prefill, "chunk": CHUNK}  # fmt: skip
    settings = [(dev, torch.bfloat16), (dev, torch.float32)] if dev.type == "cuda" else []
    settings.append((torch.device("cpu"), torch.float32))
    caches = {"dynamic": "dynamic", **cache_kinds(), "sink": "sink:window=256:sinks=4"}
    for where, dtype in settings:
        _setting(record, where, dtype, caches, tokens, context, prefill)


def _setting(record: StageRecord, where: torch.device, dtype: torch.dtype, caches: dict, tokens: int, context: int,
             prefill: int) -> None:  # fmt: skip
    """Every cache under both attentions, on one device in one dtype."""
    model, tokenizer = load_reference_model(dtype=dtype, device=where)
    ids = tokenize(tokenizer, reference_text()[: 16 * tokens])[:tokens]
    for attn in ("sdpa", "hf_kvcache"):
        model.set_attn_implementation(attn)
        for label, spec in caches.items():
            what = f"{label} [{attn}] {where.type} {str(dtype)[6:]}"
            if label == "dynamic" and attn == "hf_kvcache":
                continue  # DynamicCache hands attention plain tensors: sdpa either way
            if record.out_of_time(what, 2):
                continue
            try:
                result = window_perplexity(model, ids, lambda spec=spec: make_cache(spec, model), context, prefill,
                                           CHUNK)  # fmt: skip
            except Exception as err:
                record.error(what, err)
                continue
            record.add({"cache": label, "spec": spec, "attn": attn, "device": where.type, "dtype": str(dtype),
                        "perplexity": math.exp(result.nll / result.tokens_scored),
                        "tokens_scored": result.tokens_scored, "decode_s": result.decode_seconds})  # fmt: skip


def headline(record: dict) -> list[str]:
    rows: dict = {}
    for i in record.get("items", []):
        rows.setdefault((i["device"], i["dtype"][6:], i["attn"]), []).append(f"{i['cache']} {i['perplexity']:.2f}")
    return [f"{d} {t} [{a}]: " + ", ".join(v) for (d, t, a), v in rows.items()]

"""KIVI's ablation on a real model: keys per channel or per token, values per token or per channel, at 4 and 2 bits.

KIVI (Liu et al. 2024, https://arxiv.org/abs/2402.02750) finds that keys must be quantized per channel and values
per token, and that per-token keys fail at 2 bits. Two kinds of rows, all scored by the harness's ``perplexity``
task (:func:`hf_kvcache.eval.run_eval`) on the same windows and positions:

* **through the cache**: ``int4`` / ``int2`` in KIVI's layout (``QuantizedKVCache`` without rotation or sinks:
  groups of ``group_size`` tokens per key channel, a full-precision residual of the last 128 tokens) with
  ``key_axis=channel`` (KIVI) and ``key_axis=token`` (the ablation), the text fed `--chunk` tokens per forward after a
  prefill, each attending to what the cache returns.
* **fake quantization, no grouping** (the paper's simulated rows): ``DynamicCache`` under an attention wrapper that
  quantizes and dequantizes every key and value it is handed, post-RoPE as the cache stores them, per token (one
  scale / zero point per token and head, over all channels) or per channel (one per channel and head, over every
  token of the window), no residual. The window's scored tokens go in as one forward after the prefill (``chunk =
  context - prefill``), so that forward quantizes the whole window's K/V at once; the prefill's own forward
  quantizes its tokens among themselves.

The first row (``dynamic``, through the cache) is the baseline of the change column; the fake rows' own 16-bit row
(the same wrapper, no quantization) checks that the chunked protocol scores the same as the cached one.

    python benchmarks/kivi_ablation.py --model smollm2 --threads 2 --json docs/results/kivi-ablation.json

Defaults: 2,048 tokens of the held-out text in 1,024-token windows, 256 unscored prefill tokens per window (1,536
tokens scored), fed through the caches 4 tokens per forward. A query then sees at most 3 more tokens exact than in
decoding, out of a history of 256 to 1,023 whose last 128 are exact anyway (the residual). ``--chunk 1`` gives
decoding's logits exactly (:mod:`hf_kvcache.scoring`: the per-channel rows in forwards of up to a group, the
per-token-key rows, which encode every token, one token per forward: slower overall).
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from dataclasses import dataclass

import torch

from hf_kvcache import quant
from hf_kvcache.eval import EvalConfig, run_eval

# KIVI's layout at both widths (the defaults add a rotation and sinks, int2's pre-RoPE and smoothed keys too)
_KIVI4 = "int4:rotate=none:sinks=0"
_KIVI2 = "int2:rotate=none:sinks=0:pre_rope=false"
CACHE_SPECS = ("dynamic", _KIVI4, f"{_KIVI4}:key_axis=token", _KIVI2, f"{_KIVI2}:key_axis=token")
AXES = ("token", "channel")


@dataclass(frozen=True)
class FakeQuant:
    """One fake-quantization row: bits (None: no quantization), and the axis each of K and V is grouped along."""

    bits: int | None
    key_axis: str = "token"
    value_axis: str = "token"

    @property
    def name(self) -> str:
        if self.bits is None:
            return "kivi_fake_fp"
        return f"kivi_fake_{self.bits}_k{self.key_axis}_v{self.value_axis}"


def fake_quantize(x: torch.Tensor, bits: int, axis: str) -> torch.Tensor:
    """Quantize and dequantize ``(B, H, T, D)`` asymmetrically: one scale and zero point per (token, head) over all
    channels (``axis="token"``), or per (channel, head) over all ``T`` tokens (``axis="channel"``)."""
    dim = -1 if axis == "token" else 2
    codes, scale, zero = quant.quantize_asymmetric(x, bits, dim=dim)
    return quant.dequantize_asymmetric(codes, scale, zero, dtype=torch.float32).to(x.dtype)


def register_fake_attention(fq: FakeQuant) -> str:
    """An sdpa attention whose keys / values (post-RoPE, the whole cached history plus the new tokens) are
    fake-quantized as ``fq`` says; registered with transformers under ``fq.name``, with sdpa's mask."""
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    def attention(module, query, key, value, attention_mask, **kwargs):
        if fq.bits is not None:
            key = fake_quantize(key, fq.bits, fq.key_axis)
            value = fake_quantize(value, fq.bits, fq.value_axis)
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)

    AttentionInterface.register(fq.name, attention)
    AttentionMaskInterface.register(fq.name, sdpa_mask)
    return fq.name


def _perplexity(entry: dict) -> float:
    return entry["perplexity"]["perplexity"]


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2", help="smollm2, reference or a local folder")
    parser.add_argument("--max-tokens", type=int, default=2048, help="tokens of the held-out text")
    parser.add_argument("--context", type=int, default=1024, help="tokens per window")
    parser.add_argument("--prefill", type=int, default=256, help="unscored tokens per window")
    parser.add_argument(
        "--chunk", type=int, default=4, help="tokens per scored forward through the caches (1: decoding's logits)"
    )
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", default=None, help="write the rows and the settings here")
    args = parser.parse_args(argv)
    from hf_kvcache.eval.runner import load_configured_model

    started = time.perf_counter()
    common = dict(
        model=args.model,
        device="cpu",
        task=("perplexity",),
        max_tokens=args.max_tokens,
        context=args.context,
        prefill=args.prefill,
        threads=args.threads,
        quiet=True,
    )
    cached = EvalConfig(**common, caches=CACHE_SPECS, chunk=args.chunk)
    model, tokenizer = load_configured_model(cached)
    base_attn = model.config._attn_implementation
    rows = []
    results = run_eval(cached, model, tokenizer)
    for entry in results["results"]:
        spec = entry["cache"]
        kind = spec.split(":")[0]
        rows.append(
            {
                "kind": "cache",
                "row": spec,
                "bits": 16 if kind == "dynamic" else int(kind[3:]),
                "keys": "-" if kind == "dynamic" else ("per token" if "key_axis=token" in spec else "per channel"),
                "values": "-" if kind == "dynamic" else "per token",
                "perplexity": _perplexity(entry),
                "bytes_per_token": entry["perplexity"]["bytes_per_token"],
            }
        )
    fakes = [FakeQuant(None)] + [FakeQuant(b, k, v) for b in (4, 2) for k in AXES for v in AXES]
    fake_config = EvalConfig(**common, caches=("dynamic",), chunk=args.context - args.prefill)
    for fq in fakes:
        model.set_attn_implementation(register_fake_attention(fq))
        entry = run_eval(fake_config, model, tokenizer)["results"][0]
        rows.append(
            {
                "kind": "fake",
                "row": fq.name,
                "bits": fq.bits or 16,
                "keys": "-" if fq.bits is None else f"per {fq.key_axis}",
                "values": "-" if fq.bits is None else f"per {fq.value_axis}",
                "perplexity": _perplexity(entry),
                "bytes_per_token": None,
            }
        )
    model.set_attn_implementation(base_attn)
    base = rows[0]["perplexity"]
    for row in rows:
        row["change"] = row["perplexity"] / base - 1
    out = {
        "model": results["config"]["model"],
        "settings": vars(args),
        "scored_tokens": results["results"][0]["perplexity"]["tokens_scored"],
        "device": f"cpu ({platform.processor() or platform.machine()}), {args.threads} threads",
        "torch": torch.__version__,
        "seconds": round(time.perf_counter() - started, 1),
        "rows": rows,
    }
    print(table(out))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)
            f.write("\n")
    return out


def table(out: dict) -> str:
    lines = [
        "| rows | bits | keys | values | perplexity | change vs 16-bit | cache bytes / token |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in out["rows"]:
        label = "through the cache" if r["kind"] == "cache" else "fake quant, no grouping"
        size = f"{r['bytes_per_token']:,.0f}" if r["bytes_per_token"] else "-"
        lines.append(
            f"| {label} | {r['bits']} | {r['keys']} | {r['values']} | {r['perplexity']:.3f} | "
            f"{100 * r['change']:+.1f}% | {size} |"
        )
    return "\n".join(lines) + f"\n\n{out['model']}, {out['scored_tokens']} tokens scored, {out['seconds']} s"


if __name__ == "__main__":
    main()

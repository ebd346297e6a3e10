"""Scoring through each cache in merged forwards against one token per forward, side by side.

Per cache spec, the harness's perplexity windows (:func:`hf_kvcache.eval.window_perplexity`) are scored twice: in
the forwards :func:`hf_kvcache.scoring.decode_equivalent_tokens` allows (the harness's default) and one token per
forward (``--stepwise``), interleaved over ``--rounds`` rounds so that a busy machine slows both alike. Reported per
cache: the median seconds of each, their ratio, the forwards each took (the prefills included), and the
perplexities (equal to rounding).

    python benchmarks/bench_scoring.py --model smollm2 --threads 1
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

from hf_kvcache import make_cache
from hf_kvcache._validate import check_int
from hf_kvcache.eval import window_perplexity
from hf_kvcache.registry import check_spec

__all__ = ["main", "measure"]

DEFAULT_CACHES = "dynamic,int8,int4,int3,int2,sink:window=256:sinks=4,paged:block_size=16"


class _Forwards:
    """Counts a model's forwards (a forward pre-hook) until :meth:`close`."""

    def __init__(self, model):
        self.count = 0
        self.handle = model.register_forward_pre_hook(self._seen)

    def _seen(self, *_) -> None:
        self.count += 1

    def close(self) -> None:
        self.handle.remove()


def measure(model, ids: torch.Tensor, specs: list[str], context: int, prefill: int, rounds: int) -> list[dict]:
    """Per spec: median seconds and forwards, merged and stepwise, and the two perplexities."""
    rows = {spec: {"cache": spec, "merged_s": [], "stepwise_s": []} for spec in specs}
    forwards = _Forwards(model)
    try:
        for _ in range(rounds):
            for spec in specs:
                for stepwise in (False, True):
                    key = "stepwise" if stepwise else "merged"
                    forwards.count = 0
                    started = time.perf_counter()
                    result = window_perplexity(model, ids, lambda spec=spec: make_cache(spec, model), context,
                                               prefill, stepwise=stepwise)  # fmt: skip
                    rows[spec][f"{key}_s"].append(time.perf_counter() - started)
                    rows[spec][f"{key}_forwards"] = forwards.count
                    rows[spec][f"{key}_perplexity"] = result.perplexity
    finally:
        forwards.close()
    for row in rows.values():
        for key in ("merged_s", "stepwise_s"):
            row[key] = statistics.median(row[key])
        row["ratio"] = row["merged_s"] / row["stepwise_s"]
    return list(rows.values())


def table(rows: list[dict]) -> str:
    lines = [
        "| cache | merged s | stepwise s | x stepwise | forwards, merged / stepwise | perplexity, merged / stepwise |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['cache']} | {r['merged_s']:.1f} | {r['stepwise_s']:.1f} | {r['ratio']:.2f} | "
            f"{r['merged_forwards']} / {r['stepwise_forwards']} | "
            f"{r['merged_perplexity']:.4f} / {r['stepwise_perplexity']:.4f} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    from hf_kvcache.models import load_model
    from hf_kvcache.reference import reference_text

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="reference", help="smollm2, reference or a local folder")
    parser.add_argument("--caches", default=DEFAULT_CACHES, help="cache specs, comma-separated")
    parser.add_argument("--tokens", type=int, default=2048, help="the held-out text's first tokens, in windows")
    parser.add_argument("--context", type=int, default=1024, help="tokens per window")
    parser.add_argument("--prefill", type=int, default=512, help="unscored tokens per window")
    parser.add_argument("--rounds", type=int, default=1, help="interleaved rounds (the median is reported)")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    try:
        specs = [spec for spec in args.caches.split(",") if spec]
        if not specs:
            raise ValueError("--caches must name at least one cache")
        for spec in specs:
            check_spec(spec)
        for name in ("tokens", "context", "prefill", "rounds", "threads"):
            check_int(f"--{name}", getattr(args, name), 1)
        if args.prefill >= args.context or args.tokens <= args.prefill:
            raise ValueError("--prefill must be below --context and --tokens above --prefill")
        torch.set_num_threads(args.threads)
        model, tokenizer = load_model(args.model)
        text = reference_text()[: 16 * args.tokens]  # enough characters for the tokens, not the whole novel
        ids = tokenizer(text, return_tensors="pt").input_ids[0, : args.tokens]
        rows = measure(model, ids, specs, args.context, args.prefill, args.rounds)
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(table(rows))
    return 0

"""``stream``: one cache over a stream far longer than its window, perplexity per bucket of positions.

After a short prefill every later token is scored through the same cache: with ``chunk=1`` (the default) at
decoding's logits, in as many tokens per forward as the cache gives them exactly (:mod:`hf_kvcache.scoring`;
``--stepwise``: one token per forward), else ``chunk`` tokens per forward. The NLL is reported per bucket of
``bucket`` positions, with the cache's bytes at the end of each bucket (flat for a window).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

import torch
from transformers.cache_utils import Cache

from ..._compat import with_cache
from ..._validate import check_int
from .base import EvalData, Task, describe_forwards, register_task
from .perplexity import token_nll

__all__ = ["StreamOptions", "StreamResult", "stream_perplexity"]

STREAM_PREFILL = 16  # tokens of the first forward, not scored


@dataclass
class StreamOptions:
    """Options of the ``stream`` task."""

    stream_tokens: int = field(default=4096, metadata={"help": "tokens scored through one cache"})
    bucket: int = field(default=512, metadata={"help": "positions per perplexity bucket"})
    stream_chunk: int = field(
        default=1, metadata={"help": "tokens per forward (1: decoding's logits, see --stepwise; more: chunked)"}
    )

    def validate(self) -> None:
        check_int("--stream-tokens", self.stream_tokens, STREAM_PREFILL + 1)
        check_int("--bucket", self.bucket, 1)
        check_int("--stream-chunk", self.stream_chunk, 1)


@dataclass
class StreamResult:
    bucket_size: int
    nll: list[float] = field(default_factory=list)  # per bucket of positions
    tokens: list[int] = field(default_factory=list)
    cache_bytes: list[int] = field(default_factory=list)  # at the end of each bucket

    @property
    def perplexity(self) -> list[float]:
        return [math.exp(n / t) if t else float("nan") for n, t in zip(self.nll, self.tokens)]

    @property
    def overall(self) -> float:
        return math.exp(sum(self.nll) / sum(self.tokens))

    def as_dict(self) -> dict:
        return asdict(self) | {"perplexity": self.perplexity, "overall_perplexity": self.overall}


@torch.inference_mode()
def stream_perplexity(
    model,
    input_ids: torch.Tensor,
    cache: Cache,
    prefill: int = STREAM_PREFILL,
    chunk: int = 1,
    bucket_size: int = 512,
    progress: Callable[[int], None] | None = None,
    stepwise: bool = False,
) -> StreamResult:
    """Score a long 1-D stream through one cache; NLL per bucket of ``bucket_size`` positions. ``stepwise``: with
    ``chunk=1``, one token per forward instead of the forwards the cache allows (the same numbers to rounding)."""
    from ...memory import cache_nbytes
    from ...scoring import decode_equivalent_tokens, tokens_per_forward

    if input_ids.dim() != 1 or input_ids.numel() <= prefill:
        raise ValueError(f"input_ids must be a 1-D stream longer than prefill={prefill}")
    device = next(model.parameters()).device
    ids = input_ids.to(device).view(1, -1)
    n = ids.shape[1]
    result = StreamResult(bucket_size)
    position_nll = torch.zeros(n)

    def add(first_target: int, logits: torch.Tensor) -> None:
        targets = ids[0, first_target : first_target + logits.shape[1]]
        position_nll[first_target : first_target + len(targets)] = token_nll(logits[0], targets).cpu()

    bytes_by_bucket: dict[int, int] = {}
    logits = model(input_ids=ids[:, :prefill], **with_cache(model, cache)).logits
    add(prefill, logits[:, -1:])
    per_forward = tokens_per_forward(chunk, stepwise)
    start = prefill
    while start < n - 1:
        if per_forward is None:  # a bucket's bytes are read after its last token: no forward runs past it
            edge = -(-(start + 2) // bucket_size) * bucket_size - 1
            stop = start + decode_equivalent_tokens(cache, min(edge, n - 1) - start)
        else:
            stop = min(start + per_forward, n - 1)
        add(start + 1, model(input_ids=ids[:, start:stop], **with_cache(model, cache)).logits)
        bytes_by_bucket[stop // bucket_size] = cache_nbytes(cache)  # the last forward of a bucket wins
        if progress is not None:
            progress(stop - start)
        start = stop
    for b in range(0, n, bucket_size):
        lo, hi = max(b, prefill), min(b + bucket_size, n)
        if hi > lo:
            result.nll.append(float(position_nll[lo:hi].sum()))
            result.tokens.append(hi - lo)
            result.cache_bytes.append(bytes_by_bucket.get(b // bucket_size, 0))
    return result


@register_task
class StreamTask(Task):
    name = "stream"
    title = "Long stream through one cache, perplexity per bucket of positions"
    options = StreamOptions
    summary_keys = ("overall_perplexity",)

    # No check against the model's context: streaming past it through a bounded window is what this task measures.

    def units(self, config) -> int:
        return config.stream_tokens

    def describe(self, config) -> str:
        return (
            f"stream: {config.stream_tokens} tokens through one cache, scored "
            f"{describe_forwards(config.stream_chunk, config.stepwise)}, buckets of {config.bucket}."
        )

    def tokens_needed(self, config) -> int:
        return config.stream_tokens

    def run(self, data: EvalData, spec: str, config, progress=None) -> dict:
        from ...registry import make_cache

        if data.ids.numel() < config.stream_tokens:
            raise ValueError(
                f"--stream-tokens {config.stream_tokens} is longer than the dataset ({data.ids.numel()} tokens)"
            )
        ids = data.ids[: config.stream_tokens]
        result = stream_perplexity(
            data.model,
            ids,
            make_cache(spec, data.model),
            chunk=config.stream_chunk,
            bucket_size=config.bucket,
            progress=progress,
            stepwise=config.stepwise,
        )
        return {"task": self.name, **result.as_dict(), "summary": {"overall_perplexity": result.overall}}

    def table(self, results: dict) -> str:
        from ..tables import markdown_table

        streams = [(e["cache"], e[self.name]) for e in results["results"]]
        size = streams[0][1]["bucket_size"]
        n = max(len(s["perplexity"]) for _, s in streams)
        rows = [
            [f"{i * size}-{(i + 1) * size - 1}"]
            + [f"{s['perplexity'][i]:.2f}" if i < len(s["perplexity"]) else "" for _, s in streams]
            for i in range(n)
        ]
        return markdown_table(["positions", *(c for c, _ in streams)], rows)

    def plots(self, results: dict, out) -> list[str]:
        from ..tables import pyplot

        plt = pyplot()
        if plt is None:
            return []
        fig, ax = plt.subplots(figsize=(8, 4))
        size = None
        for entry in results["results"]:
            s = entry[self.name]
            size = s["bucket_size"]
            centers = [(i + 0.5) * size for i in range(len(s["perplexity"]))]
            ax.plot(centers, s["perplexity"], marker=".", label=entry["cache"])
        ax.set_xlabel("position in the stream")
        ax.set_ylabel(f"perplexity per {size} positions")
        ax.set_yscale("log")
        ax.legend()
        fig.tight_layout()
        fig.savefig(out / "perplexity_vs_position.png", dpi=120)
        plt.close(fig)
        return ["perplexity_vs_position.png"]

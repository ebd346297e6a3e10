"""``perplexity``: perplexity of a text *through* a KV cache, in windows.

A single forward over a window never reads a quantized or evicted cache entry, so it shows no cost for any cache.
Here the text goes through the cache the way generation does.

Window protocol (:func:`window_perplexity`): the token stream is cut into consecutive windows of ``context`` tokens
(a last partial window is kept if it has a token to score). Per window a fresh cache is made; the first ``prefill``
tokens go in with one forward and are not scored; the window's remaining tokens (positions ``prefill .. context-1``,
each predicted from everything before it in the window) are fed through the cache and scored. Perplexity = exp(total
NLL / scored tokens). With ``chunk=1`` (the default) every token gets the logits of decoding, one token per forward;
the forwards themselves take as many tokens as the cache says give those logits exactly
(:func:`hf_kvcache.scoring.teacher_forced`; ``stepwise=True``: one token per forward, to time decoding or for a
cache that cannot say). ``chunk > 1`` feeds that many tokens per forward whatever the cache: chunked scoring, which
reads a chunk's own tokens exactly and so hides part of a lossy cache's cost. With ``DynamicCache`` every protocol
equals a plain full forward over each window scoring the same positions (tested to float tolerance).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field

import torch
from transformers.cache_utils import Cache

from ..._compat import with_cache
from ..._validate import check_int
from ...compare import synchronize
from .base import EvalData, Task, describe_forwards, model_context, register_task

__all__ = ["PerplexityOptions", "PerplexityResult", "window_perplexity", "windows"]

CacheFactory = Callable[[], Cache]


@dataclass
class PerplexityOptions:
    """Options of the ``perplexity`` task."""

    max_tokens: int = field(default=2048, metadata={"help": "cut the text to this many tokens"})
    context: int = field(default=1024, metadata={"help": "tokens per window"})
    prefill: int = field(default=512, metadata={"help": "unscored tokens per window, one forward"})
    chunk: int = field(
        default=1,
        metadata={
            "help": "tokens per scored forward (1: decoding's logits, in as few forwards as give them exactly; see "
            "--stepwise)"
        },
    )
    batch_size: int = field(default=8, metadata={"help": "windows scored together"})

    def validate(self) -> None:
        for name in ("max_tokens", "context", "prefill", "chunk", "batch_size"):
            check_int(f"--{name.replace('_', '-')}", getattr(self, name), 1)
        if self.prefill >= self.context:
            raise ValueError(f"--prefill ({self.prefill}) must be smaller than --context ({self.context})")
        if self.max_tokens <= self.prefill:
            raise ValueError(
                f"--max-tokens ({self.max_tokens}) must be larger than --prefill ({self.prefill}): a window needs "
                "prefill tokens plus at least one to score"
            )


@dataclass
class PerplexityResult:
    nll: float  # summed negative log-likelihood, nats
    tokens_scored: int
    windows: int
    decode_seconds: float  # time spent in the scored (cached) forwards (decoding time only when stepwise)
    cache_bytes: int  # cache_nbytes() of the first batch's cache after its last forward
    cached_tokens: int  # tokens that cache had taken in (rows x tokens)
    seconds: float = 0.0

    @property
    def bytes_per_token(self) -> float:
        """Cache bytes per token taken in: what a token of context costs (bounded caches amortize it)."""
        return self.cache_bytes / self.cached_tokens if self.cached_tokens else float("nan")

    @property
    def perplexity(self) -> float:
        return math.exp(self.nll / self.tokens_scored) if self.tokens_scored else float("nan")

    @property
    def decode_tokens_per_s(self) -> float:
        return self.tokens_scored / self.decode_seconds if self.decode_seconds else float("nan")

    def as_dict(self) -> dict:
        extra = {"bytes_per_token": self.bytes_per_token, "decode_tokens_per_s": self.decode_tokens_per_s}
        return asdict(self) | {"perplexity": self.perplexity} | extra


def windows(input_ids: torch.Tensor, context: int, prefill: int) -> list[torch.Tensor]:
    """The protocol's windows of a 1-D stream: consecutive ``context``-token slices with a token to score."""
    if input_ids.dim() != 1:
        raise ValueError(f"input_ids must be a 1-D token stream, got shape {tuple(input_ids.shape)}")
    if prefill < 1:
        raise ValueError(f"prefill must be >= 1 (the first token has nothing to be predicted from), got {prefill}")
    if context <= prefill:
        raise ValueError(f"context ({context}) must be larger than prefill ({prefill})")
    out = [input_ids[i : i + context] for i in range(0, input_ids.numel(), context)]
    return [w for w in out if w.numel() > prefill]


def _batches(items: list[torch.Tensor], batch_size: int) -> Iterator[torch.Tensor]:
    """Stack equal-length windows ``batch_size`` at a time (a shorter last window goes alone)."""
    i = 0
    while i < len(items):
        group = [items[i]]
        while (
            len(group) < batch_size
            and i + len(group) < len(items)
            and items[i + len(group)].numel() == group[0].numel()
        ):
            group.append(items[i + len(group)])
        i += len(group)
        yield torch.stack(group)


def token_nll(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Per-token negative log-likelihood, in float32, of ``targets`` under ``logits`` (any leading shape)."""
    flat = torch.nn.functional.cross_entropy(
        logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1), reduction="none"
    )
    return flat.view(targets.shape)


@torch.inference_mode()
def window_perplexity(
    model,
    input_ids: torch.Tensor,
    make_cache: CacheFactory,
    context: int = 512,
    prefill: int = 256,
    chunk: int = 1,
    batch_size: int = 8,
    progress: Callable[[int], None] | None = None,
    stepwise: bool = False,
) -> PerplexityResult:
    """Perplexity of a 1-D token stream through caches from ``make_cache`` (see the module docstring).

    ``batch_size`` windows go through one cache together (each row is its own window). ``progress(n)`` is called
    with the number of windows done after each batch. ``stepwise``: with ``chunk=1``, one token per forward instead
    of the forwards :func:`~hf_kvcache.scoring.decode_equivalent_tokens` allows (the same numbers to rounding).
    """
    from ...memory import cache_nbytes
    from ...scoring import teacher_forced, tokens_per_forward

    check_int("chunk", chunk, 1)
    per_forward = tokens_per_forward(chunk, stepwise)
    device = next(model.parameters()).device
    total, count, n_windows, decode_s, first_bytes, first_tokens = 0.0, 0, 0, 0.0, 0, 0
    started = time.perf_counter()
    for batch in _batches(windows(input_ids, context, prefill), batch_size):
        batch = batch.to(device)
        b, length = batch.shape
        cache = make_cache()
        prompt = batch[:, :prefill]
        logits = model(input_ids=prompt, attention_mask=torch.ones_like(prompt), **with_cache(model, cache)).logits
        total += token_nll(logits[:, -1:], batch[:, prefill : prefill + 1]).sum().item()
        count += b
        synchronize(device)
        t0 = time.perf_counter()
        for start, logits in teacher_forced(model, cache, batch[:, prefill:-1], prefill, per_forward):
            targets = batch[:, prefill + start + 1 : prefill + start + 1 + logits.shape[1]]
            total += token_nll(logits, targets).sum().item()
            count += targets.numel()
        synchronize(device)
        decode_s += time.perf_counter() - t0
        if not first_tokens:
            first_bytes, first_tokens = cache_nbytes(cache), b * (length - 1)
        n_windows += b
        if progress is not None:
            progress(b)
    return PerplexityResult(total, count, n_windows, decode_s, first_bytes, first_tokens, time.perf_counter() - started)


def add_changes(entries: list[dict], key: str = "perplexity") -> None:
    """Relative change of ``key`` and the bytes ratio against the first entry (the baseline), in place."""
    base = entries[0]
    for entry in entries:
        entry[f"{key}_change"] = entry[key] / base[key] - 1
        entry["bytes_ratio"] = entry["cache_bytes"] / base["cache_bytes"] if base["cache_bytes"] else None


def shard_windows(ids: torch.Tensor, context: int, shard: tuple[int, int]) -> torch.Tensor:
    """The windows ``index, index + count, ...`` of the stream, concatenated (each stays a whole window)."""
    index, count = shard
    # Only the stream's last window can be partial, and it stays last in its shard, so cutting the concatenation
    # into windows again gives back exactly these windows.
    pieces = [ids[i : i + context] for i in range(0, ids.numel(), context)][index::count]
    return torch.cat(pieces) if pieces else ids[:0]


@register_task
class PerplexityTask(Task):
    name = "perplexity"
    title = "Perplexity through the cache (windows)"
    options = PerplexityOptions
    summary_keys = ("perplexity",)
    default = True
    shardable = True

    def tokens_needed(self, config) -> int:
        return config.max_tokens

    def units(self, config) -> int:
        return -(-config.max_tokens // config.context)

    def check_model(self, config, model_config) -> None:
        limit = model_context(model_config)
        if limit and config.context > limit:
            raise ValueError(f"--context {config.context} is longer than the model's context ({limit} tokens)")

    def describe(self, config) -> str:
        return (
            f"perplexity: windows of {config.context} tokens, {config.prefill} prefilled, then scored "
            f"{describe_forwards(config.chunk, config.stepwise)} through the cache; text cut to {config.max_tokens} "
            "tokens."
        )

    def merge(self, parts: list[dict]) -> dict:
        """NLL and token counts add up (no average of averages); decode speed is all scored tokens over the slowest
        shard's decode time (the shards run in parallel)."""
        nll, tokens = sum(r["nll"] for r in parts), sum(r["tokens_scored"] for r in parts)
        seconds = max(r["decode_seconds"] for r in parts)
        return parts[0] | {
            "nll": nll,
            "tokens_scored": tokens,
            "windows": sum(r["windows"] for r in parts),
            "perplexity": math.exp(nll / tokens),
            "decode_seconds": seconds,
            "decode_tokens_per_s": tokens / seconds if seconds else float("nan"),
            "summary": {"perplexity": math.exp(nll / tokens)},
        }

    def run(self, data: EvalData, spec: str, config, progress=None, shard: tuple[int, int] = (0, 1)) -> dict:
        from ...registry import make_cache

        if data.ids.numel() <= config.prefill:
            raise ValueError(
                f"the dataset has {data.ids.numel()} tokens, too few for one window of --prefill {config.prefill} "
                "tokens plus one to score"
            )
        ids = data.ids[: config.max_tokens]
        if shard[1] > 1:
            ids = shard_windows(ids, config.context, shard)
        device = data.device
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        result = window_perplexity(
            data.model,
            ids,
            lambda: make_cache(spec, data.model),
            context=config.context,
            prefill=config.prefill,
            chunk=config.chunk,
            batch_size=config.batch_size,
            progress=progress,
            stepwise=config.stepwise,
        )
        return {
            "task": self.name,
            **{k: v for k, v in result.as_dict().items() if k not in ("seconds", "cached_tokens")},
            "peak_memory_bytes": torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None,
            "summary": {"perplexity": result.perplexity},
        }

    def finish(self, entries: list[dict]) -> None:
        add_changes(entries)

    def table(self, results: dict) -> str:
        from ..tables import markdown_table, mib

        rows = []
        for entry in results["results"]:
            r = entry[self.name]
            rows.append(
                [
                    entry["cache"],
                    f"{r['perplexity']:.3f}",
                    f"{100 * r['perplexity_change']:+.2f}%",
                    f"{r['tokens_scored']:,}",
                    f"{r['cache_bytes']:,}",
                    f"{r['bytes_per_token']:.0f}",
                    "n/a" if r["bytes_ratio"] is None else f"{r['bytes_ratio']:.3f}",
                    f"{r['decode_tokens_per_s']:.1f}",
                    mib(r["peak_memory_bytes"]),
                ]
            )
        headers = [
            "cache",
            "perplexity",
            "change",
            "tokens scored",
            "cache bytes",
            "bytes/token",
            "x baseline",
            "scored tok/s",
            "peak memory",
        ]
        return markdown_table(headers, rows)

    def plots(self, results: dict, out) -> list[str]:
        from ..tables import pyplot

        plt = pyplot()
        if plt is None:
            return []
        rows = [(e["cache"], e[self.name]) for e in results["results"]]
        names = [name for name, _ in rows]
        fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
        ppl = [r["perplexity"] for _, r in rows]
        left.bar(names, ppl, color="tab:blue")
        left.set_ylabel("perplexity")
        left.set_ylim(min(ppl) * 0.98, max(ppl) * 1.01)
        right.bar(names, [r["bytes_per_token"] for _, r in rows], color="tab:orange")
        right.set_ylabel("cache bytes per token")
        for ax in (left, right):
            ax.tick_params(axis="x", rotation=30)
            for label in ax.get_xticklabels():
                label.set_horizontalalignment("right")
        fig.suptitle(f"{results['config']['model']} on {results['config']['dataset']}: perplexity through the cache")
        fig.tight_layout()
        fig.savefig(out / "perplexity_bytes.png", dpi=120)
        plt.close(fig)
        return ["perplexity_bytes.png"]

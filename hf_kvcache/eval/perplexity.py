"""Perplexity *through* a KV cache.

A single forward over a window never reads a quantized or evicted cache entry, so it shows no cost for any cache.
Here the text goes through the cache the way generation does.

Window protocol (:func:`window_perplexity`): the token stream is cut into consecutive windows of ``context`` tokens
(a last partial window is kept if it has a token to score). Per window a fresh cache is made; the first ``prefill``
tokens go in with one forward and are not scored; the window's remaining tokens (positions ``prefill .. context-1``,
each predicted from everything before it in the window) are fed ``chunk`` tokens per forward through the cache and
scored. Perplexity = exp(total NLL / scored tokens). With ``DynamicCache`` this equals a plain full forward over each
window scoring the same positions (tested to float tolerance).

Stream protocol (:func:`stream_perplexity`): one cache over the whole stream, far longer than the model's context
for a sliding-window cache; after a ``prefill`` forward every later token is scored, and the NLL is reported per
bucket of positions.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field

import torch
from transformers.cache_utils import Cache

from ..compare import synchronize

__all__ = ["PerplexityResult", "StreamResult", "stream_perplexity", "window_perplexity", "windows"]

CacheFactory = Callable[[], Cache]


@dataclass
class PerplexityResult:
    nll: float  # summed negative log-likelihood, nats
    tokens_scored: int
    windows: int
    decode_seconds: float  # time spent in the scored (cached) forwards
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

    def merge(self, other: PerplexityResult) -> PerplexityResult:
        """Combine the results of two disjoint sets of windows (sums, not averages)."""
        return PerplexityResult(
            self.nll + other.nll,
            self.tokens_scored + other.tokens_scored,
            self.windows + other.windows,
            self.decode_seconds + other.decode_seconds,
            self.cache_bytes or other.cache_bytes,
            self.cached_tokens or other.cached_tokens,
            self.seconds + other.seconds,
        )

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


def _nll(logits: torch.Tensor, targets: torch.Tensor) -> float:
    return torch.nn.functional.cross_entropy(
        logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1), reduction="sum"
    ).item()


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
) -> PerplexityResult:
    """Perplexity of a 1-D token stream through caches from ``make_cache`` (see the module docstring).

    ``batch_size`` windows go through one cache together (each row is its own window). ``progress(n)`` is called
    with the number of windows done after each batch.
    """
    from ..memory import cache_nbytes

    if chunk < 1:
        raise ValueError(f"chunk must be >= 1, got {chunk}")
    device = next(model.parameters()).device
    total, count, n_windows, decode_s, first_bytes, first_tokens = 0.0, 0, 0, 0.0, 0, 0
    started = time.perf_counter()
    for batch in _batches(windows(input_ids, context, prefill), batch_size):
        batch = batch.to(device)
        b, length = batch.shape
        cache = make_cache()
        mask = torch.ones_like(batch)
        logits = model(input_ids=batch[:, :prefill], attention_mask=mask[:, :prefill], past_key_values=cache).logits
        total += _nll(logits[:, -1:], batch[:, prefill : prefill + 1])
        count += b
        synchronize(device)
        t0 = time.perf_counter()
        for start in range(prefill, length - 1, chunk):
            stop = min(start + chunk, length - 1)
            logits = model(input_ids=batch[:, start:stop], attention_mask=mask[:, :stop], past_key_values=cache).logits
            total += _nll(logits, batch[:, start + 1 : stop + 1])
            count += b * (stop - start)
        synchronize(device)
        decode_s += time.perf_counter() - t0
        if not first_tokens:
            first_bytes, first_tokens = cache_nbytes(cache), b * (length - 1)
        n_windows += b
        if progress is not None:
            progress(b)
    return PerplexityResult(total, count, n_windows, decode_s, first_bytes, first_tokens, time.perf_counter() - started)


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
    prefill: int = 16,
    chunk: int = 1,
    bucket_size: int = 512,
    progress: Callable[[int], None] | None = None,
) -> StreamResult:
    """Score a long 1-D stream through one cache; NLL per bucket of ``bucket_size`` positions."""
    from ..memory import cache_nbytes

    if input_ids.dim() != 1 or input_ids.numel() <= prefill:
        raise ValueError(f"input_ids must be a 1-D stream longer than prefill={prefill}")
    device = next(model.parameters()).device
    ids = input_ids.to(device).view(1, -1)
    n = ids.shape[1]
    result = StreamResult(bucket_size)
    position_nll = torch.zeros(n)

    def add(first_target: int, logits: torch.Tensor) -> None:
        targets = ids[0, first_target : first_target + logits.shape[1]]
        nll = torch.nn.functional.cross_entropy(logits[0].float(), targets, reduction="none")
        position_nll[first_target : first_target + len(targets)] = nll.cpu()

    bytes_by_bucket: dict[int, int] = {}
    logits = model(input_ids=ids[:, :prefill], past_key_values=cache).logits
    add(prefill, logits[:, -1:])
    for start in range(prefill, n - 1, chunk):
        stop = min(start + chunk, n - 1)
        add(start + 1, model(input_ids=ids[:, start:stop], past_key_values=cache).logits)
        bytes_by_bucket[stop // bucket_size] = cache_nbytes(cache)  # the last forward of a bucket wins
        if progress is not None:
            progress(stop - start)
    for b in range(0, n, bucket_size):
        lo, hi = max(b, prefill), min(b + bucket_size, n)
        if hi > lo:
            result.nll.append(float(position_nll[lo:hi].sum()))
            result.tokens.append(hi - lo)
            result.cache_bytes.append(bytes_by_bucket.get(b // bucket_size, 0))
    return result

"""``hf-kvcache eval`` as a function: load a model and a text, score it through each cache, collect the numbers."""

from __future__ import annotations

import platform
from dataclasses import asdict, dataclass, field

import torch

from .data import load_text
from .perplexity import stream_perplexity, window_perplexity

__all__ = ["DEFAULT_CACHES", "EvalConfig", "load_model", "merge_results", "run_eval", "run_eval_distributed"]

DEFAULT_CACHES = ("dynamic", "int8", "int4", "int2", "sink:window=256:sinks=4", "paged:block_size=16")
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class EvalConfig:
    model: str | None = None  # hub id or local path; None: the embedded reference model
    dataset: str | None = None  # see hf_kvcache.eval.data; None: the embedded held-out text
    caches: tuple[str, ...] = DEFAULT_CACHES  # make_cache specs; the first is the baseline of the changes
    max_tokens: int = 16384  # the text is cut to this many tokens
    context: int = 512  # tokens per window
    prefill: int = 256  # tokens per window that go in with one forward, unscored
    chunk: int = 1  # tokens per scored forward (1: pure decode)
    batch_size: int = 8  # windows scored together
    stream_tokens: int = 0  # > 0: long-stream mode, one cache over this many tokens
    bucket: int = 512  # long-stream mode: positions per perplexity bucket
    device: str = "auto"  # cpu, cuda or auto
    dtype: str = "float32"  # float32, bfloat16, float16
    device_map: str | None = None  # "auto": accelerate splits the model across devices
    load_in_8bit: bool = False  # bitsandbytes weights, combined with any KV cache
    load_in_4bit: bool = False
    seed: int = 0
    threads: int | None = None  # CPU threads (torch.set_num_threads)
    quiet: bool = False
    extra: dict = field(default_factory=dict)

    def validate(self) -> None:
        for name in ("max_tokens", "context", "prefill", "chunk", "batch_size", "bucket"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be an integer >= 1, got {value!r}")
        if self.prefill >= self.context:
            raise ValueError(f"--prefill ({self.prefill}) must be smaller than --context ({self.context})")
        if self.stream_tokens < 0:
            raise ValueError(f"--stream-tokens must be >= 0, got {self.stream_tokens}")
        if self.device not in ("auto", "cpu", "cuda") and not self.device.startswith("cuda:"):
            raise ValueError(f"--device must be cpu, cuda or auto, got {self.device!r}")
        if self.dtype not in _DTYPES:
            raise ValueError(f"--dtype must be one of {', '.join(_DTYPES)}, got {self.dtype!r}")
        if self.load_in_8bit and self.load_in_4bit:
            raise ValueError("--load-in-8bit and --load-in-4bit are exclusive")
        if self.device_map not in (None, "auto"):
            raise ValueError(f"--device-map must be 'auto', got {self.device_map!r}")
        if not self.caches:
            raise ValueError("--caches must name at least one cache")


def _device(config: EvalConfig) -> str:
    if config.device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if config.device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"--device {config.device}: CUDA is not available on this machine")
    return config.device


def load_model(config: EvalConfig):
    """``(model, tokenizer)`` as the config asks (dtype, device or device_map, bitsandbytes weights)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from ..reference import reference_model_path

    path = config.model or reference_model_path()
    kwargs: dict = {"dtype": _DTYPES[config.dtype]}
    if config.load_in_8bit or config.load_in_4bit:
        from transformers import BitsAndBytesConfig

        kwargs["quantization_config"] = BitsAndBytesConfig(
            load_in_8bit=config.load_in_8bit, load_in_4bit=config.load_in_4bit
        )
    device = _device(config)
    if config.device_map:
        kwargs["device_map"] = config.device_map
    elif config.load_in_8bit or config.load_in_4bit:
        kwargs["device_map"] = device
    model = AutoModelForCausalLM.from_pretrained(path, **kwargs)
    if "device_map" not in kwargs:
        model = model.to(device)
    return model.eval(), AutoTokenizer.from_pretrained(path)


def tokenize(tokenizer, text: str) -> torch.Tensor:
    """A long text as one 1-D token stream (no max-length warning: windows are cut later)."""
    saved = tokenizer.model_max_length
    tokenizer.model_max_length = int(1e30)
    try:
        return torch.tensor(tokenizer(text)["input_ids"], dtype=torch.long)
    finally:
        tokenizer.model_max_length = saved


def _versions() -> dict:
    import transformers

    from .. import __version__

    return {
        "hf_kvcache": __version__,
        "transformers": transformers.__version__,
        "torch": torch.__version__,
        "python": platform.python_version(),
    }


def _progress(total: int, label: str, quiet: bool):
    if quiet:
        return None, lambda: None
    from tqdm.auto import tqdm

    bar = tqdm(total=total, desc=label, leave=False, unit="win" if total < 10_000 else "tok")
    return bar.update, bar.close


def run_eval(config: EvalConfig, model=None, tokenizer=None, shard: tuple[int, int] = (0, 1)) -> dict:
    """Score the text through every cache of ``config``; returns the ``results.json`` dictionary.

    ``shard=(index, count)``: evaluate only windows ``index, index + count, ...`` (data parallelism); results of all
    shards merge by summing NLL and token counts.
    """
    from ..registry import check_spec, make_cache

    config.validate()
    for spec in config.caches:
        check_spec(spec)
    if config.threads:
        torch.set_num_threads(config.threads)
    torch.manual_seed(config.seed)
    if model is None:
        model, tokenizer = load_model(config)
    for spec in config.caches:  # unknown kinds and options fail before any work
        make_cache(spec, model.config)
    text = load_text(config.dataset)
    limit = max(config.max_tokens, config.stream_tokens)
    ids = tokenize(tokenizer, text[: 16 * limit])[:limit]
    device = next(model.parameters()).device
    results = []
    for spec in config.caches:
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        window_ids = ids[: config.max_tokens]
        if shard[1] > 1:
            window_ids = _shard_windows(window_ids, config.context, shard)
        n_windows = -(-window_ids.numel() // config.context)
        update, close = _progress(n_windows, spec, config.quiet)
        result = window_perplexity(
            model,
            window_ids,
            lambda spec=spec: make_cache(spec, model),
            context=config.context,
            prefill=config.prefill,
            chunk=config.chunk,
            batch_size=config.batch_size,
            progress=update,
        )
        close()
        entry = {
            "cache": spec,
            "perplexity": result.perplexity,
            "tokens_scored": result.tokens_scored,
            "nll": result.nll,
            "windows": result.windows,
            "cache_bytes": result.cache_bytes,
            "bytes_per_token": result.bytes_per_token,
            "decode_tokens_per_s": result.decode_tokens_per_s,
            "decode_seconds": result.decode_seconds,
            "peak_memory_bytes": torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None,
        }
        if config.stream_tokens:
            update, close = _progress(config.stream_tokens, f"{spec} stream", config.quiet)
            stream = stream_perplexity(
                model, ids[: config.stream_tokens], make_cache(spec, model), bucket_size=config.bucket, progress=update
            )
            close()
            entry["stream"] = stream.as_dict()
        results.append(entry)
    base = results[0]
    for entry in results:
        entry["perplexity_change"] = entry["perplexity"] / base["perplexity"] - 1
        entry["bytes_ratio"] = entry["cache_bytes"] / base["cache_bytes"] if base["cache_bytes"] else None
    return {
        "config": asdict(config) | {"model": config.model or "reference", "dataset": config.dataset or "reference"},
        "device": str(device),
        "versions": _versions(),
        "results": results,
    }


def _shard_windows(ids: torch.Tensor, context: int, shard: tuple[int, int]) -> torch.Tensor:
    """The windows ``index, index + count, ...`` of the stream, concatenated (each stays a whole window)."""
    index, count = shard
    # Only the stream's last window can be partial, and it stays last in its shard, so cutting the concatenation
    # into windows again gives back exactly these windows.
    pieces = [ids[i : i + context] for i in range(0, ids.numel(), context)][index::count]
    return torch.cat(pieces) if pieces else ids[:0]


def merge_results(parts: list[dict]) -> dict:
    """Merge ``run_eval`` results of disjoint window shards: NLL and token counts add up (no average of
    averages); decode speed is all scored tokens over the slowest shard's decode time (the shards run in parallel)."""
    import math

    merged = parts[0] | {"results": []}
    for i, first in enumerate(parts[0]["results"]):
        rows = [p["results"][i] for p in parts]
        nll, tokens = sum(r["nll"] for r in rows), sum(r["tokens_scored"] for r in rows)
        seconds = max(r["decode_seconds"] for r in rows)
        entry = first | {
            "nll": nll,
            "tokens_scored": tokens,
            "windows": sum(r["windows"] for r in rows),
            "perplexity": math.exp(nll / tokens),
            "decode_seconds": seconds,
            "decode_tokens_per_s": tokens / seconds if seconds else float("nan"),
        }
        merged["results"].append(entry)
    base = merged["results"][0]
    for entry in merged["results"]:
        entry["perplexity_change"] = entry["perplexity"] / base["perplexity"] - 1
    merged["processes"] = len(parts)
    return merged


def run_eval_distributed(config: EvalConfig) -> dict | None:
    """``run_eval`` split across the processes of ``accelerate launch`` (windows round-robin); the merged results on
    the main process, None on the others. One process: plain ``run_eval``. The long stream runs on the main process."""
    from accelerate import PartialState
    from accelerate.utils import gather_object

    # On CPU, accelerate only forms a process group when asked for CPU explicitly (gloo backend).
    state = PartialState(cpu=_device(config) == "cpu")
    if state.num_processes == 1:
        return run_eval(config)
    overrides: dict = {"device": str(state.device)} if state.device.type == "cuda" and not config.device_map else {}
    if not state.is_main_process:
        overrides |= {"stream_tokens": 0, "quiet": True}
    mine = EvalConfig(**(asdict(config) | overrides))
    part = run_eval(mine, shard=(state.process_index, state.num_processes))
    parts = gather_object([part])
    return merge_results(parts) if state.is_main_process else None

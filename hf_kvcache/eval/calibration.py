"""``hf-kvcache calibrate``: per-layer key widths for a model, searched on a text
(:func:`hf_kvcache.calibrate.search_key_bits`) and saved as the file ``QuantizedKVCache(key_bits=path)`` reads."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from pathlib import Path

from .._validate import check_int
from ..caches.quantized import QuantizedKVCache
from ..calibrate import copy_rows, random_copy_rows, search_key_bits
from ..layer_widths import KEY_WIDTHS, LayerKeyWidths
from ..registry import check_spec, parse_spec
from . import runner  # its loader looked up when called, as eval's own path does: a patched loader applies
from .config import ModelOptions
from .data import DATASET_HELP, check_dataset, load_text
from .runner import _progress, tokenize

__all__ = ["CalibrateConfig", "format_widths", "run_calibration"]


@dataclass
class CalibrateConfig(ModelOptions):
    """Everything ``hf-kvcache calibrate`` takes."""

    output: str = field(default="", metadata={"help": "the widths file to write (JSON)"})
    cache: str = field(
        default="int2",
        metadata={"help": "the cache the widths are for: int4, int3 or int2 with its options, e.g. int2:sinks=0"},
    )
    budget: float = field(default=2.5, metadata={"help": "average key bits per key element (2-4)"})
    rows: int = field(default=4, metadata={"help": "calibration rows"})
    tokens: int = field(default=1024, metadata={"help": "tokens per row"})
    scored_tokens: int = field(
        default=128, metadata={"help": "tokens scored per row: the row's first ones again (a copy from far back)"}
    )
    dataset: str | None = field(default=None, metadata={"help": DATASET_HELP})
    random_tokens: bool = field(
        default=False,
        metadata={
            "help": "rows of uniformly random token ids (then their beginning again) instead of the text: a search "
            "from the model alone, no text or tokenizer read"
        },
    )
    reuse: str | None = field(
        default=None,
        metadata={
            "help": "a widths file written by calibrate: choose new widths under --budget from its measurements, "
            "without loading the model (the model, cache and row options are the file's)"
        },
    )

    def validate(self) -> None:
        self.validate_model()
        if not self.output:
            raise ValueError("--output: name the widths file to write, e.g. --output widths.json")
        name, options = parse_spec(self.cache)
        if name not in {f"int{b}" for b in KEY_WIDTHS}:
            raise ValueError(f"--cache must be an int4, int3 or int2 spec, got {self.cache!r}")
        check_spec(self.cache)
        for name in ("key_bits", "boundary_layers"):
            if name in options:
                raise ValueError(f"--cache {self.cache!r}: {name} sets layers' key widths, which calibrate chooses")
        if not math.isfinite(self.budget) or not min(KEY_WIDTHS) <= self.budget <= max(KEY_WIDTHS):
            raise ValueError(
                f"--budget must be between {min(KEY_WIDTHS)} and {max(KEY_WIDTHS)} bits, got {self.budget}"
            )
        check_int("--rows", self.rows, 1)
        check_int("--scored-tokens", self.scored_tokens, 1)
        check_int("--tokens", self.tokens, 2 * self.scored_tokens)
        check_dataset(self.dataset)
        if self.random_tokens and self.dataset is not None:
            raise ValueError("--random-tokens reads no text: leave out --dataset, or --random-tokens")


def run_calibration(config: CalibrateConfig) -> LayerKeyWidths:
    """Load the model and text, search (the rows cut from the text's start, :func:`~hf_kvcache.calibrate.copy_rows`)
    and save the widths to ``config.output`` (its folder made if missing); returns them."""
    config.validate()
    Path(config.output).parent.mkdir(parents=True, exist_ok=True)
    if config.reuse:
        widths = LayerKeyWidths.load(config.reuse).with_budget(config.budget)
        widths.save(config.output)
        return widths
    name, options = parse_spec(config.cache)
    model, tokenizer = runner.load_configured_model(config)
    if config.random_tokens:
        vocab = model.get_input_embeddings().num_embeddings
        rows = random_copy_rows(vocab, config.rows, config.tokens, config.scored_tokens)
    else:
        rows = copy_rows(
            tokenize(tokenizer, load_text(config.dataset)), config.rows, config.tokens, config.scored_tokens
        )
    layers = len(QuantizedKVCache(model, bits=int(name[3:]), **options).layers)  # bad option values fail here
    update, close = _progress(1 + layers * (len(KEY_WIDTHS) - 1), "calibrate", config.quiet)
    try:
        widths = search_key_bits(
            model, rows, int(name[3:]), config.budget, config.scored_tokens, progress=update, **options
        )
    finally:
        close()
    widths = dataclasses.replace(widths, calibration_rows="random tokens" if config.random_tokens else "text")
    widths.save(config.output)
    return widths


def format_widths(widths: LayerKeyWidths) -> str:
    """A table of each layer's measured losses and chosen width, then the totals."""
    searched = sorted(widths.sensitivity[0], key=int)
    head = "| layer | " + " | ".join(f"KL at {w} bits" for w in searched) + " | key bits |"
    lines = [head, "|" + "---|" * (len(searched) + 2)]
    for layer, (row, chosen) in enumerate(zip(widths.sensitivity, widths.key_bits)):
        cells = " | ".join(f"{row[w]:.5f}" for w in searched)
        lines.append(f"| {layer} | {cells} | {chosen} |")
    lines.append(
        f"\nkey bits {widths.mean_bits:.2f} on average (budget {widths.budget}), values {widths.bits} bits; KL is "
        f"nats per scored token against a full-precision cache, {widths.scored_tokens} tokens scored"
        + (f" (rows of {widths.calibration_rows})" if widths.calibration_rows else "")
    )
    return "\n".join(lines)

"""``repeat``: a passage, other text, then the same passage again; how well does the model copy it through the cache?

A model that uses its context predicts the second copy of a passage far better than the first (induction). That is
where a quantized or evicted history shows its cost most sharply: the second copy can only be predicted from what the
cache kept of the first.

Protocol, per distance ``d`` and sample: a ``passage``-token passage ``P`` and ``d`` tokens of other text ``G``, both
from the dataset. ``P + G`` goes into a fresh cache with one forward (the first copy is scored from those logits: no
cache is read yet; that forward runs once for every cache, its K/V handed to each, unless ``--separate-prefill``);
then the second ``P`` goes through the cache and is scored: with ``chunk=1`` (the default) at decoding's logits, in
as many tokens per forward as the cache gives them exactly (:mod:`hf_kvcache.scoring`; ``--stepwise``: one token
per forward), else ``chunk`` tokens per forward. Positions
``1 .. passage-1`` of each copy are scored (a copy's first token cannot be predicted from the other copy).
Reported per distance: first- and second-copy perplexity and their ratio; the summary pools every distance.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from ..._compat import with_cache
from ..._validate import check_int
from ...prefill import SharedPrefill
from .base import DocumentTask, EvalData, cache_for, describe_forwards, model_context, register_task
from .perplexity import token_nll

__all__ = ["RepeatOptions", "repeat_nll"]


@dataclass
class RepeatOptions:
    """Options of the ``repeat`` task."""

    distances: tuple[int, ...] = field(
        default=(0, 512, 1500), metadata={"help": "tokens of other text between the copies, comma-separated"}
    )
    passage: int = field(default=128, metadata={"help": "tokens per copy of the passage"})
    samples: int = field(default=2, metadata={"help": "passages per distance"})
    repeat_chunk: int = field(
        default=1, metadata={"help": "second-copy tokens per forward (1: decoding's logits; see --stepwise)"}
    )

    def validate(self) -> None:
        for distance in self.distances:
            check_int("--distances", distance, 0)
        check_int("--passage", self.passage, 2)
        check_int("--samples", self.samples, 1)
        check_int("--repeat-chunk", self.repeat_chunk, 1)


@torch.inference_mode()
def repeat_nll(
    model,
    passages: torch.Tensor,
    gaps: torch.Tensor,
    cache,
    chunk: int = 1,
    prefill: SharedPrefill | None = None,
    stepwise: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token NLL ``(first copy, second copy)``, each ``(B, passage - 1)``, for rows ``P + G + P`` with the second
    copy scored through ``cache`` after ``P + G`` went into it (see the module docstring). ``prefill``: ``P + G``'s
    prefill (:func:`repeat_prefill`), already stored in ``cache``, whose logits give the first copy's NLL.
    ``stepwise``: with ``chunk=1``, one token per forward (the same numbers to rounding, more forwards)."""
    from ...scoring import teacher_forced, tokens_per_forward

    device = next(model.parameters()).device
    passages, gaps = passages.to(device), gaps.to(device)
    prefix = torch.cat([passages, gaps], dim=1)  # (B, P + G)
    if prefill is None:
        logits = model(input_ids=prefix, attention_mask=torch.ones_like(prefix), **with_cache(model, cache)).logits
    else:
        logits = prefill.logits
    n = passages.shape[1]
    first = token_nll(logits[:, : n - 1], passages[:, 1:])
    second = []
    per_forward = tokens_per_forward(chunk, stepwise)
    for start, step in teacher_forced(model, cache, passages[:, : n - 1], prefix.shape[1], per_forward):
        second.append(token_nll(step, passages[:, start + 1 : start + 1 + step.shape[1]]))
    return first.cpu(), torch.cat(second, dim=1).cpu()


def repeat_prefill(model, passages: torch.Tensor, gaps: torch.Tensor) -> SharedPrefill:
    """The prefill of rows ``P + G`` once, for every cache (:class:`~hf_kvcache.prefill.SharedPrefill`, every
    position's logits kept: the first copy is scored from them)."""
    device = next(model.parameters()).device
    prefix = torch.cat([passages, gaps], dim=1).to(device)
    return SharedPrefill(model, prefix, torch.ones_like(prefix), logits_to_keep=0)


@register_task
class RepeatTask(DocumentTask):
    name = "repeat"
    title = "Repeated passage: second-copy perplexity through the cache"
    options = RepeatOptions
    summary_keys = ("second_copy_perplexity", "ratio")
    default = True

    def units(self, config) -> int:
        return len(config.distances)

    def check_model(self, config, model_config) -> None:
        limit = model_context(model_config)
        longest = 2 * config.passage + max(config.distances)
        if limit and longest > limit:
            raise ValueError(
                f"--distances {max(config.distances)} with --passage {config.passage}: the two copies and the text "
                f"between them take {longest} tokens, more than the model's context ({limit} tokens)"
            )

    def describe(self, config) -> str:
        return (
            f"repeat: {config.samples} passages of {config.passage} tokens per distance, the second copy scored "
            f"{describe_forwards(config.repeat_chunk, config.stepwise)} through the cache."
        )

    def tokens_needed(self, config) -> int:
        return (config.passage + max(config.distances)) * config.samples * 2

    def run_caches(self, data: EvalData, specs: list[str], config, progress=None) -> list[dict]:
        """Every cache on the same passages, one distance at a time: the passages and the text after them prefilled
        once and handed to each cache (unless ``config.separate_prefill``, or for a cache that refuses it)."""
        generator = torch.Generator()
        runs = [([], [], []) for _ in specs]  # per cache: cells, first-copy NLLs, second-copy NLLs
        for distance in config.distances:
            span = data.ids.numel() - config.passage - distance
            if span < 1:
                raise ValueError(
                    f"the dataset has {data.ids.numel()} tokens, too few for --passage {config.passage} plus "
                    f"--distances {distance}"
                )
            generator.manual_seed(config.seed + distance)  # the same passages for every cache
            starts = torch.randint(0, span, (2, config.samples), generator=generator)
            passages = torch.stack([data.ids[s : s + config.passage] for s in starts[0].tolist()])
            gaps = torch.stack(
                [data.ids[s + config.passage : s + config.passage + distance] for s in starts[1].tolist()]
            )
            shared = None if config.separate_prefill else repeat_prefill(data.model, passages, gaps)
            for spec, (cells, first_all, second_all) in zip(specs, runs):
                cache, prefilled = cache_for(spec, data.model, shared)
                first, second = repeat_nll(
                    data.model,
                    passages,
                    gaps,
                    cache,
                    config.repeat_chunk,
                    shared if prefilled else None,
                    config.stepwise,
                )
                first_all.append(first)
                second_all.append(second)
                cells.append(
                    {
                        "distance": distance,
                        "first_copy_perplexity": math.exp(first.mean().item()),
                        "second_copy_perplexity": math.exp(second.mean().item()),
                        "ratio": math.exp(second.mean().item() - first.mean().item()),
                        "tokens": second.numel(),
                    }
                )
                if progress is not None:
                    progress(1)
        out = []
        for cells, first_all, second_all in runs:
            first, second = torch.cat(first_all).mean().item(), torch.cat(second_all).mean().item()
            summary = {
                "first_copy_perplexity": math.exp(first),
                "second_copy_perplexity": math.exp(second),
                "ratio": math.exp(second - first),
            }
            out.append({"task": self.name, "cells": cells, "summary": summary})
        return out

    def finish(self, entries: list[dict]) -> None:
        base = entries[0]["summary"]["second_copy_perplexity"]
        for entry in entries:
            entry["second_copy_change"] = entry["summary"]["second_copy_perplexity"] / base - 1

    def table(self, results: dict) -> str:
        from ..tables import markdown_table

        entries = results["results"]
        distances = [c["distance"] for c in entries[0][self.name]["cells"]]
        headers = ["cache", "second copy ppl", "change", "ratio to first", *(f"d={d}" for d in distances)]
        rows = []
        for entry in entries:
            r = entry[self.name]
            rows.append(
                [
                    entry["cache"],
                    f"{r['summary']['second_copy_perplexity']:.3f}",
                    f"{100 * r['second_copy_change']:+.1f}%",
                    f"{r['summary']['ratio']:.3f}",
                ]
                + [f"{c['second_copy_perplexity']:.2f}" for c in r["cells"]]
            )
        return markdown_table(headers, rows)

    def plots(self, results: dict, out) -> list[str]:
        from ..tables import pyplot

        plt = pyplot()
        if plt is None:
            return []
        fig, ax = plt.subplots(figsize=(7, 4))
        for entry in results["results"]:
            cells = entry[self.name]["cells"]
            ax.plot([c["distance"] for c in cells], [c["ratio"] for c in cells], marker="o", label=entry["cache"])
        ax.set_xlabel("tokens between the two copies")
        ax.set_ylabel("second-copy / first-copy perplexity")
        ax.set_yscale("log")
        ax.legend(fontsize=8)
        ax.set_title("repeat: copying a passage through the cache (lower is better)")
        fig.tight_layout()
        fig.savefig(out / "repeat_ratio.png", dpi=120)
        plt.close(fig)
        return ["repeat_ratio.png"]

"""``passkey``: can the model still find a number stated once, far back, through the cache?

Document (the passkey-retrieval format of Mohtashami & Jaggi, https://arxiv.org/abs/2305.16300, as used by KIVI and
LongLoRA): an instruction, filler text from the dataset, the needle ``The pass key is 48213. Remember it. 48213 is
the pass key.`` at a chosen depth of the filler, more filler, then ``What is the pass key? The pass key is``. Each
document is ``length`` tokens long.

Protocol, through the cache (the question-agnostic protocol of kvpress): the document up to the question goes into a
fresh cache with one forward; the question then goes through the cache (it attends to what the cache kept: quantized,
evicted or exact) and the answer is decoded greedily through the same cache. Exact match: the first run of digits in
the answer equals the key. Accuracy per (length, depth) cell over ``samples`` documents, each with its own key and
filler. Works for any causal LM with a tokenizer: the pieces are tokenized separately (no special tokens, except the
tokenizer's own BOS at the start) and concatenated.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import torch

from ..._compat import with_cache
from ..._validate import check_distinct, check_int
from .base import (
    DocumentTask,
    EvalData,
    cache_for,
    cells_agree,
    check_lengths_fit,
    count_range,
    paired_difference,
    pool_cells,
    register_task,
    wilson,
)

__all__ = ["PasskeyOptions", "build_passkey_document"]

INSTRUCTION = (
    "There is an important info hidden inside a lot of irrelevant text. Find it and memorize it. "
    "I will quiz you about the important information there.\n\n"
)
QUESTION = "\n\nWhat is the pass key? The pass key is"
ANSWER_TOKENS = 8  # greedy tokens decoded for the answer
GENERATE_BATCH_HELP = (
    "documents of a cell answered together (passkey, ruler): up to N of one question length, left-padded into one "
    "batch, prefilled once, each cache decoding them in one generate; 1 (the default, as the published results): one "
    "at a time. A lossy cache's answers can differ from one at a time's where documents differ in length (padding "
    "moves its key groups); every cache reads the same batches"
)


def needle(key: str) -> str:
    return f" The pass key is {key}. Remember it. {key} is the pass key. "


def _cell_key(cell: dict) -> tuple:
    """What names a cell: runs pool or join a cell by it."""
    return cell["length"], cell["depth"]


def document_seeds(config, length: int, depth: float, samples: int | None = None) -> range:
    """The seeds of a cell's documents (``samples`` of them, default ``config.samples``): a document's key and filler
    depend on its seed alone, so every cache of a run reads the same ones, and a run of ``--seed S`` reads seeds
    ``S`` to ``S + samples - 1`` past the cell's own offset (runs of other seeds pool: ``hf-kvcache report``)."""
    first = config.seed + 1000 * length + 10 * round(100 * depth)
    return range(first, first + (config.samples if samples is None else samples))


def _rate(found: int, total: int) -> str:
    """``found`` of ``total`` documents as a percentage with its 95% interval: ``67% [39-86]``."""
    low, high = wilson(found, total)
    return f"{100 * found / total:.0f}% [{100 * low:.0f}-{100 * high:.0f}]"


@dataclass
class PasskeyOptions:
    """Options of the ``passkey`` task."""

    lengths: tuple[int, ...] = field(
        default=(512, 1024, 1900), metadata={"help": "document lengths in tokens, comma-separated"}
    )
    depths: tuple[float, ...] = field(
        default=(0.25, 0.75),
        metadata={"help": "needle depths in the filler, 0 (start) to 1 (end), comma-separated"},
    )
    samples: int = field(default=2, metadata={"help": "documents per (length, depth) cell"})
    key_digits: int = field(default=5, metadata={"help": "digits of the key"})
    chat_template: bool = field(
        default=False,
        metadata={"help": "the document and question as one user turn of the model's chat template"},
    )
    generate_batch: int = field(default=1, metadata={"help": GENERATE_BATCH_HELP})

    def validate(self) -> None:
        for length in self.lengths:
            check_int("--lengths", length, 64)
        for depth in self.depths:
            if not isinstance(depth, (int, float)) or isinstance(depth, bool) or not 0 <= depth <= 1:
                raise ValueError(f"--depths must be numbers from 0 to 1, got {depth!r}")
        check_int("--samples", self.samples, 1)
        check_int("--key-digits", self.key_digits, 1, 12)
        check_int("--generate-batch", self.generate_batch, 1)
        check_distinct("--lengths", self.lengths)  # a cell's documents are its length's and depth's
        check_distinct("--depths", self.depths)


def _encode(tokenizer, text: str, special: bool = False) -> list[int]:
    return tokenizer(text, add_special_tokens=special)["input_ids"]


@dataclass
class PasskeyDocument:
    context: list[int]  # everything before the question
    question: list[int]
    key: str
    needle_start: int  # token index of the needle in ``context``


def chat_parts(tokenizer) -> tuple[str, str]:
    """The text a chat template puts before and after one user message (with the assistant's turn opened)."""
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("--chat-template: this model's tokenizer has no chat template")
    marker = "\x00PASSKEY\x00"
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": marker}], add_generation_prompt=True, tokenize=False
    )
    before, after = text.split(marker)
    return before, after


def build_passkey_document(
    tokenizer, filler: torch.Tensor, length: int, depth: float, key: str, chat: bool = False
) -> PasskeyDocument:
    """A ``length``-token document with ``key`` at ``depth`` of its filler, which comes from ``filler`` (a token
    stream, read from its start). ``chat``: the instruction, filler, needle and question are one user turn of the
    tokenizer's chat template, and the assistant's turn starts with ``The pass key is``. Raises ``ValueError`` if
    ``length`` leaves no room for filler."""
    if chat:
        before, after = chat_parts(tokenizer)
        head = _encode(tokenizer, before + INSTRUCTION)
        question = _encode(tokenizer, QUESTION.removesuffix(" The pass key is") + after + "The pass key is")
    else:
        head = _encode(tokenizer, INSTRUCTION, special=True)
        question = _encode(tokenizer, QUESTION)
    middle = _encode(tokenizer, needle(key))
    n_fill = length - len(head) - len(middle) - len(question)
    if n_fill < 1:
        raise ValueError(
            f"--lengths {length} is too short for a passkey document: its fixed parts take "
            f"{length - n_fill} tokens with this tokenizer"
        )
    if filler.numel() < n_fill:
        raise ValueError(f"the dataset has {filler.numel()} tokens, fewer than the {n_fill} of filler needed")
    fill = filler[:n_fill].tolist()
    cut = round(depth * n_fill)
    context = head + fill[:cut] + middle + fill[cut:]
    return PasskeyDocument(context, question, key, len(head) + cut)


def _answer_key(text: str) -> str | None:
    match = re.search(r"\d+", text)
    return match.group(0) if match else None


def padded_batch(documents, device) -> tuple[torch.Tensor, torch.Tensor, int]:
    """``documents`` (each with ``context`` and ``question`` token ids) as one left-padded batch: the ``(B, L)``
    prompts (context, then question) and their mask, and how many leading columns are context in every row (``L``
    less the longest question). Those columns are the batch's prefill; the rest, the questions and the context of the
    rows whose question is shorter than the longest (at most the difference of the questions' lengths), go through the
    cache with the question. Documents of one question length (:func:`answer_cell`'s batches) have their whole
    contexts as the prefill, as one document has."""
    from ...prefill import left_padded

    ids, mask = left_padded([doc.context + doc.question for doc in documents])
    return ids.to(device), mask.to(device), ids.shape[1] - max(len(doc.question) for doc in documents)


@torch.inference_mode()
def generate_answers(
    model, tokenizer, documents, cache, prefilled: bool = False, answer_tokens: int = ANSWER_TOKENS
) -> list[str]:
    """Greedy answers of ``model`` to ``documents`` (passkey or RULER documents: ``context`` and ``question`` token
    ids), decoded together through ``cache`` as one left-padded batch (:func:`padded_batch`), ``answer_tokens``
    tokens at most each (see the module docstring); ``prefilled``: the cache already holds the batch's prefill
    columns (:class:`~hf_kvcache.prefill.SharedPrefill` of them)."""
    from ...prefill import padded_positions

    ids, mask, context = padded_batch(documents, next(model.parameters()).device)
    if not prefilled:
        head = mask[:, :context]
        positions = padded_positions(model, head)
        model(input_ids=ids[:, :context], attention_mask=head, **positions, **with_cache(model, cache))
    out = model.generate(
        input_ids=ids,
        attention_mask=mask,
        **with_cache(model, cache),
        max_new_tokens=answer_tokens,
        do_sample=False,
        pad_token_id=tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id,
    )
    return [tokenizer.decode(row[ids.shape[1] :], skip_special_tokens=True) for row in out]


def answers_of(data: EvalData, documents, specs: list[str], separate: bool, answer_tokens: int = ANSWER_TOKENS):
    """Each cache's answers to ``documents`` (one batch, :func:`generate_answers`): ``answers[i][j]`` is cache
    ``specs[i]``'s to document ``j``. The batch's prefill runs once for every cache unless ``separate`` (or for a
    cache that refuses a handed-over prefill, which prefills itself)."""
    from ...prefill import SharedPrefill

    shared = None
    if not separate:
        ids, mask, context = padded_batch(documents, data.device)
        shared = SharedPrefill(data.model, ids[:, :context], mask[:, :context])
    answers = []
    for spec in specs:
        cache, prefilled = cache_for(spec, data.model, shared)
        answers.append(generate_answers(data.model, data.tokenizer, documents, cache, prefilled, answer_tokens))
    return answers


def batched(config) -> str:
    """The clause a task's setup line adds for ``--generate-batch`` above 1."""
    if config.generate_batch == 1:
        return ""
    return f", answered {config.generate_batch} at a time (left-padded batches)"


def answer_cell(data: EvalData, documents, specs: list[str], config, answer_tokens: int, progress=None):
    """Each cache's answers to a cell's ``documents``, in their order (``answers[i][j]``: cache ``specs[i]``'s to
    document ``j``), ``config.generate_batch`` at a time (:func:`answers_of`). A batch holds documents of one question
    length only, so every row's prefill is its whole context, as one document's is: each row's prompt is its own,
    after its left padding."""
    by_length: dict[int, list[int]] = {}
    for j, doc in enumerate(documents):
        by_length.setdefault(len(doc.question), []).append(j)
    size = config.generate_batch
    answers: list[list[str]] = [[""] * len(documents) for _ in specs]
    for same in by_length.values():
        for batch in (same[i : i + size] for i in range(0, len(same), size)):
            docs = [documents[j] for j in batch]
            for mine, got in zip(answers, answers_of(data, docs, specs, config.separate_prefill, answer_tokens)):
                for j, answer in zip(batch, got, strict=True):
                    mine[j] = answer
                if progress is not None:
                    progress(len(batch))
    return answers


@register_task
class PasskeyTask(DocumentTask):
    name = "passkey"
    title = "Passkey retrieval through the cache (exact match)"
    options = PasskeyOptions
    summary_keys = ("accuracy",)
    default = True

    def units(self, config) -> int:
        return len(config.lengths) * len(config.depths) * config.samples

    def check_model(self, config, model_config) -> None:
        check_lengths_fit("--lengths", config.lengths, model_config, "; a passkey document must fit it")

    def describe(self, config) -> str:
        return (
            f"passkey: {config.samples} documents per (length, depth){batched(config)}, {config.key_digits}-digit "
            "keys; the document is prefilled (once, its K/V handed to every cache, unless --separate-prefill), the "
            "question goes through the cache, the answer is decoded greedily."
        )

    def tokens_needed(self, config) -> int:
        return max(config.lengths) * config.samples * 2

    def run_caches(self, data: EvalData, specs: list[str], config, progress=None) -> list[dict]:
        """Every cache on the same documents, ``config.generate_batch`` at a time (:func:`answer_cell`): their
        prefill run once and handed to each cache (unless ``config.separate_prefill``, or for a cache that refuses
        it: then through that cache)."""
        generator = torch.Generator().manual_seed(config.seed)
        span = data.ids.numel() - max(config.lengths)

        def document(length: int, depth: float, seed: int) -> PasskeyDocument:
            generator.manual_seed(seed)
            key = "".join(str(d) for d in torch.randint(0, 10, (config.key_digits,), generator=generator).tolist())
            start = int(torch.randint(0, max(span, 1), (1,), generator=generator))
            filler = data.ids[start:]
            return build_passkey_document(data.tokenizer, filler, length, depth, key, chat=config.chat_template)

        cells: list[list[dict]] = [[] for _ in specs]
        for length in config.lengths:
            for depth in config.depths:
                docs = [document(length, depth, seed) for seed in document_seeds(config, length, depth)]
                answers = answer_cell(data, docs, specs, config, ANSWER_TOKENS, progress)
                found = [[float(_answer_key(answer) == doc.key) for answer, doc in zip(mine, docs)] for mine in answers]
                for i in range(len(specs)):
                    cells[i].append({"length": length, "depth": depth, "correct": round(sum(found[i])),
                                     "samples": config.samples, "scores": found[i]})  # fmt: skip
        out = []
        for mine in cells:
            accuracy = sum(c["correct"] for c in mine) / sum(c["samples"] for c in mine)
            out.append({"task": self.name, "cells": mine, "summary": {"accuracy": accuracy}})
        return out

    def pool(self, parts: list[dict], configs: list) -> dict:
        def seeds(config, cell: dict) -> range:
            return document_seeds(config, cell["length"], cell["depth"], cell["samples"])

        def merge(a: dict, b: dict) -> dict:
            both = {"correct": a["correct"] + b["correct"], "samples": a["samples"] + b["samples"]}
            if "scores" in a and "scores" in b:  # runs saved before per-document scores have none to pair
                both["scores"] = a["scores"] + b["scores"]
            return {"length": a["length"], "depth": a["depth"]} | both

        cells = pool_cells(self.name, parts, configs, _cell_key, seeds, merge)
        accuracy = sum(c["correct"] for c in cells) / sum(c["samples"] for c in cells)
        return {"task": self.name, "cells": cells, "summary": {"accuracy": accuracy}}

    def agrees(self, mine: dict, other: dict) -> bool:
        return cells_agree(mine, other, _cell_key)

    def table(self, results: dict) -> str:
        from ..tables import markdown_table

        entries = results["results"]
        cells = entries[0][self.name]["cells"]
        lengths = list(dict.fromkeys(c["length"] for c in cells))
        # runs saved before the per-document answers were kept have no paired column
        paired = all("scores" in c for e in entries for c in e[self.name]["cells"])
        headers = ["cache", "accuracy", *(["vs first"] if paired else []), *(f"{n} tok" for n in lengths)]
        rows = []
        for entry in entries:
            by_length = {n: [0, 0] for n in lengths}
            for c in entry[self.name]["cells"]:
                by_length[c["length"]][0] += c["correct"]
                by_length[c["length"]][1] += c["samples"]
            found = sum(ok for ok, _ in by_length.values())
            total = sum(n for _, n in by_length.values())
            versus = []
            if paired:
                difference, low, high = paired_difference(entry[self.name]["cells"], cells)
                versus = ["" if entry is entries[0] else f"{difference:+.0f} [{low:+.0f}, {high:+.0f}]"]
            rows.append([entry["cache"], _rate(found, total), *versus, *(_rate(ok, n) for ok, n in by_length.values())])
        per_length = count_range(sum(c["samples"] for c in cells if c["length"] == n) for n in lengths)
        note = f"\n\n{per_length} documents per length; brackets: the 95% interval (Wilson's)."
        if paired:
            note += (
                " vs first: points against the first cache over the same documents, with the 95% interval of the "
                "per-document differences (paired)."
            )
        else:
            note += " Read a difference between caches only where their intervals do not overlap."
        return markdown_table(headers, rows) + note

    def plots(self, results: dict, out) -> list[str]:
        from ..tables import pyplot

        plt = pyplot()
        if plt is None:
            return []
        entries = results["results"]
        cells = entries[0][self.name]["cells"]
        lengths = list(dict.fromkeys(c["length"] for c in cells))
        depths = list(dict.fromkeys(c["depth"] for c in cells))
        fig, axes = plt.subplots(1, len(entries), figsize=(2.6 * len(entries) + 1, 3), squeeze=False)
        for ax, entry in zip(axes[0], entries):
            grid = torch.zeros(len(lengths), len(depths))
            for c in entry[self.name]["cells"]:
                grid[lengths.index(c["length"]), depths.index(c["depth"])] = c["correct"] / c["samples"]
            image = ax.imshow(grid.numpy(), vmin=0, vmax=1, cmap="RdYlGn", aspect="auto", origin="lower")
            ax.set_title(entry["cache"], fontsize=8)
            ax.set_xticks(range(len(depths)), [f"{d:.0%}" for d in depths], fontsize=7)
            ax.set_yticks(range(len(lengths)), [str(n) for n in lengths], fontsize=7)
            ax.set_xlabel("needle depth", fontsize=8)
        axes[0][0].set_ylabel("document tokens", fontsize=8)
        fig.colorbar(image, ax=axes[0].tolist(), shrink=0.8, label="exact match")
        fig.savefig(out / "passkey_heatmap.png", dpi=120, bbox_inches="tight")
        plt.close(fig)
        return ["passkey_heatmap.png"]

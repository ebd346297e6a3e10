"""``ruler``: RULER's synthetic retrieval and tracing tasks (Hsieh et al., https://arxiv.org/abs/2404.06654), through
the cache.

Where one passkey asks the model to find a number, these ask it to tell one fact from its neighbours, which is where a
compressed cache loses first. Each document is ``length`` tokens: an instruction, filler text from the dataset (the
"essay" haystack) with the needles at random depths, then the question and an answer prefix. Generated offline from
the dataset and the seed (the same documents for every cache); needles and questions in RULER's wording:

- ``niah_single``: one needle ``One of the special magic numbers for <key> is: <7-digit number>.``, asked for;
- ``niah_multikey``: four needles with different keys, one asked for (the others are distractors);
- ``niah_multivalue``: four needles with the same key and four numbers, all asked for;
- ``niah_multiquery``: four needles with different keys, all four asked for;
- ``vt`` (variable tracking): a chain ``VAR A = 12345``, ``VAR B = VAR A``, ... of five variables hidden in the filler
  (and a second chain as a distractor); asked for every variable that holds the first chain's value;
- ``cwe`` (common-words extraction, aggregation): a numbered list of the dataset's words in which ten appear six times
  and the others once (RULER's setting below 4k tokens), after a one-shot example; asked for the ten;
- ``fwe`` (frequent-words extraction, aggregation): a text of random six-letter "coded" words whose counts follow a
  Zeta distribution (``alpha = 2``: the word of rank ``k`` about ``k^-2`` of the time; the most frequent one is
  ``...``, noise to ignore); asked for the three most frequent words after it.

Keys are adjective-noun pairs (``quiet-harbor``), values 7-digit numbers, variables five capital letters. Scored as
RULER's ``string_match_all``: the share of the expected strings that appear in the greedy answer (case-insensitive),
averaged over a cell's documents; a cell reports its 95% interval (Wilson for all-or-nothing scores, else the mean's
normal interval), so a reader can see which differences the sample count can carry.

Protocol through the cache, as ``passkey``: the document up to the question is prefilled (once for every cache, its
K/V handed to each, unless ``--separate-prefill``), the question and answer prefix go through the cache, and the
answer is decoded greedily through it.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field

import torch

from ..._validate import check_distinct, check_int
from .base import (
    DocumentTask,
    EvalData,
    cells_agree,
    check_lengths_fit,
    count_range,
    paired_difference,
    pool_cells,
    register_task,
    wilson,
)
from .passkey import GENERATE_BATCH_HELP, _encode, answer_cell, batched, chat_parts

__all__ = ["RULER_TASKS", "RulerDocument", "RulerOptions", "build_ruler_document", "string_match_all"]

# (needles with distinct keys, values per key, keys asked for, answer tokens); vt is built apart
NIAH = {
    "niah_single": (1, 1, 1, 16),
    "niah_multikey": (4, 1, 1, 16),
    "niah_multivalue": (1, 4, 1, 48),
    "niah_multiquery": (4, 1, 4, 48),
}
RULER_TASKS = (*NIAH, "vt", "cwe", "fwe")
VT_CHAIN = 5  # variables per chain (RULER's vt: 1 chain of 4 hops)
VT_ANSWER_TOKENS = 30
# cwe below 4k tokens, as RULER: 10 common words 6 times each among words listed once; a one-shot example of 20 words
CWE_COMMON, CWE_REPEATS, CWE_ANSWER_TOKENS = 10, 6, 120
CWE_POOL_TOKENS = 40000  # the text a cwe document draws its distinct words from
CWE_TEMPLATE = (
    "Below is a numbered list of words. In these words, some appear more often than others. Memorize the ones that "
    "appear most often.\n{context}\nQuestion: What are the 10 most common words in the above list?"
)
CWE_PREFIX = " Answer: The top 10 words that appear most often in the list are:"
# fwe as RULER: one distinct 6-letter coded word per 50 document tokens, counts n k^-2 / zeta(2) by rank k, rank 1 noise
FWE_WORD_LETTERS, FWE_TOKENS_PER_DISTINCT_WORD, FWE_ANSWER_TOKENS = 6, 50, 50
FWE_TEMPLATE = (
    "Read the following coded text and track the frequency of each coded word. Find the three most frequently "
    "appeared coded words. {context}\nQuestion: Do not provide any explanation. Please ignore the dots '....'. What "
    "are the three most frequently appeared words in the above coded text?"
)
FWE_PREFIX = " Answer: According to the coded text above, the three most frequently appeared words are:"

ADJECTIVES = (
    "amber", "ancient", "bitter", "bold", "brave", "bright", "calm", "clever", "cold", "crimson", "curious", "dark",
    "distant", "eager", "early", "fierce", "gentle", "golden", "grand", "green", "hidden", "hollow", "humble", "icy",
    "jolly", "keen", "late", "lively", "lonely", "lucky", "mellow", "misty", "noble", "odd", "pale", "proud", "quiet",
    "rapid", "restless", "rough", "royal", "rusty", "sharp", "silent", "silver", "sleepy", "slow", "smooth", "solemn",
    "steady", "stormy", "sudden", "swift", "tall", "tender", "tiny", "velvet", "vivid", "wild", "wise",
)  # fmt: skip
NOUNS = (
    "anchor", "arrow", "badger", "banner", "basket", "beacon", "bridge", "brook", "candle", "canyon", "castle", "cedar",
    "cliff", "comet", "compass", "crane", "crystal", "dagger", "falcon", "feather", "forest", "fountain", "garden",
    "glacier", "harbor", "hammer", "island", "lantern", "ledger", "meadow", "mirror", "monkey", "needle", "orchard",
    "otter", "palace", "pebble", "pepper", "pillar", "planet", "quarry", "raven", "ribbon", "river", "saddle",
    "sparrow", "spindle", "summit", "thicket", "thistle", "tower", "trumpet", "tunnel", "valley", "violin", "walrus",
    "willow", "window", "wizard", "zephyr",
)  # fmt: skip


def _niah_text(single: bool, query: str) -> tuple[str, str, str]:
    """RULER's NIAH instruction, question and answer prefix, in the singular where one number is asked for."""
    if single:
        intro = (
            "A special magic number is hidden within the following text. Make sure to memorize it. I will quiz you "
            "about the number afterwards.\n"
        )
        ask, noun, verb = "What is the", "number", "is"
    else:
        intro = (
            "Some special magic numbers are hidden within the following text. Make sure to memorize it. I will quiz "
            "you about the numbers afterwards.\n"
        )
        ask, noun, verb = "What are all the", "numbers", "are"
    question = f"\n{ask} special magic {noun} for {query} mentioned in the provided text?"
    prefix = f" The special magic {noun} for {query} mentioned in the provided text {verb}"
    return intro, question, prefix


VT_INSTRUCTION = "Memorize and track the chain(s) of variable assignment hidden in the following text.\n\n"
VT_QUESTION = "\nQuestion: Find all variables that are assigned the value {value} in the text above."
VT_PREFIX = (
    " Answer: According to the chain(s) of variable assignment in the text above, {n} variables are assigned the "
    "value {value}, they are:"
)


@dataclass
class RulerOptions:
    """Options of the ``ruler`` task."""

    ruler_tasks: tuple[str, ...] = field(
        default=RULER_TASKS, metadata={"help": f"RULER tasks, comma-separated ({', '.join(RULER_TASKS)})"}
    )
    ruler_lengths: tuple[int, ...] = field(
        default=(1024, 2048), metadata={"help": "RULER document lengths in tokens, comma-separated"}
    )
    ruler_samples: int = field(default=10, metadata={"help": "RULER documents per (task, length) cell"})
    chat_template: bool = field(
        default=False,
        metadata={"help": "the document and question as one user turn of the model's chat template"},
    )
    generate_batch: int = field(default=1, metadata={"help": GENERATE_BATCH_HELP})

    def validate(self) -> None:
        if not self.ruler_tasks:
            raise ValueError(f"--ruler-tasks must name at least one of {', '.join(RULER_TASKS)}")
        for name in self.ruler_tasks:
            if name not in RULER_TASKS:
                raise ValueError(f"--ruler-tasks: unknown task {name!r}; known: {', '.join(RULER_TASKS)}")
        for length in self.ruler_lengths:
            check_int("--ruler-lengths", length, 256)
        check_int("--ruler-samples", self.ruler_samples, 1)
        check_int("--generate-batch", self.generate_batch, 1)
        check_distinct("--ruler-tasks", self.ruler_tasks)  # a cell's documents are its task's and length's
        check_distinct("--ruler-lengths", self.ruler_lengths)


@dataclass
class RulerDocument:
    """One document: ``context`` (token ids up to the question), ``question`` (the question and the answer prefix),
    the strings a correct answer contains (``answers``) and the tokens decoded for it."""

    context: list[int]
    question: list[int]
    answers: list[str]
    answer_tokens: int


def string_match_all(prediction: str, references: list[str]) -> float:
    """RULER's score of one answer: the share of ``references`` found in ``prediction``, case-insensitively."""
    text = prediction.lower()
    return sum(ref.lower() in text for ref in references) / len(references)


def _needles(task: str, rng: random.Random) -> tuple[list[str], str, list[str]]:
    """``(needle sentences in document order, what the question asks for, the expected answers)``."""
    if task == "vt":
        names = rng.sample([_variable(rng) for _ in range(4 * VT_CHAIN)], 2 * VT_CHAIN)
        first, second = names[:VT_CHAIN], names[VT_CHAIN:]
        value, other = (str(rng.randint(10000, 99999)) for _ in range(2))
        chains = []
        for chain, start in ((first, value), (second, other)):
            chains.append([f"VAR {chain[0]} = {start}."] + [f"VAR {b} = VAR {a}." for a, b in zip(chain, chain[1:])])
        # the two chains interleaved, each in its own order (a hop never comes before the one it copies)
        order = [0] * VT_CHAIN + [1] * VT_CHAIN
        rng.shuffle(order)
        positions = [0, 0]
        sentences = []
        for which in order:
            sentences.append(chains[which][positions[which]])
            positions[which] += 1
        return sentences, value, first
    keys_n, values_n, queries_n, _ = NIAH[task]
    keys: list[str] = []
    while len(keys) < keys_n:
        key = f"{rng.choice(ADJECTIVES)}-{rng.choice(NOUNS)}"
        if key not in keys:
            keys.append(key)
    values = {key: [str(rng.randint(1_000_000, 9_999_999)) for _ in range(values_n)] for key in keys}
    sentences = [f"One of the special magic numbers for {k} is: {v}." for k in keys for v in values[k]]
    rng.shuffle(sentences)
    asked = rng.sample(keys, queries_n)
    query = ", ".join(asked[:-1]) + ", and " + asked[-1] if len(asked) > 1 else asked[0]
    return sentences, query, [v for k in asked for v in values[k]]


def _variable(rng: random.Random) -> str:
    return "".join(rng.choice("ABCDEFGHIJKLMNOPQRSTUVWXYZ") for _ in range(5))


def build_ruler_document(
    tokenizer, filler: torch.Tensor, task: str, length: int, seed: int, chat: bool = False
) -> RulerDocument:
    """A ``length``-token document of RULER task ``task`` (see the module docstring), its needles and keys drawn from
    ``seed``, its filler read from the start of ``filler`` (a token stream). Raises ``ValueError`` when ``length``
    leaves no room for filler."""
    if task not in RULER_TASKS:
        raise ValueError(f"unknown RULER task {task!r}; known: {', '.join(RULER_TASKS)}")
    rng = random.Random(seed)
    if task == "cwe":
        return _common_words(tokenizer, filler, length, rng, chat)
    if task == "fwe":
        return _frequent_words(tokenizer, length, rng, chat)
    sentences, query, answers = _needles(task, rng)
    if task == "vt":
        intro, question = VT_INSTRUCTION, VT_QUESTION.format(value=query)
        prefix, answer_tokens = VT_PREFIX.format(n=len(answers), value=query), VT_ANSWER_TOKENS
    else:
        intro, question, prefix = _niah_text(len(answers) == 1, query)
        answer_tokens = NIAH[task][3]
    if chat:
        before, after = chat_parts(tokenizer)
        head = _encode(tokenizer, before + intro)
        tail = _encode(tokenizer, question + after + prefix.lstrip())
    else:
        head = _encode(tokenizer, intro, special=True)
        tail = _encode(tokenizer, question + prefix)
    pieces = [_encode(tokenizer, f" {s} ") for s in sentences]
    n_fill = length - len(head) - len(tail) - sum(map(len, pieces))
    if n_fill < len(pieces) + 1:
        raise ValueError(
            f"--ruler-lengths {length} is too short for a {task} document: its fixed parts take "
            f"{length - n_fill} tokens with this tokenizer"
        )
    if filler.numel() < n_fill:
        raise ValueError(f"the dataset has {filler.numel()} tokens, fewer than the {n_fill} of filler needed")
    fill = filler[:n_fill].tolist()
    # random depths between sentences, the needles in their order
    cuts = sorted(rng.sample(_sentence_ends(tokenizer, fill, len(pieces)), len(pieces)))
    context, last = list(head), 0
    for cut, piece in zip(cuts, pieces):
        context += fill[last:cut] + piece
        last = cut
    context += fill[last:]
    return RulerDocument(context, tail, answers, answer_tokens)


def _word_pool(tokenizer, filler: torch.Tensor) -> list[str]:
    """Distinct lowercase words of 4 to 10 letters from the dataset's text, in order of first use."""
    words = tokenizer.decode(filler[:CWE_POOL_TOKENS].tolist()).lower().split()
    seen = dict.fromkeys(w for w in words if w.isalpha() and 4 <= len(w) <= 10)
    return list(seen)


def _numbered(words: list[str]) -> str:
    return " ".join(f"{i + 1}. {w}" for i, w in enumerate(words))


def _common_words(tokenizer, filler: torch.Tensor, length: int, rng: random.Random, chat: bool) -> RulerDocument:
    """RULER's common-words extraction (cwe): a numbered list of words, ten of them repeated; the ten asked for. As
    many words listed once as fit ``length`` tokens (the document is at most ``length`` and at least 32 short)."""
    pool = _word_pool(tokenizer, filler)
    if len(pool) < 60:
        raise ValueError(f"the dataset has {len(pool)} distinct words, too few for a cwe document (60)")
    rng.shuffle(pool)
    example_words = pool[:20]
    example_list = example_words[:CWE_COMMON] * 3 + example_words[CWE_COMMON:]
    rng.shuffle(example_list)
    example = (
        CWE_TEMPLATE.format(context=_numbered(example_list)) + CWE_PREFIX + " " + _numbered(example_words[:CWE_COMMON])
    )
    common, rest = pool[20 : 20 + CWE_COMMON], pool[20 + CWE_COMMON :]

    def build(n_rare: int) -> tuple[list[int], list[int]]:
        words = common * CWE_REPEATS + rest[:n_rare]
        order = random.Random(n_rare).sample(words, len(words))  # the same list for a given size
        text = example + "\n" + CWE_TEMPLATE.format(context=_numbered(order))
        if chat:
            before, after = chat_parts(tokenizer)
            return _encode(tokenizer, before + text), _encode(tokenizer, after + CWE_PREFIX.lstrip())
        return _encode(tokenizer, text, special=True), _encode(tokenizer, CWE_PREFIX)

    short = f"the dataset has too few distinct words ({len(pool)}) for a {length}-token cwe document"
    _, head, tail = _fit(build, length, 0, len(rest), "cwe", short)  # the most rare words that fit
    return RulerDocument(head, tail, list(common), CWE_ANSWER_TOKENS)


def _zeta_counts(words: int, vocabulary: int) -> list[int]:
    """RULER's fwe counts of the words of rank 1 .. ``vocabulary`` in a text of about ``words`` words:
    ``floor(words k^-2 / zeta(2))``, ``zeta(2) = pi^2 / 6``."""
    return [int(words * k**-2 / (math.pi**2 / 6)) for k in range(1, vocabulary + 1)]


def _fit(build, length: int, low: int, high: int, task: str, short: str) -> tuple[int, list[int], list[int]]:
    """The largest ``n`` in ``[low, high]`` whose ``build(n)`` (``(head, tail)`` token lists, growing with ``n``) fits
    ``length`` tokens, by bisection, with its head and tail; a ``ValueError`` where even ``build(low)`` does not fit,
    or saying ``short`` where the best leaves more than 32 tokens unused."""
    head, tail = build(low)
    if len(head) + len(tail) > length:
        raise ValueError(
            f"--ruler-lengths {length} is too short for a {task} document: its fixed parts take "
            f"{len(head) + len(tail)} tokens with this tokenizer"
        )
    while low < high:
        mid = (low + high + 1) // 2
        h, t = build(mid)
        if len(h) + len(t) <= length:
            low, head, tail = mid, h, t
        else:
            high = mid - 1
    if len(head) + len(tail) < length - 32:
        raise ValueError(short)
    return low, head, tail


def _frequent_words(tokenizer, length: int, rng: random.Random, chat: bool) -> RulerDocument:
    """RULER's frequent-words extraction (fwe): coded words in Zeta-distributed counts, shuffled; the three most
    frequent after the noise word ``...`` asked for. As many words as fit ``length`` tokens (the document is at most
    ``length`` and at least 32 short)."""
    vocabulary = max(length // FWE_TOKENS_PER_DISTINCT_WORD, 5)
    coded: list[str] = ["..."]
    while len(coded) < vocabulary:
        word = "".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(FWE_WORD_LETTERS))
        if word not in coded:
            coded.append(word)
    order_seed = rng.random()

    def build(words: int) -> tuple[list[int], list[int]]:
        text = [w for w, n in zip(coded, _zeta_counts(words, vocabulary)) for _ in range(n)]
        random.Random(order_seed).shuffle(text)
        prompt = FWE_TEMPLATE.format(context=" ".join(text))
        if chat:
            before, after = chat_parts(tokenizer)
            return _encode(tokenizer, before + prompt), _encode(tokenizer, after + FWE_PREFIX.lstrip())
        return _encode(tokenizer, prompt, special=True), _encode(tokenizer, FWE_PREFIX)

    # every word takes at least one token: `length` words do not fit
    words, head, tail = _fit(build, length, 0, length, "fwe", f"an fwe document cannot be sized to {length} tokens")
    counts = _zeta_counts(words, vocabulary)
    if not counts[1] > counts[2] > counts[3] > counts[4]:  # the three asked for, each more frequent than the next
        raise ValueError(
            f"--ruler-lengths {length} is too short for an fwe document: its {words} words leave the three most "
            f"frequent tied ({counts[1:5]})"
        )
    return RulerDocument(head, tail, coded[1:4], FWE_ANSWER_TOKENS)


def _sentence_ends(tokenizer, fill: list[int], needed: int) -> list[int]:
    """Positions in ``fill`` just after a token ending a sentence (where RULER puts needles, between sentences); every
    position when the filler has fewer than ``needed``."""
    unique = sorted(set(fill))
    texts = dict(zip(unique, tokenizer.convert_ids_to_tokens(unique)))
    ends = [i + 1 for i, t in enumerate(fill[:-1]) if str(texts[t]).rstrip("\"'\u201d ").endswith((".", "!", "?"))]
    return ends if len(ends) >= needed else list(range(1, len(fill)))


def _cell_key(cell: dict) -> tuple:
    """What names a cell: runs pool or join a cell by it."""
    return cell["task"], cell["length"]


def document_seeds(config, task: str, length: int, samples: int | None = None) -> range:
    """The seeds of a cell's documents (``samples`` of them, default ``config.ruler_samples``): a document depends on
    its seed alone, so every cache of a run reads the same ones, and a run of ``--seed S`` reads seeds ``S`` to
    ``S + samples - 1`` past the cell's own offset (runs of other seeds pool: ``hf-kvcache report``)."""
    first = config.seed + 100_003 * config.ruler_tasks.index(task) + 1009 * length
    return range(first, first + (config.ruler_samples if samples is None else samples))


def _cell(task: str, length: int, scores: list[float]) -> dict:
    low, high = interval(scores)
    return {"task": task, "length": length, "score": sum(scores) / len(scores), "low": low, "high": high,
            "samples": len(scores), "scores": scores}  # fmt: skip


def interval(scores: list[float], z: float = 1.96) -> tuple[float, float]:
    """95% interval of the mean of ``scores``: Wilson's for all-or-nothing scores, else the normal interval of the
    mean (clipped to [0, 1]); where every score is the same fraction, Wilson's at that rate (a score in [0, 1] varies
    at most as an all-or-nothing one of its mean: a few equal documents still carry doubt)."""
    n = len(scores)
    mean = sum(scores) / n
    if all(s in (0.0, 1.0) for s in scores):
        return wilson(round(sum(scores)), n, z)
    sd = math.sqrt(sum((s - mean) ** 2 for s in scores) / (n - 1)) if n > 1 else 0.0
    if sd == 0.0:
        return wilson(sum(scores), n, z)
    return max(0.0, mean - z * sd / math.sqrt(n)), min(1.0, mean + z * sd / math.sqrt(n))


@register_task
class RulerTask(DocumentTask):
    name = "ruler"
    title = "RULER retrieval and tracing through the cache (string_match_all, %)"
    options = RulerOptions
    summary_keys = ("score",)

    def units(self, config) -> int:
        return len(config.ruler_tasks) * len(config.ruler_lengths) * config.ruler_samples

    def check_model(self, config, model_config) -> None:
        check_lengths_fit("--ruler-lengths", config.ruler_lengths, model_config)

    def describe(self, config) -> str:
        return (
            f"ruler: {', '.join(config.ruler_tasks)} at {', '.join(map(str, config.ruler_lengths))} tokens, "
            f"{config.ruler_samples} documents per cell{batched(config)}; the document prefilled (once for every "
            "cache unless --separate-prefill), the question through the cache, the answer greedy; RULER's "
            "string_match_all."
        )

    def tokens_needed(self, config) -> int:
        # room for random starts; cwe reads its words from CWE_POOL_TOKENS after its start
        return max(config.ruler_lengths) * 4 + (CWE_POOL_TOKENS if "cwe" in config.ruler_tasks else 0)

    def run_caches(self, data: EvalData, specs: list[str], config, progress=None) -> list[dict]:
        span = data.ids.numel() - max(config.ruler_lengths) - (CWE_POOL_TOKENS if "cwe" in config.ruler_tasks else 0)

        def document(task: str, length: int, seed: int) -> RulerDocument:
            start = random.Random(seed).randrange(max(span, 1))
            return build_ruler_document(data.tokenizer, data.ids[start:], task, length, seed, chat=config.chat_template)

        scores: list[dict[tuple[str, int], list[float]]] = [{} for _ in specs]
        for task in config.ruler_tasks:
            for length in config.ruler_lengths:
                docs = [document(task, length, seed) for seed in document_seeds(config, task, length)]
                tokens = max(doc.answer_tokens for doc in docs)  # one task's: the same for each
                for i, answers in enumerate(answer_cell(data, docs, specs, config, tokens, progress)):
                    scores[i][task, length] = [string_match_all(a, doc.answers) for a, doc in zip(answers, docs)]
        return [self._result([_cell(task, length, values) for (task, length), values in mine.items()])
                for mine in scores]  # fmt: skip

    def _result(self, cells: list[dict]) -> dict:
        return {"task": self.name, "cells": cells, "summary": {"score": sum(c["score"] for c in cells) / len(cells)}}

    def pool(self, parts: list[dict], configs: list) -> dict:
        def seeds(config, cell: dict) -> range:
            return document_seeds(config, cell["task"], cell["length"], cell["samples"])

        def merge(a: dict, b: dict) -> dict:
            return _cell(a["task"], a["length"], a["scores"] + b["scores"])

        return self._result(pool_cells(self.name, parts, configs, _cell_key, seeds, merge))

    def agrees(self, mine: dict, other: dict) -> bool:
        return cells_agree(mine, other, _cell_key)

    def finish(self, entries: list[dict]) -> None:
        """Points against the first cache (the baseline), per cell and overall."""
        base = entries[0]
        for entry in entries:
            entry["summary"]["points_vs_first"] = 100 * (entry["summary"]["score"] - base["summary"]["score"])
            for cell, ref in zip(entry["cells"], base["cells"]):
                cell["points_vs_first"] = 100 * (cell["score"] - ref["score"])

    def table(self, results: dict) -> str:
        from ..tables import markdown_table

        entries = results["results"]
        cells = entries[0][self.name]["cells"]
        headers = ["cache", "average", "vs first", *(f"{c['task']} {c['length']}" for c in cells)]
        rows = []
        for entry in entries:
            mine = entry[self.name]
            difference, low, high = paired_difference(mine["cells"], cells)
            versus = "" if entry is entries[0] else f"{difference:+.1f} [{low:+.1f}, {high:+.1f}]"
            rows.append(
                [entry["cache"], f"{100 * mine['summary']['score']:.1f}", versus]
                + [f"{100 * c['score']:.0f} [{100 * c['low']:.0f}-{100 * c['high']:.0f}]" for c in mine["cells"]]
            )  # fmt: skip
        n = count_range(c["samples"] for c in cells)
        note = (
            f"\n\n{n} documents per cell; brackets: the cell's 95% interval. vs first: points of the average against "
            "the first cache (the baseline) over the same documents, with the 95% interval of the per-document "
            "differences (paired); a cache is within n points of the baseline only where that interval is."
        )
        return markdown_table(headers, rows) + note

    def plots(self, results: dict, out) -> list[str]:
        from ..tables import pyplot

        plt = pyplot()
        if plt is None:
            return []
        entries = results["results"]
        cells = entries[0][self.name]["cells"]
        tasks = list(dict.fromkeys(c["task"] for c in cells))
        lengths = list(dict.fromkeys(c["length"] for c in cells))
        fig, axes = plt.subplots(1, len(entries), figsize=(2.2 * len(entries) + 1, 0.4 * len(tasks) + 1.6),
                                 squeeze=False)  # fmt: skip
        for ax, entry in zip(axes[0], entries):
            grid = torch.zeros(len(tasks), len(lengths))
            for c in entry[self.name]["cells"]:
                grid[tasks.index(c["task"]), lengths.index(c["length"])] = c["score"]
            image = ax.imshow(grid.numpy(), vmin=0, vmax=1, cmap="RdYlGn", aspect="auto")
            ax.set_title(entry["cache"], fontsize=8)
            ax.set_xticks(range(len(lengths)), [str(n) for n in lengths], fontsize=7)
            ax.set_yticks(range(len(tasks)), tasks if ax is axes[0][0] else [""] * len(tasks), fontsize=7)
            ax.set_xlabel("document tokens", fontsize=8)
        fig.colorbar(image, ax=axes[0].tolist(), shrink=0.8, label="string_match_all")
        fig.savefig(out / "ruler_heatmap.png", dpi=120, bbox_inches="tight")
        plt.close(fig)
        return ["ruler_heatmap.png"]

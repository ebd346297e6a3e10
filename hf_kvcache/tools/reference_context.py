"""Stage 2 of the reference model's training: teach it to use its context (copying and passkey retrieval).

A 4M-parameter model trained on five novels predicts from local word statistics and does not copy: a passage seen
200 tokens earlier is no easier the second time. Copying (induction heads) appears in training as a sudden phase
change, and only when the data rewards it strongly. So this stage starts from the prose model and runs a curriculum of
:class:`Phase` s, each a mix of generated document kinds (``DocumentMaker``):

* ``prose``: a window of the training novels (keeps prose perplexity);
* ``periodic``: a random segment of 6 to 48 frequent tokens repeated to fill the window, the easiest copy signal,
  which bootstraps induction (without it the loss sat at chance for hundreds of steps);
* ``copy``: prose with one or more segments (random frequent tokens or training prose, 8 to 256 tokens) written twice
  at random distances, so a copy must be found by content, not by a fixed offset;
* ``repeat``: a training-prose passage (32 to 256 tokens), other prose, then the passage again: the shape of the
  harness's ``repeat`` task, which teaches the model to trust a copy over its prose prior;
* ``passkey``: the harness's passkey document (:mod:`hf_kvcache.eval.tasks.passkey`, the same template) over
  training-novel filler, followed by the answer.

Every phase is scored on the validation split (the last 5% of each training novel, never trained on): prose
perplexity, second-copy / first-copy perplexity of a 128-token passage repeated after other text, and passkey exact
match under teacher forcing. Persuasion, the held-out novel, appears in no training document.
"""

from __future__ import annotations

import math
import random
import time
from collections import Counter
from dataclasses import asdict, dataclass, field

import torch

from hf_kvcache.eval.tasks.passkey import build_passkey_document
from hf_kvcache.reference import full_forward_nll

KINDS = ("prose", "periodic", "copy", "repeat", "passkey")


@dataclass(frozen=True)
class Phase:
    name: str
    steps: int
    length: int  # tokens per training sequence
    batch: int
    lr: float  # peak; linear warmup, then constant or cosine to lr / 10
    mix: dict[str, float]  # document kind -> share of the batch
    cosine: bool = False
    warmup: int = 50
    prose_segments: float = 0.5  # share of copy segments taken from prose (the rest: random frequent tokens)
    attention_dropout: float = 0.0  # regularizes prose (the corpus is small); copying learns better without it
    # "all", or "attention": only the attention projections train, so the MLPs and embeddings (where a 4M model
    # memorizes a 0.8M-token corpus) keep the prose the earlier phases learned.
    train: str = "all"


# The curriculum, in the order the shipped weights went through it (``training.json`` records each phase's curve).
# ``bootstrap`` and ``copy`` codify two exploratory runs that preceded this module (their curves are in
# ``training.json["stages"]["context"]["lineage"]``); the three later phases ran with this script's ``--init``.
# About 100 minutes of a 2-core CPU. The shipped model meets the passkey target, not the long-distance copy or the
# held-out perplexity target (model card). EXPERIMENTS are later tries from the shipped weights that did not help and
# are not in the chain: ``anneal`` (by step 300 of 400: validation perplexity 61.5 -> 59.5, copy ratio unchanged
# at 0.98) and ``long_attention`` (attention weights only, stopped at step 400 of 800: copy ratio 0.975 -> 0.976
# at a 1,784-token gap, validation perplexity 61.5 -> 64.0).
PHASES = (
    Phase("bootstrap", 700, 128, 32, 2e-3, {"prose": 0.3, "periodic": 0.7}),
    Phase("copy", 1000, 256, 16, 2e-3, {"prose": 0.2, "copy": 0.45, "periodic": 0.15, "passkey": 0.2}),
    Phase(
        "longer_copy",
        600,
        512,
        8,
        1.5e-3,
        {"prose": 0.25, "copy": 0.45, "periodic": 0.05, "passkey": 0.25},
        prose_segments=0.7,
    ),
    Phase(
        "longer",
        600,
        512,
        8,
        1.5e-3,
        {"prose": 0.25, "repeat": 0.35, "copy": 0.15, "periodic": 0.05, "passkey": 0.2},
        prose_segments=0.7,
    ),
    Phase(
        "long",
        500,
        2048,
        2,
        1e-3,
        {"prose": 0.3, "repeat": 0.3, "copy": 0.1, "passkey": 0.3},
        cosine=True,
        prose_segments=0.7,
    ),
)
EXPERIMENTS = (
    Phase(
        "long_attention",
        800,
        2048,
        2,
        1e-3,
        {"prose": 0.2, "repeat": 0.5, "copy": 0.1, "passkey": 0.2},
        cosine=True,
        prose_segments=0.7,
        train="attention",
    ),
    Phase(
        "anneal",
        400,
        1024,
        4,
        3e-4,
        {"prose": 0.3, "repeat": 0.3, "copy": 0.15, "passkey": 0.25},
        cosine=True,
        prose_segments=0.7,
        attention_dropout=0.1,
    ),
)


class DocumentMaker:
    """Training documents of each kind, from a token stream of the training novels (seeded)."""

    def __init__(self, stream: torch.Tensor, tokenizer, seed: int, frequent: int = 1024):
        self.stream = stream
        self.tokenizer = tokenizer
        self.rng = random.Random(seed)
        self.generator = torch.Generator().manual_seed(seed)
        self.frequent = torch.tensor([t for t, _ in Counter(stream.tolist()).most_common(frequent)])

    def window(self, n: int) -> torch.Tensor:
        start = self.rng.randrange(0, self.stream.numel() - n)
        return self.stream[start : start + n].clone()

    def random_tokens(self, n: int) -> torch.Tensor:
        return self.frequent[torch.randint(0, len(self.frequent), (n,), generator=self.generator)]

    def prose(self, length: int, phase: Phase) -> torch.Tensor:
        return self.window(length)

    def periodic(self, length: int, phase: Phase) -> torch.Tensor:
        segment = self.random_tokens(self.rng.randint(6, 48))
        return segment.repeat(length // segment.numel() + 1)[:length]

    def copy(self, length: int, phase: Phase) -> torch.Tensor:
        doc = self.window(length)
        pairs = self.rng.randint(1, max(1, length // 256))
        region = length // pairs
        for i in range(pairs):
            n = self.rng.randint(8, max(8, min(256, region // 3)))
            segment = self.window(n) if self.rng.random() < phase.prose_segments else self.random_tokens(n)
            first = i * region + self.rng.randrange(0, region - 2 * n + 1)
            second = self.rng.randrange(first + n, i * region + region - n + 1)
            doc[first : first + n] = segment
            doc[second : second + n] = segment
        return doc

    def repeat(self, length: int, phase: Phase) -> torch.Tensor:
        """A prose passage, other prose, the passage again (the shape of the harness's repeat task), to the end."""
        n = self.rng.randint(32, min(256, length // 3))
        passage = self.window(n)
        gap = self.rng.randrange(0, length - 2 * n + 1)
        doc = torch.cat([passage, self.window(gap), passage])
        return torch.cat([doc, self.window(length - doc.numel())]) if doc.numel() < length else doc

    def passkey(self, length: int, phase: Phase) -> torch.Tensor:
        key = "".join(self.rng.choice("0123456789") for _ in range(5))
        answer = self.tokenizer(f" {key}.", add_special_tokens=False)["input_ids"]
        filler = self.window(length)
        doc = build_passkey_document(self.tokenizer, filler, length - len(answer), self.rng.random(), key)
        return torch.tensor(doc.context + doc.question + answer)

    def batch(self, phase: Phase) -> torch.Tensor:
        """``(batch, length + 1)``: inputs and shifted targets of one step."""
        kinds, weights = zip(*phase.mix.items())
        docs = []
        for _ in range(phase.batch):
            kind = self.rng.choices(kinds, weights)[0]
            docs.append(getattr(self, kind)(phase.length + 1, phase))
        return torch.stack(docs)


@dataclass
class ValidationSet:
    """Fixed validation documents from the validation split, scored after every ``eval_every`` steps."""

    prose: torch.Tensor  # (n, 512) windows
    copies: torch.Tensor  # (n, 2 * 128 + gap) passage, other text, passage
    gap: int
    passkey: list[tuple[list[int], list[int]]]  # (document, answer tokens)

    @classmethod
    def build(cls, val: torch.Tensor, tokenizer, length: int, seed: int = 1) -> ValidationSet:
        rng = random.Random(seed)
        n_prose = min(20, val.numel() // 512)
        prose = val[: n_prose * 512].view(n_prose, 512)
        gap = max(64, min(length, 2048) - 2 * 128 - 8)
        copies = []
        for _ in range(12):
            start = rng.randrange(0, val.numel() - 128 - gap - 300)
            passage = val[start : start + 128]
            other = val[start + 300 : start + 300 + gap]
            copies.append(torch.cat([passage, other, passage]))
        passkey = []
        for i in range(12):
            key = "".join(rng.choice("0123456789") for _ in range(5))
            answer = tokenizer(f" {key}.", add_special_tokens=False)["input_ids"]
            start = rng.randrange(0, val.numel() - length)
            doc = build_passkey_document(tokenizer, val[start:], length - len(answer), i / 11, key)
            passkey.append((doc.context + doc.question, answer))
        return cls(prose, torch.stack(copies), gap, passkey)

    @torch.no_grad()
    def score(self, model) -> dict:
        model.eval()
        nll, count = full_forward_nll(model, self.prose.flatten(), 512)
        logits = model(input_ids=self.copies).logits.float()
        token_nll = torch.nn.functional.cross_entropy(
            logits[:, :-1].transpose(1, 2), self.copies[:, 1:], reduction="none"
        )  # (n, T - 1): position t predicts token t + 1
        first = token_nll[:, :127].mean().item()
        second = token_nll[:, 128 + self.gap : 128 + self.gap + 127].mean().item()
        correct = 0
        for doc, answer in self.passkey:
            ids = torch.tensor([doc + answer[:-1]])
            predicted = model(input_ids=ids).logits[0, len(doc) - 1 :].argmax(-1)
            correct += predicted.tolist() == answer
        model.train()
        return {
            "validation_ppl": round(math.exp(nll / count), 3),
            "copy_ratio": round(math.exp(second - first), 4),
            "second_copy_ppl": round(math.exp(second), 3),
            "passkey_teacher_forced": round(correct / len(self.passkey), 3),
        }


@dataclass
class PhaseLog:
    phase: dict
    curve: list[dict] = field(default_factory=list)
    evals: list[dict] = field(default_factory=list)
    minutes: float = 0.0


def train_phase(model, phase: Phase, maker: DocumentMaker, val: torch.Tensor, tokenizer, eval_every: int) -> PhaseLog:
    """Run one phase on ``model`` in place; returns its loss curve and validation scores."""
    for name, parameter in model.named_parameters():
        parameter.requires_grad_(phase.train == "all" or ".self_attn." in name)
    trainable = [p for p in model.parameters() if p.requires_grad]
    decay = [p for p in trainable if p.ndim >= 2]
    no_decay = [p for p in trainable if p.ndim < 2]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
        lr=phase.lr,
        betas=(0.9, 0.95),
    )

    def lr_at(step: int) -> float:
        if step < phase.warmup:
            return phase.lr * (step + 1) / phase.warmup
        if not phase.cosine:
            return phase.lr
        progress = (step - phase.warmup) / max(1, phase.steps - phase.warmup)
        return phase.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))

    model.config.attention_dropout = phase.attention_dropout
    for module in model.modules():
        if hasattr(module, "attention_dropout"):
            module.attention_dropout = phase.attention_dropout
    validation = ValidationSet.build(val, tokenizer, phase.length)
    log = PhaseLog(asdict(phase))
    log.evals.append({"step": 0} | validation.score(model))
    print(f"[{phase.name}] start {log.evals[-1]}", flush=True)
    started, running = time.perf_counter(), None
    model.train()
    for step in range(phase.steps):
        batch = maker.batch(phase)
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step)
        logits = model(input_ids=batch[:, :-1]).logits
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(trainable, 1.0)
        optimizer.step()
        running = loss.item() if running is None else 0.95 * running + 0.05 * loss.item()
        if (step + 1) % 50 == 0 or step + 1 == phase.steps:
            minutes = (time.perf_counter() - started) / 60
            log.curve.append({"step": step + 1, "train_loss": round(running, 4), "minutes": round(minutes, 2)})
        if (step + 1) % eval_every == 0 or step + 1 == phase.steps:
            log.evals.append({"step": step + 1} | validation.score(model))
            print(f"[{phase.name}] step {step + 1}/{phase.steps} loss {running:.3f} {log.evals[-1]}", flush=True)
    log.minutes = round((time.perf_counter() - started) / 60, 1)
    return log


# The targets of the model card, measured on the held-out novel with DynamicCache (tests re-measure them).
TARGETS = {
    "copy_ratio_max": 0.05,  # second-copy / first-copy perplexity, 128-token passage after 1,500 tokens
    "passkey_accuracy_min": 0.95,  # 5-digit keys, 256 to 1,900 tokens, depths 0-100%
    "heldout_perplexity_max": 80.0,  # 512-token windows, full forward
}
COPY_PROTOCOL = {"passage": 128, "distance": 1500, "samples": 16}
PASSKEY_PROTOCOL = {"lengths": (256, 512, 1024, 1900), "depths": (0.0, 0.25, 0.5, 0.75, 1.0), "samples": 2}


def copy_ratio(model, heldout: torch.Tensor, seed: int = 0) -> dict:
    """Second-copy / first-copy perplexity of held-out passages repeated after held-out text, via DynamicCache."""
    from transformers import DynamicCache

    from hf_kvcache.eval.tasks.repeat import repeat_nll

    generator = torch.Generator().manual_seed(seed)
    p, d, n = COPY_PROTOCOL["passage"], COPY_PROTOCOL["distance"], COPY_PROTOCOL["samples"]
    starts = torch.randint(0, heldout.numel() - p - d, (2, n), generator=generator)
    passages = torch.stack([heldout[s : s + p] for s in starts[0].tolist()])
    gaps = torch.stack([heldout[s + p : s + p + d] for s in starts[1].tolist()])
    first, second = repeat_nll(model, passages, gaps, DynamicCache(config=model.config))
    return COPY_PROTOCOL | {
        "first_copy_ppl": round(math.exp(first.mean().item()), 3),
        "second_copy_ppl": round(math.exp(second.mean().item()), 3),
        "ratio": round(math.exp(second.mean().item() - first.mean().item()), 4),
    }


def passkey_accuracy(model, tokenizer, heldout: torch.Tensor, seed: int = 0) -> dict:
    """Exact-match passkey retrieval over held-out filler through the harness's passkey task, via DynamicCache."""
    from hf_kvcache.eval.config import EvalConfig
    from hf_kvcache.eval.tasks import EvalData, get_task

    config = EvalConfig(task=("passkey",), seed=seed, quiet=True, **PASSKEY_PROTOCOL)
    passkey = get_task("passkey").run(EvalData(model, tokenizer, heldout), "dynamic", config)
    return {k: list(v) if isinstance(v, tuple) else v for k, v in PASSKEY_PROTOCOL.items()} | {
        "accuracy": passkey["summary"]["accuracy"],
        "cells": passkey["cells"],
    }


def measure_targets(model, tokenizer, heldout: torch.Tensor, seed: int = 0) -> dict:
    """The model card's three numbers on the held-out text, through the harness's own task code."""
    model.eval()
    nll, count = full_forward_nll(model, heldout, 512)
    return {
        "copy": copy_ratio(model, heldout, seed),
        "passkey": passkey_accuracy(model, tokenizer, heldout, seed),
        "heldout_perplexity": round(math.exp(nll / count), 3),
    }


def targets_met(measured: dict) -> dict[str, bool]:
    return {
        "copy": measured["copy"]["ratio"] <= TARGETS["copy_ratio_max"],
        "passkey": measured["passkey"]["accuracy"] >= TARGETS["passkey_accuracy_min"],
        "heldout_perplexity": measured["heldout_perplexity"] <= TARGETS["heldout_perplexity_max"],
    }

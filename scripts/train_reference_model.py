"""Train the embedded reference model: a small Llama on five Jane Austen novels.

This script is the provenance of ``hf_kvcache/assets/reference_model`` and ``hf_kvcache/assets/persuasion.txt``.
It uses only the project's own dependencies (torch, transformers, tokenizers) plus Debian's ``apt-get`` and
``dpkg`` to fetch the corpus.

Corpus
    Jane Austen's six novels (public domain; Project Gutenberg transcriptions with the Gutenberg boilerplate removed)
    as packaged by Julia Silge's R package ``janeaustenr`` (MIT), shipped by Debian as ``r-cran-janeaustenr``. The
    package is fetched with ``apt-get download r-cran-janeaustenr`` and unpacked with ``dpkg -x``; the novels sit in
    R's lazy-load database ``data/Rdata.rdb`` (indexed by ``Rdata.rdx``) as zlib-compressed R serializations of
    character vectors, one element per printed line. :func:`read_r_lazyload` decodes them without R.

Cleaning
    Lines are joined into paragraphs (a blank line ends a paragraph), whitespace runs become one space, the
    ``_emphasis_`` underscores are dropped, and paragraphs are separated by a blank line. The title page lines stay:
    they are part of the text. Train on Emma, Mansfield Park, Northanger Abbey, Pride and Prejudice and Sense and
    Sensibility; Persuasion is held out and shipped as the reference text.

Tokenizer
    Byte-level BPE (``tokenizers``), vocabulary 4096, trained on the five training novels only, with ``<unk>``,
    ``<s>`` (bos) and ``</s>`` (eos) special tokens; no bos is added when encoding.

Model
    ``LlamaForCausalLM``: 4 layers, hidden 256, 4 query heads and 2 KV heads (GQA, head_dim 64), SiLU MLP 704, RoPE
    theta 10000, tied embeddings, context 512; about 4M parameters, saved in float32.

Training
    float32 (bf16 matmuls are far slower on CPUs without AMX), AdamW (betas 0.9/0.95, weight decay 0.1), peak
    learning rate 3e-3 with a linear warmup and a cosine decay to a tenth of it, batches of 8 random 512-token windows
    of the training stream, attention dropout 0.1, gradient clipping at 1.0, a fixed number of steps. The last 5% of
    each training novel is a validation split, never trained on; it is scored every 200 steps and the weights with
    the best validation perplexity are kept. Why: the corpus is small (0.83M tokens) and a 4M-parameter model
    memorizes it. A first run of 3600 steps (17 epochs) without dropout or validation saw the held-out perplexity of
    its first 48 windows fall to 85 at step 1000 and rise to 106 at step 2000 while the training loss kept falling.
    Everything is seeded, but CPU kernels are not bit-reproducible across machines: the shipped weights are the
    artefact, the script is the record of how they were made.

Evaluation
    Held-out perplexity: Persuasion is tokenized as one stream and cut into consecutive non-overlapping windows of
    512 tokens (the last, partial window is dropped); each window gets one full forward without a cache and
    positions 1..511 are scored. Perplexity = exp(total NLL / scored tokens). The same number is recomputed by the
    test suite (``tests/test_reference_model.py``) with the same function, :func:`hf_kvcache.reference.window_nll`.

Usage::

    python scripts/train_reference_model.py --steps 1500 --threads 2
    python scripts/train_reference_model.py --steps 20 --out /tmp/ref-smoke  # smoke test

The run writes the model folder (config, weights, tokenizer, generation config, ``training.json`` with the loss curve
and the final held-out perplexity) and the held-out text.
"""

from __future__ import annotations

import argparse
import gzip
import json
import math
import random
import re
import shutil
import struct
import subprocess
import sys
import tempfile
import time
import zlib
from pathlib import Path

import torch

from hf_kvcache.reference import window_nll

ROOT = Path(__file__).resolve().parents[1]
ASSETS = ROOT / "hf_kvcache" / "assets"
TRAIN_NOVELS = ("emma", "mansfieldpark", "northangerabbey", "prideprejudice", "sensesensibility")
HELDOUT_NOVEL = "persuasion"
RDATA = "usr/lib/R/site-library/janeaustenr/data/Rdata"

HELDOUT_HEADER = """\
Persuasion, by Jane Austen (1818). Public domain.

Source: the Project Gutenberg transcription as packaged in the R package janeaustenr by Julia Silge (MIT licence),
Debian package r-cran-janeaustenr. Cleaned by scripts/train_reference_model.py: printed lines joined into paragraphs,
_emphasis_ underscores removed. This novel is held out: the reference model never saw it in training.
The text starts after the line of equals signs below.
==========
"""


# ----------------------------------------------------------------------------------------------------------------
# Corpus: R lazy-load database decoding
# ----------------------------------------------------------------------------------------------------------------


class _RUnserializer:
    """Reads R's XDR serialization format (versions 2 and 3), enough of it for data packages.

    Handles vectors (logical, integer, double, character, list), pairlists with tags and attributes, symbols,
    environments and references. Character vectors come back as lists of str (None for NA); a vector with a
    ``names`` attribute comes back as a dict.
    """

    _NIL_LIKE = {254, 253, 252, 251, 250, 242, 241}  # NILVALUE, GLOBALENV, UNBOUND, MISSINGARG, BASENS, (BASE/EMPTY)ENV

    def __init__(self, data: bytes):
        if data[:2] != b"X\n":
            raise ValueError(f"not an XDR R serialization (starts with {data[:2]!r})")
        self._data = data
        self._pos = 2
        self._refs: list = []
        version = self._int()
        self._int(), self._int()  # writer and minimal reader R versions
        if version == 3:
            n = self._int()
            self._pos += n  # native encoding name

    def _int(self) -> int:
        (value,) = struct.unpack_from(">i", self._data, self._pos)
        self._pos += 4
        return value

    def _length(self) -> int:
        n = self._int()
        if n == -1:  # long vector
            n = (self._int() << 32) + self._int()
        return n

    def read(self):
        flags = self._int()
        kind, has_attr, has_tag = flags & 0xFF, flags & (1 << 9), flags & (1 << 10)
        if kind in self._NIL_LIKE:
            return None
        if kind == 255:  # REFSXP
            index = flags >> 8 or self._int()
            return self._refs[index - 1]
        if kind == 1:  # SYMSXP
            symbol = ("symbol", self.read())
            self._refs.append(symbol)
            return symbol
        if kind in (247, 248, 249):  # PERSIST, PACKAGE, NAMESPACE: a string vector
            self._int()
            value = [self.read() for _ in range(self._int())]
            self._refs.append(value)
            return value
        if kind == 4:  # ENVSXP
            self._int()  # locked
            env: dict = {}
            self._refs.append(env)
            for part in ("enclos", "frame", "hashtab", "attributes"):
                env[part] = self.read()
            return env
        if kind in (2, 3, 5, 6, 17, 239, 240):  # pairlist-like cells
            if has_attr:
                self.read()
            tag = self.read() if has_tag else None
            cells = [(tag, self.read())]
            rest = self.read()
            return cells + rest if isinstance(rest, list) and rest and isinstance(rest[0], tuple) else cells
        if kind == 9:  # CHARSXP
            n = self._int()
            if n == -1:
                return None
            raw = self._data[self._pos : self._pos + n]
            self._pos += n
            return raw.decode("latin-1") if flags & (1 << 13) else raw.decode("utf-8")
        if kind == 238:  # ALTREP: class info, state, attributes
            self.read()
            state = self.read()
            self.read()
            return state
        if kind in (10, 13):
            n = self._length()
            value = list(struct.unpack_from(f">{n}i", self._data, self._pos))
            self._pos += 4 * n
        elif kind == 14:
            n = self._length()
            value = list(struct.unpack_from(f">{n}d", self._data, self._pos))
            self._pos += 8 * n
        elif kind in (16, 19, 20):
            value = [self.read() for _ in range(self._length())]
        else:
            raise ValueError(f"unsupported R SEXP type {kind} at byte {self._pos}")
        if has_attr:
            names = [v for tag, v in self.read() if tag == ("symbol", "names")]
            if names:
                return dict(zip(names[0], value, strict=True))
        return value


def read_r_lazyload(prefix: Path) -> dict:
    """All objects of an R lazy-load database ``prefix.rdb`` / ``prefix.rdx`` (zlib-compressed entries)."""
    index = _RUnserializer(gzip.decompress(prefix.with_suffix(".rdx").read_bytes())).read()
    if index.get("compressed", [True])[0] not in (True, 1):
        raise ValueError("only zlib-compressed lazy-load databases are supported")
    blob = prefix.with_suffix(".rdb").read_bytes()
    objects = {}
    for name, (offset, size) in index["variables"].items():
        entry = blob[offset : offset + size]  # 4-byte big-endian raw length, then zlib data
        objects[name] = _RUnserializer(zlib.decompress(entry[4:])).read()
    return objects


def fetch_novels(deb: Path | None, work: Path) -> dict[str, list[str]]:
    """The six novels as lists of printed lines, from ``deb`` or a fresh ``apt-get download``."""
    work.mkdir(parents=True, exist_ok=True)
    if deb is None:
        subprocess.run(["apt-get", "download", "r-cran-janeaustenr"], cwd=work, check=True, capture_output=True)
        deb = next(work.glob("r-cran-janeaustenr_*.deb"))
    unpacked = work / "unpacked"
    subprocess.run(["dpkg", "-x", str(deb), str(unpacked)], check=True)
    return read_r_lazyload(unpacked / RDATA)


def clean(lines: list[str]) -> str:
    """Printed lines to paragraphs separated by blank lines, without emphasis underscores."""
    paragraphs, current = [], []
    for line in lines + [""]:
        line = (line or "").strip()
        if line:
            current.append(line)
        elif current:
            paragraphs.append(" ".join(current))
            current = []
    text = "\n\n".join(paragraphs)
    text = text.replace("_", "")
    return re.sub(r"[ \t]+", " ", text) + "\n"


# ----------------------------------------------------------------------------------------------------------------
# Tokenizer and model
# ----------------------------------------------------------------------------------------------------------------


def train_tokenizer(texts: list[str], vocab_size: int, out: Path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<unk>", "<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        pad_token="</s>",
        model_max_length=512,
        clean_up_tokenization_spaces=False,
    )
    fast.save_pretrained(out)
    return fast


def build_model(tokenizer, context: int, seed: int, attention_dropout: float = 0.0):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=256,
        intermediate_size=704,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        max_position_embeddings=context,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        initializer_range=0.02,
        attention_dropout=attention_dropout,
    )
    torch.manual_seed(seed)
    return LlamaForCausalLM(config)


def train(args) -> None:
    torch.set_num_threads(args.threads)
    random.seed(args.seed)
    torch.manual_seed(args.seed)
    out = Path(args.out)
    with tempfile.TemporaryDirectory() as tmp:
        novels = fetch_novels(Path(args.deb) if args.deb else None, Path(tmp))
    train_texts = [clean(novels[name]) for name in TRAIN_NOVELS]
    heldout = clean(novels[HELDOUT_NOVEL])
    print(
        f"corpus: train {sum(map(len, train_texts)) / 1e6:.2f} MB ({', '.join(TRAIN_NOVELS)}), "
        f"held out {len(heldout) / 1e3:.0f} KB ({HELDOUT_NOVEL})",
        flush=True,
    )

    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    tokenizer = train_tokenizer(train_texts, args.vocab_size, out)
    encode = tokenizer.backend_tokenizer.encode  # whole novels at once, without the max-length warning
    stream, validation = [], []
    for text in train_texts:
        ids = encode(text).ids + [tokenizer.eos_token_id]
        cut = int(len(ids) * (1 - args.val_fraction))
        stream += ids[:cut]
        validation += ids[cut:]
    train_ids = torch.tensor(stream, dtype=torch.long)
    val_ids = torch.tensor(validation, dtype=torch.long)
    heldout_ids = torch.tensor(encode(heldout).ids, dtype=torch.long)
    print(
        f"tokens: train {train_ids.numel()}, validation {val_ids.numel()}, held out {heldout_ids.numel()} "
        f"({len(heldout.encode()) / heldout_ids.numel():.2f} bytes/token)",
        flush=True,
    )

    model = build_model(tokenizer, args.context, args.seed, args.attention_dropout)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"model: {n_params / 1e6:.2f}M parameters", flush=True)
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.ndim < 2]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": args.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=args.lr,
        betas=(0.9, 0.95),
    )

    def lr_at(step: int) -> float:
        if step < args.warmup:
            return args.lr * (step + 1) / args.warmup
        progress = (step - args.warmup) / max(1, args.steps - args.warmup)
        return args.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))

    generator = torch.Generator().manual_seed(args.seed)
    span = args.context + 1
    curve, evals = [], []
    best = (float("inf"), 0, None)  # validation perplexity, step, weights
    started = time.perf_counter()
    running = None
    model.train()
    for step in range(args.steps):
        starts = torch.randint(0, train_ids.numel() - span, (args.batch,), generator=generator)
        batch = torch.stack([train_ids[s : s + span] for s in starts.tolist()])
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step)
        logits = model(input_ids=batch[:, :-1]).logits
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        running = loss.item() if running is None else 0.95 * running + 0.05 * loss.item()
        elapsed = time.perf_counter() - started
        if (step + 1) % args.log_every == 0 or step + 1 == args.steps:
            curve.append({"step": step + 1, "train_loss": round(running, 4), "minutes": round(elapsed / 60, 2)})
            tok_s = (step + 1) * args.batch * args.context / elapsed
            print(f"step {step + 1}/{args.steps} loss {running:.3f} lr {lr_at(step):.2e} {tok_s:.0f} tok/s", flush=True)
        if (step + 1) % args.eval_every == 0 or step + 1 == args.steps:
            nll, count = window_nll(model, val_ids, args.context)
            val_ppl = math.exp(nll / count)
            evals.append({"step": step + 1, "validation_ppl": round(val_ppl, 2)})
            print(f"  validation ppl: {val_ppl:.2f}", flush=True)
            if val_ppl < best[0]:
                best = (val_ppl, step + 1, {k: v.detach().clone() for k, v in model.state_dict().items()})

    # Keep the weights with the best validation perplexity (the tails of the training novels, never trained on):
    # on 0.8M tokens a 4M-parameter model starts to memorize after a few epochs.
    model.load_state_dict(best[2])
    print(f"best validation perplexity {best[0]:.2f} at step {best[1]}", flush=True)
    nll, count = window_nll(model, heldout_ids, args.context)
    ppl = math.exp(nll / count)
    train_nll, train_count = window_nll(model, train_ids, args.context, max_windows=heldout_ids.numel() // args.context)
    print(f"final held-out perplexity {ppl:.3f} over {count} tokens; train {math.exp(train_nll / train_count):.2f}")

    model.generation_config.bos_token_id = tokenizer.bos_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(out)
    summary = {
        "corpus": {
            "source": "Debian r-cran-janeaustenr (janeaustenr by Julia Silge, MIT; novels public domain)",
            "train": list(TRAIN_NOVELS),
            "heldout": HELDOUT_NOVEL,
            "train_tokens": train_ids.numel(),
            "heldout_tokens": heldout_ids.numel(),
        },
        "model": {"parameters": n_params, "context": args.context, "vocab_size": len(tokenizer)},
        "training": {
            key: getattr(args, key)
            for key in (
                "steps",
                "batch",
                "lr",
                "warmup",
                "weight_decay",
                "attention_dropout",
                "val_fraction",
                "seed",
                "threads",
                "vocab_size",
            )
        }
        | {"minutes": round((time.perf_counter() - started) / 60, 1), "torch": torch.__version__},
        "heldout_eval": {
            "protocol": f"consecutive {args.context}-token windows of the held-out text, full forward, "
            f"positions 1..{args.context - 1} scored",
            "perplexity": round(ppl, 3),
            "tokens_scored": count,
            "train_perplexity_same_protocol": round(math.exp(train_nll / train_count), 3),
        },
        "checkpoint": {
            "selected_step": best[1],
            "validation_perplexity": round(best[0], 3),
            "validation": f"last {args.val_fraction:.0%} of each training novel, never trained on",
        },
        "loss_curve": curve,
        "validation_curve": evals,
    }
    (out / "training.json").write_text(json.dumps(summary, indent=1) + "\n")
    if args.heldout_out:
        Path(args.heldout_out).write_text(HELDOUT_HEADER + heldout)
    print(f"saved to {out}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--deb", help="path to r-cran-janeaustenr_*.deb (default: apt-get download it)")
    parser.add_argument("--out", default=str(ASSETS / "reference_model"), help="model folder to write")
    parser.add_argument(
        "--heldout-out", default=str(ASSETS / "persuasion.txt"), help="held-out text to write ('' to skip)"
    )
    parser.add_argument("--steps", type=int, default=1500)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--warmup", type=int, default=100)
    parser.add_argument("--weight-decay", type=float, default=0.1)
    parser.add_argument("--vocab-size", type=int, default=4096)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--log-every", type=int, default=50)
    parser.add_argument("--eval-every", type=int, default=200, help="steps between validation evaluations")
    parser.add_argument(
        "--val-fraction", type=float, default=0.05, help="tail of each training novel held for validation"
    )
    parser.add_argument("--attention-dropout", type=float, default=0.1)
    args = parser.parse_args(argv)
    train(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())

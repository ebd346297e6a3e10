"""The embedded reference model and held-out text: the offline default of the demo, harness, examples and tests.

A small Llama (4 layers, hidden 256, GQA 4 query / 2 KV heads, head_dim 64, RoPE, context 2048, about 4M
parameters, byte-level BPE vocabulary 4096) trained by ``scripts/train_reference_model.py`` on five Jane Austen
novels, then taught to use its context (copying, passkey retrieval); *Persuasion*, the sixth novel, is held out and
shipped as the reference text. Both are public domain; see the script for how the corpus was obtained and cleaned,
and ``training.json`` in the model folder for the loss curves, the measured targets and the held-out perplexity.

>>> from transformers import AutoModelForCausalLM, AutoTokenizer
>>> model = AutoModelForCausalLM.from_pretrained(reference_model_path())
>>> tokenizer = AutoTokenizer.from_pretrained(reference_model_path())
"""

from __future__ import annotations

import json
import math
from functools import lru_cache
from pathlib import Path

import torch

__all__ = [
    "reference_model_path",
    "reference_text",
    "reference_training_summary",
    "full_forward_nll",
    "full_forward_perplexity",
]

_ASSETS = Path(__file__).resolve().parent / "assets"
_TEXT_MARKER = "==========\n"


def reference_model_path() -> str:
    """Folder of the reference model: ``from_pretrained`` loads it offline (``HF_HUB_OFFLINE=1`` is fine)."""
    path = _ASSETS / "reference_model"
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"the reference model is missing from {path}; reinstall hf-kvcache")
    return str(path)


@lru_cache(maxsize=2)
def reference_text(with_header: bool = False) -> str:
    """The held-out text (Jane Austen's *Persuasion*, cleaned), about 464 KB of English prose.

    ``with_header=True`` keeps the provenance and licence note that precedes the text in the shipped file.
    """
    raw = (_ASSETS / "persuasion.txt").read_text(encoding="utf-8")
    return raw if with_header else raw.split(_TEXT_MARKER, 1)[1]


def reference_training_summary() -> dict:
    """``training.json`` of the reference model: corpus, hyperparameters, loss curve, held-out perplexity."""
    return json.loads((Path(reference_model_path()) / "training.json").read_text())


@torch.no_grad()
def full_forward_nll(
    model, input_ids: torch.Tensor, context: int, batch_size: int = 8, max_windows: int | None = None
) -> tuple[float, int]:
    """Total negative log-likelihood and scored-token count of a 1-D token stream, without a KV cache.

    The stream is cut into consecutive non-overlapping windows of ``context`` tokens (a last partial window is
    dropped); each window gets one full forward and its positions ``1 .. context-1`` are scored. This is the
    reference protocol of the held-out perplexity in ``training.json``.
    """
    if input_ids.dim() != 1:
        raise ValueError(f"input_ids must be a 1-D token stream, got shape {tuple(input_ids.shape)}")
    if context < 2:
        raise ValueError(f"context must be >= 2 tokens, got {context}")
    n_windows = input_ids.numel() // context
    if max_windows is not None:
        n_windows = min(n_windows, max_windows)
    if n_windows == 0:
        raise ValueError(f"the text has {input_ids.numel()} tokens, fewer than one window of context={context}")
    windows = input_ids[: n_windows * context].view(n_windows, context)
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    total, count = 0.0, 0
    for start in range(0, n_windows, batch_size):
        chunk = windows[start : start + batch_size].to(device)
        logits = model(input_ids=chunk).logits[:, :-1].float()
        targets = chunk[:, 1:]
        total += torch.nn.functional.cross_entropy(
            logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), reduction="sum"
        ).item()
        count += targets.numel()
    model.train(was_training)
    return total, count


def full_forward_perplexity(model, input_ids: torch.Tensor, context: int, **kwargs) -> float:
    """``exp(NLL / tokens)`` of :func:`full_forward_nll` (no cache: the model card's protocol)."""
    nll, count = full_forward_nll(model, input_ids, context, **kwargs)
    return math.exp(nll / count)

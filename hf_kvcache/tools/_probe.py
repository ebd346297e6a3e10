"""What the probes of a model's stored K/V share (``codebook_errors``, ``smooth_errors``): their common flags, and
one run on the held-out text's first tokens with one-line errors and an optional JSON copy of the result."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable

import torch


def add_common_flags(parser: argparse.ArgumentParser, tokens: int | None, tokens_help: str = "") -> None:
    """``--model``, ``--tokens`` (default ``tokens``; no such flag where ``tokens`` is None: a probe that derives how
    many it reads sets ``args.tokens`` itself), ``--threads`` and ``--json``."""
    parser.add_argument("--model", default="reference", help="smollm2, reference or a local folder")
    if tokens is not None:
        parser.add_argument("--tokens", type=int, default=tokens, help=tokens_help)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--json", help="also write the result here")


def run_probe(args: argparse.Namespace, check: Callable[[], None], measure, table: Callable[[dict], str]) -> int:
    """``check()`` the flags, load ``--model``, ``measure(model, ids)`` on the held-out text's first ``--tokens``
    tokens, print ``table(result)`` and write ``--json``; a ``ValueError`` is one line on stderr and exit code 2."""
    from ..reference import reference_text

    def on_text(model, tokenizer) -> dict:
        text = reference_text()[: 16 * args.tokens]  # enough characters for the tokens, not the whole novel
        return measure(model, tokenizer(text, return_tensors="pt").input_ids[:, : args.tokens])

    return run_model_probe(args, check, on_text, table)


def run_model_probe(args: argparse.Namespace, check: Callable[[], None], measure, table: Callable[[dict], str]) -> int:
    """:func:`run_probe` for a probe that reads no text: ``measure(model, tokenizer)``."""
    from ..models import load_model

    torch.set_num_threads(args.threads)
    try:
        check()
        result = measure(*load_model(args.model))
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(table(result))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0


def ratio_table(title: str, label: str, columns: dict[str, str], rows: dict[str, dict], base: str) -> str:
    """A markdown table under ``title``: one line per entry of ``rows`` (named in the ``label`` column), each of
    ``columns`` (key -> header) as its value and its ratio to row ``base``'s."""
    lines = [title, "", f"| {label} | " + " | ".join(columns.values()) + " |", "|---" * (len(columns) + 1) + "|"]
    for name, row in rows.items():  # no ratio to a base of 0 (an exact cache)
        cells = [f"{row[c]:.4g}" + (f" ({row[c] / rows[base][c]:.2f}x)" if rows[base][c] else "") for c in columns]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)

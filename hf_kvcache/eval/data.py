"""Texts to evaluate on, by ``--dataset`` spec.

* ``reference`` (default): the embedded held-out text (Jane Austen's *Persuasion*), offline.
* ``wikitext``: wikitext-2-raw-v1, test split, through ``datasets``.
* ``pg19``: the PG-19 test split (``deepmind/pg19``), through ``datasets`` (long books, for stream evaluation).
* a local ``.txt`` file (read as is) or ``.jsonl`` file (the ``text`` field of each line, or ``path.jsonl:field``).
* ``hf:NAME[:CONFIG]:SPLIT:FIELD``: any ``datasets`` dataset, e.g. ``hf:wikitext:wikitext-103-raw-v1:test:text``.

Records are joined with blank lines, as the wikitext perplexity recipes do.
"""

from __future__ import annotations

import json
from pathlib import Path

__all__ = ["DATASET_HELP", "check_dataset", "hub_offline", "load_text"]

DATASET_HELP = "reference (default), wikitext, pg19, a .txt / .jsonl[:field] path, or hf:NAME[:CONFIG]:SPLIT:FIELD"


def hub_offline() -> bool:
    """Whether the Hugging Face hub is switched off (``HF_HUB_OFFLINE=1`` / ``HF_DATASETS_OFFLINE=1``)."""
    import os

    return any(
        os.environ.get(v, "").lower() in ("1", "true", "yes", "on") for v in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")
    )


def _hub_parts(spec: str) -> tuple[str, str | None, str, str] | None:
    """``(name, config, split, field)`` of a hub dataset spec, None for a local one."""
    if spec == "wikitext":
        return "wikitext", "wikitext-2-raw-v1", "test", "text"
    if spec == "pg19":
        return "deepmind/pg19", None, "test", "text"
    if spec.startswith("hf:"):
        parts = spec[3:].split(":")
        if len(parts) == 3:
            return parts[0], None, parts[1], parts[2]
        if len(parts) == 4:
            return parts[0], parts[1], parts[2], parts[3]
        raise ValueError(f"--dataset {spec!r}: expected hf:NAME[:CONFIG]:SPLIT:FIELD")
    return None


def _local_parts(spec: str) -> tuple[Path, str | None]:
    path, _, field = spec.partition(".jsonl:")
    if field:
        path += ".jsonl"
    return Path(path).expanduser(), field or None


def check_dataset(spec: str | None) -> None:
    """Raise ``ValueError`` for a ``--dataset`` that cannot work, before any model is loaded."""
    if spec in (None, "", "reference") or _hub_parts(spec) is not None:
        return
    file, _ = _local_parts(spec)
    if not file.is_file():
        raise ValueError(f"--dataset {spec!r} is neither a known name nor an existing file; use {DATASET_HELP}")


def _from_datasets(name: str, config: str | None, split: str, field: str) -> str:
    try:
        import datasets
    except ImportError as err:
        raise ImportError("this --dataset needs the datasets package: pip install 'hf-kvcache[eval]'") from err
    hint = "use --dataset reference (offline) or a local .txt / .jsonl file"
    try:
        data = datasets.load_dataset(name, config, split=split)
    except Exception as err:  # datasets raises many kinds (ConnectionError, FileNotFoundError, DatasetNotFoundError)
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        where = (
            "the hub is switched off (HF_HUB_OFFLINE=1) and it is not in the local cache" if hub_offline() else first
        )
        raise ValueError(f"cannot load dataset {name!r}: {where}; {hint}") from err
    if field not in data.column_names:
        raise ValueError(f"dataset {name!r} has no field {field!r}; its fields: {', '.join(data.column_names)}")
    return "\n\n".join(t for t in data[field] if t)


def load_text(spec: str | None = None) -> str:
    """The text named by ``spec`` (see the module docstring)."""
    if spec in (None, "", "reference"):
        from ..reference import reference_text

        return reference_text()
    hub = _hub_parts(spec)
    if hub is not None:
        return _from_datasets(*hub)
    check_dataset(spec)
    file, field = _local_parts(spec)
    if file.suffix == ".jsonl":
        key = field or "text"
        records = [json.loads(line) for line in file.read_text(encoding="utf-8").splitlines() if line.strip()]
        missing = [i for i, r in enumerate(records) if key not in r]
        if missing:
            raise ValueError(f"--dataset {spec!r}: line {missing[0] + 1} has no field {key!r}")
        return "\n\n".join(str(r[key]) for r in records)
    return file.read_text(encoding="utf-8")

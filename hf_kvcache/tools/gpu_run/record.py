"""What a stage of the GPU run writes: one JSON file per stage, rewritten after every item, so a stage stopped at any
point (its time box, a crash, the machine taken back) leaves everything it had measured."""

from __future__ import annotations

import json
import math
import os
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["StageRecord", "load_record", "write_json"]


def _plain(value):
    """JSON-safe: non-finite floats as strings (``"inf"``, ``"nan"``), tuples as lists, anything else as text."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return str(value)


def write_json(path: Path, data: dict) -> None:
    """Write ``data`` to ``path`` through a temporary file and a rename: a reader never sees half a file."""
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(_plain(data), indent=1) + "\n")
    os.replace(tmp, path)


def load_record(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return None


@dataclass
class StageRecord:
    """The results of one stage: ``items`` (one dict per measurement or check), ``notes`` (what the reader must know
    to read them: reduced sizes, fallbacks), ``errors`` (an item that failed, with its reason) and a ``status`` that
    is ``running`` until the stage ends (``done``, ``failed``, or ``timed out`` written by the runner)."""

    path: Path
    stage: str
    deadline: float  # time.monotonic() after which the stage starts no new item
    info: dict = field(default_factory=dict)
    items: list = field(default_factory=list)
    notes: list = field(default_factory=list)
    errors: list = field(default_factory=list)
    skipped: list = field(default_factory=list)
    status: str = "running"
    started: float = field(default_factory=time.monotonic)

    def left(self) -> float:
        """Seconds before the deadline."""
        return self.deadline - time.monotonic()

    def has_time(self, needed: float = 0.0) -> bool:
        return self.left() > needed

    def out_of_time(self, what: str, needed: float) -> bool:
        """Whether item ``what`` must be left out, ``needed`` seconds being more than the box has left (recorded as
        skipped, then)."""
        if self.has_time(needed):
            return False
        self.skip(what, "the stage's time box ran out")
        return True

    def add(self, item: dict) -> None:
        self.items.append(item)
        self.save()

    def note(self, text: str) -> None:
        self.notes.append(text)
        self.save()

    def error(self, what: str, err: BaseException) -> None:
        """A failed item: its name, the exception's one line, and the last frames (what a reader needs to fix it)."""
        frames = traceback.format_exception(type(err), err, err.__traceback__)
        self.errors.append({"item": what, "error": f"{type(err).__name__}: {err}", "trace": "".join(frames[-4:])})
        self.save()

    def skip(self, what: str, why: str) -> None:
        self.skipped.append({"item": what, "why": why})
        self.save()

    def save(self) -> None:
        write_json(
            self.path,
            {
                "stage": self.stage,
                "status": self.status,
                "elapsed_s": round(time.monotonic() - self.started, 3),
                "info": self.info,
                "notes": self.notes,
                "items": self.items,
                "errors": self.errors,
                "skipped": self.skipped,
            },
        )

    def finish(self, status: str = "done") -> None:
        self.status = status
        self.save()

"""The task registry of the harness: a dict, a decorator and one lookup function, like the cache registry.

A task is one module: an options dataclass (its fields become CLI flags, :mod:`hf_kvcache.eval.flags`), and a
:class:`Task` subclass registered by name that scores one cache, summarizes, tabulates and plots.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

__all__ = ["TASKS", "EvalData", "Task", "get_task", "register_task"]


@dataclass
class EvalData:
    """What every task reads: the model, its tokenizer and the dataset as one token stream."""

    model: torch.nn.Module
    tokenizer: object
    ids: torch.Tensor  # (N,) the dataset's tokens

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device


class Task:
    """One evaluation task. Subclasses set ``name``, ``options`` (the options dataclass) and ``summary_keys``."""

    name: str = ""
    options: type = object
    summary_keys: tuple[str, ...] = ()  # the headline numbers of ``run``'s ``summary``, for tables

    def tokens_needed(self, config) -> int:
        """Dataset tokens this task reads with ``config``."""
        raise NotImplementedError

    def run(self, data: EvalData, spec: str, config, progress=None) -> dict:
        """Score cache ``spec``: ``{"task": name, "summary": {...}, ...per-cell numbers}``."""
        raise NotImplementedError

    def finish(self, entries: list[dict]) -> None:
        """Add numbers relative to the first cache (the baseline) to every cache's result, in place."""

    def table(self, results: dict) -> str:
        """Markdown table of this task over every cache of a run (``results["results"][i][name]``)."""
        raise NotImplementedError

    def plots(self, results: dict, out: Path) -> list[str]:
        """PNG files written into ``out`` (names), none if matplotlib is missing."""
        return []


TASKS: dict[str, Task] = {}


def register_task(cls: type[Task]) -> type[Task]:
    if cls.name in TASKS:
        raise ValueError(f"task {cls.name!r} is already registered")
    TASKS[cls.name] = cls()
    return cls


def get_task(name: str) -> Task:
    if name not in TASKS:
        raise ValueError(f"unknown task {name!r}; known tasks: {', '.join(TASKS)}")
    return TASKS[name]

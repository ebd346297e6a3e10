"""The task registry of the harness: a dict, a decorator and one lookup function, like the cache registry.

A task is one class registered by name. It declares everything the harness needs to know about it, so that the
config, runner, report and CLI name no task:

- ``options``: a dataclass of its options; every field becomes a flag of ``hf-kvcache eval`` (``--field-name``,
  :mod:`hf_kvcache.eval.flags`) and a keyword of :class:`~hf_kvcache.eval.EvalConfig`. Each field needs
  ``metadata["help"]``. The options dataclass may define ``validate()`` (raise ``ValueError`` naming the flag).
- ``title`` (the heading of its table), ``summary_keys``, ``default`` (runs when ``--task`` is not given),
  ``shardable`` (``run`` takes ``shard=(index, count)`` and :meth:`Task.merge` adds the parts up).
- ``units`` (progress units of one cache's run), ``check_model`` (validation against the model's config, before the
  first document), ``describe`` (one sentence of the report's setup line), ``tokens_needed``, ``run``, ``finish``,
  ``table``, ``plots``.

Option names form one namespace (the flags of ``eval``). Two tasks may declare the same option only with the same
type and default: it is one flag that sets both (``--samples``: passkey documents and repeat passages per cell).
Any other clash, or a name the harness itself uses (``--model``, ``--caches``, ``--output``, ...), is a
``ValueError`` at :func:`register_task`, naming both owners.
"""

from __future__ import annotations

import dataclasses
import math
import typing
from dataclasses import dataclass
from pathlib import Path

import torch

__all__ = [
    "TASKS",
    "DocumentTask",
    "EvalData",
    "Task",
    "cache_for",
    "cells_agree",
    "check_lengths_fit",
    "count_range",
    "describe_forwards",
    "get_task",
    "model_context",
    "option_fields",
    "option_owners",
    "paired_difference",
    "pool_cells",
    "register_task",
    "wilson",
]


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
    """One evaluation task. Subclasses set ``name``, ``title``, ``options`` and implement ``tokens_needed``, ``run``
    and ``table``; every hook receives the run's :class:`~hf_kvcache.eval.EvalConfig` (``config.<option>`` reads
    any option, ``config.options[name]`` is this task's options dataclass)."""

    name: str = ""
    title: str = ""  # heading of this task's table in reports (default: the name)
    options: type | None = None  # the options dataclass (its fields become flags), None: no options
    summary_keys: tuple[str, ...] = ()  # the headline numbers of ``run``'s ``summary``, for tables
    default: bool = False  # in the run when --task is not given
    shardable: bool = False  # run(..., shard=(index, count)) scores a disjoint part; merge() adds parts up

    def validate(self, config) -> None:
        """Raise ``ValueError`` naming the flag of a bad option; needs no model. Default: ``options.validate()``."""
        check = getattr(config.options_of(self.name), "validate", None)
        if check is not None:
            check()

    def check_model(self, config, model_config) -> None:
        """Raise ``ValueError`` when an option does not fit the model (its ``PretrainedConfig``); called after the
        model loads and before the first document."""

    def units(self, config) -> int | None:
        """Progress units of one cache's run (``progress(n)`` calls add up to this), None: unknown."""
        return None

    def describe(self, config) -> str:
        """One sentence for the report's setup line: the protocol with these options."""
        return ""

    def tokens_needed(self, config) -> int:
        """Dataset tokens this task reads with ``config``."""
        raise NotImplementedError

    def run(self, data: EvalData, spec: str, config, progress=None) -> dict:
        """Score cache ``spec``: ``{"task": name, "summary": {...}, ...per-cell numbers}``."""
        raise NotImplementedError

    def run_caches(self, data: EvalData, specs: list[str], config, progress=None, **kwargs) -> list[dict]:
        """Score every cache of ``specs`` (``run``'s result for each, in order); ``kwargs`` go to ``run``. The runner
        calls this: a task whose documents start with a long prompt overrides it to prefill each document once and
        hand the prompt's K/V to every cache (:class:`~hf_kvcache.prefill.SharedPrefill`) unless
        ``config.separate_prefill``. Default: ``run`` per cache."""
        return [self.run(data, spec, config, progress, **kwargs) for spec in specs]

    def merge(self, parts: list[dict]) -> dict:
        """One cache's result from the results of disjoint shards (``shardable`` tasks only)."""
        raise NotImplementedError(f"task {self.name!r} is not shardable")

    def pool(self, parts: list[dict], configs: list) -> dict:
        """One cache's result from runs over other documents (``hf-kvcache report`` of several runs; ``configs``:
        each part's run config, an :class:`~hf_kvcache.eval.EvalConfig`): tasks whose results are cells of seeded
        documents pool them (:func:`pool_cells`); the others cannot."""
        raise ValueError(f"the {self.name} task's results cannot be pooled across runs; report its runs one at a time")

    def agrees(self, mine: dict, other: dict) -> bool:
        """Whether two runs' results of one cache measured the same: runs joined as one run (``hf-kvcache report`` of
        runs over the same documents) must agree on every cache they share, which checks that their documents were
        the same. Default: the ``summary_keys`` numbers, to float noise: another thread count or CPU sums in
        another order (SmolLM2's perplexity 46.03261 and 46.03224 on two machines of one kind, 8e-6 apart), where
        other documents move it by percents."""
        return all(math.isclose(mine["summary"][k], other["summary"][k], rel_tol=1e-4) for k in self.summary_keys)

    def finish(self, entries: list[dict]) -> None:
        """Add numbers relative to the first cache (the baseline) to every cache's result, in place."""

    def table(self, results: dict) -> str:
        """Markdown table of this task over every cache of a run (``results["results"][i][name]``)."""
        raise NotImplementedError

    def plots(self, results: dict, out: Path) -> list[str]:
        """PNG files written into ``out`` (names), none if matplotlib is missing."""
        return []


class DocumentTask(Task):
    """A task that goes document by document, handing each document's prefill to every cache (passkey, ruler,
    repeat): it implements ``run_caches``, and ``run`` is that for one cache."""

    def run(self, data: EvalData, spec: str, config, progress=None) -> dict:
        return self.run_caches(data, [spec], config, progress)[0]

    def run_caches(self, data: EvalData, specs: list[str], config, progress=None, **kwargs) -> list[dict]:
        raise NotImplementedError


def check_lengths_fit(flag: str, lengths, model_config, why: str = "") -> None:
    """Refuse, naming ``flag``, the document ``lengths`` longer than the model's trained context (``why``: a clause
    saying what must fit it)."""
    limit = model_context(model_config)
    beyond = [n for n in lengths if limit and n > limit]
    if beyond:
        raise ValueError(
            f"{flag} {','.join(map(str, beyond))}: longer than the model's context ({limit} tokens, "
            f"max_position_embeddings){why}"
        )


def cache_for(spec: str, model, prefill=None) -> tuple[object, bool]:
    """A fresh cache ``spec`` for ``model`` and whether it holds ``prefill`` (a
    :class:`~hf_kvcache.prefill.SharedPrefill`, or None): a cache that refuses a handed-over prefill (``ValueError``)
    is replaced by a fresh, empty one for the task to prefill itself."""
    from ...registry import make_cache

    cache = make_cache(spec, model)
    if prefill is None:
        return cache, False
    try:
        prefill.into(cache)
    except ValueError:
        return make_cache(spec, model), False
    return cache, True


TASKS: dict[str, Task] = {}

# Names the harness itself uses: the shared options of EvalConfig (added by hf_kvcache.eval.config), its attributes,
# and the CLI's own destinations. No task option may take one.
RESERVED: dict[str, str] = {"output": "the CLI", "command": "the CLI", "func": "the CLI"}


def describe_forwards(chunk: int, stepwise: bool) -> str:
    """How a scoring task feeds its scored tokens, for its ``describe``."""
    if chunk > 1:
        return f"{chunk} tokens per forward (chunked)"
    if stepwise:
        return "one token per forward"
    return "at decoding's logits, in as many tokens per forward as each cache gives them exactly"


def option_fields(cls: type | None) -> list[dataclasses.Field]:
    return list(dataclasses.fields(cls)) if cls is not None else []


def _default(f: dataclasses.Field):
    return f.default if f.default is not dataclasses.MISSING else f.default_factory()


def option_owners() -> dict[str, tuple[str, ...]]:
    """Each task option name and the registered tasks that declare it."""
    owners: dict[str, tuple[str, ...]] = {}
    for task in TASKS.values():
        for f in option_fields(task.options):
            owners[f.name] = (*owners.get(f.name, ()), task.name)
    return owners


def _check_options(cls: type[Task]) -> None:
    from ..flags import check_flag_type

    name, options = cls.name, cls.options
    if options is None:
        return
    if not dataclasses.is_dataclass(options):
        raise ValueError(f"task {name!r}: options must be a dataclass, got {options!r}")
    hints = typing.get_type_hints(options)
    for f in dataclasses.fields(options):
        if f.name in RESERVED:
            raise ValueError(f"task {name!r}: option {f.name!r} is taken by {RESERVED[f.name]}; rename it")
        if not f.metadata.get("help"):
            raise ValueError(f"task {name!r}: option {f.name!r} has no metadata['help'] (every flag says what it does)")
        if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            raise ValueError(f"task {name!r}: option {f.name!r} has no default")
        check_flag_type(f"task {name!r}: option {f.name!r}", hints[f.name])
        for other in TASKS.values():
            for g in option_fields(other.options):
                if g.name != f.name:
                    continue
                same = typing.get_type_hints(other.options)[g.name] == hints[f.name] and _default(g) == _default(f)
                if not same:
                    raise ValueError(
                        f"task {name!r}: option {f.name!r} is also an option of task {other.name!r} with another type "
                        f"or default ({hints[f.name]} = {_default(f)!r} vs {g.type} = {_default(g)!r}); one flag "
                        "sets both, so they must agree: rename one"
                    )


def register_task(cls: type[Task]) -> type[Task]:
    """Register a :class:`Task` subclass under ``cls.name`` (a class decorator); checks its options first."""
    if not (isinstance(cls, type) and issubclass(cls, Task)):
        raise ValueError(f"register_task takes a Task subclass, got {cls!r}")
    if not cls.name or not isinstance(cls.name, str) or "," in cls.name:
        raise ValueError(f"a task needs a name without commas, got {cls.name!r}")
    if cls.name in TASKS:
        raise ValueError(f"task {cls.name!r} is already registered")
    _check_options(cls)
    TASKS[cls.name] = cls()
    return cls


def reserve(names: dict[str, str]) -> None:
    """Reserve option names for the harness (``name -> who uses it``); checks the tasks registered so far."""
    RESERVED.update(names)
    for task in TASKS.values():
        for f in option_fields(task.options):
            if f.name in RESERVED:
                raise ValueError(f"task {task.name!r}: option {f.name!r} is taken by {RESERVED[f.name]}")


def model_context(model_config) -> int | None:
    """The model's trained context (``max_position_embeddings`` of its text config), when its config states one."""
    text = model_config.get_text_config(decoder=True) if hasattr(model_config, "get_text_config") else model_config
    value = getattr(text, "max_position_embeddings", None)
    return value if isinstance(value, int) and value > 0 else None


def get_task(name: str) -> Task:
    if name not in TASKS:
        raise ValueError(f"unknown task {name!r}; known tasks: {', '.join(TASKS)}")
    return TASKS[name]


def wilson(successes: float, n: int, z: float = 1.96) -> tuple[float, float]:
    """Wilson's 95% interval (``z`` = 1.96) of a success rate from ``successes`` of ``n`` all-or-nothing trials: the
    interval a retrieval cell of a few documents can carry (2 of 2 found: 34-100%)."""
    if n <= 0:
        raise ValueError(f"n must be at least 1, got {n}")
    rate = successes / n
    centre = (rate + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(rate * (1 - rate) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return max(0.0, centre - half), min(1.0, centre + half)


def pool_cells(name: str, parts: list[dict], configs: list, key, seeds, merge) -> list[dict]:
    """The cells of ``parts`` (one cache's results of a cell task from several runs, each run's config in ``configs``)
    in one list, in the order first seen. Two runs may hold the same cell (``key(cell)``) only over other documents:
    ``seeds(config, cell)``, the seeds of the documents the cell read in that run, must not meet (runs of other
    ``--seed`` values); such cells become one, ``merge(a, b)`` (the documents of ``a``, then ``b``: every cache's
    cells pool in the same order, so their documents stay paired). Where the seeds meet, ``ValueError``: the same
    documents would count twice."""
    pooled: dict[tuple, tuple[dict, set[int]]] = {}
    for part, config in zip(parts, configs, strict=True):
        for cell in part["cells"]:
            mine = set(seeds(config, cell))
            if key(cell) not in pooled:
                pooled[key(cell)] = cell, mine
                continue
            held, read = pooled[key(cell)]
            if read & mine:
                raise ValueError(
                    f"two runs hold the {name} cell {' '.join(map(str, key(cell)))} over the same documents; pool "
                    "runs of other cells (lengths, tasks, depths) or of other --seed values (with --seed S and N "
                    "documents a cell, a run reads each cell's documents S to S+N-1)"
                )
            pooled[key(cell)] = merge(held, cell), read | mine
    return [cell for cell, _ in pooled.values()]


def cells_agree(mine: dict, other: dict, key) -> bool:
    """Whether two results of a cell task hold the same cells (``key``) with the same per-document ``scores``."""

    def read(result: dict) -> list:
        return [(key(c), c.get("scores"), c.get("samples")) for c in result["cells"]]

    return read(mine) == read(other)


def count_range(counts) -> str:
    """Documents per cell (or length) as a table's note says it: ``"10"``, or ``"5-10"`` where pooled runs differ."""
    values = sorted(set(counts))
    return "-".join(map(str, dict.fromkeys([values[0], values[-1]]))) if values else "0"


def paired_difference(cells: list[dict], base_cells: list[dict], z: float = 1.96) -> tuple[float, float, float]:
    """A cache's average score minus the baseline's, in points, with its 95% interval: ``(difference, low, high)``.

    ``cells`` and ``base_cells``: the same cells of two caches, each with ``scores``, its documents' scores in
    [0, 1]. Every cache reads the same documents, so the difference is measured document by document (paired): the
    spread of the documents' own difficulty, which makes each cell's interval wide, cancels. The interval is the
    normal one of the average of the cells' mean per-document differences, never narrower than 3/N either way (N
    documents: where none of them disagrees, the share that would is below 3/N at 95%, the rule of three)."""
    pairs = zip(cells, base_cells, strict=True)  # the same cells, then the same documents in each
    diffs = [[a - b for a, b in zip(c["scores"], r["scores"], strict=True)] for c, r in pairs]
    count = sum(len(d) for d in diffs)
    if not count:
        raise ValueError("paired_difference needs the cells' per-document scores")
    mean = sum(sum(d) / len(d) for d in diffs) / len(diffs)
    variance = sum(_variance(d) / len(d) for d in diffs) / len(diffs) ** 2
    half = max(z * math.sqrt(variance), 3 / count)
    return 100 * mean, 100 * max(mean - half, -1.0), 100 * min(mean + half, 1.0)


def _variance(values: list[float]) -> float:
    """Sample variance; 1 (the most a difference in [-1, 1] can have, about) for a single value."""
    if len(values) < 2:
        return 1.0
    mean = sum(values) / len(values)
    return sum((v - mean) ** 2 for v in values) / (len(values) - 1)

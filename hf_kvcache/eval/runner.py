"""``hf-kvcache eval`` as a function: load a model and a text, run each task through each cache, collect the numbers.

``results.json`` (what :func:`run_eval` returns) keeps one entry per cache; under each task's name an entry holds
that task's result: ``task``, its per-cell numbers and a ``summary`` (the task's ``summary_keys``). Every task is
read from the registry (:mod:`hf_kvcache.eval.tasks`): this module names none.
"""

from __future__ import annotations

import copy
import math
import platform
import time

import torch

from .._validate import DTYPES, check_distinct
from .config import DEFAULT_CACHES, DEFAULT_TASKS, EvalConfig, ModelOptions
from .data import hub_offline, load_text
from .tasks import EvalData, get_task

__all__ = [
    "DEFAULT_CACHES",
    "DEFAULT_TASKS",
    "EvalConfig",
    "combine_runs",
    "join_runs",
    "load_configured_model",
    "merge_results",
    "pool_runs",
    "run_eval",
    "run_eval_distributed",
    "same_documents",
    "select_caches",
    "tokenize",
]


def resolve_device(config: ModelOptions) -> str:
    if config.device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if config.device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"--device {config.device}: CUDA is not available on this machine (use --device cpu)")
    return config.device


def quiet_loading() -> None:
    """Silence the progress bars of model loading (transformers, huggingface_hub) and of datasets."""
    import transformers

    transformers.utils.logging.disable_progress_bar()
    try:
        import huggingface_hub

        huggingface_hub.utils.disable_progress_bars()
    except (ImportError, AttributeError):
        pass
    try:
        import datasets

        datasets.disable_progress_bars()
    except ImportError:
        pass


def load_configured_model(config: ModelOptions):
    """``(model, tokenizer)`` as the harness's options ask (dtype, device or device_map, bitsandbytes weights),
    loaded by :func:`hf_kvcache.load_model`.

    Expected failures (no such folder, a hub id that cannot be fetched, the hub switched off) become one-line
    ``ValueError``s that say what to do."""
    from ..models import load_model as load
    from ..models import model_path

    if config.quiet:
        quiet_loading()
    path = model_path(config.model)
    kwargs: dict = {"dtype": DTYPES[config.dtype]}
    if config.load_in_8bit or config.load_in_4bit:
        from transformers import BitsAndBytesConfig

        kwargs["quantization_config"] = BitsAndBytesConfig(
            load_in_8bit=config.load_in_8bit, load_in_4bit=config.load_in_4bit
        )
    device = resolve_device(config)
    if config.device_map:
        kwargs["device_map"] = config.device_map
    elif config.load_in_8bit or config.load_in_4bit:
        kwargs["device_map"] = device
    try:
        return load(path, kwargs.pop("dtype"), device, **kwargs)
    except OSError as err:
        why = str(err).strip().splitlines()[0].rstrip(".") if str(err).strip() else type(err).__name__
        offline = " (HF_HUB_OFFLINE=1: only models already in the local cache load)" if hub_offline() else ""
        raise ValueError(
            f"cannot load --model {path!r}{offline}: {why}. Pass a local model folder, or omit --model for the "
            "default model (smollm2 when installed, else the embedded reference model)"
        ) from err


def tokenize(tokenizer, text: str) -> torch.Tensor:
    """A long text as one 1-D token stream (no max-length warning: tasks cut it later)."""
    saved = tokenizer.model_max_length
    tokenizer.model_max_length = int(1e30)
    try:
        return torch.tensor(tokenizer(text)["input_ids"], dtype=torch.long)
    finally:
        tokenizer.model_max_length = saved


def _versions() -> dict:
    import transformers

    from .. import __version__

    return {
        "hf_kvcache": __version__,
        "transformers": transformers.__version__,
        "torch": torch.__version__,
        "python": platform.python_version(),
    }


def _progress(total: int, label: str, quiet: bool):
    if quiet:
        return None, lambda: None
    from tqdm.auto import tqdm

    bar = tqdm(total=total, desc=label, leave=False)
    return bar.update, bar.close


def _non_finite(results: dict) -> list[str]:
    bad = []
    for entry in results["results"]:
        for name in results["config"]["task"]:
            for key, value in entry[name]["summary"].items():
                if not math.isfinite(value):
                    bad.append(f"{entry['cache']} {name} {key}={value}")
    return bad


def run_eval(config: EvalConfig, model=None, tokenizer=None, shard: tuple[int, int] = (0, 1)) -> dict:
    """Run every task of ``config`` through every cache; returns the ``results.json`` dictionary.

    ``shard=(index, count)``: the ``shardable`` tasks (perplexity) score only their part ``index`` of ``count``
    (perplexity: windows ``index, index + count, ...``; data parallelism); the other tasks run on shard 0 only.
    Results of all shards merge with :func:`merge_results`. Options that do not fit the model (a passkey document
    longer than its context) fail after the model loads, before the first document.
    """
    from ..models import default_model
    from ..registry import make_cache

    config.validate()
    if config.threads:
        torch.set_num_threads(config.threads)
    torch.manual_seed(config.seed)
    tasks = [get_task(name) for name in config.task]
    if shard[0] > 0:  # other shards run the shardable tasks only
        tasks = [t for t in tasks if t.shardable]
    if model is None:
        model, tokenizer = load_configured_model(config)
    for task in tasks:  # options against the model (its context), before any document
        task.check_model(config, model.config)
    for spec in config.caches:  # bad option values fail before any work
        make_cache(spec, model)
    limit = max(task.tokens_needed(config) for task in tasks)
    text = load_text(config.dataset)
    data = EvalData(model, tokenizer, tokenize(tokenizer, text[: 16 * limit])[:limit])
    entries = [{"cache": spec} for spec in config.caches]
    seconds = {}  # each task's wall time over every cache, documents and model forwards included
    for task in tasks:
        started = time.perf_counter()
        units = task.units(config)
        label = f"{task.name} x {len(entries)} caches"
        update, close = _progress(units * len(entries) if units is not None else None, label, config.quiet)
        kwargs = {"shard": shard} if task.shardable else {}
        for entry, result in zip(entries, task.run_caches(data, list(config.caches), config, update, **kwargs)):
            entry[task.name] = result
        close()
        task.finish([entry[task.name] for entry in entries])
        seconds[task.name] = round(time.perf_counter() - started, 1)
    results = {
        "config": config.as_dict()
        | {"model": config.model or default_model(), "dataset": config.dataset or "reference"}
        | {"task": [t.name for t in tasks]},
        "device": str(data.device),
        "versions": _versions(),
        "seconds": seconds,
        "results": entries,
    }
    bad = _non_finite(results)
    if bad:
        raise ValueError(f"the run produced non-finite results ({'; '.join(bad)}); nothing was written")
    return results


def merge_results(parts: list[dict]) -> dict:
    """Merge ``run_eval`` results of disjoint shards: each ``shardable`` task merges its parts (:meth:`Task.merge`;
    perplexity: NLL and token counts add up, no average of averages) and recomputes the numbers relative to the
    baseline. The other tasks come from the first shard, which ran them."""
    merged = parts[0] | {"results": [dict(entry) for entry in parts[0]["results"]]}
    for name in merged["config"]["task"]:
        task = get_task(name)
        if not task.shardable:
            continue
        for i, entry in enumerate(merged["results"]):
            entry[name] = task.merge([p["results"][i][name] for p in parts])
        task.finish([entry[name] for entry in merged["results"]])
    merged["processes"] = len(parts)
    return merged


def select_caches(results: dict, caches: list[str] | tuple[str, ...]) -> dict:
    """``results`` of ``run_eval`` with only ``caches``, in that order, the first the baseline: every task's numbers
    relative to the baseline (perplexity change, bytes ratio, second-copy change, points and their paired intervals)
    are recomputed against it, from what each cache measured. No model runs: every cache of a run read the same
    documents, so two caches that are not the run's first compare document by document as the first did.

    ``caches`` names caches of the run as its ``config["caches"]`` spells them, each once; a copy is returned."""
    run = _caches(results)
    if not caches:
        raise ValueError(f"--caches must name at least one cache of the run: {', '.join(run)}")
    unknown = [spec for spec in caches if spec not in run]
    if unknown:
        raise ValueError(f"--caches {unknown[0]!r} is not a cache of this run; it has: {', '.join(run)}")
    check_distinct("--caches", caches)
    chosen = copy.deepcopy([next(e for e in results["results"] if e["cache"] == spec) for spec in caches])
    for name in results["config"]["task"]:
        get_task(name).finish([entry[name] for entry in chosen])
    selected = results | {"config": results["config"] | {"caches": list(caches)}, "results": chosen}
    if list(caches) != run:  # the run's wall times are over all its caches, not this selection's
        selected.pop("seconds", None)
    return selected


# Settings that change no number a run measures: runs that differ in nothing else read the same documents.
_UNMEASURED = ("caches", "quiet", "threads")
# What pooled runs must share for their documents to count as one sample: the model, its precision, the text, the
# prompt's form and how many documents were answered together (padding moves a lossy cache's answers).
_POOLED_ALIKE = ("model", "dtype", "dataset", "chat_template", "generate_batch")


# Options added after runs were published whose default is what those runs did: a saved run without one ran at its
# default. (Not --stepwise nor --separate-prefill: the runs before them scored and prefilled otherwise.)
_ADDED_AT_DEFAULT = ("generate_batch",)


def _settings(run: dict) -> dict:
    """A run's config with the :data:`_ADDED_AT_DEFAULT` options its version did not have at their defaults, tuples
    as the lists of a run read from its JSON."""
    values = dict(run["config"])
    defaults = EvalConfig.from_dict(values).as_dict()
    values |= {k: defaults[k] for k in _ADDED_AT_DEFAULT if k in defaults and k not in values}
    return {k: list(v) if isinstance(v, tuple) else v for k, v in values.items()}


def same_documents(runs: list[dict]) -> bool:
    """Whether the ``run_eval`` results ``runs`` read the same documents: their configs are the same but for their
    caches and the settings that change no number (threads, progress bars)."""

    def documents(run: dict) -> dict:
        return {k: v for k, v in _settings(run).items() if k not in _UNMEASURED}

    return all(documents(run) == documents(runs[0]) for run in runs[1:])


def combine_runs(runs: list[dict], caches: list[str] | None = None) -> dict:
    """What ``hf-kvcache report`` shows of one or several ``run_eval`` results: runs over the same documents joined
    (:func:`join_runs`), then, where runs read other documents too, those joined groups pooled (:func:`pool_runs`;
    a cache run alone on a published run's documents at each of several lengths joins that run at each, and the
    lengths pool), then ``caches`` chosen (:func:`select_caches`; where groups pool, from each, which must have them
    all)."""
    if len(runs) > 1:
        for i, run in enumerate(runs, 1):
            if "runs" in run or "joined" in run:
                raise ValueError(
                    f"run {i} is a report of several runs (pooled or joined); report the runs it was made from"
                )
    groups: list[list[dict]] = []  # runs of the same documents, in the order their first run was given
    for run in runs:
        group = next((g for g in groups if same_documents([g[0], run])), None)
        if group is None:
            groups.append([run])
        else:
            group.append(run)
    joined = [join_runs(group) for group in groups]
    if len(joined) == 1:
        return joined[0] if caches is None else select_caches(joined[0], caches)
    if caches is not None:
        joined = [select_caches(run, caches) for run in joined]
    pooled = pool_runs(joined)
    if any(len(group) > 1 for group in groups):
        pooled["joined_groups"] = [[_caches(run) for run in group] for group in groups]
    return pooled


def join_runs(runs: list[dict]) -> dict:
    """``run_eval`` results over the same documents (:func:`same_documents`) as one run with every run's caches, in
    the order given: a cache run later on a published run's documents compares with that run's caches document by
    document, as if it had been one of them. A cache several runs hold is kept once, from the first, and must have
    measured the same in each (:meth:`Task.agrees`): the check that the documents, and the code that read them, were
    the same. ``results["joined"]`` keeps each run's caches."""
    if len(runs) < 2:
        return runs[0]
    if not same_documents(runs):
        raise ValueError("runs of other documents or settings cannot be joined; runs of other cells pool (pool_runs)")
    tasks = runs[0]["config"]["task"]
    entries = {entry["cache"]: entry for entry in runs[0]["results"]}
    for i, run in enumerate(runs[1:], 2):
        for entry in run["results"]:
            first = entries.setdefault(entry["cache"], entry)
            for name in tasks if first is not entry else ():
                if not get_task(name).agrees(first[name], entry[name]):
                    raise ValueError(
                        f"run {i} holds {entry['cache']!r} as an earlier run does, but its {name} numbers differ: "
                        "joined runs must have read the same documents with the same code (another version or device "
                        "measures otherwise)"
                    )
    joined = copy.deepcopy(list(entries.values()))
    for name in tasks:
        get_task(name).finish([entry[name] for entry in joined])
    head = {k: v for k, v in runs[0].items() if k != "seconds"}  # each run timed its own caches
    return head | {
        "config": runs[0]["config"] | {"caches": list(entries)},
        "joined": [_caches(run) for run in runs],
        "results": joined,
    }


def pool_runs(runs: list[dict]) -> dict:
    """Several ``run_eval`` results over other documents as one: each cache's retrieval cells (``ruler``,
    ``passkey``) from every run side by side, averages and paired intervals over all of them, so a comparison made in
    runs of one length each reads over every length; a cell two runs of other ``--seed`` values hold becomes one
    over both runs' documents. Every run must have the same tasks, each a task that pools (:meth:`Task.pool`), the
    same model, dtype, text and prompt form, and no document twice (:func:`~hf_kvcache.eval.tasks.base.pool_cells`).
    The caches are those every run has, in the first run's order; ``results["runs"]`` keeps each run's config."""
    if len(runs) < 2:
        return runs[0]
    tasks = runs[0]["config"]["task"]
    first_settings = _settings(runs[0])
    for run in runs[1:]:
        if run["config"]["task"] != tasks:
            other = ", ".join(run["config"]["task"])
            raise ValueError(f"runs of other tasks cannot pool: {', '.join(tasks)} and {other}")
        settings = _settings(run)
        for key in _POOLED_ALIKE:
            mine, first = settings.get(key), first_settings.get(key)
            if mine != first:
                raise ValueError(f"runs of another {key} cannot pool: {first!r} and {mine!r}")
    caches = [e["cache"] for e in runs[0]["results"] if all(e["cache"] in _caches(run) for run in runs[1:])]
    if not caches:
        raise ValueError("the runs have no cache in common to pool")
    configs = [EvalConfig.from_dict(run["config"]) for run in runs]
    entries = []
    for spec in caches:
        parts = [next(e for e in run["results"] if e["cache"] == spec) for run in runs]
        entries.append(
            {"cache": spec} | {name: get_task(name).pool([p[name] for p in parts], configs) for name in tasks}
        )
    for name in tasks:
        get_task(name).finish([entry[name] for entry in entries])
    pooled = {k: v for k, v in runs[0].items() if k not in ("seconds", "joined")}  # "runs" has each part's caches
    return pooled | {
        "config": runs[0]["config"] | {"caches": caches},
        "runs": [run["config"] for run in runs],
        "results": entries,
    }


def _caches(results: dict) -> list[str]:
    return [entry["cache"] for entry in results["results"]]


def run_eval_distributed(config: EvalConfig) -> dict | None:
    """``run_eval`` split across the processes of ``accelerate launch`` (perplexity windows round-robin); the merged
    results on the main process, None on the others. One process: plain ``run_eval``."""
    from accelerate import PartialState
    from accelerate.utils import gather_object

    # On CPU, accelerate only forms a process group when asked for CPU explicitly (gloo backend).
    state = PartialState(cpu=resolve_device(config) == "cpu")
    if state.num_processes == 1:
        return run_eval(config)
    overrides: dict = {"device": str(state.device)} if state.device.type == "cuda" and not config.device_map else {}
    if not state.is_main_process:
        overrides |= {"quiet": True}
    mine = config.replace(**overrides)
    part = run_eval(mine, shard=(state.process_index, state.num_processes))
    parts = gather_object([part])
    return merge_results(parts) if state.is_main_process else None

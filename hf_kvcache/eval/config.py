"""The harness's configuration: dataclasses validated before any model is loaded; the CLI flags are generated from
their fields (:mod:`hf_kvcache.eval.flags`).

:class:`EvalConfig` holds the options every run shares (:class:`ModelOptions`, :class:`RunOptions`) and one options
dataclass per registered task (:mod:`hf_kvcache.eval.tasks.base`), read from the task registry: no task is named
here. ``--task`` picks which tasks run.
"""

from __future__ import annotations

import copy
import dataclasses
import os
from dataclasses import dataclass, field
from pathlib import Path

from .._validate import DTYPES, check_bool, check_int
from .data import DATASET_HELP, check_dataset
from .tasks import TASKS, get_task
from .tasks.base import option_fields, reserve

__all__ = [
    "DEFAULT_CACHES",
    "DEFAULT_TASKS",
    "EvalConfig",
    "ModelOptions",
    "RunOptions",
    "check_model",
    "default_tasks",
]

# Sized for the real model on one CPU thread (about 4 minutes with every default); the paged cache, lossless, is in
# the demo and the bench rather than here.
DEFAULT_CACHES = ("dynamic", "int8", "int4", "int2", "sink:window=256:sinks=4")


def default_tasks() -> tuple[str, ...]:
    """The registered tasks that run when ``--task`` is not given (``Task.default``), in registry order."""
    return tuple(name for name, task in TASKS.items() if task.default)


DEFAULT_TASKS = default_tasks()


def check_model(model: str | None) -> None:
    """A ``--model`` that is clearly a local path must exist (hub ids are checked when loading)."""
    from ..models import is_model_name

    if model is None or is_model_name(model):
        return
    local = model.startswith((os.sep, ".", "~")) or (os.sep in model and model.count("/") != 1)
    path = Path(model).expanduser()
    if local and not path.is_dir():
        raise ValueError(
            f"--model {model!r}: no such directory (a local model is a folder holding config.json; a hub id looks "
            "like org/name)"
        )
    if path.is_dir() and not (path / "config.json").is_file():
        raise ValueError(f"--model {model!r} is a directory without config.json, not a model folder")


@dataclass
class ModelOptions:
    """Which model, where and in which precision."""

    model: str | None = field(
        default=None,
        metadata={
            "help": "smollm2 (the real model, installed by scripts/setup.sh), reference (the embedded 4M model), a "
            "local folder or a hub id (default: smollm2 when installed, else reference)"
        },
    )
    device: str = field(default="auto", metadata={"help": "cpu, cuda, cuda:N or auto (cuda when available)"})
    dtype: str = field(default="float32", metadata={"help": "weights and K/V dtype", "choices": tuple(DTYPES)})
    device_map: str | None = field(
        default=None, metadata={"help": "'auto': accelerate splits the model across devices"}
    )
    load_in_8bit: bool = field(default=False, metadata={"help": "bitsandbytes 8-bit weights (with any KV cache)"})
    load_in_4bit: bool = field(default=False, metadata={"help": "bitsandbytes 4-bit weights (with any KV cache)"})
    threads: int | None = field(default=None, metadata={"help": "CPU threads (default: torch's choice)"})
    seed: int = field(default=0, metadata={"help": "seed of every random choice (documents, keys, prompts)"})
    quiet: bool = field(default=False, metadata={"help": "no progress bars (ours, the model loading's, datasets')"})

    def validate_model(self) -> None:
        check_model(self.model)
        if self.device not in ("auto", "cpu", "cuda") and not self.device.startswith("cuda:"):
            raise ValueError(f"--device must be cpu, cuda or auto, got {self.device!r}")
        if self.dtype not in DTYPES:
            raise ValueError(f"--dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if self.load_in_8bit and self.load_in_4bit:
            raise ValueError("--load-in-8bit and --load-in-4bit are exclusive")
        if self.device_map not in (None, "auto"):
            raise ValueError(f"--device-map must be 'auto', got {self.device_map!r}")
        if self.threads is not None:
            check_int("--threads", self.threads, 1)


@dataclass
class RunOptions:
    """What an evaluation run scores: which tasks, caches and text."""

    task: tuple[str, ...] = field(
        default_factory=default_tasks,
        metadata={"help": "tasks to run, comma-separated (the registered tasks)", "metavar": "TASKS"},
    )
    caches: tuple[str, ...] = field(
        default=DEFAULT_CACHES,
        metadata={"help": "make_cache specs, comma-separated; the first is the baseline of the change columns"},
    )
    dataset: str | None = field(default=None, metadata={"help": DATASET_HELP})
    separate_prefill: bool = field(
        default=False,
        metadata={
            "help": "prefill every document through each cache (by default a document's prompt runs once and its "
            "K/V go to every cache: the same cache states, one forward instead of one per cache)"
        },
    )
    stepwise: bool = field(
        default=False,
        metadata={
            "help": "score one token per forward (by default perplexity, repeat and stream take as many tokens per "
            "forward as each cache says give decoding's logits exactly: the same numbers to float rounding, fewer "
            "forwards)"
        },
    )

    def validate_run(self) -> None:
        from ..registry import check_spec

        if not self.task:
            raise ValueError("--task must name at least one task")
        for name in self.task:
            if name not in TASKS:
                raise ValueError(f"--task: unknown task {name!r}; known tasks: {', '.join(TASKS)}")
        if not self.caches:
            raise ValueError("--caches must name at least one cache")
        for spec in self.caches:
            check_spec(spec)
        check_dataset(self.dataset)
        check_bool("--separate-prefill", self.separate_prefill)
        check_bool("--stepwise", self.stepwise)


def _as_tuple(value):
    """A tuple option from Python code: a list becomes a tuple, one value a 1-tuple."""
    if isinstance(value, tuple):
        return value
    if isinstance(value, list):
        return tuple(value)
    return (value,)


def _coerced(cls, values: dict) -> dict:
    tuples = {f.name for f in dataclasses.fields(cls) if str(f.type).startswith("tuple")}
    return {k: _as_tuple(v) if k in tuples else v for k, v in values.items()}


_SHARED = (ModelOptions, RunOptions)


@dataclass(init=False)
class EvalConfig(RunOptions, ModelOptions):
    """Everything ``hf-kvcache eval`` takes: the shared options (model, run) and the options of every registered
    task, as keywords; only the tasks named in ``task`` run, and only their options are checked.

    A task's options read as attributes (``config.lengths``) or as that task's options dataclass
    (``config.options["passkey"]``). An option two tasks share (``samples``) sets both.

    >>> EvalConfig(task=("passkey",), lengths=(512,), caches=("dynamic", "sink:window=256")).validate()
    """

    options: dict = field(default_factory=dict)  # task name -> its options dataclass instance

    def __init__(self, **kwargs) -> None:
        shared = {f.name: f for cls in _SHARED for f in dataclasses.fields(cls)}
        for name, f in shared.items():
            value = kwargs.pop(name) if name in kwargs else f.default
            if value is dataclasses.MISSING:
                value = f.default_factory()
            object.__setattr__(self, name, value)
        for name in ("task", "caches"):
            object.__setattr__(self, name, _as_tuple(getattr(self, name)))
        object.__setattr__(self, "options", {})
        used = set()
        for task in TASKS.values():
            if task.options is None:
                continue
            mine = {f.name: kwargs[f.name] for f in option_fields(task.options) if f.name in kwargs}
            used |= set(mine)
            self.options[task.name] = task.options(**_coerced(task.options, mine))
        unknown = sorted(set(kwargs) - used)
        if unknown:
            raise TypeError(
                f"EvalConfig got unknown option(s) {', '.join(unknown)}: not a model or run option, nor an option "
                f"of a registered task ({', '.join(TASKS)})"
            )

    @classmethod
    def from_dict(cls, values: dict) -> EvalConfig:
        """The config of a saved ``results.json`` (keys no registered task knows are left out)."""
        known = {f.name for c in _SHARED for f in dataclasses.fields(c)}
        known |= {f.name for task in TASKS.values() for f in option_fields(task.options)}
        return cls(**{k: v for k, v in values.items() if k in known})

    def options_of(self, task: str):
        """The options dataclass of ``task`` (defaults for a task registered after this config was made)."""
        if task not in self.options:
            options = get_task(task).options
            if options is None:
                return None
            self.options[task] = options()
        return self.options[task]

    def __getattr__(self, name: str):
        if name.startswith("__") or "options" not in self.__dict__:
            raise AttributeError(name)
        for task in TASKS.values():
            if any(f.name == name for f in option_fields(task.options)):
                return getattr(self.options_of(task.name), name)
        raise AttributeError(f"EvalConfig has no option {name!r}")

    def __setattr__(self, name: str, value) -> None:
        owners = [
            o for o in self.__dict__.get("options", {}).values() if name in {f.name for f in option_fields(type(o))}
        ]
        if not owners:
            object.__setattr__(self, name, value)
        for options in owners:
            setattr(options, name, value)

    def replace(self, **changes) -> EvalConfig:
        """A copy with ``changes`` (any option names)."""
        new = copy.deepcopy(self)
        for name, value in changes.items():
            if not hasattr(new, name):
                raise TypeError(f"EvalConfig has no option {name!r}")
            setattr(new, name, value)
        return new

    def as_dict(self) -> dict:
        """The flat options of ``results.json``: model and run options, then the options of each task that runs."""
        flat = {f.name: getattr(self, f.name) for cls in _SHARED for f in dataclasses.fields(cls)}
        for name in self.task:
            if name in TASKS:
                flat |= dataclasses.asdict(self.options_of(name)) if self.options_of(name) is not None else {}
        return flat

    def validate(self) -> None:
        """Raise ``ValueError`` naming the flag of the first bad value; needs no model."""
        self.validate_model()
        self.validate_run()
        for name in self.task:
            get_task(name).validate(self)


# Task options may not take a shared option's name nor an attribute of EvalConfig (``config.<option>`` reads them).
reserve(
    {name: "EvalConfig" for name in dir(EvalConfig) if not name.startswith("_")}
    | {"options": "EvalConfig"}
    | {
        f.name: f"--{f.name.replace('_', '-')} (a model or run option)"
        for cls in _SHARED
        for f in dataclasses.fields(cls)
    }
)

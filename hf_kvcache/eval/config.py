"""The harness's configuration: dataclasses validated before any model is loaded; the CLI flags are generated from
their fields (:mod:`hf_kvcache.eval.flags`).

:class:`EvalConfig` composes the options every run shares (:class:`ModelOptions`, :class:`RunOptions`) with each
task's options dataclass, defined in that task's module; ``--task`` picks which tasks run.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from .._validate import DTYPES, check_int
from .data import DATASET_HELP, check_dataset
from .tasks import TASKS
from .tasks.passkey import PasskeyOptions
from .tasks.perplexity import PerplexityOptions
from .tasks.repeat import RepeatOptions
from .tasks.stream import StreamOptions

__all__ = ["DEFAULT_CACHES", "DEFAULT_TASKS", "EvalConfig", "ModelOptions", "RunOptions", "check_model"]

# Sized for the real model on 2 CPU cores (about 10 minutes with every default); the paged cache, lossless, is in
# the demo and the bench rather than here.
DEFAULT_CACHES = ("dynamic", "int8", "int4", "int2", "sink:window=256:sinks=4")
DEFAULT_TASKS = ("perplexity", "repeat", "passkey")


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
        default=DEFAULT_TASKS,
        metadata={"help": "tasks to run, comma-separated: perplexity, stream, passkey, repeat", "metavar": "TASKS"},
    )
    caches: tuple[str, ...] = field(
        default=DEFAULT_CACHES,
        metadata={"help": "make_cache specs, comma-separated; the first is the baseline of the change columns"},
    )
    dataset: str | None = field(default=None, metadata={"help": DATASET_HELP})

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


@dataclass
class EvalConfig(RepeatOptions, PasskeyOptions, StreamOptions, PerplexityOptions, RunOptions, ModelOptions):
    """Everything ``hf-kvcache eval`` takes: the shared options and the options of every task (only the tasks named
    in ``task`` run, and only their options are checked).

    >>> EvalConfig(task=("passkey",), lengths=(512,), caches=("dynamic", "sink:window=256")).validate()
    """

    def __post_init__(self) -> None:
        for name in ("task", "caches", "lengths", "depths", "distances"):
            value = getattr(self, name)
            if isinstance(value, (list, str)):  # a list from Python code, or one name
                setattr(self, name, (value,) if isinstance(value, str) else tuple(value))

    def validate(self) -> None:
        """Raise ``ValueError`` naming the flag of the first bad value; needs no model."""
        self.validate_model()
        self.validate_run()
        for name in self.task:
            getattr(self, f"validate_{name}")()

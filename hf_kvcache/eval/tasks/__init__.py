"""Evaluation tasks, one module each, registered by name (:mod:`hf_kvcache.eval.tasks.base`)."""

from .base import TASKS, EvalData, Task, get_task, register_task

# isort: off
# Import order is the order tasks are listed in: perplexity, stream, passkey, repeat.
from . import perplexity, stream, passkey, repeat  # noqa: F401, E402

# isort: on

__all__ = ["TASKS", "EvalData", "Task", "get_task", "register_task"]

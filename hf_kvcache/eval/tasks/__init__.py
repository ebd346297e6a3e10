"""Evaluation tasks, one module each, registered by name (:mod:`hf_kvcache.eval.tasks.base`)."""

from .base import TASKS, EvalData, Task, get_task, option_owners, register_task

# isort: off
# Import order is the order tasks are listed in (and the default run's order): perplexity, repeat, passkey, stream,
# ruler.
from . import perplexity, repeat, passkey, stream, ruler  # noqa: F401, E402

# isort: on

__all__ = ["TASKS", "EvalData", "Task", "get_task", "option_owners", "register_task"]

"""The evaluation harness: tasks through a cache (perplexity, stream, passkey, repeat), memory and speed, reports
(``pip install hf-kvcache[eval]``).

The core package never imports this subpackage.
"""

from pathlib import Path

from .bench import BenchConfig, run_bench
from .config import DEFAULT_CACHES, DEFAULT_TASKS, EvalConfig
from .data import load_text
from .report import format_bench_table, format_eval_table, load_results, write_bench_report, write_report
from .runner import (
    combine_runs,
    join_runs,
    load_configured_model,
    merge_results,
    pool_runs,
    run_eval,
    run_eval_distributed,
    same_documents,
    select_caches,
)
from .tasks import TASKS, get_task, register_task
from .tasks.passkey import PasskeyOptions, build_passkey_document
from .tasks.perplexity import PerplexityOptions, PerplexityResult, window_perplexity, windows
from .tasks.repeat import RepeatOptions, repeat_nll
from .tasks.stream import StreamOptions, StreamResult, stream_perplexity


def metric_path() -> str:
    """Folder of the ``evaluate`` metric module: ``evaluate.load(metric_path())`` (offline, no hub)."""
    return str(Path(__file__).resolve().parent / "metrics" / "kv_cache_perplexity")


__all__ = [
    "DEFAULT_CACHES",
    "DEFAULT_TASKS",
    "TASKS",
    "BenchConfig",
    "EvalConfig",
    "PasskeyOptions",
    "PerplexityOptions",
    "PerplexityResult",
    "RepeatOptions",
    "StreamOptions",
    "StreamResult",
    "build_passkey_document",
    "combine_runs",
    "format_bench_table",
    "format_eval_table",
    "get_task",
    "join_runs",
    "load_configured_model",
    "load_results",
    "load_text",
    "merge_results",
    "metric_path",
    "pool_runs",
    "register_task",
    "repeat_nll",
    "run_bench",
    "run_eval",
    "run_eval_distributed",
    "same_documents",
    "select_caches",
    "stream_perplexity",
    "window_perplexity",
    "windows",
    "write_bench_report",
    "write_report",
]

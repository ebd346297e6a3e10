"""The evaluation harness: perplexity through a cache, memory and speed, reports (``pip install hf-kvcache[eval]``).

The core package never imports this subpackage.
"""

from pathlib import Path

from .bench import run_bench
from .data import load_text
from .perplexity import PerplexityResult, StreamResult, stream_perplexity, window_perplexity, windows
from .report import format_bench_table, format_eval_table, write_bench_report, write_report
from .runner import DEFAULT_CACHES, EvalConfig, load_model, merge_results, run_eval, run_eval_distributed


def metric_path() -> str:
    """Folder of the ``evaluate`` metric module: ``evaluate.load(metric_path())`` (offline, no hub)."""
    return str(Path(__file__).resolve().parent / "metrics" / "kv_cache_perplexity")


__all__ = [
    "DEFAULT_CACHES",
    "EvalConfig",
    "PerplexityResult",
    "StreamResult",
    "format_bench_table",
    "format_eval_table",
    "load_model",
    "load_text",
    "merge_results",
    "metric_path",
    "run_bench",
    "run_eval",
    "run_eval_distributed",
    "stream_perplexity",
    "window_perplexity",
    "windows",
    "write_bench_report",
    "write_report",
]

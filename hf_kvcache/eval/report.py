"""Reports of an evaluation: markdown tables (through ``tabulate``), ``results.json``, ``report.md`` and PNG plots.

Each task formats, describes and plots its own results (:mod:`hf_kvcache.eval.tasks`); this module assembles them.
``results.json`` is written last and atomically (a temporary file renamed into place): an interrupted run leaves no
``results.json`` that looks complete.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

from .tables import markdown_table, mib, pyplot

__all__ = [
    "check_output",
    "format_bench_table",
    "format_eval_table",
    "load_results",
    "markdown_table",
    "render_saved_run",
    "write_bench_report",
    "write_report",
]


def check_output(output: str | Path, flag: str = "--output") -> Path:
    """Create the output folder and check that a file can be written there, before any work; ``ValueError`` naming
    ``flag`` otherwise."""
    out = Path(output).expanduser()
    try:
        out.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=out, prefix=".write-check-"):
            pass
    except OSError as err:
        why = err.strerror or type(err).__name__
        raise ValueError(f"{flag} {str(output)!r} cannot be written: {why}") from err
    return out


def write_atomic(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` through a temporary file in the same folder, renamed into place when complete."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _tasks(results: dict) -> list:
    from .tasks import get_task

    return [get_task(name) for name in results["config"]["task"]]


def format_eval_table(results: dict) -> str:
    """Markdown tables of ``run_eval`` results: one per task, each with a title line, one row per cache."""
    blocks = []
    for task in _tasks(results):
        blocks.append(f"**{task.title or task.name}**\n\n{task.table(results)}")
    seconds = results.get("seconds")  # runs saved before the harness timed its tasks have none
    if seconds:
        each = ", ".join(f"{name} {s:.0f} s" for name, s in seconds.items())
        blocks.append(f"Wall time {sum(seconds.values()):.0f} s: {each} (every cache, on {results['device']}).")
    return "\n\n".join(blocks)


def _setup_line(results: dict) -> str:
    from .config import EvalConfig

    cfg = results["config"]
    parts = [f"Device {results['device']}, dtype {cfg['dtype']}."]
    runs = results.get("runs") or [cfg]  # a pooled report: each run's documents
    groups = results.get("joined_groups")  # pooled sets of documents, each joined from runs of its own
    if groups:
        each = "; ".join(" + ".join(", ".join(caches) for caches in group) for group in groups)
        parts.append(
            f"Pooled from {len(runs)} sets of documents, each joined from runs of them (their caches: {each}):"
        )
    elif len(runs) > 1:
        parts.append(f"Pooled from {len(runs)} runs:")
    if results.get("joined"):  # a joined report: one set of documents, each run's caches
        each = "; ".join(", ".join(caches) for caches in results["joined"])
        parts.append(f"Joined from {len(results['joined'])} runs of the same documents (their caches: {each}).")
    for run in runs:
        config = EvalConfig.from_dict(run)
        parts += [line for task in _tasks(results) if (line := task.describe(config))]
    parts.append(
        "Peak memory is CUDA's max_memory_allocated; on CPU it is not measured (n/a). Versions: "
        + ", ".join(f"{k} {v}" for k, v in results["versions"].items())
        + "."
    )
    return " ".join(parts)


def write_report(results: dict, output: str | Path, command: str | None = None) -> list[str]:
    """Write the tasks' plots, ``report.md`` and last ``results.json`` into ``output``; returns the file names."""
    out = check_output(output)
    plots = [name for task in _tasks(results) for name in task.plots(results, out)]
    cfg = results["config"]
    lines = [f"# hf-kvcache eval: {cfg['model']} on {cfg['dataset']}", "", _setup_line(results), ""]
    if command:
        lines += ["```bash", command, "```", ""]
    lines += [format_eval_table(results), ""]
    lines += [f"![{p}]({p})" for p in plots]
    write_atomic(out / "report.md", "\n".join(lines) + "\n")
    write_atomic(out / "results.json", json.dumps(results, indent=1) + "\n")
    return ["results.json", "report.md", *plots]


def results_file(path: str | Path) -> Path:
    """The file :func:`load_results` reads for ``path``: ``path``, or the ``results.json`` of the folder it names."""
    file = Path(path).expanduser()
    return file / "results.json" if file.is_dir() else file


def load_results(path: str | Path) -> dict:
    """The ``results.json`` of an eval run from ``path``: that file, the ``--output`` folder holding it, or a run
    saved by ``scripts/build_results.py`` (``docs/results/NAME.json``, whose ``results`` it is; a saved report holds
    its joined or pooled run). ``ValueError`` naming ``path`` for anything else."""
    file = results_file(path)
    try:
        record = json.loads(file.read_text())
    except OSError as err:
        raise ValueError(f"results {str(path)!r} cannot be read: {err.strerror or type(err).__name__}") from err
    except json.JSONDecodeError as err:
        raise ValueError(f"results {str(path)!r} is not JSON ({err.msg}, line {err.lineno})") from err
    if isinstance(record, dict) and "kind" in record and "results" in record:  # a run (or a report) saved for the docs
        if record["kind"] not in ("eval", "report"):
            raise ValueError(f"results {str(path)!r} holds a {record['kind']} run; only eval runs have these tables")
        record = record["results"]
    if not (isinstance(record, dict) and isinstance(record.get("results"), list) and "config" in record):
        raise ValueError(f"results {str(path)!r} is not an eval run's results.json (hf-kvcache eval --output DIR)")
    return record


def format_bench_table(bench: dict) -> str:
    """Markdown table of ``run_bench`` rows, with decode speed relative to the first cache at each context, and the
    budget search's table when there is one."""
    from .bench import BUDGET_RESOLUTION

    rows, first = [], {}
    for r in bench["rows"]:
        base = first.setdefault(r["context"], r["decode_tokens_per_s"])
        rows.append(
            [
                str(r["context"]),
                r["cache"],
                f"{1000 * r['ttft_s']:.1f}",
                f"{r['decode_tokens_per_s']:.1f}",
                f"{r['decode_tokens_per_s'] / base:.2f}",
                f"{100 * r['spread']:.0f}%",
                f"{r['cache_bytes']:,}",
                mib(r["peak_memory_bytes"]),
            ]
        )
    headers = ["context", "cache", "TTFT ms", "decode tok/s", "x first", "spread", "cache bytes", "peak memory"]
    lines = [markdown_table(headers, rows)]
    if bench.get("max_context"):
        budget = bench["memory_budget_bytes"] / 2**30
        found = [
            [
                spec,
                f"{r['measured']:,}" + (" (all of the trained context)" if r["capped"] else ""),
                f"{r['planned']:,}",
                f"{r['measured'] / r['planned']:.2f}" if r["planned"] else "n/a",
            ]
            for spec, r in bench["max_context"].items()
        ]
        lines += [
            "",
            f"Largest context whose generation peaks within {budget:.2f} GiB, found by running (to "
            f"{BUDGET_RESOLUTION} tokens), next to `hf-kvcache plan` (weights + KV, no reserve):",
            "",
            markdown_table(["cache", "measured", "planned", "measured / planned"], found),
        ]
    return "\n".join(lines)


def write_bench_report(bench: dict, output: str | Path) -> list[str]:
    """``bench.json``, ``bench.md`` and ``bench.png`` (decode speed and cache bytes versus context)."""
    out = Path(output)
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench.json").write_text(json.dumps(bench, indent=1) + "\n")
    (out / "bench.md").write_text(format_bench_table(bench) + "\n")
    written = ["bench.json", "bench.md"]
    plt = pyplot()
    if plt is None:
        return written
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    for spec in dict.fromkeys(r["cache"] for r in bench["rows"]):
        rows = [r for r in bench["rows"] if r["cache"] == spec]
        contexts = [r["context"] for r in rows]
        left.plot(contexts, [r["decode_tokens_per_s"] for r in rows], marker="o", label=spec)
        memory = [r["peak_memory_bytes"] or r["cache_bytes"] for r in rows]
        right.plot(contexts, [m / 2**20 for m in memory], marker="o", label=spec)
    left.set_xlabel("context tokens")
    left.set_ylabel("decode tokens/s")
    right.set_xlabel("context tokens")
    right.set_ylabel("peak memory (MiB)" if bench["rows"][0]["peak_memory_bytes"] else "cache MiB")
    for ax in (left, right):
        ax.set_xscale("log", base=2)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "bench.png", dpi=120)
    plt.close(fig)
    return [*written, "bench.png"]


def render_saved_run(record: dict) -> str:
    """Markdown for a saved run of the CLI: the command that produced it, then its table(s).

    ``record`` is what ``scripts/build_results.py`` saves under ``docs/results/``: ``{"command": ..., "kind":
    "eval" | "bench", "results": <results.json or bench.json>}``. The docs build checks that every results region of
    a page equals this rendering, so the pages cannot drift from the harness output they quote.
    """
    lines = ["```bash", record["command"], "```", ""]
    if record["kind"] == "bench":
        lines.append(format_bench_table(record["results"]))
    else:
        lines.append(format_eval_table(record["results"]))
    return "\n".join(lines)

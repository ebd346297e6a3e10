"""Reports of an evaluation: a markdown table, ``results.json``, ``report.md`` and PNG plots."""

from __future__ import annotations

import json
from pathlib import Path

__all__ = [
    "format_bench_table",
    "format_eval_table",
    "format_stream_table",
    "render_saved_run",
    "write_bench_report",
    "write_report",
]


def _fmt(value, spec: str, none: str = "n/a") -> str:
    return none if value is None else format(value, spec)


def format_eval_table(results: dict) -> str:
    """Markdown table of ``run_eval`` results, one row per cache."""
    lines = [
        "| cache | perplexity | change | tokens scored | cache bytes | bytes/token | x baseline | decode tok/s | "
        "peak memory |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results["results"]:
        peak = _fmt(r["peak_memory_bytes"] and r["peak_memory_bytes"] / 2**20, ".0f") + (
            " MiB" if r["peak_memory_bytes"] else ""
        )
        lines.append(
            f"| {r['cache']} | {r['perplexity']:.3f} | {100 * r['perplexity_change']:+.2f}% | {r['tokens_scored']:,} | "
            f"{r['cache_bytes']:,} | {r['bytes_per_token']:.0f} | {_fmt(r['bytes_ratio'], '.3f')} | "
            f"{r['decode_tokens_per_s']:.1f} | {peak} |"
        )
    return "\n".join(lines)


def format_stream_table(results: dict) -> str | None:
    """Markdown table of perplexity per bucket of positions, one column per cache (None without a stream)."""
    streams = [(r["cache"], r["stream"]) for r in results["results"] if "stream" in r]
    if not streams:
        return None
    size = streams[0][1]["bucket_size"]
    n = max(len(s["perplexity"]) for _, s in streams)
    lines = ["| positions | " + " | ".join(c for c, _ in streams) + " |", "|---|" + "---|" * len(streams)]
    for i in range(n):
        cells = [f"{s['perplexity'][i]:.2f}" if i < len(s["perplexity"]) else "" for _, s in streams]
        lines.append(f"| {i * size}-{(i + 1) * size - 1} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _plots(results: dict, out: Path) -> list[str]:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    rows = results["results"]
    names = [r["cache"] for r in rows]
    written = []
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    left.bar(names, [r["perplexity"] for r in rows], color="tab:blue")
    left.set_ylabel("perplexity")
    left.set_ylim(min(r["perplexity"] for r in rows) * 0.98, max(r["perplexity"] for r in rows) * 1.01)
    right.bar(names, [r["bytes_per_token"] for r in rows], color="tab:orange")
    right.set_ylabel("cache bytes per token")
    for ax in (left, right):
        ax.tick_params(axis="x", rotation=30)
        for label in ax.get_xticklabels():
            label.set_horizontalalignment("right")
    fig.suptitle(f"{results['config']['model']} on {results['config']['dataset']}")
    fig.tight_layout()
    fig.savefig(out / "perplexity_bytes.png", dpi=120)
    plt.close(fig)
    written.append("perplexity_bytes.png")
    streams = [(r["cache"], r["stream"]) for r in rows if "stream" in r]
    if streams:
        fig, ax = plt.subplots(figsize=(8, 4))
        for name, s in streams:
            centers = [(i + 0.5) * s["bucket_size"] for i in range(len(s["perplexity"]))]
            ax.plot(centers, s["perplexity"], marker=".", label=name)
        ax.set_xlabel("position in the stream")
        ax.set_ylabel(f"perplexity per {streams[0][1]['bucket_size']} positions")
        ax.set_yscale("log")
        ax.legend()
        fig.tight_layout()
        fig.savefig(out / "perplexity_vs_position.png", dpi=120)
        plt.close(fig)
        written.append("perplexity_vs_position.png")
    return written


def write_report(results: dict, output: str | Path, command: str | None = None) -> list[str]:
    """Write ``results.json``, ``report.md`` and the plots into ``output``; returns the file names."""
    out = Path(output)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(results, indent=1) + "\n")
    plots = _plots(results, out)
    cfg = results["config"]
    lines = [
        f"# hf-kvcache eval: {cfg['model']} on {cfg['dataset']}",
        "",
        f"Device {results['device']}, dtype {cfg['dtype']}; windows of {cfg['context']} tokens, {cfg['prefill']} "
        f"prefilled, then scored {cfg['chunk']} token(s) per forward through the cache; text cut to "
        f"{cfg['max_tokens']} tokens. Versions: " + ", ".join(f"{k} {v}" for k, v in results["versions"].items()) + ".",
        "",
    ]
    if command:
        lines += ["```bash", command, "```", ""]
    lines += [format_eval_table(results), ""]
    stream = format_stream_table(results)
    if stream:
        lines += [f"Long stream of {cfg['stream_tokens']} tokens through one cache, perplexity per bucket:", "", stream]
        lines.append("")
    lines += [f"![{p}]({p})" for p in plots]
    (out / "report.md").write_text("\n".join(lines) + "\n")
    return ["results.json", "report.md", *plots]


def format_bench_table(bench: dict) -> str:
    """Markdown table of ``run_bench`` rows, with decode speed relative to the first cache at each context."""
    lines = [
        "| context | cache | TTFT ms | decode tok/s | x first | spread | cache bytes | peak memory |",
        "|---|---|---|---|---|---|---|---|",
    ]
    first: dict[int, float] = {}
    for r in bench["rows"]:
        base = first.setdefault(r["context"], r["decode_tokens_per_s"])
        peak = f"{r['peak_memory_bytes'] / 2**20:.0f} MiB" if r["peak_memory_bytes"] else "n/a"
        lines.append(
            f"| {r['context']} | {r['cache']} | {1000 * r['ttft_s']:.1f} | {r['decode_tokens_per_s']:.1f} | "
            f"{r['decode_tokens_per_s'] / base:.2f} | {100 * r['spread']:.0f}% | {r['cache_bytes']:,} | {peak} |"
        )
    if bench.get("max_context_estimate"):
        budget = bench["memory_budget_bytes"] / 2**30
        lines.append("")
        lines.append(f"Largest context within {budget:.1f} GiB (linear estimate from the measured peaks):")
        for spec, context in bench["max_context_estimate"].items():
            lines.append(f"- {spec}: {context:,} tokens" if context else f"- {spec}: n/a")
    return "\n".join(lines)


def write_bench_report(bench: dict, output: str | Path) -> list[str]:
    """``bench.json``, ``bench.md`` and ``bench.png`` (decode speed and cache bytes versus context)."""
    out = Path(output)
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench.json").write_text(json.dumps(bench, indent=1) + "\n")
    (out / "bench.md").write_text(format_bench_table(bench) + "\n")
    written = ["bench.json", "bench.md"]
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
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
        return "\n".join(lines)
    results = record["results"]
    stream = format_stream_table(results)
    if stream:
        lines += [stream, "", "The windows part of the same run:", ""]
    lines.append(format_eval_table(results))
    return "\n".join(lines)

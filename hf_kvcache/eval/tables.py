"""The small formatting helpers every task's table and plot use: a leaf module (it imports no task), so the tasks do
not import the report that imports them."""

from __future__ import annotations

__all__ = ["markdown_table", "mib", "pyplot"]


def markdown_table(headers: list[str], rows: list[list]) -> str:
    """A GitHub-style markdown table (cells are used as given: format numbers before)."""
    from tabulate import tabulate

    return tabulate(rows, headers=headers, tablefmt="github", disable_numparse=True)


def mib(nbytes: int | None) -> str:
    return "n/a" if not nbytes else f"{nbytes / 2**20:.0f} MiB"


def pyplot():
    """matplotlib's pyplot on the Agg backend, or None when matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt

"""Reading the markdown tables the CLI and the reports print (cells are padded, so tests look rows up by cell)."""

from __future__ import annotations


def table_rows(text: str) -> dict[str, list[str]]:
    """``{first cell: cells}`` of every markdown table row in ``text`` (separator rows skipped)."""
    rows = {}
    for line in text.splitlines():
        line = line.strip()
        if not line.startswith("|") or set(line) <= set("|-: "):
            continue
        cells = [cell.strip() for cell in line.strip("|").split("|")]
        rows.setdefault(cells[0], cells)
    return rows

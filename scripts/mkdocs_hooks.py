"""MkDocs hooks: keep the results regions of the pages equal to the harness output, and draw its plots.

A page region ``<!-- results:NAME -->`` must equal the rendering of ``docs/results/NAME.json`` (see
``scripts/build_results.py``, :mod:`hf_kvcache.tools.results`); the build stops otherwise. The plots of every
saved run are drawn at build time into ``results/NAME/*.png`` of the site, from the same files, so no generated
image is committed.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

from mkdocs.exceptions import PluginError
from mkdocs.structure.files import File

from hf_kvcache.tools.results import SAVED, stale_regions


def on_files(files, config):
    import json

    from hf_kvcache.eval.report import write_bench_report, write_report

    for saved in sorted(SAVED.glob("*.json")):
        record = json.loads(saved.read_text())
        with tempfile.TemporaryDirectory() as tmp:
            if record["kind"] == "bench":
                write_bench_report(record["results"], tmp)
            elif record["kind"] in ("eval", "report"):  # (bench-cpu and gpu-run runs have tables only)
                write_report(record["results"], tmp)
            for png in sorted(Path(tmp).glob("*.png")):
                files.append(File.generated(config, f"results/{saved.stem}/{png.name}", content=png.read_bytes()))
    return files


def on_page_markdown(markdown, page, config, files):
    try:
        stale = stale_regions(markdown)
    except FileNotFoundError as err:
        raise PluginError(f"{page.file.src_uri}: {err}") from err
    if stale:
        raise PluginError(
            f"{page.file.src_uri}: the results region(s) {', '.join(stale)} differ from docs/results/*.json; "
            "run `python scripts/build_results.py --write` (or --run NAME to measure again)"
        )
    return markdown

"""MkDocs hooks: keep the results regions of the pages equal to the harness output, and draw its plots.

A page region ``<!-- results:NAME -->`` must equal the rendering of ``docs/results/NAME.json`` (see
``scripts/build_results.py``, :mod:`hf_kvcache.tools.results`); the build stops otherwise. The plots of every
saved run that a page shows (``results/NAME/PLOT.png``) are drawn at build time into the site, from the same files,
so no generated image is committed; a plot a page shows that its run does not draw stops the build.
"""

from __future__ import annotations

import re
import tempfile
from pathlib import Path

from mkdocs.exceptions import PluginError
from mkdocs.structure.files import File

from hf_kvcache.tools.results import SAVED, stale_regions

# A plot a page shows: results/NAME/PLOT.png, NAME a saved run (docs/results/NAME.json).
_PLOT = re.compile(r"\bresults/([\w.-]+)/([\w.-]+\.png)\b")


def on_files(files, config):
    import json

    from hf_kvcache.eval.report import write_bench_report, write_report

    # Only the plots the pages show are drawn: drawing every saved run's took most of the build's time.
    shown: dict[str, set[str]] = {}
    for page in files.documentation_pages():
        for run, plot in _PLOT.findall(Path(page.abs_src_path).read_text(encoding="utf-8")):
            shown.setdefault(run, set()).add(plot)
    for stem, plots in sorted(shown.items()):
        saved = SAVED / f"{stem}.json"
        if not saved.is_file():
            raise PluginError(f"a page shows results/{stem}/ but there is no saved run {saved}")
        record = json.loads(saved.read_text())
        with tempfile.TemporaryDirectory() as tmp:
            if record["kind"] == "bench":
                write_bench_report(record["results"], tmp)
            elif record["kind"] in ("eval", "report"):  # (bench-cpu and gpu-run runs have tables only)
                write_report(record["results"], tmp)
            for plot in sorted(plots):
                png = Path(tmp) / plot
                if not png.is_file():
                    raise PluginError(f"a page shows results/{stem}/{plot}, which that run does not draw")
                files.append(File.generated(config, f"results/{stem}/{plot}", content=png.read_bytes()))
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

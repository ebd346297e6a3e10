"""The docs cannot drift from the code: snippets run, commands parse, results match the harness, the site builds.

- Every ```python block of every page (and of the README) runs, in page order, in one namespace per page. A block
  that must not run here (a GPU, a hub model) is preceded by ``<!-- snippet: skip REASON -->``.
- Every ``hf-kvcache ...`` command in a ```bash block parses with the real CLI parser; every
  ``python benchmarks|scripts|examples/X.py`` names a file that exists.
- The ``>>>`` examples in the package's docstrings pass as doctests.
- Results regions equal the harness output saved in ``docs/results/`` (``scripts/build_results.py``).
- ``mkdocs build --strict`` succeeds, and the home page and a cache page render in headless Chromium (skipped when
  Chromium is absent, unless ``HF_KVCACHE_REQUIRE_BROWSER=1``, which CI sets).
"""

from __future__ import annotations

import contextlib
import doctest
import functools
import http.server
import importlib
import io
import os
import pkgutil
import re
import shlex
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
PAGES = [*sorted(DOCS.rglob("*.md")), ROOT / "README.md"]
FENCE = re.compile(r"^```(?P<lang>[\w-]*)[^\n]*\n(?P<body>.*?)^```[ \t]*$", re.MULTILINE | re.DOTALL)
SKIP = re.compile(r"<!-- snippet: skip (?P<reason>[^>]*\S)\s*-->\s*$")

from hf_kvcache.tools import results as build_results  # noqa: E402


def blocks(page: Path, lang: str) -> list[tuple[int, str, str | None]]:
    """``(line, code, skip reason)`` of the page's fenced blocks in ``lang`` (snippet includes left out)."""
    text = page.read_text()
    found = []
    for m in FENCE.finditer(text):
        if m["lang"] != lang or m["body"].lstrip().startswith("--8<--"):
            continue
        before = text[: m.start()].rstrip("\n").rsplit("\n", 1)[-1]
        skip = SKIP.search(before)
        found.append((text.count("\n", 0, m.start()) + 1, m["body"], skip and skip["reason"]))
    return found


def _id(page: Path) -> str:
    return str(page.relative_to(ROOT))


PYTHON_PAGES = [p for p in PAGES if blocks(p, "python")]


def test_snippet_discovery_finds_the_pages():
    names = {_id(p) for p in PYTHON_PAGES}
    assert {"README.md", "docs/index.md", "docs/caches/quantized.md", "docs/evaluation.md"} <= names, names


@pytest.mark.parametrize("page", PYTHON_PAGES, ids=_id)
def test_python_snippets_run(page, monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.chdir(tmp_path)  # snippets that write files write here
    namespace: dict = {"__name__": "__snippet__"}
    ran = 0
    for line, code, skip in blocks(page, "python"):
        if skip:
            continue
        out = io.StringIO()
        try:
            with contextlib.redirect_stdout(out):
                # dont_inherit: a snippet runs as a user's script does, without this file's __future__ imports
                exec(compile(code, f"{_id(page)}:{line}", "exec", dont_inherit=True), namespace)
        except Exception as err:
            raise AssertionError(f"{_id(page)}, block at line {line} failed: {err!r}\n{code}") from err
        ran += 1
    assert ran, f"{_id(page)}: every python block is skipped"


def _commands(page: Path) -> list[tuple[int, str]]:
    """The command lines of the page's bash blocks, continuations joined and comments dropped."""
    found = []
    for line, code, _ in blocks(page, "bash") + blocks(page, "sh"):
        for i, cmd in enumerate(code.replace("\\\n", " ").splitlines()):
            cmd = cmd.split(" #", 1)[0].strip()
            if cmd and not cmd.startswith("#"):
                found.append((line + i + 1, cmd))
    return found


@pytest.mark.parametrize("page", [p for p in PAGES if _commands(p)], ids=_id)
def test_shell_commands_are_real(page):
    from hf_kvcache.cli import build_parser

    parser = build_parser()
    for line, cmd in _commands(page):
        words = shlex.split(cmd)
        where = f"{_id(page)}:{line}: {cmd}"
        if "hf_kvcache" in words and "-m" in words:  # accelerate launch ... -m hf_kvcache eval ...
            words = ["hf-kvcache", *words[words.index("hf_kvcache") + 1 :]]
        if words[0] == "hf-kvcache":
            try:
                parser.parse_args(words[1:])
            except SystemExit as err:
                raise AssertionError(f"{where}: the CLI rejects it") from err
        for word in words:
            if re.fullmatch(r"(benchmarks|scripts|examples)/[\w./-]+\.(py|sh)", word):
                assert (ROOT / word).is_file(), f"{where}: {word} does not exist"


def test_docstring_examples_pass():
    import hf_kvcache

    names = [m.name for m in pkgutil.walk_packages(hf_kvcache.__path__, "hf_kvcache.")]
    modules = [hf_kvcache] + [importlib.import_module(n) for n in names if not n.endswith("__main__")]
    finder, runner = doctest.DocTestFinder(), doctest.DocTestRunner(optionflags=doctest.ELLIPSIS)
    attempted = 0
    for module in modules:
        for test in finder.find(module, module.__name__):
            if test.examples:
                runner.run(test, out=lambda s: None)
                attempted += len(test.examples)
    result = runner.summarize(verbose=False)
    assert result.failed == 0, f"{result.failed} docstring example(s) failed (run python -m doctest on the module)"
    assert attempted >= 10, f"only {attempted} docstring examples found"


def test_results_regions_match_saved_harness_output():
    used = set()
    for page in PAGES:
        text = page.read_text()
        names = [name for name, _ in build_results.regions(text)]
        used.update(names)
        stale = build_results.stale_regions(text)
        assert not stale, f"{_id(page)}: regions {stale} differ; run python scripts/build_results.py --write"
    saved = {p.stem for p in build_results.SAVED.glob("*.json")}
    assert used and used <= saved, f"regions without a saved run: {used - saved}"
    # GPU runs are saved by the GPU run's renderer (hf_kvcache.tools.gpu_run.render --save), not by build_results
    saved = {name for name in saved if build_results.load_run(name)["kind"] != "gpu-run"}
    assert saved <= set(build_results.RUNS), f"saved runs no script produces: {saved - set(build_results.RUNS)}"
    for name in saved:
        record = build_results.load_run(name)
        assert record["command"] == build_results.command_of(name), name


def test_stale_region_is_detected():
    name = next(iter(build_results.RUNS))
    page = f"<!-- results:{name} -->\n| made up | numbers |\n<!-- /results -->\n"
    assert build_results.stale_regions(page) == [name]
    assert build_results.stale_regions(build_results.rewrite(page)) == []


def test_readme_links_to_the_docs_pages():
    readme = (ROOT / "README.md").read_text()
    links = set(re.findall(r"\]\(((?:docs|examples)/[^)#\s]+)", readme))
    for link in links:
        assert (ROOT / link).exists(), f"README links to {link}, which does not exist"
    nav_pages = {f"docs/{p}" for p in re.findall(r":\s*([\w/-]+\.md)\s*$", (ROOT / "mkdocs.yml").read_text(), re.M)}
    missing = nav_pages - links
    assert not missing, f"README does not link to the site pages {sorted(missing)}"


def test_every_example_is_on_the_examples_page():
    page = (DOCS / "examples.md").read_text()
    for script in sorted((ROOT / "examples").glob("*.py")):
        assert f'--8<-- "examples/{script.name}"' in page, f"docs/examples.md does not include {script.name}"


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    out = tmp_path_factory.mktemp("site")
    proc = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )
    assert proc.returncode == 0, f"mkdocs build --strict failed:\n{proc.stdout}\n{proc.stderr}"
    return out


def test_site_builds_strictly_with_every_page(site):
    nav = re.findall(r":\s*([\w/-]+)\.md\s*$", (ROOT / "mkdocs.yml").read_text(), re.M)
    assert len(nav) >= 10
    for page in nav:
        html = site / ("index.html" if page == "index" else f"{page}/index.html")
        assert html.is_file(), f"{page}.md was not rendered"
        assert "md-content" in html.read_text(), f"{page}.md has no Material layout"
    api = (site / "api" / "index.html").read_text()
    for name in ("QuantizedKVCache", "SlidingWindowKVCache", "PagedKVCache", "make_cache", "EvalConfig"):
        assert f'id="hf_kvcache.{name}"' in api or f'id="hf_kvcache.eval.{name}"' in api, name
    assert ":::" not in api
    for plot in (
        "eval-default/perplexity_bytes.png",
        "eval-stream/perplexity_vs_position.png",
        "eval-passkey/passkey_heatmap.png",
        "bench-cpu/bench.png",
    ):
        assert (site / "results" / plot).stat().st_size > 10_000, plot


def _chromium() -> str | None:
    return shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")


@pytest.mark.parametrize("page", ["", "caches/sliding-window/"], ids=["home", "sliding-window"])
def test_page_renders_in_headless_chromium(site, page, tmp_path):
    browser = _chromium()
    if browser is None:
        if os.environ.get("HF_KVCACHE_REQUIRE_BROWSER") == "1":
            pytest.fail("HF_KVCACHE_REQUIRE_BROWSER=1 but no chromium on PATH (apt-get install chromium)")
        pytest.skip("no chromium on PATH")
    from PIL import Image

    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(site))
    handler.log_message = lambda *a: None
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}/{page}"
    flags = [
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-quic",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        f"--user-data-dir={tmp_path / 'profile'}",
        "--virtual-time-budget=5000",
    ]
    try:
        name = page.strip("/").replace("/", "-") or "home"
        shot = Path(os.environ.get("HF_KVCACHE_SCREENSHOT_DIR", tmp_path)) / f"{name}.png"
        subprocess.run(
            [browser, *flags, "--window-size=1280,2000", f"--screenshot={shot}", url],
            check=True,
            capture_output=True,
            timeout=120,
        )
        dom = subprocess.run(
            [browser, *flags, "--dump-dom", url], check=True, capture_output=True, text=True, timeout=120
        ).stdout
    finally:
        server.shutdown()
    assert "<h1" in dom and "md-content" in dom, "the page did not render Material's layout"
    if page:
        assert "sliding.svg" in dom and "RoPE re-rotation" in dom
    else:
        assert "<table>" in dom and "QuantizedKVCache" in dom
    image = Image.open(shot).convert("RGB")
    assert image.size == (1280, 2000)
    colors = image.getcolors(maxcolors=1 << 20)
    assert colors is not None and len(colors) > 50, "the screenshot is (nearly) blank"


OPTION_TABLES = {
    "caches/quantized.md": "QuantizedKVCache",
    "caches/sliding-window.md": "SlidingWindowKVCache",
    "caches/paged.md": "PagedKVCache",
}


@pytest.mark.parametrize("page, cls", OPTION_TABLES.items())
def test_option_tables_follow_the_constructors(page, cls):
    """Each cache page's options table names every constructor argument, and each non-None default as the
    constructor has it (``"auto"``, ``8``, ``True``...)."""
    import inspect

    import hf_kvcache

    text = (DOCS / page).read_text()
    table = text[text.index("| argument | allowed | default | meaning |") :].split("\n\n", 1)[0]
    rows = {}
    for line in table.splitlines()[2:]:
        cells = [c.strip() for c in line.strip("|").split("|")]
        rows[cells[0].strip("`")] = cells[2]
    params = inspect.signature(getattr(hf_kvcache, cls)).parameters
    assert list(rows) == list(params), f"{page}: the table's arguments differ from {cls}'s"
    for name, p in params.items():
        if p.default is inspect.Parameter.empty or p.default is None:
            continue
        literal = f'"{p.default}"' if isinstance(p.default, str) else str(p.default)
        said = rows[name].replace("`", "")
        assert literal in said, f"{page}: {name}'s default is {literal}, the table says {said}"

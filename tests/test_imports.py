"""The package's import graph: no cycle, counting imports inside functions, and the layers in their order (the
storage formats above the kernels, never imported by them; the core never importing the harness)."""

from __future__ import annotations

import ast
from pathlib import Path

import hf_kvcache

ROOT = Path(hf_kvcache.__file__).parent


def _module_names() -> dict[str, Path]:
    names = {}
    for path in ROOT.rglob("*.py"):
        parts = ["hf_kvcache", *path.relative_to(ROOT).with_suffix("").parts]
        if parts[-1] == "__init__":
            parts.pop()
        names[".".join(parts)] = path
    return names


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The package's modules ``name`` imports anywhere in its body (functions included): ``from x import y`` counts
    as ``x.y`` where that is a module, else ``x``."""
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = ".".join(package[: len(package) - node.level + 1]) if node.level else ""
            module = ".".join(x for x in (base, node.module or "") if x)
            targets = [f"{module}.{a.name}" if f"{module}.{a.name}" in modules else module for a in node.names]
        else:
            continue
        found.update(t for t in targets if t in modules and t != name)
    return found


def _graph() -> dict[str, set[str]]:
    modules = _module_names()
    return {name: _imports(name, path, modules) for name, path in modules.items()}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan's algorithm)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in graph:
        if v not in index:
            visit(v)
    return found


def test_the_package_has_no_import_cycle():
    assert _cycles(_graph()) == []


def test_the_cycle_finder_finds_one():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_layers_import_downward_only():
    """The kernels import nothing from the formats (they see one contract type); neither imports the caches, the
    layers or the harness; the core never imports the harness (eval) or the tools."""
    graph = _graph()

    def under(prefix: str) -> set[str]:
        return {m for m in graph if m == prefix or m.startswith(prefix + ".")}

    def reaches(sources: set[str], targets: set[str]) -> list[tuple[str, str]]:
        return sorted((s, t) for s in sources for t in graph[s] if t in targets)

    kernels, formats = under("hf_kvcache.kernels"), under("hf_kvcache.formats")
    upper = under("hf_kvcache.layers") | under("hf_kvcache.caches") | under("hf_kvcache.eval")
    assert reaches(kernels, formats | upper) == []
    assert reaches(formats, upper) == []
    core = kernels | formats | under("hf_kvcache.layers") | under("hf_kvcache.caches")
    assert reaches(core, under("hf_kvcache.eval") | under("hf_kvcache.tools")) == []


def test_the_recorded_release_is_pyproject_s():
    """Saved caches and the harness's results record hf_kvcache.__version__: it is the version pyproject.toml
    releases."""
    import tomllib

    pyproject = tomllib.loads((ROOT.parent / "pyproject.toml").read_text())
    assert hf_kvcache.__version__ == pyproject["project"]["version"]

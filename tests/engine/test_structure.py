"""The engine's shape, read from the source: the core has no import circle (imports under
TYPE_CHECKING and inside functions count: a circle there still ties the modules together), no
class in the engine package is over 300 lines, and `Engine` (the step loop) is at most 200."""

from __future__ import annotations

import ast
from pathlib import Path

import engines  # noqa: F401 - puts tests/ on the path
from test_layering import ROOT, imported_modules, module_name

CORE = ROOT / "hypic_core"


def import_graph(root: Path) -> dict[str, set[str]]:
    """module -> the modules of the same tree it imports (a `from a.b import c` of a module c counts as a.b.c)."""
    files = {module_name_under(p, root): p for p in root.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for mod, path in files.items():
        deps = set()
        for _, name in imported_modules(path.read_text(), mod, path.name == "__init__.py"):
            while name and name not in files:
                name = name.rpartition(".")[0]
            if name and name != mod:
                deps.add(name)
        graph[mod] = deps
    return graph


def module_name_under(path: Path, root: Path) -> str:
    return module_name(path) if root == CORE else ".".join(path.relative_to(root.parent).with_suffix("").parts)


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle per strongly connected component of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def class_lengths(root: Path) -> dict[str, int]:
    out = {}
    for path in root.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                out[f"{path.relative_to(ROOT)}:{node.name}"] = node.end_lineno - node.lineno + 1
    return out


def test_the_cycle_check_finds_a_circle(tmp_path):
    pkg = tmp_path / "hypic_core" / "engine"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from .b import B\n")
    (pkg / "b.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .a import A\n")
    (pkg / "c.py").write_text("from . import a\n")
    assert cycles(import_graph(tmp_path / "hypic_core")) == [["hypic_core.engine.a", "hypic_core.engine.b"]]


def test_the_core_has_no_import_circle():
    assert cycles(import_graph(CORE)) == []


def test_no_engine_class_is_over_300_lines_and_the_engine_is_at_most_200():
    lengths = class_lengths(CORE / "engine")
    assert {name: n for name, n in lengths.items() if n > 300} == {}
    assert lengths["hypic_core/engine/engine.py:Engine"] <= 200

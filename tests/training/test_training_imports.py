"""The training package's import graph: no module imports one that imports it back (lazy imports
inside functions included), and reuse training stays below the gateway (never app/ or bench/)."""

from __future__ import annotations

import ast

from helpers import ROOT


def _module(path) -> str:
    return ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")


def _imports(path) -> set[str]:
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.add(node.module)
            out |= {f"{node.module}.{a.name}" for a in node.names}
    return out


def _graph() -> dict[str, set[str]]:
    files = {_module(p): p for p in (ROOT / "training").rglob("*.py")}
    return {m: {i for i in _imports(p) if i in files and i != m} for m, p in files.items()}


def test_no_training_module_imports_one_that_imports_it_back():
    graph = _graph()
    cycles = []

    def visit(node, stack):
        for nxt in graph[node]:
            if nxt in stack:
                cycles.append(stack[stack.index(nxt):] + [nxt])
            elif len(stack) < 12:
                visit(nxt, stack + [nxt])

    for start in graph:
        visit(start, [start])
    assert not cycles, f"import cycles: {sorted({' -> '.join(c) for c in cycles})}"


def test_reuse_training_imports_neither_the_gateway_nor_the_benchmarks():
    for path in (ROOT / "training" / "reuse").rglob("*.py"):
        bad = sorted(i for i in _imports(path) if i.split(".")[0] in ("app", "bench"))
        assert not bad, f"{path.relative_to(ROOT)} imports {bad}"

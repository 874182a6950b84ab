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


def test_the_installed_hypic_command_reaches_the_training_package(tmp_path):
    """`hypic tune` from the installed console script, run outside the repository: the training package is
    installed with the project (pyproject.toml's packages), so the command gets as far as checking its
    options (a 2 naming --data), never a ModuleNotFoundError."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    hypic = Path(sys.executable).with_name("hypic")
    assert hypic.is_file(), f"{hypic} missing: the project is not installed in this environment"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    proc = subprocess.run([str(hypic), "tune", "--out", str(tmp_path / "run"), "--data", "nowhere"], cwd=tmp_path,
                          env=env, capture_output=True, text=True, timeout=300)
    assert "ModuleNotFoundError" not in proc.stderr, proc.stderr[-2000:]
    assert proc.returncode == 2 and "--data" in proc.stderr, (proc.returncode, proc.stderr[-2000:])

"""The engine's shape, read from the source: the core has no import circle (imports under
TYPE_CHECKING and inside functions count: a circle there still ties the modules together), no
class in hypic_core is over 300 lines, and `Engine` (the step loop) is at most 200."""

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


def test_no_core_class_is_over_300_lines_and_the_engine_is_at_most_200():
    lengths = class_lengths(CORE)
    assert "hypic_core/adapters/base.py:ModelAdapter" in lengths  # the scan reaches past engine/
    assert {name: n for name, n in lengths.items() if n > 300} == {}
    assert lengths["hypic_core/engine/engine.py:Engine"] <= 200


JOB_STATE = {"state", "part", "ticket", "entry"}


def job_state_writes(root: Path) -> list[str]:
    """file:line of every assignment to an attribute named like an entry job's state fields, outside
    the cache manager (the one place allowed to move a job between states) and the runner's own
    objects (`PartialEntry`) — recognised by the name the code gives a job: `job` or `cw`."""
    found = []
    for path in root.rglob("*.py"):
        if path.name == "cache_manager.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AugAssign) else []
            for target in targets:
                for t in (target.elts if isinstance(target, ast.Tuple) else [target]):
                    if (isinstance(t, ast.Attribute) and t.attr in JOB_STATE and isinstance(t.value, ast.Name)
                            and t.value.id in ("job", "cw")):
                        found.append(f"{path.relative_to(root)}:{node.lineno}")
    return found


def test_the_state_check_finds_a_write(tmp_path):
    (tmp_path / "builder.py").write_text("def f(job, entry):\n    job.state, x = 1, 2\n    job.entry = entry\n")
    (tmp_path / "cache_manager.py").write_text("def g(cw):\n    cw.state = 3\n")
    assert len(job_state_writes(tmp_path)) == 2


def test_only_the_cache_manager_moves_an_entry_job():
    assert job_state_writes(CORE / "engine") == []


CURSOR = "num_computed_tokens"


def cursor_writes(root: Path) -> list[str]:
    """file:line of every write to a `num_computed_tokens` attribute under `root` (an assignment, augmented
    or annotated, also inside a tuple or list target, or a `setattr` naming it)."""
    found = []

    def targets(node) -> list:
        if isinstance(node, ast.Assign):
            return list(node.targets)
        return [node.target] if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else []

    def flat(t) -> list:
        if isinstance(t, (ast.Tuple, ast.List)):
            return [x for e in t.elts for x in flat(e)]
        return flat(t.value) if isinstance(t, ast.Starred) else [t]

    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            hit = any(isinstance(t, ast.Attribute) and t.attr == CURSOR for target in targets(node) for t in flat(target))
            hit = hit or (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "setattr"
                          and len(node.args) > 1 and isinstance(node.args[1], ast.Constant) and node.args[1].value == CURSOR)
            if hit:
                found.append(f"{path.relative_to(root)}:{node.lineno}")
    return found


def test_the_cursor_check_finds_every_kind_of_write(tmp_path):
    (tmp_path / "a.py").write_text("def f(s, t):\n    s.num_computed_tokens = 1\n    t.x, t.num_computed_tokens = 2, 3\n"
                                   "    s.num_computed_tokens += 1\n    setattr(s, 'num_computed_tokens', 4)\n"
                                   "    [s.y, *s.num_computed_tokens] = 5, 6\n")
    (tmp_path / "b.py").write_text("def g(s):\n    return s.num_computed_tokens == 1\n")  # a read
    assert sorted(cursor_writes(tmp_path)) == ["a.py:2", "a.py:3", "a.py:4", "a.py:5", "a.py:6"]


def test_the_cursor_moves_in_one_place_the_update():
    """Issue 60: the executor reports what it advanced; only the update (output.py `move_cursors`) writes the
    cursor, the rejected draft rolled back beside it."""
    writes = cursor_writes(CORE) + [f"app/{w}" for w in cursor_writes(ROOT / "app")]
    assert {w.rsplit(":", 1)[0] for w in writes} == {"engine/output.py"}, writes
    assert len(writes) == 2, writes  # the advance and the rollback, in move_cursors

"""The layering rules (docs/architecture.md#rooms-by-role), read from the source:

- the engine core (`hypic_core/`) imports nothing from the gateway (`app`), retrieval, the web
  stack (FastAPI, Starlette, uvicorn), pydantic or FAISS, directly or through what it imports;
- inside the core, imports point only down the list of rooms (`CORE_ROOMS`), function-level ones
  included: a room imports its own modules and the rooms below it, never one above;
- the gateway's service (`app/service/`) never imports the HTTP side (`app/http/`) nor the web
  stack, and knows no HTTP: no `APIError`, `HTTPException` or response classes, no status code
  passed as `status`/`status_code`. It raises domain errors (app/service/errors.py), which
  app/http/errors.py alone maps to status codes.
"""

from __future__ import annotations

import ast
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CORE_FORBIDDEN = ("app", "retrieval", "fastapi", "starlette", "uvicorn", "pydantic", "pydantic_core", "pydantic_settings",
                  "faiss")
SERVICE_FORBIDDEN = ("app.http", "fastapi", "starlette", "uvicorn", "h11")
# The core's rooms, top to bottom (docs/architecture.md#rooms-by-role): each imports only itself and
# the rooms below it. "" is the package itself (hypic_core/__init__.py).
CORE_ROOMS = ("", "testing", "engine", "prefill_pool", "runner", "native", "models", "cache", "adapters", "algebra", "config",
              "errors")
HTTP_NAMES = {"APIError", "HTTPException", "JSONResponse", "Response", "StreamingResponse", "Request"}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_modules(source: str, module: str, is_package: bool) -> list[tuple[int, str]]:
    """(line, absolute module name) of every import in `source`, function-level ones included;
    `from . import x` counts as importing `<package>.x`."""
    package = module.split(".") if is_package else module.split(".")[:-1]
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            found.append((node.lineno, target))
            found += [(node.lineno, f"{target}.{alias.name}") for alias in node.names]
    return found


def forbidden_imports(source: str, module: str, is_package: bool, forbidden: tuple[str, ...]) -> list[str]:
    return [f"{module}:{line} imports {name}" for line, name in imported_modules(source, module, is_package)
            if any(name == f or name.startswith(f + ".") for f in forbidden)]


def room_of(module: str) -> str:
    """`hypic_core.engine.engine` -> "engine", `hypic_core.config.Mode` -> "config", `hypic_core` -> ""."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def upward_imports(source: str, module: str, is_package: bool) -> list[str]:
    """Imports of a core module that point up `CORE_ROOMS` (or into a room the list does not name)."""
    rank = {room: i for i, room in enumerate(CORE_ROOMS)}
    here = room_of(module)
    problems = [] if here in rank else [f"{module} is in no room of CORE_ROOMS"]
    for line, name in imported_modules(source, module, is_package):
        if name == "hypic_core" or not name.startswith("hypic_core."):
            continue  # the package itself (`from .. import x` also yields `hypic_core.x`), or outside the core
        there = room_of(name)
        if there not in rank:
            problems.append(f"{module}:{line} imports {name}, in no room of CORE_ROOMS")
        elif here in rank and there != here and rank[there] < rank[here]:
            problems.append(f"{module}:{line} imports {name} ({there}/ is above {here or 'hypic_core'})")
    return problems


def http_knowledge(source: str, module: str) -> list[str]:
    """Uses of HTTP in service code: HTTP error and response names, `status_code`, and an
    integer passed as `status=` / `status_code=`."""
    problems = []
    for node in ast.walk(ast.parse(source)):
        name = node.id if isinstance(node, ast.Name) else node.attr if isinstance(node, ast.Attribute) else None
        if name in HTTP_NAMES or name == "status_code":
            problems.append(f"{module}:{node.lineno} uses {name}")
        if isinstance(node, ast.keyword) and node.arg in ("status", "status_code") and isinstance(node.value, ast.Constant):
            problems.append(f"{module}:{node.value.lineno} passes {node.arg}={node.value.value!r}")
    return problems


def sources(folder: str) -> list[tuple[Path, str]]:
    files = sorted((ROOT / folder).rglob("*.py"))
    assert files, folder
    return [(path, path.read_text(encoding="utf-8")) for path in files]


def test_the_checks_find_what_they_look_for():
    """The checkers flag each kind of violation (so the rules below can fail)."""
    bad = textwrap.dedent("""
        from fastapi import Request
        from ..http.errors import APIError
        from .. import http

        def f():
            import faiss
            raise APIError(429, "busy", status_code=429)
        """)
    imports = forbidden_imports(bad, "app.service.pipeline", False, SERVICE_FORBIDDEN)
    assert [p.split(" imports ")[1] for p in imports] == ["fastapi", "fastapi.Request", "app.http.errors",
                                                        "app.http.errors.APIError", "app.http"]
    assert forbidden_imports(bad, "hypic_core.engine.engine", False, CORE_FORBIDDEN) == [
        "hypic_core.engine.engine:2 imports fastapi", "hypic_core.engine.engine:2 imports fastapi.Request",
        "hypic_core.engine.engine:7 imports faiss"]
    assert sorted(http_knowledge(bad, "m")) == ["m:8 passes status_code=429", "m:8 uses APIError"]
    ok = "from hypic_core.errors import InvalidRequestError\nfrom .errors import QueueFullError\nraise QueueFullError(3)\n"
    assert forbidden_imports(ok, "app.service.pipeline", False, SERVICE_FORBIDDEN) == [] and http_knowledge(ok, "m") == []


def test_the_room_check_finds_upward_imports():
    """Upward imports are flagged at module and function level, relative or absolute; its own room,
    rooms below and the package itself are not."""
    bad = textwrap.dedent("""
        from ..engine.sequence import Sequence
        from ..algebra.entry import SegmentEntry
        from .store import SegmentStore
        from .. import config

        def f():
            import hypic_core.prefill_pool
            from hypic_core.nowhere import x
        """)
    assert upward_imports(bad, "hypic_core.cache.tiered", False) == [
        "hypic_core.cache.tiered:2 imports hypic_core.engine.sequence (engine/ is above cache)",
        "hypic_core.cache.tiered:2 imports hypic_core.engine.sequence.Sequence (engine/ is above cache)",
        "hypic_core.cache.tiered:8 imports hypic_core.prefill_pool (prefill_pool/ is above cache)",
        "hypic_core.cache.tiered:9 imports hypic_core.nowhere, in no room of CORE_ROOMS",
        "hypic_core.cache.tiered:9 imports hypic_core.nowhere.x, in no room of CORE_ROOMS"]
    assert upward_imports(bad, "hypic_core.engine.engine", False) == [
        "hypic_core.engine.engine:9 imports hypic_core.nowhere, in no room of CORE_ROOMS",
        "hypic_core.engine.engine:9 imports hypic_core.nowhere.x, in no room of CORE_ROOMS"]
    assert upward_imports("", "hypic_core.newroom.x", False) == ["hypic_core.newroom.x is in no room of CORE_ROOMS"]


def test_core_imports_point_down_the_rooms():
    problems = []
    for path, source in sources("hypic_core"):
        problems += upward_imports(source, module_name(path), path.name == "__init__.py")
    assert problems == []


def test_the_core_imports_no_gateway_web_stack_pydantic_or_faiss():
    problems = []
    for path, source in sources("hypic_core"):
        problems += forbidden_imports(source, module_name(path), path.name == "__init__.py", CORE_FORBIDDEN)
    assert problems == []


def test_service_code_knows_no_http():
    problems = []
    for path, source in sources("app/service"):
        module = module_name(path)
        problems += forbidden_imports(source, module, path.name == "__init__.py", SERVICE_FORBIDDEN)
        problems += http_knowledge(source, module)
    assert problems == []


def test_importing_the_core_loads_none_of_them():
    """What the modules import in turn counts too: every module of the core imported in a fresh
    interpreter leaves the gateway, retrieval, FastAPI, pydantic and FAISS unloaded."""
    modules = [module_name(path) for path, _ in sources("hypic_core")]
    code = ("import sys\n" + "".join(f"import {m}\n" for m in modules) +
            f"print(sorted({{m.split('.')[0] for m in sys.modules}} & {set(CORE_FORBIDDEN)!r}))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "[]"


def documented_core_rooms() -> tuple[list[str], list[str]]:
    """(rooms in order, files named) of hypic_core/ in docs/architecture.md's "Rooms by role" block:
    a room's line starts two spaces in (`engine/` or `testing.py`, then what it holds), a deeper
    indent continues the room above."""
    import re

    block = (ROOT / "docs" / "architecture.md").read_text().split("## Rooms by role", 1)[1].split("```", 2)[1]
    lines = block.split("hypic_core/", 1)[1].splitlines()[1:]
    rooms, files, folder = [], [], ""
    for line in lines:
        if line and not line.startswith(" "):
            break  # the next top-level folder
        rest = line
        if re.match(r"  \S", line):
            names, rest = (re.split(r"\s{2,}", line.strip(), maxsplit=1) + [""])[:2]
            for name in names.split():
                rooms.append(name.rstrip("/").removesuffix(".py"))
                folder = name if name.endswith("/") else ""
                files += [] if folder else [name]
        files += [folder + w for w in re.findall(r"[\w.]+\.py\b", rest)] if folder else []
    return rooms, files


def test_the_documented_rooms_are_the_checked_ones_in_their_order():
    """docs/architecture.md lists the core's rooms top to bottom as CORE_ROOMS ranks them, and every
    file it names there exists."""
    rooms, files = documented_core_rooms()
    assert rooms == [r for r in CORE_ROOMS if r], rooms
    missing = [f for f in files if not (ROOT / "hypic_core" / f).is_file()]
    assert not missing, missing
    assert len(files) > 20, files

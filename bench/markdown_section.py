"""Benchmarks write their results into docs/benchmarks.md between `<!-- tag:begin -->` and `<!-- tag:end -->`."""

from __future__ import annotations

from pathlib import Path


def write_section(path: Path, section: str, tag: str) -> None:
    """Replace the <!-- tag:begin -->...<!-- tag:end --> block of `path` (or append it)."""
    text = path.read_text() if path.exists() else "# Benchmarks\n\nEvery number here was produced by the command printed beside it.\n"
    begin, end = f"<!-- {tag}:begin -->", f"<!-- {tag}:end -->"
    if begin in text and end in text:
        text = text[: text.index(begin)] + section + text[text.index(end) + len(end):]
    else:
        text = text.rstrip() + "\n\n" + section + "\n"
    path.write_text(text)

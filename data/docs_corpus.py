"""Build data/docs_corpus.jsonl, the default demo corpus: the project's own documentation.

    .venv/bin/python data/docs_corpus.py            # rewrites data/docs_corpus.jsonl from the pages below

Real English that ships with the repository under the project's license and that no model was
trained on, so a newcomer's first questions (README.md, "Try it") are about the gateway itself and
their answers can be checked against the pages. Each page is cut at its `## ` headings into one
document per section ({"id", "title", "text"}, titled "<page>: <section>"); the gateway chunks them
in the serving model's tokenizer when it ingests the file into an empty default index.

The file is a snapshot: the README's example questions were checked against it, so it is rebuilt
on purpose (then those questions are checked again), not on every docs edit.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "data" / "docs_corpus.jsonl"
# The pages a newcomer reads first. The rest stay out: the measurement pages' tables of numbers
# retrieve badly, and every page more is ingest time before the first serve is ready (the nine
# largest pages made 166 chunks, 45 s of ingest on 2 busy cores; these five make about a third).
PAGES = ("README.md", "docs/design.md", "docs/models.md", "docs/deploy.md", "docs/gpu.md")


def slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")[:60] or "section"


def sections(page: Path) -> list[dict[str, str]]:
    """`page` cut at its `## ` headings (outside code fences): the text before the first one is the page's introduction."""
    text = page.read_text(encoding="utf-8")
    lines = text.splitlines()
    page_title = next((line[2:].strip() for line in lines if line.startswith("# ")), page.stem)
    name = page.stem if page.name != "README.md" else "readme"
    found: list[dict[str, str]] = []
    heading, body, fenced = "Introduction", [], False

    def flush() -> None:
        content = "\n".join(body).strip()
        if len(content.split()) >= 20:  # a heading with a line under it says nothing on its own
            found.append({"id": f"{name}-{slug(heading)}", "title": f"{page_title}: {heading}", "text": content})

    for line in lines:
        if line.startswith("```"):
            fenced = not fenced
        if not fenced and line.startswith("## "):
            flush()
            heading, body = line[3:].strip(), []
        elif not line.startswith("# "):
            body.append(line)
    flush()
    return found


def build() -> list[dict[str, str]]:
    documents: list[dict[str, str]] = []
    seen: dict[str, int] = {}
    for relative in PAGES:
        for document in sections(ROOT / relative):
            count = seen.get(document["id"], 0)
            seen[document["id"]] = count + 1
            if count:
                document["id"] = f"{document['id']}-{count + 1}"
            documents.append({**document, "source": relative})
    return documents


def main() -> int:
    documents = build()
    with OUT.open("w", encoding="utf-8") as out:
        for document in documents:
            out.write(json.dumps(document, ensure_ascii=False) + "\n")
    print(f"wrote {OUT.relative_to(ROOT)}: {len(documents)} documents, {sum(len(d['text']) for d in documents)} characters",
          file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

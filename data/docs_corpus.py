"""Build data/docs_corpus.jsonl, the default demo corpus: the project's own documentation (its questions page).

    .venv/bin/python data/docs_corpus.py            # rewrites data/docs_corpus.jsonl from the pages below

Real English that ships with the repository under the project's license and that no model was
trained on, so a newcomer's first questions (README.md's Quickstart) are about the gateway itself and
their answers can be checked against the page. Each page is cut at its `## ` headings into one
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
# The questions page: one fact a sentence, which a 135M model answers from best. The hybrid's
# distillation sampled prompts from docs/*.md paragraphs (training/hybrid/generate.py); docs/faq.md was
# written after it, so no shipped model was trained on it, while the other pages were. README.md was
# never among those prompts, but it quotes the example questions with their answers, and with it in
# the index the model answered the port question with the seam's answer in `full` (the README's own
# example table, retrieved beside the FAQ): it stays out.
PAGES = ("docs/faq.md",)


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
        if len(content.split()) >= 8:  # a heading with a word or two under it says nothing on its own
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

"""Extract the documents of bench/faithfulness.py's prompts into bench/data/faithfulness_docs.jsonl.gz.

Two sources of real text that no model here was distilled or tuned on:

- `docstrings`: the held-out slice of the hybrid's docstring corpus (training/hybrid/data.py: CPython's
  standard-library docstrings and pydoc topics, PSF-2.0) that reuse training never sees:
  training/reuse/data.py `heldout_documents()` (one document in ten, by a hash of its origin). The held-out
  documents of one source file are joined in corpus order before they are cut into units, so long units
  exist; a paragraph sharing an 8-word run with a training document (a docstring repeated elsewhere) is dropped. The distilled hybrid shipped before reuse training was distilled on the whole corpus, these
  documents included; SmolLM2 may have read CPython's source in pretraining.
- `debian`: prose paragraphs of the README, FAQ and plain-text documentation files Debian packages install
  under /usr/share/doc (written by each package's authors), each unit with the licence its package's
  `copyright` file names (DEP-5 `License:` fields, the first three distinct ones; a free-form copyright file
  is named instead). The package's own copyright file says which of its licences covers its documentation.

Each unit joins consecutive paragraphs of one file (or one module's docstrings) up to ~230 words; units
under 60 words are dropped. The committed file is what the benchmark reads, so CI and machines without
/usr/share/doc get the same prompts:

    .venv/bin/python bench/data/make_faithfulness_docs.py   # rewrites bench/data/faithfulness_docs.jsonl.gz
"""

from __future__ import annotations

import gzip
import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
OUT = Path(__file__).resolve().parent / "faithfulness_docs.jsonl.gz"
UNIT_WORDS, MIN_WORDS = 230, 60
DEBIAN_DOC = Path("/usr/share/doc")
DEBIAN_PER_PACKAGE = 6  # units per package at most, so no one package's style dominates
DEBIAN_UNITS = 900


def _prose(paragraph: str) -> bool:
    """A paragraph of running text: mostly words, few symbols (not a table, code block or list of names)."""
    words = paragraph.split()
    if len(words) < 12:
        return False
    alpha = sum(bool(re.fullmatch(r"[A-Za-z][A-Za-z'’,.;:()-]*", w)) for w in words)
    symbols = sum(c in "{}[]<>|=$#*\\/_`~" for c in paragraph)
    return alpha / len(words) >= 0.8 and symbols / len(paragraph) < 0.02 and "http" not in paragraph


def _units(paragraphs: list[str]) -> list[str]:
    out, cur = [], []
    for p in paragraphs:
        cur.append(p)
        if sum(len(x.split()) for x in cur) >= UNIT_WORDS:
            out.append("\n\n".join(cur))
            cur = []
    if cur:
        out.append("\n\n".join(cur))
    return [u for u in out if len(u.split()) >= MIN_WORDS]


def docstring_units() -> list[dict]:
    sys.path.insert(0, str(ROOT))
    from training.hybrid.data import shingles
    from training.reuse.data import heldout_documents, training_documents

    trained: set = set()
    for _, text in training_documents():
        trained |= shingles(text)
    by_file: dict[str, list[str]] = {}
    for where, text in heldout_documents():
        key = where.split(":", 1)[0] if not where.startswith("pydoc_data.topics:") else where
        # a docstring repeated in a trained module (shared 8-word runs) is not unseen text: dropped
        by_file.setdefault(key, []).extend(p for p in text.split("\n\n") if not shingles(p) & trained)
    return [{"source": "docstrings", "where": key, "licence": "PSF-2.0", "text": unit}
            for key in sorted(by_file) for unit in _units(by_file[key])]


def _licences(package_dir: Path) -> str:
    try:
        text = (package_dir / "copyright").read_text(errors="replace")
    except OSError:
        return ""
    if not text.startswith("Format:"):  # free-form: no licence names to read reliably
        return f"free-form, see /usr/share/doc/{package_dir.name}/copyright"
    seen = list(dict.fromkeys(m.strip() for m in re.findall(r"^License:\s*(\S.*)$", text, re.M) if len(m) < 50))
    return ", ".join(seen[:3]) or f"see /usr/share/doc/{package_dir.name}/copyright"


def _read(path: Path) -> str:
    data = path.read_bytes()
    if path.suffix == ".gz":
        data = gzip.decompress(data)
    return data.decode("utf-8", errors="replace")


def debian_units() -> list[dict]:
    out = []
    for package_dir in sorted(p for p in DEBIAN_DOC.iterdir() if p.is_dir()):
        licence = _licences(package_dir)
        if not licence:
            continue
        files = sorted(f for f in package_dir.rglob("*") if f.is_file() and "examples" not in f.parts
                       and re.match(r"(?i)(readme|faq)|.*\.txt(\.gz)?$", f.name) and not f.name.startswith("changelog"))
        units = []
        for f in files:
            try:
                text = _read(f)
            except OSError:
                continue
            paras = [re.sub(r"\s*\n\s*", " ", p).strip() for p in re.split(r"\n\s*\n", text)]
            units += [(f, u) for u in _units([p for p in paras if _prose(p)])]
        out += [{"source": "debian", "where": str(f.relative_to(DEBIAN_DOC)), "licence": licence, "text": u}
                for f, u in units[:DEBIAN_PER_PACKAGE]]
    return out[:DEBIAN_UNITS]


def main() -> None:
    docs = docstring_units()
    debian = debian_units() if DEBIAN_DOC.is_dir() else []
    rows = docs + debian
    with gzip.open(OUT, "wt", encoding="utf-8", compresslevel=9) as f:
        for i, row in enumerate(rows):
            f.write(json.dumps({"id": f"{row['source']}-{i}", **row}, ensure_ascii=False) + "\n")
    longs = {s: sum(r["source"] == s and len(r["text"].split()) >= 200 for r in rows) for s in ("docstrings", "debian")}
    print(f"{OUT.relative_to(ROOT)}: {len(docs)} docstring units, {len(debian)} Debian units "
          f"(>= 200 words: {longs}), {OUT.stat().st_size} bytes")


if __name__ == "__main__":
    main()

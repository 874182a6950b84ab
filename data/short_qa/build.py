"""Build data/short_qa/ from data/real_qa/: short documents (~60 words, ~80 tokens), six per question.

    .venv/bin/python data/short_qa/build.py            # write questions.jsonl
    .venv/bin/python data/short_qa/build.py --preview  # print counts and one question, write nothing

Every real_qa passage is cut into documents of at most WORDS words at sentence ends (a sentence
longer than that is cut at a word); the text is the passage's own, only split. A question keeps
the one document of its passage that contains its answer (or an alias, ignoring case and
punctuation, as scoring does); a question whose answer no single document holds is left out.
Its other five documents are what a retriever would put beside it: the documents of its own
passage and of its real_qa distractor passages that contain neither the answer nor an alias,
the five most similar to the question by BM25 (k1 1.2, b 0.75, over every document of the set).
Each document carries its BM25 score; a prompt orders them as the gateway's prompter does
(ascending score, the best next to the question), so the gold document sits wherever its score
puts it, not always last.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
from collections import Counter
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(ROOT / "bench"))

from real_qa import load_passages, load_real_qa, normalize_answer  # noqa: E402

WORDS = 60  # words per document at most: ~80 SmolLM2 tokens of this English
DOCS = 6  # documents per question (top_k 6)
_SENTENCE = re.compile(r"(?<=[.!?:])\s+")


def split_passage(text: str, words: int = WORDS) -> list[str]:
    """`text` cut into documents of at most `words` words, at sentence ends where it can."""
    sentences: list[list[str]] = []
    for para in text.split("\n\n"):
        for s in _SENTENCE.split(para.strip()):
            w = s.split()
            while len(w) > words:
                sentences.append(w[:words])
                w = w[words:]
            if w:
                sentences.append(w)
    docs, cur = [], []
    for s in sentences:
        if cur and len(cur) + len(s) > words:
            docs.append(" ".join(cur))
            cur = []
        cur += s
    if cur:
        docs.append(" ".join(cur))
    return docs


def holds(text: str, answers) -> bool:
    t = f" {normalize_answer(text)} "
    return any(normalize_answer(a) and f" {normalize_answer(a)} " in t for a in answers)


def _terms(text: str) -> list[str]:
    return normalize_answer(text).split()


class BM25:
    def __init__(self, docs: list[str], k1: float = 1.2, b: float = 0.75):
        self.tf = [Counter(_terms(d)) for d in docs]
        self.len = [sum(c.values()) for c in self.tf]
        self.avg = sum(self.len) / len(self.len)
        df = Counter(t for c in self.tf for t in c)
        n = len(docs)
        self.idf = {t: math.log(1 + (n - m + 0.5) / (m + 0.5)) for t, m in df.items()}
        self.k1, self.b = k1, b

    def score(self, query: str, i: int) -> float:
        tf, s = self.tf[i], 0.0
        for t in set(_terms(query)):
            f = tf.get(t, 0)
            if f:
                s += self.idf[t] * f * (self.k1 + 1) / (f + self.k1 * (1 - self.b + self.b * self.len[i] / self.avg))
        return s


def build() -> list[dict]:
    passages = load_passages()
    pieces = {pid: split_passage(p["text"]) for pid, p in passages.items()}
    ids = [(pid, j) for pid in pieces for j in range(len(pieces[pid]))]
    index = {d: i for i, d in enumerate(ids)}
    bm25 = BM25([pieces[pid][j] for pid, j in ids])
    out = []
    for pair in load_real_qa():
        own = [j for j, d in enumerate(pieces[pair.passage_id]) if holds(d, pair.answers)]
        if len(own) != 1:
            continue
        gold = (pair.passage_id, own[0])
        pool = [(pid, j) for pid in (pair.passage_id, *pair.distractor_ids) for j in range(len(pieces[pid]))
                if (pid, j) != gold and not holds(pieces[pid][j], pair.answers)]
        scored = sorted(pool, key=lambda d: (-bm25.score(pair.question, index[d]), d))[: DOCS - 1]
        docs = [{"id": f"{pid}#{j}", "text": pieces[pid][j], "score": round(bm25.score(pair.question, index[(pid, j)]), 4)}
                for pid, j in [gold, *scored]]
        out.append({"id": pair.id, "question": pair.question, "answer": pair.answer, "aliases": list(pair.aliases),
                    "gold": f"{gold[0]}#{gold[1]}", "docs": docs})
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preview", action="store_true")
    args = ap.parse_args()
    rows = build()
    words = [len(d["text"].split()) for r in rows for d in r["docs"]]
    print(f"{len(rows)} questions, {len(words)} documents, {min(words)}-{max(words)} words (mean "
          f"{sum(words) / len(words):.1f})", file=sys.stderr)
    if args.preview:
        print(json.dumps(rows[0], indent=1))
        return
    with open(HERE / "questions.jsonl", "w", encoding="utf-8") as f:
        for r in rows:
            f.write(json.dumps(r, ensure_ascii=False) + "\n")


if __name__ == "__main__":
    main()

"""The real-text document-question set in data/real_qa/ (see its README.md): loading and scoring.

    from real_qa import load_real_qa, score, build_context

    pairs = load_real_qa()
    chunks, gold = build_context(pairs[0], n_chunks=5, seed=0)  # gold passage at a shuffled position
    em, f1 = score(prediction, pairs[0].answer, pairs[0].aliases)

Scoring is SQuAD-style: lowercase, punctuation and the articles a/an/the removed, whitespace
collapsed; exact match and token F1 are the best over the gold answer and its aliases.
"""

from __future__ import annotations

import json
import random
import re
import string
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

DEFAULT_ROOT = Path(__file__).resolve().parent.parent / "data" / "real_qa"


@dataclass(frozen=True)
class QAPair:
    id: str
    passage_id: str
    title: str
    passage: str  # the gold passage's text
    question: str
    answer: str
    aliases: tuple[str, ...]
    distractor_ids: tuple[str, ...]
    distractors: tuple[str, ...]  # texts of the distractor passages, same order as distractor_ids
    source: str
    licence: str

    @property
    def answers(self) -> tuple[str, ...]:
        return (self.answer, *self.aliases)


def _jsonl(path: Path) -> list[dict]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def load_passages(root: Path | str = DEFAULT_ROOT) -> dict[str, dict]:
    """passage id -> {"id", "title", "text", "source", "licence"}."""
    return {p["id"]: p for p in _jsonl(Path(root) / "passages.jsonl")}


def load_real_qa(root: Path | str = DEFAULT_ROOT) -> list[QAPair]:
    """Every question of `root`/questions.jsonl with its passage and distractor texts resolved."""
    root = Path(root)
    passages = load_passages(root)
    pairs = []
    for q in _jsonl(root / "questions.jsonl"):
        gold = passages[q["passage_id"]]
        pairs.append(QAPair(
            id=q["id"], passage_id=q["passage_id"], title=gold["title"], passage=gold["text"],
            question=q["question"], answer=q["answer"], aliases=tuple(q["aliases"]),
            distractor_ids=tuple(q["distractors"]), distractors=tuple(passages[d]["text"] for d in q["distractors"]),
            source=gold["source"], licence=gold["licence"],
        ))
    return pairs


def build_context(pair: QAPair, n_chunks: int | None = None, seed: int = 0) -> tuple[list[str], int]:
    """Retrieved-context chunks for `pair`: the gold passage plus `n_chunks - 1` of its distractors
    (all of them when None), shuffled by `seed`. Returns (chunks, index of the gold passage)."""
    available = len(pair.distractors) + 1
    n = available if n_chunks is None else n_chunks
    if not 1 <= n <= available:
        raise ValueError(f"{pair.id}: n_chunks must be in [1, {available}], got {n}")
    chunks = [pair.passage, *pair.distractors[: n - 1]]
    order = list(range(n))
    random.Random(f"{seed}:{pair.id}").shuffle(order)
    return [chunks[i] for i in order], order.index(0)


# --- SQuAD-style scoring -----------------------------------------------------------------------
_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCT = set(string.punctuation) | {"\u2019", "\u2018", "\u201c", "\u201d", "\u2013", "\u2014"}


def normalize_answer(text: str) -> str:
    """Lowercase, drop punctuation, drop the articles a/an/the, collapse whitespace (SQuAD v1.1)."""
    text = "".join(ch for ch in text.lower() if ch not in _PUNCT)
    return " ".join(_ARTICLES.sub(" ", text).split())


def _f1(prediction: str, gold: str) -> float:
    pred, ref = normalize_answer(prediction).split(), normalize_answer(gold).split()
    if not pred or not ref:
        return float(pred == ref)
    common = sum((Counter(pred) & Counter(ref)).values())
    if common == 0:
        return 0.0
    precision, recall = common / len(pred), common / len(ref)
    return 2 * precision * recall / (precision + recall)


def score(prediction: str, answer: str, aliases: Iterable[str] = ()) -> tuple[bool, float]:
    """(exact match, token F1) of `prediction`, the best over `answer` and `aliases`."""
    golds = [answer, *aliases]
    norm = normalize_answer(prediction)
    exact = any(norm == normalize_answer(g) for g in golds)
    return exact, max(_f1(prediction, g) for g in golds)

"""The short-document question set in data/short_qa/ (see its README.md): loading and prompt contexts.

    from short_qa import load_short_qa

    items = load_short_qa()                       # retrieval order: ascending BM25, the best next to the question
    items = load_short_qa(order="shuffled", seed=0)  # the same six documents in a seeded random order
    item.chunks, item.gold                        # the documents' texts in prompt order, the gold one's index

Each question has six documents of at most 60 words (~80 tokens), one of which holds its answer;
scoring is bench/real_qa.py's (`score`, `normalize_answer`).
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

DEFAULT_ROOT = Path(__file__).resolve().parent.parent / "data" / "short_qa"
ORDERS = ("retrieval", "shuffled")


@dataclass(frozen=True)
class ShortQA:
    id: str
    question: str
    answer: str
    aliases: tuple[str, ...]
    chunks: tuple[str, ...]  # the documents' texts in prompt order
    gold: int  # index of the document holding the answer in `chunks`
    scores: tuple[float, ...]  # each document's BM25 score against the question, same order

    @property
    def answers(self) -> tuple[str, ...]:
        return (self.answer, *self.aliases)


def load_short_qa(root: Path | str = DEFAULT_ROOT, order: str = "retrieval", seed: int = 0) -> list[ShortQA]:
    """Every question of `root`/questions.jsonl with its documents in prompt order: `retrieval` (ascending
    BM25 score, ties by id, as the gateway's prompter orders hits) or `shuffled` (by `seed` and the id)."""
    if order not in ORDERS:
        raise ValueError(f"order must be one of {ORDERS}, got {order!r}")
    out = []
    with open(Path(root) / "questions.jsonl", encoding="utf-8") as f:
        for line in f:
            if not line.strip():
                continue
            q = json.loads(line)
            docs = sorted(q["docs"], key=lambda d: (d["score"], d["id"]))
            if order == "shuffled":
                random.Random(f"{seed}:{q['id']}").shuffle(docs)
            ids = [d["id"] for d in docs]
            out.append(ShortQA(q["id"], q["question"], q["answer"], tuple(q["aliases"]),
                               tuple(d["text"] for d in docs), ids.index(q["gold"]), tuple(d["score"] for d in docs)))
    return out

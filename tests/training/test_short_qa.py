"""data/short_qa/: the short-document set is well formed, reproducible from data/real_qa, and bench/short_qa.py loads it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from helpers import load_script

ROOT = Path(__file__).resolve().parents[2]
DATA = ROOT / "data" / "short_qa"


short_qa = load_script("bench_short_qa", ROOT / "bench" / "short_qa.py")
build = load_script("short_qa_build", DATA / "build.py")


def _rows() -> list[dict]:
    return [json.loads(line) for line in (DATA / "questions.jsonl").read_text(encoding="utf-8").splitlines() if line.strip()]


def test_every_question_has_six_short_documents_and_one_holds_the_answer():
    rows = _rows()
    assert len(rows) >= 48
    for r in rows:
        answers = [r["answer"], *r["aliases"]]
        assert len(r["docs"]) == build.DOCS, r["id"]
        assert len({d["id"] for d in r["docs"]}) == build.DOCS, r["id"]
        assert all(1 <= len(d["text"].split()) <= build.WORDS for d in r["docs"]), r["id"]
        holding = [d["id"] for d in r["docs"] if build.holds(d["text"], answers)]
        assert holding == [r["gold"]], r["id"]


def test_the_file_is_what_build_makes():
    assert build.build() == _rows()


def test_split_keeps_every_word_in_order():
    text = "One two three. Four five six seven eight nine ten eleven twelve.\n\nThirteen fourteen. " + "w " * 130
    docs = build.split_passage(text, words=5)
    assert " ".join(docs).split() == text.split()
    assert all(len(d.split()) <= 5 for d in docs)
    assert docs[0] == "One two three."  # a sentence end is preferred to filling the document


def test_loader_orders_as_the_prompter_and_shuffles_reproducibly():
    items = short_qa.load_short_qa(DATA)
    rows = {r["id"]: r for r in _rows()}
    assert len(items) == len(rows)
    for it in items:
        assert list(it.scores) == sorted(it.scores)  # ascending: the best next to the question
        r = rows[it.id]
        assert it.chunks[it.gold] == next(d["text"] for d in r["docs"] if d["id"] == r["gold"])
        assert sorted(it.chunks) == sorted(d["text"] for d in r["docs"])
    a = short_qa.load_short_qa(DATA, order="shuffled", seed=3)
    assert a == short_qa.load_short_qa(DATA, order="shuffled", seed=3)
    assert [x.chunks for x in a] != [x.chunks for x in items]
    assert all(x.chunks[x.gold] == y.chunks[y.gold] for x, y in zip(a, items))
    with pytest.raises(ValueError, match="order"):
        short_qa.load_short_qa(DATA, order="random")

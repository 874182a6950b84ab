"""The default demo corpus (data/docs_corpus.jsonl): real English the gateway ingests on first serve,
built from README.md and docs/faq.md by data/docs_corpus.py, and what the README asks of it."""

from __future__ import annotations

import json
import re

from helpers import ROOT, load_script

from app.service.settings import DEFAULT_MODEL, DEMO_CORPUS_PATH, TINY_CORPUS_PATH
from retrieval.formats import parse_jsonl

builder = load_script("docs_corpus", ROOT / "data" / "docs_corpus.py")


def test_the_corpus_parses_as_the_gateway_reads_it():
    body = (ROOT / DEMO_CORPUS_PATH).read_bytes()
    documents = parse_jsonl(body, DEMO_CORPUS_PATH)
    assert len(documents) >= 10
    records = [json.loads(line) for line in body.decode().splitlines()]
    assert {r["source"] for r in records} == set(builder.PAGES)
    assert all(len(r["text"].split()) >= 8 and r["title"] for r in records)
    assert (ROOT / TINY_CORPUS_PATH).is_file()  # hypic-tiny's world stays beside it


def test_sections_are_cut_at_second_level_headings_outside_code(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("# Title\n\nIntro words enough to count as a section of text here.\n\n"
                    "## First part\n\nOne two three four five six seven eight nine.\n\n"
                    "```bash\n## not a heading inside a fence, so still the first part\n```\n\n"
                    "## Short\n\ntoo few words\n", encoding="utf-8")
    found = builder.sections(page)
    assert [d["id"] for d in found] == ["page-introduction", "page-first-part"]
    assert "## not a heading" in found[1]["text"] and found[1]["title"] == "Title: First part"


def test_every_readme_example_answer_is_in_the_corpus():
    """The README's example questions are answered from what the corpus says, not from the model's memory:
    every number of an answer, and most of its longer words, are in the corpus's text."""
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    table = readme.split("| question | its answer (both modes) |", 1)[1].split("\n\n", 1)[0]
    rows = re.findall(r'^\| ([^|]+\?) \| "([^"]+)" \|', table, flags=re.M)
    assert len(rows) >= 3, table
    text = " ".join(json.loads(line)["text"] for line in (ROOT / DEMO_CORPUS_PATH).read_text().splitlines()
                    if json.loads(line)["source"] == "docs/faq.md").lower()
    for question, answer in rows:
        assert all(n in text for n in re.findall(r"\d+(?:\.\d+)?", answer)), (question, answer)
        words = [w for w in re.findall(r"[a-z][a-z-]{4,}", answer.lower())]
        assert sum(w in text for w in words) >= 0.6 * len(words), (question, answer)


def test_hypic_demo_asks_its_questions_of_the_world_they_name(monkeypatch, tmp_path):
    from app.cli import demo_settings
    from app.demo import demo_questions

    monkeypatch.setenv("HYPIC_MODEL", DEFAULT_MODEL)  # whose demo corpus is the FAQ
    settings = demo_settings()
    assert str(settings.corpus_path) == TINY_CORPUS_PATH
    ids = {json.loads(line)["id"] for line in (ROOT / settings.corpus_path).read_text().splitlines()}
    _, _, sources = demo_questions(ROOT / settings.corpus_path.with_name("demo_questions.md"))[0]
    assert set(sources) <= ids
    mine = tmp_path / "mine.jsonl"
    monkeypatch.setenv("HYPIC_CORPUS_PATH", str(mine))
    assert demo_settings().corpus_path == mine  # a corpus the user names is kept

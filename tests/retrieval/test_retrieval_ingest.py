"""Ingestion: file formats, directory walks, request bodies, and bad input leaving the index as it was."""

from __future__ import annotations

import json

import numpy as np
import pytest
from transformers import AutoTokenizer

from retrieval import (
    BinaryInputError,
    Chunker,
    DimensionMismatchError,
    EmptyInputError,
    HashingEmbedder,
    InputNotFoundError,
    InvalidInputError,
    MalformedLineError,
    RetrievalError,
    UnsupportedFormatError,
    VectorIndex,
    ingest_jsonl,
    ingest_paths,
    ingest_text,
    load_documents,
    minilm_model_dir,
    parse_jsonl,
)


@pytest.fixture(scope="module")
def chunker() -> Chunker:
    tokenizer = AutoTokenizer.from_pretrained(str(minilm_model_dir()), local_files_only=True)
    return Chunker(tokenizer, target_tokens=32, max_tokens=48)


@pytest.fixture
def index(tmp_path) -> VectorIndex:
    return VectorIndex(tmp_path / "index", HashingEmbedder(64))


@pytest.fixture
def corpus(tmp_path):
    root = tmp_path / "corpus"
    (root / "sub").mkdir(parents=True)
    (root / "notes.txt").write_text("Plain text about tides and the Moon.\n")
    (root / "sub" / "guide.md").write_text("# Brewing guide\n\nEspresso needs fine grounds and nine bars of pressure.\n")
    lines = [{"id": "j1", "text": "Jupiter is the largest planet.", "title": "Jupiter"}, {"id": "j2", "text": "Mars is red."}]
    (root / "planets.jsonl").write_text("\n".join(json.dumps(line) for line in lines) + "\n\n")
    (root / "image.png").write_bytes(b"\x89PNG\r\n")
    (root / ".hidden.md").write_text("ignored")
    return root


def _snapshot(index: VectorIndex):
    files = {p.name: p.read_bytes() for p in sorted(index.directory.iterdir())} if index.directory.exists() else {}
    return files, index.list_documents(), len(index)


def test_directory_walk_reads_every_format(corpus, index, chunker):
    progress = []
    summary = ingest_paths([corpus], index, chunker, progress=lambda p: progress.append((p.documents, p.documents_total, p.chunks)))
    assert (summary.documents, summary.chunks, summary.replaced) == (4, 4, 0)
    assert summary.skipped == (f"{corpus / 'image.png'} (unsupported type)",)
    assert summary.seconds > 0
    assert progress[-1] == (4, 4, 4)
    documents = {d.document_id: d for d in index.list_documents()}
    assert set(documents) == {"corpus/notes.txt", "corpus/sub/guide.md", "j1", "j2"}
    assert documents["corpus/sub/guide.md"].title == "Brewing guide"
    assert documents["corpus/notes.txt"].title == "notes"
    assert documents["j1"].title == "Jupiter" and documents["j2"].title == "j2"
    assert documents["j1"].source == str(corpus / "planets.jsonl")
    assert index.search("espresso pressure", top_k=1)[0].chunk.document_id == "corpus/sub/guide.md"


def test_reingest_replaces_documents(corpus, index, chunker):
    ingest_paths([corpus], index, chunker)
    (corpus / "notes.txt").write_text("Completely different words now.")
    summary = ingest_paths([corpus / "notes.txt", corpus / "planets.jsonl"], index, chunker)
    assert (summary.documents, summary.replaced) == (3, 2)
    assert [c.text for c in index.chunks("notes.txt")] == ["Completely different words now."]
    assert len(index) == 5  # the directory's corpus/notes.txt is a different id from notes.txt


def test_request_bodies(index, chunker):
    assert ingest_text(b"# Title\n\nBody text here.", "doc-1", index, chunker).documents == 1
    assert index.list_documents()[0].title == "Title"
    body = '{"id": "a", "text": "alpha"}\n{"id": "b", "text": "beta", "source": "upload.jsonl"}\n'
    summary = ingest_jsonl(body, index, chunker)
    assert (summary.documents, summary.chunks) == (2, 2)
    assert {d.document_id: d.source for d in index.list_documents()} == {"doc-1": "<request>", "a": "<request>", "b": "upload.jsonl"}


@pytest.mark.parametrize(
    ("line", "reason"),
    [
        ("{not json", "invalid JSON"),
        ('["a list"]', "expected a JSON object"),
        ('{"id": "x"}', "'text' must be a non-empty string"),
        ('{"id": "", "text": "t"}', "'id' must be a non-empty string"),
        ('{"id": 7, "text": "t"}', "'id' must be a non-empty string"),
        ('{"id": "x", "text": "t", "title": 3}', "'title' must be a string"),
        ('{"id": "first", "text": "again"}', "duplicate id 'first' (first on line 1)"),
    ],
)
def test_malformed_jsonl_names_the_line(line, reason):
    body = '{"id": "first", "text": "ok"}\n\n' + line + "\n"
    with pytest.raises(MalformedLineError) as error:
        parse_jsonl(body, "upload.jsonl")
    assert error.value.line_number == 3
    assert str(error.value).startswith("upload.jsonl: line 3: ")
    assert reason in str(error.value)


def _write(tmp_path, name: str, data: bytes):
    path = tmp_path / name
    path.write_bytes(data)
    return path


@pytest.mark.parametrize(
    ("name", "data", "error", "message"),
    [
        ("empty.txt", b"", EmptyInputError, "empty"),
        ("blank.md", b"  \n\t\n", EmptyInputError, "empty"),
        ("nul.txt", b"text\x00with nul", BinaryInputError, "NUL"),
        ("latin1.txt", "caf\u00e9".encode("latin-1"), BinaryInputError, "not UTF-8"),
        ("data.csv", b"a,b\n1,2\n", UnsupportedFormatError, "'.csv'"),
        ("noext", b"hello", UnsupportedFormatError, "(none)"),
        ("blank.jsonl", b"\n\n", EmptyInputError, "empty"),
        ("bad.jsonl", b'{"id": "a", "text": "x"}\n{"id": "b"', MalformedLineError, "line 2"),
    ],
)
def test_bad_files_leave_the_index_untouched(tmp_path, corpus, index, chunker, name, data, error, message):
    ingest_paths([corpus], index, chunker)
    before = _snapshot(index)
    bad = _write(tmp_path, name, data)
    with pytest.raises(error, match=message.replace("(", r"\(").replace(")", r"\)")) as raised:
        ingest_paths([corpus / "notes.txt", bad], index, chunker)
    assert isinstance(raised.value, RetrievalError)
    assert _snapshot(index) == before


def test_missing_paths_duplicates_and_empty_directories(tmp_path, corpus, index, chunker):
    with pytest.raises(InputNotFoundError, match="no such file"):
        load_documents([tmp_path / "missing"])
    (tmp_path / "only-images").mkdir()
    (tmp_path / "only-images" / "a.png").write_bytes(b"png")
    with pytest.raises(InputNotFoundError, match=r"no .txt, .md, .rst, .html, .htm, .jsonl \(or any of them \+ .gz\) files"):
        load_documents([tmp_path / "only-images"])
    with pytest.raises(InvalidInputError, match="'notes.txt' appears twice"):
        load_documents([corpus / "notes.txt", corpus / "notes.txt"])
    with pytest.raises(EmptyInputError):
        ingest_text("   ", "doc", index, chunker)
    assert _snapshot(index) == ({}, [], 0)


def test_embedder_dimension_mismatch_leaves_the_index_untouched(corpus, index, chunker):
    ingest_paths([corpus], index, chunker)
    before = _snapshot(index)
    with pytest.raises(DimensionMismatchError):
        VectorIndex(index.directory, HashingEmbedder(32))

    class WrongDimension(HashingEmbedder):
        def embed(self, texts):
            return np.zeros((len(texts), 16), dtype=np.float32)

    index.embedder = WrongDimension(64)
    with pytest.raises(DimensionMismatchError):
        ingest_text("new text", "new", index, chunker)
    assert _snapshot(index) == before


def test_a_file_that_does_not_parse_is_skipped_in_a_walk_but_fatal_when_named(tmp_path):
    from retrieval.errors import RetrievalError
    from retrieval.ingest import load_documents

    (tmp_path / "notes.md").write_text("# Notes\n\nReal text.\n")
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "loss": 2.5}\n')
    documents, skipped = load_documents([tmp_path])
    assert [d.document_id for d in documents] == [f"{tmp_path.name}/notes.md"]
    assert len(skipped) == 1 and skipped[0].startswith(str(tmp_path / "metrics.jsonl")) and "'id'" in skipped[0]
    with pytest.raises(RetrievalError, match="'id'"):
        load_documents([tmp_path / "metrics.jsonl"])

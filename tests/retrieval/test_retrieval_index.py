"""VectorIndex: add, search, filter, replace, delete, persistence, atomic save, mismatches."""

from __future__ import annotations

import json

import numpy as np
import pytest

import retrieval.index as index_module
from retrieval import (
    Chunk,
    DimensionMismatchError,
    Document,
    DocumentNotFoundError,
    EmbedderMismatchError,
    HashingEmbedder,
    IndexCorruptError,
    InvalidInputError,
    VectorIndex,
)

CORPUS = {
    "cats": ["Cats purr when they are content.", "A cat sleeps most of the day."],
    "rust": ["Rust's borrow checker prevents data races.", "Ownership frees memory without a garbage collector."],
    "paris": ["The Eiffel Tower stands in Paris."],
}


def _chunks(document_id: str, texts: list[str], title: str = "") -> list[Chunk]:
    document = Document(document_id, " ".join(texts), title=title, source=f"src/{document_id}")
    return [Chunk.create(document, index, text, len(text.split())) for index, text in enumerate(texts)]


def _all_chunks() -> list[Chunk]:
    return [chunk for doc, texts in CORPUS.items() for chunk in _chunks(doc, texts)]


def _disk(directory) -> dict[str, bytes]:
    return {path.name: path.read_bytes() for path in sorted(directory.iterdir())}


@pytest.fixture(params=["flat", "hnsw"])
def index(request, tmp_path) -> VectorIndex:
    index = VectorIndex(tmp_path / "index", HashingEmbedder(64), index_type=request.param)
    index.upsert(_all_chunks())
    return index


def test_search_finds_the_right_document(index):
    hits = index.search("why do cats purr", top_k=3)
    assert hits[0].chunk.document_id == "cats"
    assert hits[0].chunk.text == "Cats purr when they are content."
    assert hits[0].chunk.source == "src/cats" and hits[0].chunk.title == "cats"
    assert [h.score for h in hits] == sorted((h.score for h in hits), reverse=True)
    assert len(index) == 5 and index.manifest.count == 5 and index.manifest.documents == 3


def test_search_by_vector_filter_and_limits(index):
    vector = HashingEmbedder(64).embed(["Eiffel Tower Paris"])[0]
    assert index.search(vector, top_k=1)[0].chunk.document_id == "paris"
    filtered = index.search("cats purr", top_k=10, document_ids=["rust", "paris"])
    assert {h.chunk.document_id for h in filtered} == {"rust", "paris"} and len(filtered) == 3
    assert index.search("anything", document_ids=[]) == []
    with pytest.raises(DocumentNotFoundError):
        index.search("cats", document_ids=["nope"])
    with pytest.raises(DimensionMismatchError):
        index.search(np.ones(32, dtype=np.float32))
    with pytest.raises(InvalidInputError):
        index.search("cats", top_k=0)


def test_reingest_replaces_without_duplicates(index):
    replaced = index.upsert(_chunks("cats", ["Dogs bark at the mail carrier."]))
    assert replaced == 1
    assert [c.text for c in index.chunks("cats")] == ["Dogs bark at the mail carrier."]
    assert len(index) == 4
    assert all(h.chunk.text != "Cats purr when they are content." for h in index.search("cats purr", top_k=10))
    assert index.upsert(_chunks("cats", ["Dogs bark at the mail carrier."])) == 1
    assert len(index) == 4


def test_delete_document(index):
    assert index.delete_document("rust") == 2
    assert [d.document_id for d in index.list_documents()] == ["cats", "paris"]
    assert all(h.chunk.document_id != "rust" for h in index.search("borrow checker", top_k=10))
    with pytest.raises(DocumentNotFoundError) as error:
        index.delete_document("rust")
    assert isinstance(error.value, KeyError)
    assert str(error.value) == "document 'rust' is not in the index"


def test_persist_and_reload(index):
    index.delete_document("paris")
    reopened = VectorIndex(index.directory, HashingEmbedder(64))
    assert reopened.index_type == index.index_type
    assert reopened.list_documents() == index.list_documents()
    assert [(h.score, h.chunk) for h in reopened.search("cat sleeps", top_k=3)] == [(h.score, h.chunk) for h in index.search("cat sleeps", top_k=3)]
    info = {d.document_id: d for d in reopened.list_documents()}["cats"]
    assert (info.chunk_count, info.token_count, info.source) == (2, 13, "src/cats")
    manifest = json.loads((index.directory / "manifest.json").read_text())
    assert manifest["embedder"] == "hashing-64" and manifest["dim"] == 64 and manifest["count"] == 4
    assert sorted(p.name for p in index.directory.iterdir()) == sorted(["manifest.json", manifest["index_file"], manifest["metadata_file"], "write.lock"])


@pytest.mark.parametrize("failing_file", ["index-", "meta-", "manifest.json"])
def test_failed_save_leaves_index_untouched(index, monkeypatch, failing_file):
    before_disk, before_docs, before_len = _disk(index.directory), index.list_documents(), len(index)
    real_write = index_module.write_atomic

    def crash(path, data):
        if path.name.startswith(failing_file):
            raise OSError("disk full")
        real_write(path, data)

    monkeypatch.setattr(index_module, "write_atomic", crash)
    with pytest.raises(OSError, match="disk full"):
        index.upsert(_chunks("new", ["A brand new document."]))
    with pytest.raises(OSError, match="disk full"):
        index.delete_document("cats")
    monkeypatch.undo()
    assert (index.list_documents(), len(index)) == (before_docs, before_len)
    reopened = VectorIndex(index.directory, HashingEmbedder(64))
    assert (reopened.list_documents(), len(reopened)) == (before_docs, before_len)
    assert {k: v for k, v in _disk(index.directory).items() if not k.startswith(".")} == before_disk
    index.upsert(_chunks("new", ["A brand new document."]))
    assert not [p for p in index.directory.iterdir() if p.name.startswith(".")], "temp files must be cleaned up"


def test_orphan_files_from_a_crash_are_ignored_and_removed(index):
    (index.directory / "index-999999.faiss").write_bytes(b"half written")
    (index.directory / ".manifest.json.tmp").write_bytes(b"{")
    reopened = VectorIndex(index.directory, HashingEmbedder(64))
    assert len(reopened) == 5
    reopened.delete_document("paris")
    assert not (index.directory / "index-999999.faiss").exists()
    assert not (index.directory / ".manifest.json.tmp").exists()


def test_embedder_of_other_dimension_or_name_is_refused(index):
    before = _disk(index.directory)
    with pytest.raises(DimensionMismatchError, match="dimension 64"):
        VectorIndex(index.directory, HashingEmbedder(32))
    renamed = HashingEmbedder(64)
    renamed.name = "other-model"
    with pytest.raises(EmbedderMismatchError, match="hashing-64"):
        VectorIndex(index.directory, renamed)
    assert _disk(index.directory) == before


def test_embedder_returning_wrong_shape_changes_nothing(index):
    class LyingEmbedder(HashingEmbedder):
        def embed(self, texts):
            return np.ones((len(texts), 32), dtype=np.float32)

    liar = LyingEmbedder(64)
    before = _disk(index.directory)
    index.embedder = liar
    with pytest.raises(DimensionMismatchError, match="shape"):
        index.upsert(_chunks("cats", ["replacement"]))
    assert _disk(index.directory) == before and len(index) == 5
    assert [c.text for c in index.chunks("cats")] == CORPUS["cats"]


def test_bad_chunk_sets_are_rejected(index):
    with pytest.raises(InvalidInputError, match="no chunks"):
        index.upsert([])
    duplicated = _chunks("x", ["one", "two"])
    with pytest.raises(InvalidInputError, match="chunk indexes"):
        index.upsert([duplicated[0], duplicated[0]])
    with pytest.raises(DocumentNotFoundError):
        index.chunks("x")


def test_corrupt_or_inconsistent_files_raise(index):
    manifest_path = index.directory / "manifest.json"
    manifest = json.loads(manifest_path.read_text())
    manifest["count"] += 1
    manifest_path.write_text(json.dumps(manifest))
    with pytest.raises(IndexCorruptError, match="inconsistent"):
        VectorIndex(index.directory, HashingEmbedder(64))
    manifest["count"] -= 1
    manifest["format_version"] = 99
    manifest_path.write_text(json.dumps(manifest))
    with pytest.raises(IndexCorruptError, match="format 99"):
        VectorIndex(index.directory, HashingEmbedder(64))
    manifest_path.write_text("{not json")
    with pytest.raises(IndexCorruptError, match="manifest"):
        VectorIndex(index.directory, HashingEmbedder(64))


def test_empty_index(tmp_path):
    index = VectorIndex(tmp_path / "fresh", HashingEmbedder(16))
    assert len(index) == 0 and index.list_documents() == [] and index.search("anything") == []
    assert not (tmp_path / "fresh").exists(), "opening must not write"
    with pytest.raises(InvalidInputError, match="index type"):
        VectorIndex(tmp_path / "x", HashingEmbedder(16), index_type="ivf")

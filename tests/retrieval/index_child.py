"""Child-process side of tests/retrieval/test_index_writers.py, in a module that imports only the index
(spawned children import it; the test module would bring FastAPI and torch along)."""

from __future__ import annotations

from retrieval.document import Chunk, Document
from retrieval.embedder import HashingEmbedder
from retrieval.index import VectorIndex


def document(document_id: str) -> list[Chunk]:
    """One single-chunk document about `document_id`."""
    text = f"Document {document_id} is about the river number {document_id}."
    return [Chunk.create(Document(document_id, text), 0, text, len(text.split()))]


def writer(directory: str, prefix: str, count: int, start, done) -> None:
    """Open the index, wait for the others (`start`: a barrier, or None), then add `count`
    documents one write at a time, as fast as it can; report the ids it then holds to `done`."""
    index = VectorIndex(directory, HashingEmbedder(64))
    if start is not None:
        start.wait(60)
    for n in range(count):
        index.upsert(document(f"{prefix}-{n:02d}"))
    done.put((prefix, sorted(d.document_id for d in index.list_documents())))

"""The ingest pipeline: chunking on a thread while windows of chunks embed across documents,
against its per-document reference twin; embedding workers; progress lines."""

from __future__ import annotations

import os
import sys
import threading
import time

import numpy as np
import pytest
from transformers import AutoTokenizer
from typer.testing import CliRunner

import retrieval.embedder
from app.cli import cli
from retrieval import Chunker, Document, HashingEmbedder, MiniLMEmbedder, VectorIndex, ingest_documents, minilm_model_dir
from retrieval.pipeline import IngestProgress, ProgressLog, chunk_and_embed, chunk_and_embed_reference

SENTENCES = [
    "Tides rise and fall twice a day as the Moon pulls on the oceans.",
    "Espresso is brewed by forcing hot water through finely ground coffee.",
    "The TCP protocol retransmits lost segments and keeps them in order.",
    "Sourdough bread rises with wild yeast and lactic acid bacteria.",
    "Jupiter is the largest planet and has a great red storm.",
]


def corpus(count: int = 9) -> list[Document]:
    """Documents of 1 to several chunks (at 32-token chunks), so windows cross document boundaries."""
    documents = []
    for n in range(count):
        paragraphs = [f"Part {n}.{p}. " + " ".join(SENTENCES[(n + p + k) % len(SENTENCES)] for k in range(1 + (n + p) % 3))
                      for p in range(1 + n % 4)]
        documents.append(Document(f"doc-{n}", "\n\n".join(paragraphs), source="test"))
    return documents


@pytest.fixture(scope="module")
def chunker() -> Chunker:
    return Chunker(AutoTokenizer.from_pretrained(str(minilm_model_dir()), local_files_only=True), target_tokens=32, max_tokens=48)


@pytest.fixture(scope="module")
def minilm() -> MiniLMEmbedder:
    return MiniLMEmbedder(batch_size=4)


def test_hashing_pipeline_matches_the_reference_bit_for_bit(chunker):
    documents = corpus()
    reference = chunk_and_embed_reference(documents, chunker, HashingEmbedder(64))
    fast = chunk_and_embed(documents, chunker, HashingEmbedder(64), window=5)
    assert fast.chunks == reference.chunks
    assert len({c.document_id for c in fast.chunks}) == len(documents) and len(fast.chunks) > len(documents)
    np.testing.assert_array_equal(fast.vectors, reference.vectors)
    assert [chunker.count_tokens([c.text])[0] for c in fast.chunks] == [c.token_count for c in fast.chunks]


def test_minilm_pipeline_matches_the_per_document_reference(chunker, minilm):
    documents = corpus()
    reference = chunk_and_embed_reference(documents, chunker, minilm)
    fast = chunk_and_embed(documents, chunker, minilm, window=7)
    assert fast.chunks == reference.chunks
    # Batches of other lengths pad differently: agreement to float rounding, not to the bit.
    np.testing.assert_allclose(fast.vectors, reference.vectors, rtol=0, atol=2e-6)


def test_embedding_workers_give_the_same_bits(minilm):
    texts = [f"{SENTENCES[n % 5]} Number {n}." * (1 + n % 3) for n in range(14)]
    one = minilm.embed(texts)
    try:
        minilm.workers = 2
        np.testing.assert_array_equal(minilm.embed(texts), one)
    finally:
        minilm.workers = 1


def test_ingest_stores_what_the_reference_computes(chunker, tmp_path):
    documents = corpus()
    fast = VectorIndex(tmp_path / "fast", HashingEmbedder(64))
    ingest_documents(documents, fast, chunker)
    reference = VectorIndex(tmp_path / "reference", HashingEmbedder(64))
    computed = chunk_and_embed_reference(documents, chunker, reference.embedder)
    reference.upsert_embedded(computed.chunks, computed.vectors)
    for document in documents:
        assert fast.chunks(document.document_id) == reference.chunks(document.document_id)
    for query in SENTENCES:
        assert fast.search(query, top_k=5) == reference.search(query, top_k=5)


def test_a_chunking_error_stops_the_pipeline(chunker):
    class Failing(Chunker):
        def chunk(self, document):
            if document.document_id == "doc-3":
                raise ValueError("chunker broke on doc-3")
            return super().chunk(document)

    failing = Failing(chunker.tokenizer, 32, 48)
    with pytest.raises(ValueError, match="doc-3"):
        chunk_and_embed(corpus(), failing, HashingEmbedder(64), window=2)


def test_an_embedder_sharing_the_chunkers_tokenizer_chunks_inline(minilm):
    shared = Chunker(minilm.tokenizer, target_tokens=32, max_tokens=48)
    documents = corpus(4)
    assert chunk_and_embed(documents, shared, HashingEmbedder(64)).chunks == chunk_and_embed_reference(documents, shared, HashingEmbedder(64)).chunks
    slow = chunk_and_embed(documents, shared, minilm, window=3)  # would race on the tokenizer if chunked on a thread
    assert len(slow.vectors) == len(slow.chunks)


def test_progress_reaches_the_totals_and_logs_every_interval(chunker):
    seen: list[IngestProgress] = []
    documents = corpus()
    result = chunk_and_embed(documents, chunker, HashingEmbedder(64), progress=seen.append, window=4)
    assert [p.chunks for p in seen] == sorted(p.chunks for p in seen)
    assert (seen[-1].documents, seen[-1].documents_total, seen[-1].chunks) == (len(documents), len(documents), len(result.chunks))
    assert all(p.documents <= p.documents_total and p.chunks <= p.chunks_cut for p in seen)

    lines: list[float] = []
    log = ProgressLog(lambda p: lines.append(p.seconds), every_s=10)
    for seconds in (1, 5, 10.5, 12, 19, 20.6, 31):
        log(IngestProgress(1, 2, 3, 4, seconds))
    assert lines == [10.5, 20.6, 31]
    assert IngestProgress(3, 9, 40, 50, 4.0).line() == "ingest: 3/9 documents, 40 chunks embedded (50 cut), 10.0 chunks/s, 4 s"


def test_cli_without_a_terminal_logs_progress_lines(tmp_path, monkeypatch):
    class Slow(HashingEmbedder):
        def embed(self, texts):
            time.sleep(0.3)
            return super().embed(texts)

    monkeypatch.setattr(retrieval.embedder, "load_embedder", lambda spec, **kwargs: Slow(64))
    (tmp_path / "a.txt").write_text("Some words about tides.")
    result = CliRunner().invoke(cli, ["ingest", str(tmp_path / "a.txt"), "--index-dir", str(tmp_path / "index"),
                                      "--tokenizer", str(minilm_model_dir()), "--log-every", "0.1"])
    assert result.exit_code == 0, result.output
    assert "ingest: 1/1 documents, 1 chunks embedded (1 cut)" in result.stderr


class NicenessRecorder(HashingEmbedder):
    """A hashing embedder that notes the niceness of each thread it embeds on."""

    def __init__(self) -> None:
        super().__init__(64)
        self.seen: list[int] = []

    def embed(self, texts):
        self.seen.append(os.getpriority(os.PRIO_PROCESS, threading.get_native_id()))
        return super().embed(texts)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="per-thread niceness is Linux's")
def test_ingestion_embeds_at_a_lower_priority_and_leaves_the_callers(chunker):
    """An upload's windows are embedded on a thread niced INGEST_NICE above the caller, so the
    engine and queries' embeds get the CPU first; the caller's own priority is unchanged."""
    from retrieval.pipeline import INGEST_NICE

    mine = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    embedder = NicenessRecorder()
    chunk_and_embed(corpus(), chunker, embedder, window=5)
    assert len(embedder.seen) > 1 and set(embedder.seen) == {min(19, mine + INGEST_NICE)}
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == mine

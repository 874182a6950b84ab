"""Chunk and embed many documents: a producer thread chunks while the embedder runs.

`chunk_and_embed` is the fast path `retrieval.ingest` uses: one thread chunks the documents in
order while the calling thread embeds the chunks in windows of `EMBED_WINDOW` across document
boundaries (the embedder sorts a window by length, so batches carry little padding; per
document, a corpus of small files would embed in tiny batches). `chunk_and_embed_reference` is
its plain twin, same signature: chunk one document, embed its chunks, next document. Both
return the same chunks; vectors agree to float rounding (a batch's padding can move the last
bit), and are bit-identical for embedders that treat texts independently (hashing).

Ingestion yields the CPU: its windows are embedded, and its chunks cut, on threads whose
niceness is `INGEST_NICE` above the process's (Linux; `lower_priority`), so on a busy machine
the engine and a query's own embed (which never waits for these windows: retrieval/embedder.py)
run first.

Progress: `progress(IngestProgress)` is called from the calling thread after every window;
`ProgressLog` turns those calls into one log line every few seconds, for runs without a
terminal (the gateway's log, `hypic ingest > file`).
"""

from __future__ import annotations

import bisect
import os
import queue
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np

from retrieval.chunker import Chunker
from retrieval.document import Chunk, Document
from retrieval.embedder import Embedder
from retrieval.errors import DimensionMismatchError

# Chunks embedded per call. Larger windows sort more chunks by length (less padding); 256
# halved the padding of 64-chunk slices on real text (docs/retrieval.md, "Ingest throughput").
EMBED_WINDOW = 256
INGEST_NICE = 10  # niceness added to the threads that cut and embed an ingestion's chunks


def lower_priority(by: int = INGEST_NICE) -> None:
    """Raise the calling thread's niceness by `by` (at most 19), so that the scheduler prefers the
    process's other threads. Linux only, where niceness is per thread (elsewhere it would lower
    the whole process); best effort. It cannot be undone without privileges: call it only on
    threads that do nothing else."""
    if not sys.platform.startswith("linux"):
        return
    try:
        tid = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid) + by))
    except OSError:
        pass


_bulk: ThreadPoolExecutor | None = None
_bulk_lock = threading.Lock()


def _bulk_thread() -> ThreadPoolExecutor:
    """The one low-priority thread every ingestion's windows are embedded on, in turn."""
    global _bulk
    with _bulk_lock:
        if _bulk is None:
            _bulk = ThreadPoolExecutor(1, thread_name_prefix="hypic-ingest-embed", initializer=lower_priority)
        return _bulk


@dataclass(frozen=True)
class IngestProgress:
    """Where an ingestion stands: documents whose chunks are all embedded, chunks embedded,
    chunks cut so far (the producer runs ahead), and seconds since it started."""

    documents: int
    documents_total: int
    chunks: int
    chunks_cut: int
    seconds: float

    @property
    def chunks_per_second(self) -> float:
        return self.chunks / self.seconds if self.seconds > 0 else 0.0

    def line(self) -> str:
        return (f"ingest: {self.documents}/{self.documents_total} documents, {self.chunks} chunks embedded "
                f"({self.chunks_cut} cut), {self.chunks_per_second:.1f} chunks/s, {self.seconds:.0f} s")


IngestCallback = Callable[[IngestProgress], None]


class ProgressLog:
    """A progress callback that passes `IngestProgress` to `emit` at most once every `every_s`
    seconds (the first call after each interval), so a long ingest logs a steady trickle."""

    def __init__(self, emit: Callable[[IngestProgress], None], every_s: float = 10.0) -> None:
        self.emit = emit
        self.every_s = every_s
        self._next = every_s

    def __call__(self, progress: IngestProgress) -> None:
        if progress.seconds >= self._next:
            self.emit(progress)
            self._next = progress.seconds + self.every_s


@dataclass(frozen=True)
class EmbeddedChunks:
    """Chunks of documents in order (each document's in chunk order) and their vectors (row i is chunk i's)."""

    chunks: list[Chunk]
    vectors: np.ndarray


def chunk_and_embed(documents: Sequence[Document], chunker: Chunker, embedder: Embedder,
                    progress: IngestCallback | None = None, window: int = EMBED_WINDOW) -> EmbeddedChunks:
    """Chunk `documents` on a producer thread and embed the chunks here, `window` at a time.
    Raises whatever chunking or embedding raises (the producer is stopped first)."""
    started = time.perf_counter()
    if getattr(embedder, "tokenizer", None) is chunker.tokenizer:
        # A Rust tokenizer must not be called from two threads at once: chunk here instead.
        return _embed_in_windows(iter([chunker.chunk(d) for d in documents]), len(documents), embedder, progress, window, started)
    cut: queue.Queue = queue.Queue()
    stop = threading.Event()

    def produce() -> None:
        lower_priority()
        try:
            for document in documents:
                if stop.is_set():
                    return
                cut.put(chunker.chunk(document))
        except BaseException as exc:  # handed to the consumer, which raises it
            cut.put(exc)

    producer = threading.Thread(target=produce, name="chunker", daemon=True)
    producer.start()

    def consume():
        for _ in documents:
            item = cut.get()
            if isinstance(item, BaseException):
                raise item
            yield item

    try:
        return _embed_in_windows(consume(), len(documents), embedder, progress, window, started)
    finally:
        stop.set()
        producer.join()


def chunk_and_embed_reference(documents: Sequence[Document], chunker: Chunker, embedder: Embedder,
                              progress: IngestCallback | None = None, window: int = EMBED_WINDOW) -> EmbeddedChunks:
    """The plain twin of `chunk_and_embed`: one document at a time, chunk it, embed its chunks."""
    started = time.perf_counter()
    chunks: list[Chunk] = []
    parts: list[np.ndarray] = []
    for done, document in enumerate(documents, start=1):
        mine = chunker.chunk(document)
        chunks += mine
        parts.append(_embed(embedder, [c.text for c in mine]))
        if progress is not None:
            progress(IngestProgress(done, len(documents), len(chunks), len(chunks), time.perf_counter() - started))
    return EmbeddedChunks(chunks, _stack(parts, embedder))


def _embed_in_windows(per_document: Iterator[list[Chunk]], total: int, embedder: Embedder, progress: IngestCallback | None,
                      window: int, started: float) -> EmbeddedChunks:
    """Embed the chunk lists that `per_document` yields, `window` chunks per `embed` call."""
    chunks: list[Chunk] = []
    ends: list[int] = []  # ends[i]: chunks of documents 0..i
    parts: list[np.ndarray] = []
    embedded = 0

    def embed_upto(count: int) -> None:
        nonlocal embedded
        parts.append(_bulk_thread().submit(_embed, embedder, [c.text for c in chunks[embedded:count]]).result())
        embedded = count
        if progress is not None:
            progress(IngestProgress(bisect.bisect_right(ends, embedded), total, embedded, len(chunks), time.perf_counter() - started))

    for document_chunks in per_document:
        chunks += document_chunks
        ends.append(len(chunks))
        while len(chunks) - embedded >= window:
            embed_upto(embedded + window)
    if embedded < len(chunks):
        embed_upto(len(chunks))
    return EmbeddedChunks(chunks, _stack(parts, embedder))


def _embed(embedder: Embedder, texts: list[str]) -> np.ndarray:
    """`embedder.embed(texts)` as float32; raises `DimensionMismatchError` unless it has one row per text
    (the index checks the dimension)."""
    vectors = np.asarray(embedder.embed(texts), dtype=np.float32)
    if vectors.ndim != 2 or len(vectors) != len(texts):
        raise DimensionMismatchError(f"embedder {embedder.name!r} returned vectors of shape {vectors.shape} for {len(texts)} texts")
    return vectors


def _stack(parts: list[np.ndarray], embedder: Embedder) -> np.ndarray:
    return np.concatenate(parts) if parts else np.zeros((0, int(embedder.dim)), dtype=np.float32)

"""A persistent vector index of chunks: FAISS for vectors, SQLite for metadata, a JSON manifest.

Layout of an index directory:

    manifest.json            names the current generation's two files; written last
    index-<gen>.faiss        FAISS IndexIDMap2 over IndexFlatIP (exact cosine) or IndexHNSWFlat
    meta-<gen>.sqlite        documents and chunks; chunks.row_id is the vector's FAISS id
    write.lock               the write lock (an flock; its content means nothing)

Every mutation writes a new generation (each file to a temp name, fsync, `os.replace`) and then
replaces the manifest, so the manifest always names a complete, consistent pair: a crash at any
point leaves the previous index readable. Files of older generations are removed afterwards.
Mutations are validated (and vectors computed) before anything changes; if persisting fails
the in-memory state is reloaded from disk, so a failed call leaves the index as it was.

Several processes may open one directory (a gateway serving it, `hypic ingest` adding to it).
A write holds the directory's write lock (`write.lock`) and, under it, first loads any
generation another process has published, so it never writes a generation that drops someone
else's documents; the slow part of an upsert, embedding, runs before the lock is taken, so the
lock is held for the save alone. Reads take no lock: each compares the manifest's stat (inode,
mtime, size: one `stat` call) with the one it last loaded and reloads when another process has
published since. Within a process, a thread lock makes the methods thread-safe.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import sqlite3
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import faiss
import filelock
import numpy as np

from retrieval.document import Chunk
from retrieval.embedder import Embedder
from retrieval.errors import (DimensionMismatchError, DocumentNotFoundError, EmbedderMismatchError, IndexCorruptError, IndexLockedError,
                              InvalidInputError, RetrievalError)

log = logging.getLogger(__name__)

INDEX_TYPES = ("flat", "hnsw")
MANIFEST_NAME = "manifest.json"
LOCK_NAME = "write.lock"
LOCK_TIMEOUT_S = 60.0  # a writer waits this long for another process's save, then gives up (`hypic ingest --help` says 60)
LOAD_ATTEMPTS = 5  # a generation's files can vanish under a reader while a newer one is published
FORMAT_VERSION = 1
EMBED_BATCH = 64
HNSW_EF_SEARCH = 64

Progress = Callable[[int, int], None]
"""Called as progress(chunks_embedded, chunks_total) while an upsert embeds."""

_SCHEMA = """
CREATE TABLE documents (
    document_id TEXT PRIMARY KEY,
    title TEXT NOT NULL,
    source TEXT NOT NULL,
    ingested_at REAL NOT NULL
);
CREATE TABLE chunks (
    row_id INTEGER PRIMARY KEY,
    chunk_id TEXT NOT NULL,
    document_id TEXT NOT NULL REFERENCES documents(document_id),
    chunk_index INTEGER NOT NULL,
    text TEXT NOT NULL,
    token_count INTEGER NOT NULL,
    UNIQUE (document_id, chunk_index)
);
CREATE INDEX chunks_by_document ON chunks(document_id);
"""

_DOCUMENT_COLUMNS = "d.document_id, d.title, d.source, COUNT(c.row_id), COALESCE(SUM(c.token_count), 0), d.ingested_at"
_CHUNK_COLUMNS = "c.row_id, c.chunk_id, c.document_id, d.title, d.source, c.chunk_index, c.text, c.token_count"


@dataclass(frozen=True)
class SearchHit:
    """One search result: cosine `score` (higher is closer) and the matching `chunk`."""

    score: float
    chunk: Chunk


@dataclass(frozen=True)
class DocumentInfo:
    """A document in the index, with its number of chunks and their total tokens."""

    document_id: str
    title: str
    source: str
    chunk_count: int
    token_count: int
    ingested_at: float


@dataclass(frozen=True)
class Manifest:
    """The contents of manifest.json: what built the index and which files hold it."""

    embedder: str
    dim: int
    index_type: str
    count: int
    documents: int
    generation: int
    index_file: str
    metadata_file: str
    format_version: int = FORMAT_VERSION

    @classmethod
    def read(cls, path: Path) -> Manifest:
        """Parse `path`; raises `IndexCorruptError` if it is not a valid manifest of this format."""
        try:
            manifest = cls(**json.loads(path.read_text(encoding="utf-8")))
        except (OSError, ValueError, TypeError) as exc:
            raise IndexCorruptError(f"cannot read index manifest {path}: {exc}") from exc
        if manifest.format_version != FORMAT_VERSION:
            raise IndexCorruptError(f"index manifest {path} has format {manifest.format_version}; this version reads {FORMAT_VERSION}")
        return manifest

    def to_bytes(self) -> bytes:
        return (json.dumps(asdict(self), indent=2, sort_keys=True) + "\n").encode("utf-8")


class VectorIndex:
    """Chunks of documents with their embeddings, persisted in `directory`.

    Opening a directory without a manifest gives an empty index of `index_type` ("flat": exact;
    "hnsw": approximate, for large corpora, `hnsw_m` links per node); an existing index keeps the
    type it was built with. Raises `DimensionMismatchError` if `embedder.dim` differs from the
    stored index's, `EmbedderMismatchError` if only the name differs, `IndexCorruptError` if the
    files are unreadable or inconsistent. Mutating methods persist before they return; they
    wait up to `lock_timeout` seconds for another process's write, then raise `IndexLockedError`.
    Reads see what other processes have written (see the module's docstring).
    """

    def __init__(self, directory: str | Path, embedder: Embedder, index_type: str = "flat", hnsw_m: int = 32,
                 lock_timeout: float = LOCK_TIMEOUT_S) -> None:
        if index_type not in INDEX_TYPES:
            raise InvalidInputError(f"index type must be one of {INDEX_TYPES}, got {index_type!r}")
        self.directory = Path(directory)
        self.embedder = embedder
        self._requested_type = index_type
        self._hnsw_m = hnsw_m
        self._lock = threading.RLock()
        self._write_lock = filelock.FileLock(self.directory / LOCK_NAME, timeout=lock_timeout)
        self._seen: tuple[int, int, int] | None = None  # stat of the manifest last loaded or saved
        self._load()

    @property
    def manifest(self) -> Manifest:
        """The manifest of the generation this object holds (generation 0 if never saved)."""
        return self._manifest

    @property
    def index_type(self) -> str:
        """"flat" or "hnsw"."""
        return self._manifest.index_type

    def __len__(self) -> int:
        """Number of chunks in the index."""
        with self._lock:
            self._refresh()
            return int(self._faiss.ntotal)

    def _has(self, document_id: str) -> bool:
        return self._db.execute("SELECT 1 FROM documents WHERE document_id = ?", (document_id,)).fetchone() is not None

    def list_documents(self, after: str | None = None, limit: int | None = None) -> list[DocumentInfo]:
        """Documents ordered by id: all of them, or (a page) the first `limit` whose id sorts
        after `after` (which need not be in the index). Raises `InvalidInputError` for limit < 0."""
        if limit is not None and limit < 0:
            raise InvalidInputError(f"limit must be >= 0, got {limit}")
        with self._lock:
            self._refresh()
            rows = self._db.execute(
                f"SELECT {_DOCUMENT_COLUMNS} FROM documents d LEFT JOIN chunks c USING (document_id)"
                " WHERE ? IS NULL OR d.document_id > ? GROUP BY d.document_id ORDER BY d.document_id LIMIT ?",
                (after, after, -1 if limit is None else limit),
            ).fetchall()
        return [DocumentInfo(*row) for row in rows]

    def has_document(self, document_id: str) -> bool:
        """Whether a document of this id is in the index."""
        with self._lock:
            self._refresh()
            return self._has(document_id)

    def usage(self, document_ids: Sequence[str] | None = None) -> tuple[int, int]:
        """(documents, UTF-8 bytes of their chunks' text): of the whole index, or of the documents
        of `document_ids` it holds (unknown ids count nothing)."""
        query = "SELECT COUNT(DISTINCT document_id), COALESCE(SUM(LENGTH(CAST(text AS BLOB))), 0) FROM chunks"
        with self._lock:
            self._refresh()
            if document_ids is None:
                documents, size = self._db.execute(query).fetchone()
                return int(self._db.execute("SELECT COUNT(*) FROM documents").fetchone()[0]), int(size)
            documents = size = 0
            ids = list(dict.fromkeys(document_ids))
            for first in range(0, len(ids), 500):
                part = ids[first:first + 500]
                n, b = self._db.execute(f"{query} WHERE document_id IN ({','.join('?' * len(part))})", part).fetchone()
                documents, size = documents + int(n), size + int(b)
            return documents, size

    def document(self, document_id: str) -> DocumentInfo:
        """The document of this id; raises `DocumentNotFoundError` if it is not in the index."""
        with self._lock:
            self._refresh()
            row = self._db.execute(
                f"SELECT {_DOCUMENT_COLUMNS} FROM documents d LEFT JOIN chunks c USING (document_id)"
                " WHERE d.document_id = ? GROUP BY d.document_id",
                (document_id,),
            ).fetchone()
        if row is None:
            raise DocumentNotFoundError(document_id)
        return DocumentInfo(*row)

    def chunks(self, document_id: str) -> list[Chunk]:
        """The chunks of a document in order; raises `DocumentNotFoundError` for an unknown id."""
        with self._lock:
            self._refresh()
            self._require_documents([document_id])
            rows = self._db.execute(
                f"SELECT {_CHUNK_COLUMNS} FROM chunks c JOIN documents d USING (document_id) WHERE c.document_id = ? ORDER BY c.chunk_index",
                (document_id,),
            ).fetchall()
        return [_chunk_from_row(row) for row in rows]

    def upsert(self, chunks: Sequence[Chunk], progress: Progress | None = None) -> int:
        """Add the documents that `chunks` belong to, replacing any already in the index.

        `chunks` must hold, for each document id, chunk indexes 0..n-1 exactly once (the output
        of `Chunker.chunk`). All chunks are embedded and checked before the index changes.
        Returns how many of these documents replaced existing ones. Raises
        `InvalidInputError` (no chunks, bad indexes) or `DimensionMismatchError` (the embedder
        returned vectors of the wrong shape); on any error the index is unchanged.
        """
        _check_chunk_sets(chunks)
        return self._write(chunks, self._embed([chunk.text for chunk in chunks], progress))

    def upsert_embedded(self, chunks: Sequence[Chunk], vectors: np.ndarray) -> int:
        """`upsert` with the chunks' vectors already computed by this index's embedder (row i
        is chunk i's), e.g. by `retrieval.ingest.chunk_and_embed`. Checks as `upsert` does."""
        _check_chunk_sets(chunks)
        return self._write(chunks, self._checked(np.asarray(vectors, dtype=np.float32), len(chunks)))

    def _write(self, chunks: Sequence[Chunk], vectors: np.ndarray) -> int:
        """Replace the documents of `chunks` with them and their checked `vectors`; persist."""
        document_ids = sorted({chunk.document_id for chunk in chunks})
        with self._lock, self._exclusive(), self._mutation():
            replaced = [doc for doc in document_ids if self._has(doc)]
            self._remove_rows(self._row_ids(replaced))
            self._db.executemany("DELETE FROM documents WHERE document_id = ?", [(doc,) for doc in replaced])
            first = self._db.execute("SELECT COALESCE(MAX(row_id), -1) + 1 FROM chunks").fetchone()[0]
            row_ids = np.arange(first, first + len(chunks), dtype=np.int64)
            self._insert(chunks, row_ids)
            self._faiss.add_with_ids(vectors, row_ids)
        return len(replaced)

    def delete_document(self, document_id: str) -> int:
        """Remove a document and its chunks; returns the number of chunks removed.
        Raises `DocumentNotFoundError` (a `KeyError`) if the id is not in the index."""
        with self._lock, self._exclusive():
            self._require_documents([document_id])
            with self._mutation():
                row_ids = self._row_ids([document_id])
                self._remove_rows(row_ids)
                self._db.execute("DELETE FROM documents WHERE document_id = ?", (document_id,))
        return len(row_ids)

    def search(self, query: str | np.ndarray, top_k: int = 5, document_ids: Sequence[str] | None = None) -> list[SearchHit]:
        """The `top_k` chunks closest to `query` (a text, embedded here, or a vector of the index
        dimension used as given), best first; only chunks of `document_ids` when given.
        Raises `InvalidInputError` for top_k < 1, `DimensionMismatchError` for a vector of
        another size, `DocumentNotFoundError` for an unknown id in `document_ids`."""
        if top_k < 1:
            raise InvalidInputError(f"top_k must be at least 1, got {top_k}")
        vector = self._query_vector(query)
        with self._lock:
            self._refresh()
            selector = None
            candidates = int(self._faiss.ntotal)
            if document_ids is not None:
                self._require_documents(document_ids)
                allowed = self._row_ids(document_ids)
                selector = faiss.IDSelectorBatch(allowed)
                candidates = len(allowed)
            k = min(top_k, candidates)
            if k == 0:
                return []
            scores, ids = self._faiss.search(vector, k, params=self._search_params(selector, k))
            found = [(float(score), int(row)) for score, row in zip(scores[0], ids[0]) if row >= 0]
            by_row = self._chunks_by_row([row for _, row in found])
        return [SearchHit(score, by_row[row]) for score, row in found]

    def query_vector(self, query: str | np.ndarray) -> np.ndarray:
        """`query` as `search` uses it: a text embedded, or a vector checked against the index dimension."""
        return self._query_vector(query)

    def _query_vector(self, query: str | np.ndarray) -> np.ndarray:
        vector = self.embedder.embed([query]) if isinstance(query, str) else np.asarray(query, dtype=np.float32).reshape(1, -1)
        if vector.shape != (1, self._manifest.dim):
            raise DimensionMismatchError(f"query vector has dimension {vector.shape[-1]}, the index has {self._manifest.dim}")
        return np.ascontiguousarray(vector, dtype=np.float32)

    def _search_params(self, selector: faiss.IDSelector | None, k: int) -> faiss.SearchParameters:
        if self.index_type == "hnsw":
            params = faiss.SearchParametersHNSW(efSearch=max(HNSW_EF_SEARCH, k))
        else:
            params = faiss.SearchParameters()
        if selector is not None:
            params.sel = selector
        return params

    def _embed(self, texts: list[str], progress: Progress | None) -> np.ndarray:
        """Embed `texts` in batches, reporting progress; check shape and finiteness."""
        parts = []
        for first in range(0, len(texts), EMBED_BATCH):
            parts.append(np.asarray(self.embedder.embed(texts[first : first + EMBED_BATCH]), dtype=np.float32))
            if progress is not None:
                progress(min(first + EMBED_BATCH, len(texts)), len(texts))
        vectors = np.concatenate(parts) if parts else np.zeros((0, self._manifest.dim), dtype=np.float32)
        return self._checked(vectors, len(texts))

    def _checked(self, vectors: np.ndarray, count: int) -> np.ndarray:
        """`vectors` as a contiguous float32 array, if it holds `count` finite rows of the index
        dimension; else `DimensionMismatchError` or `InvalidInputError`."""
        if vectors.ndim != 2 or vectors.shape != (count, self._manifest.dim):
            raise DimensionMismatchError(
                f"embedder {self.embedder.name!r} returned vectors of shape {vectors.shape}, the index needs ({count}, {self._manifest.dim})"
            )
        if not np.isfinite(vectors).all():
            raise InvalidInputError(f"embedder {self.embedder.name!r} returned non-finite values")
        return np.ascontiguousarray(vectors)

    def _require_documents(self, document_ids: Sequence[str]) -> None:
        for document_id in document_ids:
            if not self._has(document_id):
                raise DocumentNotFoundError(document_id)

    def _row_ids(self, document_ids: Sequence[str]) -> np.ndarray:
        rows = []
        for document_id in document_ids:
            rows += [row for (row,) in self._db.execute("SELECT row_id FROM chunks WHERE document_id = ?", (document_id,))]
        return np.asarray(rows, dtype=np.int64)

    def _chunks_by_row(self, row_ids: list[int]) -> dict[int, Chunk]:
        marks = ",".join("?" * len(row_ids))
        rows = self._db.execute(f"SELECT {_CHUNK_COLUMNS} FROM chunks c JOIN documents d USING (document_id) WHERE c.row_id IN ({marks})", row_ids)
        return {row[0]: _chunk_from_row(row) for row in rows}

    def _insert(self, chunks: Sequence[Chunk], row_ids: np.ndarray) -> None:
        now = time.time()
        documents = {chunk.document_id: (chunk.document_id, chunk.title, chunk.source, now) for chunk in chunks}
        self._db.executemany("INSERT INTO documents VALUES (?, ?, ?, ?)", documents.values())
        self._db.executemany(
            "INSERT INTO chunks VALUES (?, ?, ?, ?, ?, ?)",
            [(int(row), c.chunk_id, c.document_id, c.chunk_index, c.text, c.token_count) for row, c in zip(row_ids, chunks)],
        )

    def _remove_rows(self, row_ids: np.ndarray) -> None:
        """Delete rows from SQLite and their vectors from FAISS (HNSW cannot remove: rebuild)."""
        if len(row_ids) == 0:
            return
        self._db.executemany("DELETE FROM chunks WHERE row_id = ?", [(int(row),) for row in row_ids])
        if self.index_type == "flat":
            self._faiss.remove_ids(faiss.IDSelectorBatch(row_ids))
            return
        inner = faiss.downcast_index(self._faiss.index)
        vectors = inner.reconstruct_n(0, inner.ntotal)
        ids = faiss.vector_to_array(self._faiss.id_map)
        keep = ~np.isin(ids, row_ids)
        rebuilt = self._new_faiss(self.index_type, self._manifest.dim)
        rebuilt.add_with_ids(vectors[keep], ids[keep])
        self._faiss = rebuilt

    @contextlib.contextmanager
    def _exclusive(self) -> Iterator[None]:
        """(Thread lock held.) Hold the directory's write lock, with the newest generation loaded.
        Raises `IndexLockedError` after `lock_timeout` s, and whatever loading a newer generation raises."""
        self.directory.mkdir(parents=True, exist_ok=True)
        try:
            self._write_lock.acquire()
        except filelock.Timeout:
            raise IndexLockedError(str(self.directory), lock_holder(self.directory / LOCK_NAME), self._write_lock.timeout) from None
        try:
            self._refresh(strict=True)
            yield
        finally:
            self._write_lock.release()

    def _refresh(self, strict: bool = False) -> None:
        """(Thread lock held.) Load the generation another process published since this object
        last loaded or saved one. A read skips the check while the manifest's stat is unchanged
        and, when the new generation cannot be loaded, logs that once and keeps serving the one
        it holds; a write (`strict`, under the write lock) compares generations and raises."""
        path = self.directory / MANIFEST_NAME
        seen = _stat_key(path)
        if seen == self._seen and not strict:
            return
        if seen is None:  # no manifest (never saved, or removed): nothing newer to load
            self._seen = None
            return
        try:
            on_disk = Manifest.read(path)
            if (on_disk.generation, on_disk.index_file) == (self._manifest.generation, self._manifest.index_file):
                self._seen = seen
                return
            held = self._manifest.generation
            self._load()
        except RetrievalError as exc:
            if strict:
                raise
            self._seen = seen
            log.warning("index %s: cannot load the generation another process published (%s); still serving generation %d",
                        self.directory, exc, self._manifest.generation)
            return
        log.info("index %s: loaded generation %d published by another process (held %d)", self.directory, self._manifest.generation, held)

    @contextlib.contextmanager
    def _mutation(self) -> Iterator[None]:
        """Run a change, then persist it; on any failure reload the last saved state."""
        try:
            yield
            self._db.commit()
            self._save()
        except BaseException:
            self._load()
            raise

    def _new_faiss(self, index_type: str, dim: int) -> faiss.IndexIDMap2:
        if index_type == "hnsw":
            inner = faiss.IndexHNSWFlat(dim, self._hnsw_m, faiss.METRIC_INNER_PRODUCT)
            inner.hnsw.efSearch = HNSW_EF_SEARCH
        else:
            inner = faiss.IndexFlatIP(dim)
        return faiss.IndexIDMap2(inner)

    def _load(self) -> None:
        """(Re)load the saved state, or start empty when the directory has no manifest."""
        manifest_path = self.directory / MANIFEST_NAME
        for attempt in range(1, LOAD_ATTEMPTS + 1):
            seen = _stat_key(manifest_path)
            if seen is None:
                dim = int(self.embedder.dim)
                manifest = Manifest(self.embedder.name, dim, self._requested_type, 0, 0, 0, "", "")
                index = self._new_faiss(self._requested_type, dim)
                db = sqlite3.connect(":memory:", check_same_thread=False)
                db.executescript(_SCHEMA)
                break
            manifest = Manifest.read(manifest_path)
            _check_embedder(manifest, self.embedder)
            try:
                index, db = _read_generation(self.directory, manifest)
                break
            except IndexCorruptError:
                # Another process may have published a newer generation and removed this one's
                # files after we read the manifest: then read the new manifest.
                if attempt == LOAD_ATTEMPTS or _stat_key(manifest_path) == seen:
                    raise
        previous = getattr(self, "_db", None)
        self._manifest, self._faiss, self._db, self._seen = manifest, index, db, seen
        if previous is not None:
            previous.close()

    def _save(self) -> None:
        """Write a new generation, then the manifest naming it; then drop older files."""
        self.directory.mkdir(parents=True, exist_ok=True)
        generation = self._manifest.generation + 1
        manifest = Manifest(
            embedder=self.embedder.name,
            dim=self._manifest.dim,
            index_type=self._manifest.index_type,
            count=int(self._faiss.ntotal),
            documents=self._db.execute("SELECT COUNT(*) FROM documents").fetchone()[0],
            generation=generation,
            index_file=f"index-{generation:06d}.faiss",
            metadata_file=f"meta-{generation:06d}.sqlite",
        )
        try:
            write_atomic(self.directory / manifest.index_file, faiss.serialize_index(self._faiss).tobytes())
            write_atomic(self.directory / manifest.metadata_file, self._db.serialize())
            write_atomic(self.directory / MANIFEST_NAME, manifest.to_bytes())
        except BaseException:
            self._discard_unpublished(manifest)
            raise
        self._manifest, self._seen = manifest, _stat_key(self.directory / MANIFEST_NAME)
        for path in self.directory.iterdir():
            if path.name not in (MANIFEST_NAME, manifest.index_file, manifest.metadata_file) and _is_index_file(path.name):
                path.unlink(missing_ok=True)

    def _discard_unpublished(self, manifest: Manifest) -> None:
        """After a failed save, remove the new generation's files unless the manifest on disk
        already names them (the failure came after the manifest was replaced)."""
        manifest_path = self.directory / MANIFEST_NAME
        if manifest_path.exists() and Manifest.read(manifest_path).generation == manifest.generation:
            return
        for name in (manifest.index_file, manifest.metadata_file):
            (self.directory / name).unlink(missing_ok=True)


def write_atomic(path: Path, data: bytes) -> None:
    """Write `data` to `path` so that `path` is either its old content or all of `data`:
    write a temp file in the same directory, fsync it, `os.replace` it, fsync the directory."""
    temp = path.with_name(f".{path.name}.tmp")
    try:
        with open(temp, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(temp, path)
    except BaseException:
        temp.unlink(missing_ok=True)
        raise
    directory = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(directory)
    finally:
        os.close(directory)


def lock_holder(path: Path) -> str | None:
    """Who holds the flock on `path`, as "pid N (command line)", read from /proc/locks: Linux,
    and only a process in this PID namespace (a `docker compose exec` into the gateway's
    container sees the gateway). None when that cannot be told."""
    try:
        inode = os.stat(path).st_ino
        for line in Path("/proc/locks").read_text().splitlines():
            # "1: FLOCK  ADVISORY  WRITE 4711 fd:00:1234 0 EOF" (pid, device:inode); a waiter has "->" in fields[1].
            # Only the inode is compared: on overlay filesystems the device differs from what stat says.
            fields = line.split()
            if len(fields) > 5 and fields[1] == "FLOCK" and fields[5].rsplit(":", 1)[-1] == str(inode):
                pid = fields[4]
                command = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
                return f"pid {pid} ({command[:200]})" if command else f"pid {pid}"
    except (OSError, ValueError):
        return None
    return None


def _stat_key(path: Path) -> tuple[int, int, int] | None:
    """(inode, mtime, size) of `path`, None if it does not exist. A manifest is always replaced
    by a new file, so a published generation changes the inode (and the mtime)."""
    try:
        info = os.stat(path)
    except FileNotFoundError:
        return None
    return info.st_ino, info.st_mtime_ns, info.st_size


def _is_index_file(name: str) -> bool:
    """Whether `name` is a generation file or a temp file this module writes."""
    return (name.startswith(("index-", "meta-")) and name.endswith((".faiss", ".sqlite"))) or (name.startswith(".") and name.endswith(".tmp"))


def _check_embedder(manifest: Manifest, embedder: Embedder) -> None:
    if manifest.dim != embedder.dim:
        raise DimensionMismatchError(
            f"the index was built with {manifest.embedder!r} (dimension {manifest.dim}); embedder {embedder.name!r} has dimension {embedder.dim}"
        )
    if manifest.embedder != embedder.name:
        raise EmbedderMismatchError(f"the index was built with embedder {manifest.embedder!r}, not {embedder.name!r}")


def _read_generation(directory: Path, manifest: Manifest) -> tuple[faiss.IndexIDMap2, sqlite3.Connection]:
    """Load the FAISS index and SQLite database named by `manifest`; check they agree with it."""
    try:
        index = faiss.deserialize_index(np.frombuffer((directory / manifest.index_file).read_bytes(), dtype=np.uint8))
        db = sqlite3.connect(":memory:", check_same_thread=False)
        db.deserialize((directory / manifest.metadata_file).read_bytes())
        rows = db.execute("SELECT COUNT(*) FROM chunks").fetchone()[0]
    except (OSError, RuntimeError, sqlite3.Error) as exc:
        raise IndexCorruptError(f"cannot read index generation {manifest.generation} in {directory}: {exc}") from exc
    if not index.ntotal == rows == manifest.count or index.d != manifest.dim:
        raise IndexCorruptError(
            f"index in {directory} is inconsistent: manifest says {manifest.count} chunks of dimension {manifest.dim}, "
            f"FAISS holds {index.ntotal} of dimension {index.d}, SQLite {rows}"
        )
    return index, db


def _check_chunk_sets(chunks: Sequence[Chunk]) -> None:
    """Raise `InvalidInputError` unless each document's chunk indexes are exactly 0..n-1."""
    if not chunks:
        raise InvalidInputError("nothing to add: no chunks")
    indexes: dict[str, list[int]] = {}
    for chunk in chunks:
        indexes.setdefault(chunk.document_id, []).append(chunk.chunk_index)
    for document_id, found in indexes.items():
        if sorted(found) != list(range(len(found))):
            raise InvalidInputError(f"document {document_id!r}: chunk indexes must be 0..{len(found) - 1} once each, got {sorted(found)}")


def _chunk_from_row(row: tuple) -> Chunk:
    return Chunk(*row[1:])

"""Ingestion: read documents from files, directories or request bodies, chunk them, index them.

Formats (`retrieval.formats`): `.txt`, `.md`, `.rst`, `.html`/`.htm` (one document per file,
titled from its heading or `<title>`) and `.jsonl` (one JSON object per line: "id" and "text"
required, "title" and "source" optional; blank lines are skipped), each optionally gzip'd
(`.md.gz`). A directory is walked recursively: hidden entries are
ignored and files of other types are skipped and reported. Document ids: a file named directly
is `<file name>`; a file found under directory D is `<D's name>/<path inside D>`; a JSONL line
supplies its own.

Everything is read, validated, chunked and embedded before the index changes, so bad input
(missing path, unknown extension, empty or binary file, malformed JSONL line, duplicate id,
embedder of another dimension) raises a `RetrievalError` and leaves the index as it was.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from retrieval.chunker import Chunker
from retrieval.document import Chunk, Document, clip
from retrieval.errors import EmptyInputError, InputNotFoundError, InvalidInputError, RetrievalError
from retrieval.formats import SUPPORTED_DESCRIPTION, decode_text, is_supported, markdown_title, parse_jsonl, read_documents, require_format
from retrieval.index import VectorIndex
from retrieval.pipeline import IngestCallback, chunk_and_embed



@dataclass(frozen=True)
class IngestSummary:
    """What an ingestion did: documents and chunks written (`replaced` of the documents already
    existed), wall-clock seconds, and files a directory walk skipped for their type."""

    documents: int
    chunks: int
    seconds: float
    replaced: int = 0
    skipped: tuple[str, ...] = ()


def document_from_text(body: str | bytes, document_id: str, title: str = "", source: str = "<request>") -> Document:
    """One document from a text or Markdown body (the title defaults to a leading `# heading`)."""
    text = decode_text(body, source)
    return Document(document_id, text, title or clip(markdown_title(text), "title"), source)


def load_documents(paths: Iterable[str | Path]) -> tuple[list[Document], tuple[str, ...]]:
    """Read every document under `paths` (files or directories). Returns the documents and the
    files skipped during directory walks, each as "path (reason)": an unsupported type, or
    content that does not parse (a named file with such content raises instead). Raises `InputNotFoundError` for a missing path or a
    directory without documents, `UnsupportedFormatError` for a file named directly with an
    unknown extension, `InvalidInputError` for a document id found twice, and the errors of
    `decode_text` / `parse_jsonl` for bad content."""
    documents: list[Document] = []
    skipped: list[str] = []
    for path in map(Path, paths):
        files, skipped_here = _files_under(path)
        skipped += skipped_here
        for file, document_id in files:
            if path.is_dir():  # found by a walk: a file that does not parse is reported, not fatal
                try:
                    documents += _read_file(file, document_id)
                except RetrievalError as exc:
                    skipped.append(f"{file} ({exc})")
            else:
                documents += _read_file(file, document_id)
    _check_unique(documents)
    return documents, tuple(skipped)


def ingest_documents(documents: Sequence[Document], index: VectorIndex, chunker: Chunker, progress: IngestCallback | None = None,
                     admit: Callable[[Sequence[Chunk]], None] | None = None) -> IngestSummary:
    """Chunk `documents` and upsert them into `index` (replacing documents of the same id):
    chunking runs on a thread while the index's embedder embeds windows of chunks across
    documents (`retrieval.pipeline.chunk_and_embed`). `progress(IngestProgress)` is called as
    chunks are embedded; `admit(chunks)`, when given, before anything is written: what it raises
    (a quota) stops the ingest. Atomic: on error nothing changes."""
    started = time.perf_counter()
    if not documents:
        raise EmptyInputError("no documents to ingest")
    _check_unique(documents)
    embedded = chunk_and_embed(documents, chunker, index.embedder, progress)
    if admit is not None:
        admit(embedded.chunks)
    replaced = index.upsert_embedded(embedded.chunks, embedded.vectors)
    return IngestSummary(len(documents), len(embedded.chunks), time.perf_counter() - started, replaced)


def ingest_paths(paths: Iterable[str | Path], index: VectorIndex, chunker: Chunker, progress: IngestCallback | None = None) -> IngestSummary:
    """Read (`load_documents`) and ingest (`ingest_documents`) files and directories."""
    started = time.perf_counter()
    documents, skipped = load_documents(paths)
    summary = ingest_documents(documents, index, chunker, progress)
    return IngestSummary(summary.documents, summary.chunks, time.perf_counter() - started, summary.replaced, skipped)


def ingest_text(body: str | bytes, document_id: str, index: VectorIndex, chunker: Chunker, title: str = "", source: str = "<request>") -> IngestSummary:
    """Ingest one text or Markdown body as document `document_id` (e.g. from an HTTP request)."""
    return ingest_documents([document_from_text(body, document_id, title, source)], index, chunker)


def ingest_jsonl(body: str | bytes, index: VectorIndex, chunker: Chunker, source: str = "<request>") -> IngestSummary:
    """Ingest every document of a JSONL body (e.g. from an HTTP request)."""
    return ingest_documents(parse_jsonl(body, source), index, chunker)


def _files_under(path: Path) -> tuple[list[tuple[Path, str]], list[str]]:
    """The (file, document id) pairs to read for `path`, and the files skipped by type."""
    if path.is_file():
        require_format(path.name, str(path))
        return [(path, path.name)], []
    if not path.is_dir():
        raise InputNotFoundError(f"{path}: no such file or directory")
    root = path.resolve().name
    files, skipped = [], []
    for file in sorted(path.rglob("*")):
        relative = file.relative_to(path)
        if not file.is_file() or any(part.startswith(".") for part in relative.parts):
            continue
        if is_supported(file.name):
            files.append((file, f"{root}/{relative.as_posix()}"))
        else:
            skipped.append(f"{file} (unsupported type)")
    if not files:
        raise InputNotFoundError(f"{path}: no {SUPPORTED_DESCRIPTION} files found")
    return files, skipped


def _read_file(path: Path, document_id: str) -> list[Document]:
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise InputNotFoundError(f"{path}: cannot read: {exc.strerror}") from exc
    return read_documents(data, path.name, document_id, str(path))


def _check_unique(documents: Sequence[Document]) -> None:
    seen: dict[str, str] = {}
    for document in documents:
        if document.document_id in seen:
            raise InvalidInputError(f"document id {document.document_id!r} appears twice ({seen[document.document_id]} and {document.source})")
        seen[document.document_id] = document.source


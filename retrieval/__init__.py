"""Offline retrieval for the gateway: chunk documents, embed them, index and search them.

    from retrieval import Chunker, MiniLMEmbedder, VectorIndex, ingest_paths
    embedder = MiniLMEmbedder()
    index = VectorIndex("data/index", embedder)
    ingest_paths(["docs/"], index, Chunker(serving_tokenizer))
    hits = index.search("how does the seam work?", top_k=5)

Modules: `document` (Document, Chunk), `formats` (file types), `chunker`, `embedder`, `index` (VectorIndex),
`pipeline` (chunking while embedding), `ingest`,
`errors` (RetrievalError and subclasses), `cli` (the `hypic ingest` command).
No FastAPI or pydantic here: results are plain dataclasses.
"""

from retrieval.chunker import Chunker
from retrieval.document import Chunk, Document, chunk_id_for
from retrieval.embedder import Embedder, HashingEmbedder, LocalEmbedder, MiniLMEmbedder, load_embedder, minilm_model_dir
from retrieval.errors import (
    BinaryInputError,
    DimensionMismatchError,
    DocumentNotFoundError,
    EmbedderMismatchError,
    EmptyInputError,
    IndexCorruptError,
    IndexLockedError,
    InputNotFoundError,
    InvalidInputError,
    MalformedItemError,
    MalformedLineError,
    RetrievalError,
    UnsupportedFormatError,
)
from retrieval.formats import parse_json, read_documents
from retrieval.index import DocumentInfo, Manifest, SearchHit, VectorIndex
from retrieval.ingest import (
    IngestSummary,
    document_from_text,
    ingest_documents,
    ingest_jsonl,
    ingest_paths,
    ingest_text,
    load_documents,
    parse_jsonl,
)
from retrieval.pipeline import EmbeddedChunks, IngestProgress, ProgressLog, chunk_and_embed, chunk_and_embed_reference

__all__ = [
    "BinaryInputError",
    "Chunk",
    "Chunker",
    "DimensionMismatchError",
    "Document",
    "DocumentInfo",
    "DocumentNotFoundError",
    "EmbeddedChunks",
    "Embedder",
    "EmbedderMismatchError",
    "EmptyInputError",
    "HashingEmbedder",
    "IndexCorruptError",
    "IndexLockedError",
    "IngestProgress",
    "IngestSummary",
    "InputNotFoundError",
    "InvalidInputError",
    "LocalEmbedder",
    "MalformedItemError",
    "MalformedLineError",
    "Manifest",
    "MiniLMEmbedder",
    "ProgressLog",
    "RetrievalError",
    "SearchHit",
    "UnsupportedFormatError",
    "VectorIndex",
    "chunk_and_embed",
    "chunk_and_embed_reference",
    "chunk_id_for",
    "document_from_text",
    "ingest_documents",
    "ingest_jsonl",
    "ingest_paths",
    "ingest_text",
    "load_documents",
    "load_embedder",
    "minilm_model_dir",
    "parse_json",
    "parse_jsonl",
    "read_documents",
]

"""Offline retrieval for the gateway: chunk documents, embed them, index and search them.

    from retrieval import Chunker, MiniLMEmbedder, VectorIndex, ingest_paths
    embedder = MiniLMEmbedder()
    index = VectorIndex("data/index", embedder)
    ingest_paths(["docs/"], index, Chunker(serving_tokenizer))
    hits = index.search("how does the seam work?", top_k=5)

Modules: `document` (Document, Chunk), `formats` (file types), `chunker`, `embedder`, `index` (VectorIndex), `ingest`,
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
    InputNotFoundError,
    InvalidInputError,
    MalformedLineError,
    RetrievalError,
    UnsupportedFormatError,
)
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

__all__ = [
    "BinaryInputError",
    "Chunk",
    "Chunker",
    "DimensionMismatchError",
    "Document",
    "DocumentInfo",
    "DocumentNotFoundError",
    "Embedder",
    "EmbedderMismatchError",
    "EmptyInputError",
    "HashingEmbedder",
    "IndexCorruptError",
    "IngestSummary",
    "InputNotFoundError",
    "InvalidInputError",
    "LocalEmbedder",
    "MalformedLineError",
    "Manifest",
    "MiniLMEmbedder",
    "RetrievalError",
    "SearchHit",
    "UnsupportedFormatError",
    "VectorIndex",
    "chunk_id_for",
    "document_from_text",
    "ingest_documents",
    "ingest_jsonl",
    "ingest_paths",
    "ingest_text",
    "load_documents",
    "load_embedder",
    "minilm_model_dir",
    "parse_jsonl",
]

"""Retrieval: the index, the corpus ingested at startup, chunking and the embedder."""

from __future__ import annotations

from pathlib import Path

from pydantic import Field

from .base import AreaSettings

DEFAULT_INDEX_DIR = "data/index"
DEMO_CORPUS_PATH = "data/demo_corpus.jsonl"


class RetrievalSettings(AreaSettings):
    """Where documents are indexed and how many chunks a request retrieves."""

    index_dir: Path = Field(Path(DEFAULT_INDEX_DIR), description="The default tenant's index of chunks (and their "
                            "embeddings); created when missing.")
    corpus_path: Path | None = Field(Path(DEMO_CORPUS_PATH), description="Ingested at startup when the index is empty. The demo corpus "
                                     "(this default) only goes into the default index_dir, never into an index you point the gateway at; "
                                     "a corpus_path you set goes into any empty index. none: never ingest at startup.")
    chunk_tokens: int | None = Field(None, ge=8, description="Chunk size (serving-model tokens) for documents added through the API; "
                                     "default: min(384, a quarter of the model's context). Chunks may reach 4/3 of it.")
    embedder: str = Field("minilm", description="minilm, hashing, hashing-<dim>, or a model directory.")
    default_top_k: int = Field(4, ge=1, description="Chunks retrieved for a /query or /search that names no top_k.")
    max_top_k: int = Field(32, ge=1, description="Largest top_k a request may ask for; beyond: 400 naming top_k.")

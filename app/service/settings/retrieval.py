"""Retrieval: the index, the corpus ingested at startup, chunking and the embedder."""

from __future__ import annotations

from pathlib import Path

from pydantic import Field

from .base import AreaSettings

DEFAULT_INDEX_DIR = "data/index"
# The demo corpus a model gets when corpus_path is unset: the project's own docs (real English,
# data/docs_corpus.jsonl, built by data/docs_corpus.py), except for hypic-tiny, a model of a
# made-up world, which gets that world (data/demo_corpus.jsonl) in an index of its own.
DEMO_CORPUS_PATH = "data/docs_corpus.jsonl"
TINY_MODEL = "hypic-tiny"
TINY_CORPUS_PATH = "data/demo_corpus.jsonl"
TINY_INDEX_DIR = "data/hypic-tiny/index"


def demo_corpus(model: str) -> Path:
    """The corpus ingested into `model`'s default index at startup when corpus_path is unset."""
    return Path(TINY_CORPUS_PATH if model == TINY_MODEL else DEMO_CORPUS_PATH)


def default_index_dir(model: str) -> Path:
    """`model`'s index when index_dir is unset: hypic-tiny's world apart from the real-language one."""
    return Path(TINY_INDEX_DIR if model == TINY_MODEL else DEFAULT_INDEX_DIR)


class RetrievalSettings(AreaSettings):
    """Where documents are indexed and how many chunks a request retrieves."""

    index_dir: Path = Field(Path(DEFAULT_INDEX_DIR), description="The default tenant's index of chunks (and their "
                            "embeddings); created when missing. Unset: data/index, or data/hypic-tiny/index when the "
                            "model is hypic-tiny.")
    corpus_path: Path | None = Field(Path(DEMO_CORPUS_PATH), description="Ingested at startup when the index is empty. Unset: "
                                     "the demo corpus, the project's own docs (data/docs_corpus.jsonl; hypic-tiny: its made-up "
                                     "world, data/demo_corpus.jsonl), and only into the model's default index_dir, never into an "
                                     "index you point the gateway at; a corpus_path you set goes into any empty index. none: "
                                     "never ingest at startup.")
    chunk_tokens: int | None = Field(None, ge=8, description="Chunk size (serving-model tokens) for documents added through the API; "
                                     "default: min(384, a quarter of the model's context). Chunks may reach 4/3 of it.")
    embedder: str = Field("minilm", description="minilm, hashing, hashing-<dim>, or a model directory.")
    default_top_k: int = Field(4, ge=1, description="Chunks retrieved for a /query or /search that names no top_k.")
    max_top_k: int = Field(32, ge=1, description="Largest top_k a request may ask for; beyond: 400 naming top_k.")

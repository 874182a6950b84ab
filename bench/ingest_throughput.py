"""Ingest throughput: chunks per second through chunk + embed + index + save.

    .venv/bin/python bench/ingest_throughput.py [--documents 120] [--threads 1] [--tokenizer DIR]

Builds a synthetic corpus from data/retrieval_eval/corpus.jsonl: each document is a seeded
random selection of paragraphs from it, each paragraph prefixed with a unique section line, so
chunks are distinct and near the default 384-token target. For each embedder it ingests the
corpus into a fresh index and reports documents, chunks, chunking seconds, total seconds and
chunks/s; embedders print side by side.
"""

from __future__ import annotations

import argparse
import random
import tempfile
import time
from pathlib import Path

from transformers import AutoTokenizer

from retrieval import Chunker, Document, HashingEmbedder, MiniLMEmbedder, VectorIndex, ingest_documents, load_documents, minilm_model_dir

EVAL_CORPUS = Path(__file__).resolve().parents[1] / "data" / "retrieval_eval" / "corpus.jsonl"
PARAGRAPHS_PER_DOCUMENT = 12


def synthetic_corpus(count: int, seed: int = 0) -> list[Document]:
    """`count` documents of PARAGRAPHS_PER_DOCUMENT paragraphs drawn from the eval corpus."""
    paragraphs = [document.text for document in load_documents([EVAL_CORPUS])[0]]
    rng = random.Random(seed)
    documents = []
    for number in range(count):
        body = "\n\n".join(f"Section {number}.{part}. {rng.choice(paragraphs)}" for part in range(PARAGRAPHS_PER_DOCUMENT))
        documents.append(Document(f"synthetic-{number}", body, source="bench"))
    return documents


def measure(embedder, documents: list[Document], chunker: Chunker) -> dict[str, float]:
    """Chunk-only time, then a full ingest into a fresh index; returns the figures."""
    started = time.perf_counter()
    chunks = [chunk for document in documents for chunk in chunker.chunk(document)]
    chunking = time.perf_counter() - started
    with tempfile.TemporaryDirectory() as directory:
        summary = ingest_documents(documents, VectorIndex(directory, embedder), chunker)
    assert summary.chunks == len(chunks)
    return {
        "documents": summary.documents,
        "chunks": summary.chunks,
        "mean tokens/chunk": sum(chunk.token_count for chunk in chunks) / len(chunks),
        "chunking s": chunking,
        "ingest s": summary.seconds,
        "chunks/s": summary.chunks / summary.seconds,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--documents", type=int, default=120)
    parser.add_argument("--threads", type=int, default=1, help="torch threads for MiniLM")
    parser.add_argument("--tokenizer", type=Path, default=None, help="chunking tokenizer directory (default: MiniLM's)")
    args = parser.parse_args()

    tokenizer = AutoTokenizer.from_pretrained(str(args.tokenizer or minilm_model_dir()), local_files_only=True)
    chunker = Chunker(tokenizer)
    documents = synthetic_corpus(args.documents)
    table = {}
    for embedder in (MiniLMEmbedder(num_threads=args.threads), HashingEmbedder(256)):
        embedder.embed(["warm up"])
        table[embedder.name] = measure(embedder, documents, chunker)
    names = list(table)
    print(f"chunker: target {chunker.target_tokens} / max {chunker.max_tokens} tokens, tokenizer {tokenizer.name_or_path}; MiniLM threads {args.threads}")
    print("| metric | " + " | ".join(names) + " |")
    print("|---|" + "---|" * len(names))
    for metric in table[names[0]]:
        print(f"| {metric} | " + " | ".join(_format(table[name][metric]) for name in names) + " |")


def _format(value: float) -> str:
    return f"{value:.1f}" if isinstance(value, float) else str(value)


if __name__ == "__main__":
    main()

"""Ingest throughput: chunks per second through chunk + embed + index + save, before and after.

    .venv/bin/python bench/ingest_throughput.py [--corpus stdlib|synthetic|PATH...] [--documents 40]
                                                [--workers N] [--tokenizer DIR] [--skip-before]

Corpora (real English text, available offline):
- `stdlib` (default): the pydoc text of the first `--documents` public modules of Python's
  standard library, alphabetically (the same text wherever this Python version runs);
- `synthetic`: seeded selections of paragraphs from data/retrieval_eval/corpus.jsonl;
- paths: files and directories read as `hypic ingest` reads them (e.g. /usr/share/doc).

Chunks are cut with the serving model's tokenizer (models/hypic-tiny) unless `--tokenizer` names
another, at its default chunk size. Three MiniLM ingests into fresh indexes, side by side:
- before: the previous path (chunk every document, then embed in order in 64-chunk slices:
  `VectorIndex.upsert`), 1 torch thread;
- after, 1 worker: `ingest_documents` (chunking on a thread, embedding in length-sorted windows
  of 256 chunks across documents), 1 torch thread;
- after, N workers: the same with N embedding batches at once (`hypic ingest`'s default:
  one per usable core), 1 torch thread each.
"""

from __future__ import annotations

import argparse
import importlib
import os
import pkgutil
import pydoc
import random
import sys
import tempfile
import time
import warnings
from pathlib import Path

from transformers import AutoTokenizer

from retrieval import Chunker, Document, MiniLMEmbedder, VectorIndex, ingest_documents, load_documents
from retrieval.chunker import default_chunk_tokens
from retrieval.cli import SERVING_MODEL_DIR, context_window

EVAL_CORPUS = Path(__file__).resolve().parents[1] / "data" / "retrieval_eval" / "corpus.jsonl"
PARAGRAPHS_PER_DOCUMENT = 12


def stdlib_corpus(count: int) -> list[Document]:
    """The pydoc text of the first `count` public stdlib modules that import and document cleanly."""
    stdlib = Path(os.__file__).parent
    names = sorted(m.name for m in pkgutil.iter_modules([str(stdlib)]) if not m.name.startswith("_") and m.name not in ("antigravity", "this"))
    documents = []
    for name in names:
        if len(documents) == count:
            break
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                text = pydoc.plaintext.document(importlib.import_module(name))
        except BaseException:  # modules that need a display, a platform or a missing C library
            continue
        if text.strip():
            documents.append(Document(f"stdlib/{name}", text, name, "pydoc"))
    return documents


def synthetic_corpus(count: int, seed: int = 0) -> list[Document]:
    """`count` documents of PARAGRAPHS_PER_DOCUMENT paragraphs drawn from the eval corpus."""
    paragraphs = [document.text for document in load_documents([EVAL_CORPUS])[0]]
    rng = random.Random(seed)
    documents = []
    for number in range(count):
        body = "\n\n".join(f"Section {number}.{part}. {rng.choice(paragraphs)}" for part in range(PARAGRAPHS_PER_DOCUMENT))
        documents.append(Document(f"synthetic-{number}", body, source="bench"))
    return documents


def before(documents: list[Document], chunker: Chunker, embedder) -> tuple[int, float]:
    """The previous ingest path: chunk everything, then `upsert` (64-chunk slices in order)."""
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as directory:
        index = VectorIndex(directory, embedder)
        chunks = [chunk for document in documents for chunk in chunker.chunk(document)]
        index.upsert(chunks)
    return len(chunks), time.perf_counter() - started


def after(documents: list[Document], chunker: Chunker, embedder) -> tuple[int, float]:
    with tempfile.TemporaryDirectory() as directory:
        summary = ingest_documents(documents, VectorIndex(directory, embedder), chunker)
    return summary.chunks, summary.seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--corpus", nargs="+", default=["stdlib"], help="stdlib, synthetic, or files/directories")
    parser.add_argument("--documents", type=int, default=40, help="documents of the stdlib or synthetic corpus")
    parser.add_argument("--workers", type=int, default=len(os.sched_getaffinity(0)), help="embedding workers of the last column")
    parser.add_argument("--tokenizer", type=Path, default=None, help="chunking tokenizer directory (default: the serving model's)")
    parser.add_argument("--skip-before", action="store_true", help="only measure the new path")
    args = parser.parse_args()

    if args.corpus == ["stdlib"]:
        documents = stdlib_corpus(args.documents)
    elif args.corpus == ["synthetic"]:
        documents = synthetic_corpus(args.documents)
    else:
        documents = load_documents(args.corpus)[0]
    tokenizer_dir = args.tokenizer or SERVING_MODEL_DIR
    target = default_chunk_tokens(context_window(args.tokenizer))
    chunker = Chunker(AutoTokenizer.from_pretrained(str(tokenizer_dir), local_files_only=True), target, target * 4 // 3)
    started = time.perf_counter()
    chunks = [chunk for document in documents for chunk in chunker.chunk(document)]
    chunking = time.perf_counter() - started
    print(f"corpus {' '.join(args.corpus)}: {len(documents)} documents, {sum(len(d.text) for d in documents)} characters, "
          f"{len(chunks)} chunks of {sum(c.token_count for c in chunks) / len(chunks):.1f} tokens on average "
          f"(target {chunker.target_tokens}, max {chunker.max_tokens}, tokenizer {tokenizer_dir}); chunking alone {chunking:.1f} s",
          flush=True)

    runs = {}
    if not args.skip_before:
        runs["before (1 thread)"] = lambda: before(documents, chunker, MiniLMEmbedder(num_threads=1))
    runs["after, 1 worker"] = lambda: after(documents, chunker, MiniLMEmbedder(num_threads=1, workers=1))
    runs[f"after, {args.workers} workers"] = lambda: after(documents, chunker, MiniLMEmbedder(num_threads=1, workers=args.workers))
    table = {}
    for name, run in runs.items():
        load = os.getloadavg()[0]
        count, seconds = run()
        table[name] = {"chunks": count, "seconds": seconds, "chunks/s": count / seconds, "load average at start": load}
        print(f"{name}: {count} chunks in {seconds:.1f} s = {count / seconds:.1f} chunks/s (load {load:.2f})", file=sys.stderr, flush=True)
    names = list(table)
    base = table[names[0]]["chunks/s"]
    print("| metric | " + " | ".join(names) + " |")
    print("|---|" + "---|" * len(names))
    for metric in table[names[0]]:
        print(f"| {metric} | " + " | ".join(_format(table[name][metric]) for name in names) + " |")
    print("| speed-up | " + " | ".join(f"{table[name]['chunks/s'] / base:.2f}x" for name in names) + " |")


def _format(value: float) -> str:
    return f"{value:.1f}" if isinstance(value, float) else str(value)


if __name__ == "__main__":
    main()

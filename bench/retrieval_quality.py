"""Retrieval quality on the labelled eval set: recall@1, recall@5 and MRR per embedder.

    .venv/bin/python bench/retrieval_quality.py [--embedders minilm,hashing] [--threads 1]

Each embedder gets a fresh index of data/retrieval_eval/corpus.jsonl (chunked with MiniLM's
tokenizer, the same for all, so only the embedder differs). A query's ranking is its hits'
documents in order, first occurrence only. recall@k is the share of a query's relevant documents
in its top k, averaged over queries; MRR uses the first relevant document's rank (0 if not in
the top 20). Results print as one table, embedders side by side.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

from transformers import AutoTokenizer

from retrieval import Chunker, HashingEmbedder, MiniLMEmbedder, VectorIndex, ingest_documents, load_documents, minilm_model_dir

EVAL_DIR = Path(__file__).resolve().parents[1] / "data" / "retrieval_eval"
SEARCH_DEPTH = 20


def ranked_documents(index: VectorIndex, query: str) -> list[str]:
    """Document ids of the top chunks for `query`, best first, each id once."""
    ranking: list[str] = []
    for hit in index.search(query, top_k=SEARCH_DEPTH):
        if hit.chunk.document_id not in ranking:
            ranking.append(hit.chunk.document_id)
    return ranking


def evaluate(index: VectorIndex, queries: list[dict]) -> dict[str, float]:
    """Mean recall@1, recall@5, MRR and per-query latency (ms) of `index` on `queries`."""
    totals = {"recall@1": 0.0, "recall@5": 0.0, "MRR": 0.0}
    started = time.perf_counter()
    for query in queries:
        ranking = ranked_documents(index, query["query"])
        relevant = set(query["relevant"])
        totals["recall@1"] += len(relevant & set(ranking[:1])) / len(relevant)
        totals["recall@5"] += len(relevant & set(ranking[:5])) / len(relevant)
        first = next((rank for rank, doc in enumerate(ranking, start=1) if doc in relevant), None)
        totals["MRR"] += 1.0 / first if first else 0.0
    results = {name: value / len(queries) for name, value in totals.items()}
    results["query ms"] = 1000 * (time.perf_counter() - started) / len(queries)
    return results


def build_embedder(spec: str, threads: int):
    return MiniLMEmbedder(num_threads=threads) if spec == "minilm" else HashingEmbedder(256)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--corpus", type=Path, default=EVAL_DIR / "corpus.jsonl")
    parser.add_argument("--queries", type=Path, default=EVAL_DIR / "queries.jsonl")
    parser.add_argument("--embedders", default="minilm,hashing", help="comma-separated: minilm, hashing")
    parser.add_argument("--threads", type=int, default=1, help="torch threads for MiniLM")
    args = parser.parse_args()

    documents, _ = load_documents([args.corpus])
    queries = [json.loads(line) for line in args.queries.read_text().splitlines() if line.strip()]
    chunker = Chunker(AutoTokenizer.from_pretrained(str(minilm_model_dir()), local_files_only=True))
    table: dict[str, dict[str, float]] = {}
    for spec in args.embedders.split(","):
        with tempfile.TemporaryDirectory() as directory:
            index = VectorIndex(directory, build_embedder(spec, args.threads))
            summary = ingest_documents(documents, index, chunker)
            table[index.embedder.name] = {**evaluate(index, queries), "chunks": summary.chunks}
    print(f"{len(documents)} documents, {len(queries)} queries ({args.corpus.name}, {args.queries.name})")
    names = list(table)
    print("| metric | " + " | ".join(names) + " |")
    print("|---|" + "---|" * len(names))
    for metric in ["recall@1", "recall@5", "MRR", "query ms", "chunks"]:
        print(f"| {metric} | " + " | ".join(f"{table[name][metric]:.3f}" if metric != "chunks" else f"{table[name][metric]:.0f}" for name in names) + " |")


if __name__ == "__main__":
    main()

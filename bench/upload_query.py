"""Query latency while a large upload is being embedded, against a real `hypic serve`.

Starts the gateway (the hypic-tiny model and the MiniLM embedder, as `hypic serve` runs them by
default; a fresh index, no disk cache, guard off), sends `--idle` queries one after another, then
uploads `--documents` generated documents in one `POST /documents` (JSONL) and, while it is being
chunked and embedded, sends a query every `--every` seconds until it is answered. Queries search
only the 20 seed documents (`document_ids`), so they retrieve the same chunks idle and during the
upload (whose documents would otherwise be retrieved, and prefilled cold). Prints the
query latencies (end to end, and the `retrieval_ms` the gateway reports) idle and during the
upload, side by side.

    .venv/bin/python bench/upload_query.py --documents 900
    .venv/bin/python bench/upload_query.py --root /path/to/another/checkout   # that checkout's gateway

The hostile round of issue 51 measured 13-15 s per query during a 300-document upload (28 s
during 900): the embedder held one lock for a whole window of 256 chunks.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import threading
import time

import httpx

WORDS = ("harbour salt amber river council winter ledger bridge mill grain market tower archive valley "
         "lantern merchant treaty season quarry orchard festival canal granite copper weaver").split()
QUESTIONS = ["Where does Lyastil trade salt?", "Who keeps the ledger of the mill?", "When is the lantern festival?",
             "Which river runs past the quarry?", "What does the council of the valley decide?"]


def documents(count: int, size: int, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    out = []
    for i in range(count):
        name = f"Town{i:04d}"
        words: list[str] = []
        while sum(len(w) + 1 for w in words) < size:
            words += [name, *rng.sample(WORDS, 8)]
        out.append({"id": f"upload-{i:04d}", "title": name, "text": " ".join(words) + "."})
    return out


SEED_IDS: list[str] = []  # the documents queries search (fixed, so that the upload changes no query's work)


def query(url: str, question: str) -> dict:
    """One query's seconds: end to end as the client saw it, and the gateway's own timings."""
    started = time.perf_counter()
    r = httpx.post(f"{url}/query", json={"question": question, "top_k": 3, "max_tokens": 8, "document_ids": SEED_IDS},
                   timeout=300)
    r.raise_for_status()
    t = r.json()["timings"]
    return {"e2e": time.perf_counter() - started, "retrieval": t["retrieval_ms"] / 1000,
            "ttft": (t["ttft_ms"] or 0) / 1000, "prefill": (t["prefill_ms"] or 0) / 1000}


def percentile(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, round(q * (len(values) - 1)))]


def summary(name: str, rows: list[dict]) -> str:
    if not rows:
        return f"{name}: no queries"
    cols = []
    for field in ("e2e", "retrieval"):
        values = [r[field] for r in rows]
        cols += [statistics.median(values), percentile(values, 0.95), max(values)]
    cols += [statistics.median(r["ttft"] for r in rows), statistics.median(r["prefill"] for r in rows)]
    return f"{name:>14} | {len(rows):>3} | " + " | ".join(f"{c:7.3f}" for c in cols)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--documents", type=int, default=900)
    parser.add_argument("--size", type=int, default=1000, help="characters per generated document")
    parser.add_argument("--idle", type=int, default=20, help="queries before the upload")
    parser.add_argument("--every", type=float, default=0.25, help="seconds between queries during the upload")
    parser.add_argument("--root", default=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                        help="the checkout whose gateway to run (default: this one)")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        port = 20000 + os.getpid() % 20000
        env = {**os.environ, "HYPIC_INDEX_DIR": f"{tmp}/index", "HYPIC_CACHE_DIR": "none", "HYPIC_PORT": str(port),
               "HYPIC_MODEL": "hypic-tiny", "HYPIC_EMBEDDER": "minilm", "HYPIC_GUARD_ENABLED": "false",
               "HYPIC_LOG_LEVEL": "warning", "TOKENIZERS_PARALLELISM": "false", "PYTHONPATH": args.root}
        # In the checkout (`python -c` puts the working directory first on sys.path), with its models/.
        server = subprocess.Popen([sys.executable, "-c", "import app; print('gateway from', app.__file__, flush=True); "
                                   "from app.cli import main; main()", "serve"], env=env, cwd=args.root)
        url = f"http://127.0.0.1:{port}"
        try:
            deadline = time.monotonic() + 300
            while True:
                try:
                    if httpx.get(f"{url}/ready", timeout=5).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                if time.monotonic() > deadline or server.poll() is not None:
                    raise SystemExit("the gateway did not become ready")
                time.sleep(0.5)
            seed = documents(20, args.size, seed=1)
            for d in seed:
                d["id"] = "seed-" + d["id"]
            SEED_IDS[:] = [d["id"] for d in seed]
            httpx.post(f"{url}/documents", json=seed, timeout=300).raise_for_status()
            for q in QUESTIONS:
                query(url, q)  # warm: first calls of each path
            idle = [query(url, QUESTIONS[i % len(QUESTIONS)]) for i in range(args.idle)]

            body = "".join(json.dumps(d) + "\n" for d in documents(args.documents, args.size))
            upload: dict = {}

            def send() -> None:
                started = time.perf_counter()
                r = httpx.post(f"{url}/documents", content=body.encode(), headers={"content-type": "application/jsonl"},
                               timeout=3600)
                upload.update(status=r.status_code, seconds=time.perf_counter() - started, reply=r.json())

            uploader = threading.Thread(target=send)
            uploader.start()
            time.sleep(1.0)  # read and validated; chunking and embedding under way
            during, i = [], 0
            while uploader.is_alive():
                during.append(query(url, QUESTIONS[i % len(QUESTIONS)]))
                i += 1
                time.sleep(args.every)
            uploader.join()
        finally:
            server.terminate()
            server.wait(30)
    reply = upload.get("reply", {})
    print(f"upload: {args.documents} documents, {len(body) / 1e6:.2f} MB, status {upload.get('status')}, "
          f"{upload.get('seconds', 0):.1f} s, {reply.get('chunks', '?')} chunks")
    print("queries (seconds) | n | e2e p50 | e2e p95 | e2e max | retrieval p50 | retrieval p95 | retrieval max | "
          "ttft p50 | prefill p50")
    print(summary("idle", idle))
    print(summary("during upload", during))
    if idle and during:
        for field in ("e2e", "retrieval"):
            late = percentile([r[field] for r in during], 0.95) - percentile([r[field] for r in idle], 0.95)
            print(f"{field} p95 during - idle: {late:+.3f} s")


if __name__ == "__main__":
    main()

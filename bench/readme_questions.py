"""The README's questions, asked of a served model in `full` and `hypic` mode: does it still answer them?

Starts `hypic serve` on MODEL with a fresh index of the demo corpus (data/docs_corpus.jsonl) in a
temporary directory (so data/index is never touched), asks every question of the README's table
(`| question | its answer (both modes) |`) through POST /query in both modes (greedy, 24 tokens,
top_k 4 unless told otherwise) and prints, per question, both answers and whether each holds the
README's expected answer (its numbers and most of its longer words, as tests/gateway/test_demo_corpus.py
checks the table against the corpus). Writes the rows to a JSON file.

    .venv/bin/python bench/readme_questions.py --model smollm2-hybrid-135m-reuse --json bench/results/readme_questions_reuse.json
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from harness import cpu_name, wait_until_ready  # bench/, the script's own folder

ROOT = Path(__file__).resolve().parents[1]


def readme_questions(readme: str) -> list[tuple[str, str]]:
    """(question, expected answer) rows of the README's table of questions."""
    table = readme.split("| question | its answer (both modes) |", 1)[1].split("\n\n", 1)[0]
    return re.findall(r'^\| ([^|]+\?) \| "([^"]+)" \|', table, flags=re.M)


def holds(answer: str, expected: str) -> bool:
    """Whether `answer` carries `expected`'s numbers and at least 60% of its words of 5+ letters
    (the "..." of a table cell stands for text that may differ)."""
    text = answer.lower()
    numbers = re.findall(r"\d+(?:\.\d+)?", expected)
    words = re.findall(r"[a-z][a-z0-9-]{4,}", expected.lower())
    return all(n in text for n in numbers) and sum(w in text for w in words) >= 0.6 * len(words)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--port", type=int, default=8766)
    ap.add_argument("--top-k", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=24)
    ap.add_argument("--threads", type=int, default=1, help="HYPIC_TORCH_THREADS of the gateway")
    ap.add_argument("--timeout", type=float, default=900.0)
    ap.add_argument("--also", nargs="*", default=[], help="more questions, asked and shown (no expected answer)")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    rows = readme_questions((ROOT / "README.md").read_text(encoding="utf-8")) + [(q, None) for q in args.also]
    work = Path(tempfile.mkdtemp(prefix="readme-questions-"))
    env = {**os.environ, "HYPIC_MODEL": args.model, "HYPIC_PORT": str(args.port), "HYPIC_TORCH_THREADS": str(args.threads),
           "HYPIC_INDEX_DIR": str(work / "index"), "HYPIC_CORPUS_PATH": str(ROOT / "data" / "docs_corpus.jsonl"),
           "HYPIC_CACHE_DIR": "none", "HYPIC_COLLECTIONS_DIR": str(work / "collections")}
    log = open(work / "serve.log", "w")
    server = subprocess.Popen([str(ROOT / ".venv" / "bin" / "hypic"), "serve"], cwd=ROOT, env=env, stdout=log,
                              stderr=subprocess.STDOUT, start_new_session=True)
    url, results = f"http://127.0.0.1:{args.port}", []
    try:
        started = time.perf_counter()
        wait_until_ready(server, url, started, args.timeout, work / "serve.log")
        print(f"{args.model}: ready after {time.perf_counter() - started:.0f} s", file=sys.stderr)
        for i, (question, expected) in enumerate(rows, 1):
            row = {"question": question, "expected": expected}
            for mode in ("full", "hypic"):
                reply = httpx.post(f"{url}/query", json={"question": question, "mode": mode, "max_tokens": args.max_tokens,
                                                         "top_k": args.top_k, "temperature": 0}, timeout=args.timeout).json()
                row[mode] = {"answer": reply["answer"], "holds": None if expected is None else holds(reply["answer"], expected)}
            results.append(row)
            marks = {True: "ok", False: "NO", None: "--"}
            print(f"[{i}/{len(rows)}] {question}\n  full  ({marks[row['full']['holds']]}): {row['full']['answer']!r}"
                  f"\n  hypic ({marks[row['hypic']['holds']]}): {row['hypic']['answer']!r}", file=sys.stderr)
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        server.wait(timeout=60)
        log.close()
    table = [r for r in results if r["expected"] is not None]
    both = sum(r["full"]["holds"] and r["hypic"]["holds"] for r in table)
    print(f"{args.model}: {both} of {len(table)} answered in both modes "
          f"(full {sum(r['full']['holds'] for r in table)}, hypic {sum(r['hypic']['holds'] for r in table)})")
    if args.json:
        args.json.write_text(json.dumps({
            "command": " ".join([".venv/bin/python bench/readme_questions.py", *sys.argv[1:]]),
            "date": time.strftime("%Y-%m-%d", time.gmtime()), "cpu": cpu_name(), "model": args.model, "top_k": args.top_k,
            "max_tokens": args.max_tokens, "rows": results}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

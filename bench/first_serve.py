"""A newcomer's first serve, timed: `scripts/serve` with nothing set, to /ready, to the README's first
question answered in `hypic` mode.

Starts from an empty default index (data/index, data/cache and data/collections are moved aside and
put back afterwards), so the time includes loading the default model and ingesting the demo corpus
(data/docs_corpus.jsonl); the install itself is not timed (run `scripts/serve` once before). Writes
the times, the answer and the machine's load to a JSON file.

    .venv/bin/python bench/first_serve.py --json bench/results/first_serve.json [--env HYPIC_TORCH_THREADS=1]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from harness import cpu_name, wait_until_ready  # bench/, the script's own folder

ROOT = Path(__file__).resolve().parents[1]
QUESTION = "Which port does the gateway listen on?"  # the README's first curl
STATE = ("data/index", "data/cache", "data/collections")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--port", type=int, default=8765)
    ap.add_argument("--question", default=QUESTION)
    ap.add_argument("--max-tokens", type=int, default=24)
    ap.add_argument("--timeout", type=float, default=900.0)
    ap.add_argument("--env", nargs="*", default=[], help="NAME=VALUE settings for the gateway (e.g. HYPIC_TORCH_THREADS=1)")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    env = {**os.environ, "HYPIC_PORT": str(args.port), **dict(item.split("=", 1) for item in args.env)}
    aside = Path(tempfile.mkdtemp(prefix="first-serve-"))
    moved = [name for name in STATE if (ROOT / name).exists()]
    for name in moved:
        shutil.move(str(ROOT / name), aside / Path(name).name)
    load_before = os.getloadavg()
    started = time.perf_counter()
    log = open(aside / "serve.log", "w")
    server = subprocess.Popen([str(ROOT / "scripts" / "serve")], cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                              start_new_session=True)
    result: dict = {}
    try:
        url = f"http://127.0.0.1:{args.port}"
        wait_until_ready(server, url, started, args.timeout, aside / "serve.log")
        ready = time.perf_counter() - started
        reply = httpx.post(f"{url}/query", json={"question": args.question, "mode": "hypic", "max_tokens": args.max_tokens},
                           timeout=args.timeout).json()
        answered = time.perf_counter() - started
        result = {
            "command": " ".join([".venv/bin/python bench/first_serve.py", *sys.argv[1:]]),
            "date": time.strftime("%Y-%m-%d", time.gmtime()), "cpu": cpu_name(), "cpus": os.cpu_count(),
            "env": dict(item.split("=", 1) for item in args.env), "question": args.question,
            "ready_s": round(ready, 1), "first_answer_s": round(answered, 1), "answer": reply.get("answer"),
            "sources": [s["document_id"] for s in reply.get("sources", [])], "ttft_ms": (reply.get("timings") or {}).get("ttft_ms"),
            "load_before": [round(x, 2) for x in load_before], "load_after": [round(x, 2) for x in os.getloadavg()],
        }
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        server.wait(timeout=60)
        log.close()
        for name in STATE:  # the run's own state goes; what was there before comes back
            shutil.rmtree(ROOT / name, ignore_errors=True)
        for name in moved:
            shutil.move(str(aside / Path(name).name), ROOT / name)
    print(json.dumps(result, indent=1))
    if args.json:
        args.json.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

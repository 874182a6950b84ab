"""The accuracy guard's whole-answer watch on a served model over many requests: does it trip, and when?

Starts `hypic serve` on MODEL (an empty index, so the model's release card and nothing else decides
the threshold unless --min-faithfulness is given), then sends REQUESTS requests of the faithfulness
set's kind (bench/faithfulness.py `build_prompts`: 3-8 held-out documents in a random order, a
templated question; seed 1, so not the prompts the release card was measured on) through
POST /v1/chat/completions, the question as the user's message and the documents as `segments` (the
chat template around them, as /query lays out its chunks), greedy, one at a time, and after each reads
the guard off /health (its shadow checks run while the engine is idle, so each is given time to run).
Prints the request at which the guard left `ok` (tripped), or that it never did, with the checks it
ran and its faithfulness estimate (identical 32-token answers, Wilson 95% interval) against the
threshold. Writes every request's guard state to a JSON file.

    .venv/bin/python bench/guard_soak.py --model smollm2-hybrid-135m-reuse --requests 500 \
        --json bench/results/guard_soak_smollm2-hybrid-135m-reuse.json
    # a deliberately unfaithful control: reuse without a seam, no recompute
    .venv/bin/python bench/guard_soak.py --model smollm2-135m-instruct --mode pic-naive --seam 0 --requests 50
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from faithfulness import build_prompts, load_docs  # bench/, the script's own folder
from harness import cpu_name, wait_until_ready

ROOT = Path(__file__).resolve().parents[1]


def guard(url: str) -> dict:
    return httpx.get(f"{url}/health", timeout=60).json()["guard"]


def settled(url: str, timeout: float) -> dict:
    """The guard once no shadow check is pending (or after `timeout` seconds)."""
    deadline = time.monotonic() + timeout
    while True:
        g = guard(url)
        if g.get("pending", 0) == 0 or time.monotonic() > deadline:
            return g
        time.sleep(0.1)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--requests", type=int, default=500)
    ap.add_argument("--mode", default="hypic", help="HYPIC_DEFAULT_MODE of the gateway")
    ap.add_argument("--seam", type=int, default=None, help="HYPIC_SEAM (default: the gateway's)")
    ap.add_argument("--max-tokens", type=int, default=8, help="tokens each request asks for (a check compares 32 itself)")
    ap.add_argument("--sample-rate", type=float, default=None, help="HYPIC_GUARD_SAMPLE_RATE (default: the gateway's)")
    ap.add_argument("--min-faithfulness", type=float, default=None, help="HYPIC_GUARD_MIN_FAITHFULNESS (default: the card's)")
    ap.add_argument("--stop-on-trip", action="store_true", help="stop at the first action")
    ap.add_argument("--port", type=int, default=8767)
    ap.add_argument("--threads", type=int, default=1, help="HYPIC_TORCH_THREADS of the gateway")
    ap.add_argument("--timeout", type=float, default=900.0)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    prompts = build_prompts(load_docs(), args.requests, seed=1)
    work = Path(tempfile.mkdtemp(prefix="guard-soak-"))
    env = {**os.environ, "HYPIC_MODEL": args.model, "HYPIC_PORT": str(args.port), "HYPIC_TORCH_THREADS": str(args.threads),
           "HYPIC_INDEX_DIR": str(work / "index"), "HYPIC_CACHE_DIR": "none", "HYPIC_COLLECTIONS_DIR": str(work / "collections"),
           "HYPIC_DEFAULT_MODE": args.mode}
    for name, value in (("HYPIC_SEAM", args.seam), ("HYPIC_GUARD_SAMPLE_RATE", args.sample_rate),
                        ("HYPIC_GUARD_MIN_FAITHFULNESS", args.min_faithfulness)):
        if value is not None:
            env[name] = str(value)
    log = open(work / "serve.log", "w")
    server = subprocess.Popen([str(ROOT / ".venv" / "bin" / "hypic"), "serve"], cwd=ROOT, env=env, stdout=log,
                              stderr=subprocess.STDOUT, start_new_session=True)
    url, rows, tripped = f"http://127.0.0.1:{args.port}", [], None
    started = time.perf_counter()
    try:
        wait_until_ready(server, url, started, args.timeout, work / "serve.log")
        first = guard(url)
        print(f"{args.model}: ready after {time.perf_counter() - started:.0f} s; threshold "
              f"{first['faithfulness'].get('threshold')} ({first['faithfulness'].get('threshold_from')})", file=sys.stderr)
        for i, p in enumerate(prompts, 1):
            body = {"model": args.model, "messages": [{"role": "user", "content": p.question}], "segments": list(p.documents),
                    "max_tokens": args.max_tokens, "temperature": 0}
            reply = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=args.timeout)
            if reply.status_code != 200:
                raise SystemExit(f"request {i}: {reply.status_code} {reply.text[:300]}")
            g = settled(url, args.timeout)
            f = g["faithfulness"]
            rows.append({"request": i, "state": g["state"], "checks": g["checks"], "errors": g["errors"],
                         "answers": f.get("answers"), "estimate": f.get("estimate"), "low": f.get("low"),
                         "high": f.get("high"), "threshold": f.get("threshold")})
            if g["state"] != "ok" and tripped is None:
                tripped = i
                print(f"tripped at request {i}: {g.get('last_action')}", file=sys.stderr)
            if i % 10 == 0 or i == len(prompts) or tripped == i:
                print(f"[{i}/{len(prompts)}] {time.perf_counter() - started:.0f} s, state {g['state']}, {g['checks']} checks, "
                      f"faithfulness {f.get('estimate')} ({f.get('low')}-{f.get('high')}) of {f.get('answers')}, "
                      f"threshold {f.get('threshold')}", file=sys.stderr, flush=True)
            if tripped is not None and args.stop_on_trip:
                break
        final = guard(url)
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        server.wait(timeout=60)
        log.close()
    f = final["faithfulness"]
    verdict = f"tripped at request {tripped}" if tripped else f"did not trip in {len(rows)} requests"
    print(f"{args.model} ({args.mode}, seam {args.seam if args.seam is not None else 'default'}): {verdict}; "
          f"{final['checks']} checks, {final['errors']} errors; faithfulness {f.get('estimate')} "
          f"({f.get('low')}-{f.get('high')}) of {f.get('answers')} answers, threshold {f.get('threshold')} "
          f"({f.get('threshold_from')}); state {final['state']}")
    if args.json:
        args.json.write_text(json.dumps({
            "command": " ".join([".venv/bin/python bench/guard_soak.py", *sys.argv[1:]]),
            "date": time.strftime("%Y-%m-%d", time.gmtime()), "cpu": cpu_name(), "model": args.model, "mode": args.mode,
            "seam": args.seam, "requests": len(rows), "tripped_at": tripped, "guard": final, "rows": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

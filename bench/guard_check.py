"""What the online accuracy guard reports for the bundled model on the demo questions.

Start a gateway that checks every request (and its greedy tokens), then run this script:

    HYPIC_PORT=8141 HYPIC_INDEX_DIR=/tmp/guardrun/index HYPIC_CORPUS_PATH=data/demo_corpus.jsonl \
    HYPIC_GUARD_SAMPLE_RATE=1 HYPIC_GUARD_GREEDY_SAMPLE=1 [HYPIC_SEAM=0] .venv/bin/hypic serve &
    .venv/bin/python bench/guard_check.py

It asks each demo question twice (top_k 5, pausing so the idle-time checks run), then prints the
guard's state and windows from /health.
"""

import argparse
import json
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from app.demo import demo_questions  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", default="http://127.0.0.1:8141")
    parser.add_argument("--rounds", type=int, default=2, help="times each demo question is asked")
    args = parser.parse_args()
    questions = demo_questions(ROOT / "data" / "demo_questions.md")
    for _ in range(args.rounds):
        for question, _, _ in questions:
            r = httpx.post(f"{args.url}/query", json={"question": question, "top_k": 5, "max_tokens": 4}, timeout=60)
            r.raise_for_status()
            time.sleep(0.3)  # idle: the guard runs its checks now
    time.sleep(3)
    guard = httpx.get(f"{args.url}/health").json()["guard"]
    print(f"{len(questions) * args.rounds} requests")
    print(json.dumps({k: guard[k] for k in ("state", "mode", "seam", "agreement", "greedy_agreement", "checks", "dropped", "errors")}))
    print(json.dumps(guard["windows"]))


if __name__ == "__main__":
    main()

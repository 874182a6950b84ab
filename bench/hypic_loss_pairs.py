"""Two `distill train --hypic-weight` runs compared step by step on the same sequences.

Runs started from the same file with the same `--draw-seed` draw the same sequence at each step,
and each RAG step logs the answer's KL to the teacher in `full` (`full_kl_answer`) and as hypic
serves it (`hypic_kl`), both measured before that step's update. So the per-step difference
between two such runs is paired on the sequence: it shows what a change of recipe (for example
`--hypic-documents`) did to the reuse gap while training, with a 95% interval over the steps both
runs logged. Reads the logs only; no model runs.

    .venv/bin/python bench/hypic_loss_pairs.py bench/results/hybrid_hypic_loss_log.jsonl \\
        bench/results/hybrid_hypic_documents_loss_log.jsonl
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

KEYS = ("full_kl_answer", "hypic_kl")


def rag_steps(path: Path) -> dict[int, dict]:
    """step -> log line, for the stage-2 steps that carry both answer KLs (a torn line is skipped)."""
    out = {}
    for line in path.read_text().splitlines():
        try:
            row = json.loads(line)
        except ValueError:
            continue
        if row.get("stage") == 2 and all(k in row for k in KEYS):
            out[int(row["step"])] = row
    return out


def paired(a: list[float], b: list[float]) -> tuple[float, float, int]:
    """(mean of b - a, its 95% half-width, how many steps b is lower on)."""
    d = [y - x for x, y in zip(a, b)]
    m = sum(d) / len(d)
    sd = math.sqrt(sum((x - m) ** 2 for x in d) / (len(d) - 1)) if len(d) > 1 else 0.0
    return m, 1.96 * sd / math.sqrt(len(d)), sum(x < 0 for x in d)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("before", type=Path, help="the first run's log (training_log.jsonl or log.jsonl)")
    p.add_argument("after", type=Path, help="the second run's log")
    p.add_argument("--skip", type=int, default=0, help="leave out the first steps (warm-up: the runs barely differ yet)")
    args = p.parse_args(argv)
    a, b = rag_steps(args.before), rag_steps(args.after)
    steps = sorted(k for k in set(a) & set(b) if k > args.skip)
    if not steps:
        raise SystemExit("the two logs share no RAG step with both answer KLs")
    mismatched = [k for k in steps if a[k].get("kind") != b[k].get("kind") or a[k].get("tokens") != b[k].get("tokens")]
    if mismatched:
        raise SystemExit(f"steps {mismatched[:5]} drew different sequences: the runs are not paired (same start, --draw-seed)")
    print(f"{len(steps)} RAG steps in both (steps {steps[0]}-{steps[-1]}), answer KL to the teacher before each step's update:\n")
    print(f"| measure | {args.before.name} | {args.after.name} | after - before (+-95%) | lower after on |")
    print("|---|---|---|---|---|")
    for key, label in (("full_kl_answer", "`full`"), ("hypic_kl", "hypic"), (None, "hypic - `full`")):
        def val(r):
            return r[key] if key else r["hypic_kl"] - r["full_kl_answer"]
        xa, xb = [val(a[k]) for k in steps], [val(b[k]) for k in steps]
        m, h, lower = paired(xa, xb)
        print(f"| {label} | {sum(xa) / len(xa):.4f} | {sum(xb) / len(xb):.4f} | {m:+.4f} (+-{h:.4f}) | {lower}/{len(steps)} |")


if __name__ == "__main__":
    main()

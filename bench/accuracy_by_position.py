"""`full` accuracy on data/real_qa by how far the gold passage sits from the question.

Reads the raw rows bench/accuracy_real.py writes (bench/results/accuracy_real_*.json) and counts, for each
file, the questions answered by one config (default `full`), grouped by the number of retrieved
documents between the gold passage and the question (0: the gold passage is the last document,
right before the question). A model whose linear layers forget a document over the ones after
it loses the far groups first; attention does not care. Prints a markdown table; no model runs.

    .venv/bin/python bench/accuracy_by_position.py bench/results/accuracy_real_smollm2-135m-instruct_84.json \\
        bench/results/accuracy_real_smollm2-hybrid-135m_r9.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

GROUPS = ((0, 0), (1, 2), (3, 4), (5, 9))


def documents_after_gold(row: dict) -> int:
    """Retrieved documents between the gold passage and the question in this row's prompt."""
    return row["chunks"] - 1 - row["gold_at"]


def group_of(after: int) -> str:
    for lo, hi in GROUPS:
        if lo <= after <= hi:
            return str(lo) if lo == hi else f"{lo}-{hi}"
    raise ValueError(f"{after} documents after the gold passage: outside {GROUPS}")


def by_position(rows: list[dict]) -> dict[str, tuple[int, int]]:
    """{group: (answered, questions)} over `rows`, every group of GROUPS present (in order)."""
    res = {group_of(lo): [0, 0] for lo, _ in GROUPS}
    for row in rows:
        cell = res[group_of(documents_after_gold(row))]
        cell[0] += bool(row["acc"])
        cell[1] += 1
    return {k: (a, n) for k, (a, n) in res.items()}


def table(files: list[Path], config: str = "full") -> str:
    loaded = [(f, json.loads(f.read_text())) for f in files]
    ids = [[r["id"] for r in raw["rows"][config]] for _, raw in loaded]
    if any(i != ids[0] for i in ids):
        raise SystemExit("the files hold different questions: compare runs of the same questions and contexts")
    counts = [by_position(raw["rows"][config]) for _, raw in loaded]
    head = ["documents after the gold passage", "questions"] + [f.stem.removeprefix("accuracy_real_") for f, _ in loaded]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for group in counts[0]:
        n = counts[0][group][1]
        lines.append(f"| {group} | {n} | " + " | ".join(str(c[group][0]) for c in counts) + " |")
    lines.append(f"| all | {len(ids[0])} | " + " | ".join(str(sum(a for a, _ in c.values())) for c in counts) + " |")
    return "\n".join(lines)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("files", nargs="+", type=Path, help="raw rows of bench/accuracy_real.py (the same questions)")
    p.add_argument("--config", default="full", help="the row label to count (default: full)")
    args = p.parse_args(argv)
    print(table(args.files, args.config))


if __name__ == "__main__":
    main()

"""The hybrid's distillation progress as a picture: held-back KL per pool, and `full` accuracy
on data/real_qa as a share of the teacher's, against stage-2 steps counted across machines.

The shipped `training_log.jsonl` restarts its step count each time a new machine continued from
the shipped mixers (a `"stage": "resume"` line saying the steps "count from 0 again" and naming
the "stage 1 + N stage-2 steps" it restarted from); this adds those N, so every validation lands
at its step in the whole run. A `"stage": "relayer"` line (the run moved to another choice of
attention layers, `distill relayer`) is drawn as a dotted line.
Accuracy points come from `bench/accuracy_real.py --raw` files, each given as STEPS=FILE.

    python -m training.hybrid.progress --accuracy 1890=bench/results/accuracy_real_smollm2-hybrid-135m_r2.json \\
        3563=bench/results/accuracy_real_smollm2-hybrid-135m_r3.json 4970=bench/results/accuracy_real_smollm2-hybrid-135m_r4.json \\
        --out docs/hybrid_progress.png
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
LOG = ROOT / "models" / "smollm2-hybrid-135m" / "training_log.jsonl"
TEACHER = ROOT / "bench" / "results" / "accuracy_real_smollm2-135m-instruct_84.json"


def _walk(lines: list[str]):
    """(stage-2 step in the whole run, record) of every record of a log."""
    offset, last = 0, 0
    for line in lines:
        if not line.strip():
            continue
        rec = json.loads(line)
        if rec.get("stage") == 2:
            last = rec["step"]
        elif rec.get("stage") == "resume" and "count from 0 again" in rec.get("note", ""):
            # the note names the steps in the mixers it restarted from ("stage 1 + N stage-2
            # steps"); steps logged after the last shipped file were lost with their machine
            shipped = re.search(r"stage 1 \+ ([\d,]+) stage-2 steps", rec["note"])
            offset, last = (int(shipped.group(1).replace(",", "")) if shipped else offset + last), 0
        elif rec.get("stage") == "validate":
            last = max(last, rec["step"])  # a validation of shipped mixers whose steps are not in this log
            yield offset + rec["step"], rec
            continue
        yield offset + last, rec


def validations(lines: list[str]) -> list[tuple[int, dict[str, float]]]:
    """(stage-2 step in the whole run, held-back KL per pool) of every validation in a log."""
    return [(step, rec["held_kl"]) for step, rec in _walk(lines) if rec.get("stage") == "validate"]


def layout_changes(lines: list[str]) -> list[int]:
    """Stage-2 steps in the whole run where `distill relayer` moved the run to another layout."""
    return [step for step, rec in _walk(lines) if rec.get("stage") == "relayer"]


def accuracy(raw: Path, config: str = "full") -> float:
    """Answer accuracy (share of questions) of one config in a bench/accuracy_real.py raw file."""
    rows = json.loads(raw.read_text())["rows"][config]
    return sum(r["acc"] for r in rows) / len(rows)


def plot(log: Path, points: dict[int, Path], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lines = log.read_text().splitlines()
    vals = validations(lines)
    fig, (ax_kl, ax_acc) = plt.subplots(1, 2, figsize=(11, 4))
    for n, step in enumerate(layout_changes(lines)):
        for ax in (ax_kl, ax_acc):
            ax.axvline(step, color="black", linestyle=":", label="layers re-chosen (relayer)" if n == 0 else None)
    # a pool added later (rag-long) starts at its first validation; the held-back long answers'
    # full/hypic KL ("rag-long answer, ...": validate's reuse gap) are positions of a pool, not pools
    for pool in (p for p in vals[-1][1] if ", " not in p):
        have = [(s, kl[pool]) for s, kl in vals if pool in kl]
        ax_kl.plot([s for s, _ in have], [v for _, v in have], marker="o", label=pool)
    ax_kl.set_xlabel("stage-2 steps (one sequence each)")
    ax_kl.set_ylabel("held-back KL(teacher || hybrid)")
    ax_kl.set_title("held-back KL per pool")
    ax_kl.legend()
    teacher = accuracy(TEACHER)
    steps = sorted(points)
    shares = [accuracy(points[s]) / teacher for s in steps]
    ax_acc.plot(steps, [100 * x for x in shares], marker="o", label="hybrid full / teacher full")
    ax_acc.axhline(75, color="gray", linestyle="--", label="target: 75% of the teacher")
    for i, (s, x) in enumerate(zip(steps, shares)):
        if i and abs(x - shares[i - 1]) < 1e-9 and s - steps[i - 1] < 500:
            continue  # the same share a few steps on: one label (they would overprint)
        ax_acc.annotate(f"{100 * x:.0f}%", (s, 100 * x), textcoords="offset points", xytext=(0, 6), ha="center")
    ax_acc.set_ylim(0, 100)
    ax_acc.set_xlim(ax_kl.get_xlim())  # the same steps under both panels
    ax_acc.set_xlabel("stage-2 steps (one sequence each)")
    ax_acc.set_ylabel("% of the teacher's accuracy")
    ax_acc.set_title(f"real_qa, all 84 questions (teacher {100 * teacher:.1f}%)")
    ax_acc.legend(loc="upper left")
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--log", type=Path, default=LOG)
    p.add_argument("--accuracy", nargs="*", default=[], help="STEPS=RAW_FILE of bench/accuracy_real.py --raw")
    p.add_argument("--out", type=Path, default=ROOT / "docs" / "hybrid_progress.png")
    args = p.parse_args(argv)
    points = {}
    for item in args.accuracy:
        steps, _, f = item.partition("=")
        if not f:
            p.error(f"--accuracy {item!r}: expected STEPS=FILE")
        points[int(steps)] = Path(f)
    plot(args.log, points, args.out)
    print(args.out)


if __name__ == "__main__":
    main()

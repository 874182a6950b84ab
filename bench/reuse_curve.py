"""The reuse-training curve as a picture: each checkpoint's whole answers against its training step.

From saved runs only (no run of its own): per checkpoint, bench/faithfulness.py's result (the share of
32-token answers identical to `full`'s on the held-out faithfulness set, with its Wilson 95% interval)
and, where given, bench/accuracy_real.py's on the 84 real questions (`full`'s and `hypic`'s correct
answers, and the share where `hypic`'s answer is `full`'s word for word).

    .venv/bin/python bench/reuse_curve.py \\
        --point 0=bench/results/faithfulness_smollm2-hybrid-135m.json,bench/results/accuracy_real_smollm2-hybrid-135m_r12.json \\
        --point 44=bench/results/faithfulness_smollm2-hybrid-135m-reuse-step44.json ... --out docs/reuse_curve.png

A point is `STEP=FAITHFULNESS_JSON[,ACCURACY_JSON]`; `--config` names the reused configuration of both
files' rows (faithfulness `hypic:8`, accuracy `hypic s=8` by default).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

from stats import identical_share  # noqa: E402


def point(spec: str, faith_config: str = "hypic:8", acc_config: str = "hypic s=8") -> dict:
    """One checkpoint's numbers from `STEP=FAITHFULNESS_JSON[,ACCURACY_JSON]`."""
    step, _, files = spec.partition("=")
    if not files or not step.strip().isdigit():
        raise ValueError(f"a point is STEP=FAITHFULNESS_JSON[,ACCURACY_JSON], got {spec!r}")
    faith_path, _, acc_path = files.partition(",")
    faith = json.loads(Path(faith_path).read_text())
    try:
        n, share = identical_share(faith["rows"], faith_config)
    except ValueError as exc:
        raise ValueError(f"{faith_path}: {exc}") from None
    out = {"step": int(step), "n": n, "identical": share.mean, "low": share.low, "high": share.high}
    if acc_path:
        acc = json.loads(Path(acc_path).read_text())
        full = {r["id"]: r for r in acc["rows"]["full"]}
        reused = acc["rows"][acc_config]
        out.update(full_correct=sum(bool(r["acc"]) for r in full.values()), hypic_correct=sum(bool(r["acc"]) for r in reused),
                   questions=len(reused), same_answer=sum(r["answer"] == full[r["id"]]["answer"] for r in reused) / len(reused))
    return out


def plot(points: list[dict], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    points = sorted(points, key=lambda p: p["step"])
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    steps = [p["step"] for p in points]
    ys = [100 * p["identical"] for p in points]
    left.errorbar(steps, ys, yerr=[[y - 100 * p["low"] for y, p in zip(ys, points)], [100 * p["high"] - y for y, p in zip(ys, points)]],
                  marker="o", capsize=4, label="identical to full (Wilson 95%)")
    for x, y, p in zip(steps, ys, points):
        left.annotate(f"n={p['n']}", (x, y), textcoords="offset points", xytext=(6, -12), fontsize=8)
    left.set(xlabel="training step", ylabel="% of 32-token answers", title="held-out faithfulness set: reused answer = full's",
             ylim=(0, 100))
    left.axhline(70, ls=":", color="grey")
    left.annotate("target 70%", (steps[0], 71), fontsize=8, color="grey")
    acc = [p for p in points if "questions" in p]
    if acc:
        xs = [p["step"] for p in acc]
        right.plot(xs, [p["full_correct"] for p in acc], marker="s", label="full: correct")
        right.plot(xs, [p["hypic_correct"] for p in acc], marker="o", label="hypic: correct")
        right.plot(xs, [p["same_answer"] * p["questions"] for p in acc], marker="^", ls="--", label="hypic answer = full's")
        right.set(xlabel="training step", ylabel=f"of {acc[0]['questions']} questions", title="84 real questions (data/real_qa)",
                  ylim=(0, max(40, max(p["same_answer"] * p["questions"] for p in acc) + 5)))
        right.legend(fontsize=8)
    left.legend(fontsize=8, loc="upper left")
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--point", action="append", required=True, help="STEP=FAITHFULNESS_JSON[,ACCURACY_JSON]")
    ap.add_argument("--faith-config", default="hypic:8")
    ap.add_argument("--acc-config", default="hypic s=8")
    ap.add_argument("--out", type=Path, default=ROOT / "docs" / "reuse_curve.png")
    args = ap.parse_args(argv)
    points = [point(p, args.faith_config, args.acc_config) for p in args.point]
    for p in sorted(points, key=lambda p: p["step"]):
        acc = (f"; 84: full {p['full_correct']}, hypic {p['hypic_correct']}, same answer {100 * p['same_answer']:.1f}%"
               if "questions" in p else "")
        print(f"step {p['step']}: identical {100 * p['identical']:.1f}% of {p['n']} ({100 * p['low']:.1f}-{100 * p['high']:.1f}){acc}")
    plot(points, args.out)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()

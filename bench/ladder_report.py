"""The attention-side ladder (issue 49) in one table and one plot: accuracy vs warm TTFT, both real models.

Accuracy: each config's answers on the real questions (bench/accuracy_real.py raw rows), paired with
`full` on the same prompts; warm TTFT: bench/ladder_ttft.py's JSON, as full / config (higher is
faster). Writes the `ladder-summary` section of docs/accuracy.md and the plot.

    .venv/bin/python bench/ladder_report.py --ttft bench/results/ladder_ttft.json \\
        --rows smollm2-hybrid-135m=bench/results/accuracy_real_smollm2-hybrid-135m_ladder.json \\
               smollm2-135m-instruct=bench/results/accuracy_real_smollm2-135m-instruct_ladder.json \\
        --default "hypic s=8" --out docs/accuracy_vs_ttft.png

`--rows MODEL=A.json,B.json` merges the configs of several runs of the same questions (their `full`
answers must be identical). `--tag` writes another section (e.g. `short-summary` for data/short_qa's rows, with `--out
bench/results/accuracy_short_vs_ttft.png`), leaving the ladder's summary as it is.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
from markdown_section import write_section  # noqa: E402
from stats import mcnemar_exact  # noqa: E402


def summary(models: dict[str, dict], ttft: dict, default: str) -> list[str]:
    """One row per (model, config): answers, paired against full (lost / gained, the exact McNemar p), first-token
    KL, seam tokens, warm speed-up."""
    lines = ["| model | config | n | answers (full's) | lost / gained vs full | McNemar p | same answer as full | first-token KL "
             "| seam tokens / prompt | warm TTFT full / config |", "|---|---|---:|---|---|---:|---:|---:|---:|---:|"]
    for model, rows in models.items():
        full = rows["full"]
        for label in sorted(rows, key=lambda k: k != default):  # the default first
            r = rows[label]
            if label == "full":
                continue
            n = len(r)
            lost = sum(f["acc"] and not x["acc"] for f, x in zip(full, r))
            gained = sum(x["acc"] and not f["acc"] for f, x in zip(full, r))
            seam = [x["seam_tokens"] for x in r if "seam_tokens" in x]
            seam_cell = f"{sum(seam) / len(seam):.0f}" if len(seam) == n else "n/a"
            speed = ttft.get(model, {}).get(label)
            speed_cell = f"{speed['full_over']:.1f}x" if speed else ""
            name = label + (" (default)" if label == default else "")
            lines.append(f"| {model} | {name} | {n} | {sum(x['acc'] for x in r)} ({sum(f['acc'] for f in full)}) "
                         f"| {lost} / {gained} | {mcnemar_exact(lost, gained):.3g} | {100 * sum(x['agree'] for x in r) / n:.0f}% | {sum(x['kl'] for x in r) / n:.4f} "
                         f"| {seam_cell} | {speed_cell} |")
    return lines


def merged_rows(paths: list[str]) -> dict:
    """The configs' rows of several raw-rows files of one model, as one run: each later file adds the configs
    the earlier ones lack. Raises SystemExit unless every file holds the same questions with `full`'s answers
    identical (the runs must be of the same prompts)."""
    rows: dict = {}
    for path in paths:
        more = json.loads(Path(path).read_text())["rows"]
        if rows and [(r.get("id"), r.get("answer")) for r in more["full"]] != [(r.get("id"), r.get("answer")) for r in rows["full"]]:
            raise SystemExit(f"{path}: its full answers differ from {paths[0]}'s (not the same questions or prompts)")
        for label, r in more.items():
            rows.setdefault(label, r)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ttft", type=Path, required=True)
    ap.add_argument("--rows", nargs="+", required=True, help="MODEL=raw rows JSON[,JSON...] (runs of the same questions, merged)")
    ap.add_argument("--default", default="hypic s=8", help="the config to mark as the default")
    ap.add_argument("--out", type=Path, default=Path("docs/accuracy_vs_ttft.png"))
    ap.add_argument("--command", default="", help="the commands that made the inputs, printed above the table")
    ap.add_argument("--tag", default="ladder-summary", help="the docs/accuracy.md section written")
    ap.add_argument("--title", default="The attention-side ladder: accuracy and KL vs warm TTFT")
    args = ap.parse_args()
    ttft = json.loads(args.ttft.read_text())
    models = {spec.split("=", 1)[0]: merged_rows(spec.split("=", 1)[1].split(",")) for spec in args.rows}
    table = summary(models, ttft, args.default)
    print("\n".join(table))
    write_section(ROOT / "docs" / "accuracy.md", "\n".join([f"<!-- {args.tag}:begin -->", *( [args.command, ""] if args.command else []),
                                                          *table, "", f"![accuracy vs warm TTFT]({args.out.name})",
                                                          f"<!-- {args.tag}:end -->"]), args.tag)
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.8))
    for model, marker in zip(models, "os^"):
        rows, speed = models[model], ttft[model]
        pts = []
        for label, r in rows.items():
            if label in speed:
                acc = 100.0 * sum(x["acc"] for x in r) / len(r)
                pts.append((speed[label]["full_over"], acc, sum(x["kl"] for x in r) / len(r), label))
        pts.sort()
        for ax, k in zip(axes, (1, 2)):
            ax.plot([p[0] for p in pts], [p[k] for p in pts], marker=marker, linestyle=":", label=f"{model} (n={len(r)})")
            for p in pts:
                ax.annotate(p[3].replace("hypic ", "") + (" (default)" if p[3] == args.default else ""), (p[0], p[k]),
                            textcoords="offset points", xytext=(4, 4), fontsize=7,
                            weight="bold" if p[3] == args.default else "normal")
    for ax, ylabel in zip(axes, ("answer accuracy (%)", "first-token KL from full (lower is closer)")):
        ax.set_xscale("log")
        ax.set_xlabel("warm TTFT speed-up over full (x, log)")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(args.title)
    fig.tight_layout()
    fig.savefig(args.out, dpi=120)
    print(args.out)


if __name__ == "__main__":
    main()

"""The lead table of docs/accuracy.md: each model, tuned or not, on the 84 real questions and on the
faithfulness set, one row each, from the raw result files (no run of its own).

Per model: `full`'s and `hypic`'s answers on data/real_qa (bench/accuracy_real.py's rows: the gold
answer contained; Wilson 95% intervals), the questions `hypic` lost and gained against `full` with the
exact McNemar p (bench/stats.py), the share of the 84 where `hypic`'s answer is `full`'s word for word,
the mean first-token and answer KL(full || hypic) on the 84; then on the faithfulness set
(bench/faithfulness.py's rows: held-out documents, 32 forced greedy tokens) the share of identical
answers (Wilson 95%) and the answer KL (paired bootstrap 95%).

    .venv/bin/python bench/accuracy_lead.py \\
        --row smollm2-hybrid-135m=bench/results/accuracy_real_smollm2-hybrid-135m_r12.json,bench/results/faithfulness_smollm2-hybrid-135m.json \\
        --row ... [--config "hypic s=8"] [--markdown docs/accuracy.md --section lead]

A row's files are `ACCURACY_JSON[,FAITHFULNESS_JSON]` (a missing faithfulness file leaves its cells empty).
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

from markdown_section import write_section  # noqa: E402
from stats import mcnemar_exact, paired_bootstrap_ci, wilson_interval  # noqa: E402

HEADER = ("| model | `full` answers (95% CI) | `hypic` answers (95% CI) | lost / gained, exact McNemar p "
          "| same answer as `full` (84) | first-token KL | answer KL (84) | identical 32-token answers, "
          "faithfulness set (95% CI) | answer KL, faithfulness set (95% CI) |")
RULE = "|---|---|---|---|---:|---:|---:|---|---|"


def accuracy_cells(result: dict, config: str) -> list[str]:
    """The cells of bench/accuracy_real.py's rows: full, config, lost/gained with p, agreement, KLs."""
    full = {r["id"]: r for r in result["rows"]["full"]}
    rows = [r for r in result["rows"][config] if r["id"] in full]
    if not rows:
        raise SystemExit(f"no {config!r} rows paired with full")
    n = len(rows)
    a = sum(full[r["id"]]["acc"] for r in rows)
    b = sum(r["acc"] for r in rows)
    lost = sum(full[r["id"]]["acc"] and not r["acc"] for r in rows)
    gained = sum(r["acc"] and not full[r["id"]]["acc"] for r in rows)

    def share(k: int) -> str:
        w = wilson_interval(k, n)
        return f"{k}/{n} ({100 * w.low:.0f}-{100 * w.high:.0f}%)"

    agree = sum(r["agree"] for r in rows)
    return [share(a), share(b), f"{lost} / {gained}, p = {mcnemar_exact(lost, gained):.3g}",
            f"{100 * agree / n:.1f}%", f"{statistics.fmean(r['kl'] for r in rows):.3f}",
            f"{statistics.fmean(r['cont_kl'] for r in rows):.3f}"]


def faithfulness_cells(result: dict | None) -> list[str]:
    """Identical share (Wilson) and answer KL (bootstrap) of bench/faithfulness.py's first configuration."""
    if result is None:
        return ["not measured", ""]
    config = result["configs"][0]
    rows = result["rows"]
    k, n = sum(r[config]["identical"] for r in rows), len(rows)
    w = wilson_interval(k, n)
    kl = paired_bootstrap_ci([r[config]["kl_answer"] for r in rows])
    return [f"{100 * k / n:.1f}% of {n} ({100 * w.low:.1f}-{100 * w.high:.1f})", kl.cell(".4f")]


def table(rows: list[tuple[str, dict, dict | None]], config: str) -> list[str]:
    lines = [HEADER, RULE]
    for label, accuracy, faithfulness in rows:
        lines.append("| " + " | ".join([label, *accuracy_cells(accuracy, config), *faithfulness_cells(faithfulness)]) + " |")
    return lines


def parse_row(spec: str) -> tuple[str, dict, dict | None]:
    label, _, files = spec.partition("=")
    if not files:
        raise SystemExit(f"--row {spec!r}: expected LABEL=ACCURACY_JSON[,FAITHFULNESS_JSON]")
    paths = files.split(",")
    accuracy = json.loads(Path(paths[0]).read_text())
    faithfulness = json.loads(Path(paths[1]).read_text()) if len(paths) > 1 and paths[1] else None
    return label, accuracy, faithfulness


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--row", action="append", required=True, help="LABEL=ACCURACY_JSON[,FAITHFULNESS_JSON]")
    ap.add_argument("--config", default="hypic s=8", help="the accuracy rows' reuse configuration")
    ap.add_argument("--markdown", type=Path, help="write the table into this file's section")
    ap.add_argument("--section", default="lead")
    args = ap.parse_args(argv)
    lines = table([parse_row(r) for r in args.row], args.config)
    command = ".venv/bin/python bench/accuracy_lead.py " + " ".join(f"--row {shlex.quote(r)}" for r in args.row)
    if args.config != "hypic s=8":
        command += f" --config {shlex.quote(args.config)}"
    text = "\n".join(lines)
    print(text)
    if args.markdown:
        section = f"<!-- {args.section}:begin -->\n{text}\n\nCommand: `{command}`\n<!-- {args.section}:end -->"
        write_section(args.markdown, section, args.section)


if __name__ == "__main__":
    main()

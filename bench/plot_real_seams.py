"""Plot bench/accuracy_real.py's seam sweeps: answer KL from full and agreement with full against
the seam width, hypic and pic-naive, for every model given (raw rows in bench/results/accuracy_real_*.json).

Run:  .venv/bin/python bench/plot_real_seams.py smollm2-hybrid-135m smollm2-135m-instruct
Writes bench/results/accuracy_real_vs_seam.png.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def series(results: dict, mode: str, key: str) -> tuple[list[int], list[float], list[float]]:
    xs, ys, err = [], [], []
    for label, m, seam in results["configs"]:
        if m != mode:
            continue
        vals = [float(r[key]) for r in results["rows"][label] if key in r]
        if not vals:
            continue
        xs.append(seam)
        ys.append(statistics.fmean(vals) * (100 if key == "agree" else 1))
        sd = statistics.stdev(vals) if len(vals) > 1 else 0.0
        err.append(1.96 * sd / math.sqrt(len(vals)) * (100 if key == "agree" else 1))
    return xs, ys, err


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("models", nargs="+")
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "accuracy_real_vs_seam.png"))
    args = parser.parse_args()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for name in args.models:
        results = json.loads((ROOT / "bench" / "results" / f"accuracy_real_{name}.json").read_text())
        for mode, style in (("hypic", "-o"), ("pic-naive", "--s")):
            for ax, key in zip(axes, ("cont_kl", "agree")):
                xs, ys, err = series(results, mode, key)
                if xs:
                    ax.errorbar([max(x, 0.5) for x in xs], ys, yerr=err, fmt=style, capsize=3, label=f"{name} {mode}")
    axes[0].set_ylabel("answer KL(full || mode), nats/token")
    axes[1].set_ylabel("greedy answer identical to full (%)")
    for ax in axes:
        ax.set_xscale("log", base=2)
        ax.set_xlabel("seam width (tokens; 0 drawn at 0.5)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle("Cache reuse on real text (data/real_qa): error bars are 95% intervals")
    fig.tight_layout()
    fig.savefig(args.out, dpi=110)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()

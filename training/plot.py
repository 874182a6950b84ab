"""Plot a training run's curves from its metrics.jsonl: answer loss, curriculum, validation EM.

Usage: ``python -m training.plot var/train/metrics.jsonl docs/training_curve.png``
"""

from __future__ import annotations

import json
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from training import world  # noqa: E402


def read(path: str) -> tuple[list[dict], list[dict]]:
    """(training rows, validation rows) of a metrics file (10-step averages, evaluations)."""
    rows = [json.loads(line) for line in open(path) if line.strip()]
    return [r for r in rows if "loss" in r], [r for r in rows if "valid" in r]


def plot(metrics: str, out: str) -> None:
    train, valid = read(metrics)
    fig, (ax_loss, ax_em) = plt.subplots(1, 2, figsize=(11, 4))
    steps = [r["step"] for r in train]
    ax_loss.plot(steps, [r["loss"] for r in train], label="answer loss")
    ax_loss.plot(steps, [r["lm"] for r in train], label="next-token loss (whole sequence)", alpha=0.7)
    ax_loss.plot(steps, [r["aux"] for r in train], label="attention-supervision loss", alpha=0.7)
    bound = [r for r in train if "bind" in r]  # --bind-weight runs only
    if bound:
        ax_loss.plot([r["step"] for r in bound], [r["bind"] for r in bound], label="entity-binding probe loss",
                     alpha=0.7)
    ax_loss.set_yscale("log")
    ax_loss.set_xlabel("step")
    twin = ax_loss.twinx()
    twin.plot(steps, [r["max_docs"] for r in train], color="gray", linestyle="--", label="curriculum max docs")
    twin.set_ylabel("max documents per prompt")
    ax_loss.legend(loc="upper right")
    kinds = [k for k in world.KINDS if any(k in r["valid"] for r in valid)]
    for kind in kinds:  # a kind added mid-run is plotted from its first evaluation on
        rows = [r for r in valid if kind in r["valid"]]
        ax_em.plot([r["step"] for r in rows], [100 * r["valid"][kind] for r in rows], marker=".", label=kind)
    ax_em.set_xlabel("step")
    ax_em.set_ylabel("validation exact match (%), k in {1, 5, 10}")
    ax_em.set_ylim(0, 100)
    ax_em.legend()
    fig.tight_layout()
    fig.savefig(out, dpi=90)


if __name__ == "__main__":
    plot(sys.argv[1], sys.argv[2])

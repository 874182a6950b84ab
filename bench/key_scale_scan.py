"""Rung 4 of the accuracy ladder, scanned: first-token KL from `full` against the reused keys' scale.

For each question (data/real_qa's 84 with 3-10 shuffled passages, or data/short_qa's six ~80-token
documents in retrieval order, as bench/accuracy_real.py builds them), one `full` prefill and one
`hypic` seam-8 prefill per `EngineConfig.reuse_key_scale` value, all engines sharing one segment
store (the scale is applied at the stitch; the entries do not depend on it). Prefill only, no
answers: a fast way to choose the values bench/accuracy_real.py then answers with (`--variants 8~S`).
Prints each scale's mean KL, the paired difference to scale 1.0 with a 95% interval, on how many
questions it is lower, and top-1 agreement; progress to stderr.

Run:  .venv/bin/python bench/key_scale_scan.py --model smollm2-hybrid-135m --set short --n 30 \\
          --scales 0.8 0.9 0.95 1.0 1.1 [--json out.json]
      .venv/bin/python bench/key_scale_scan.py --plot bench/results/accuracy_vs_key_scale.png --from A.json B.json ...
      (one line per JSON: mean first-token KL against the scale, each relative to its scale 1.0)
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from accuracy_real import kl, mean_ci, prompt_segments  # noqa: E402
from app.service.prompter import Prompter  # noqa: E402
from app.service.settings import Settings  # noqa: E402
from hypic_core.config import EngineConfig, GenerationRequest, SamplingParams  # noqa: E402
from hypic_core.engine.engine import Engine  # noqa: E402
from hypic_core.models.registry import resolve  # noqa: E402
from real_qa import build_context, load_real_qa  # noqa: E402
from short_qa import load_short_qa  # noqa: E402


def contexts(which: str, n: int, seed: int = 0):
    """(question, chunks) as bench/accuracy_real.py draws them (the same chunk counts and orders)."""
    if which == "short":
        for pair in load_short_qa(seed=seed)[:n]:
            yield pair.question, list(pair.chunks)
        return
    rng = random.Random(seed)
    for pair in load_real_qa()[:n]:
        count = rng.randint(3, min(10, len(pair.distractors) + 1))
        chunks, _ = build_context(pair, count, seed=seed)
        yield pair.question, chunks


def scan(name: str, which: str, n: int, scales: list[float], seam: int = 8) -> dict:
    model = resolve(name)
    settings = Settings(_env_file=None, model=name)
    base = Engine.from_pretrained(model.path, EngineConfig(seam=seam), model_id=settings.served_model_name)
    layout = settings.prompt_layout(base.tokenizer, model.prompt)
    prompter = Prompter(base.tokenizer, layout, base.max_positions)
    engines = {s: Engine(base.model, base.tokenizer, dataclasses.replace(base.config, reuse_key_scale=s), base.store,
                         model_id=settings.served_model_name) for s in scales}
    kls: dict[float, list[float]] = {s: [] for s in scales}
    top1: dict[float, int] = {s: 0 for s in scales}
    t0 = time.perf_counter()
    for i, (question, chunks) in enumerate(contexts(which, n)):
        segs = prompt_segments(prompter, question, chunks)

        def prefill(engine, mode):
            return engine.prefill(GenerationRequest(segs, mode=mode, seam=seam, sampling=SamplingParams(max_tokens=1))).logits

        full = prefill(base, "full")
        for s in scales:
            out = prefill(engines[s], "hypic")
            kls[s].append(kl(full, out))
            top1[s] += int(out.argmax()) == int(full.argmax())
        print(f"[{i + 1}/{n}] {time.perf_counter() - t0:.0f}s "
              + " ".join(f"{s:g}:{statistics.fmean(kls[s]):.4f}" for s in scales), file=sys.stderr, flush=True)
    return {"model": name, "set": which, "n": len(kls[scales[0]]), "seam": seam,
            "kl": {str(s): v for s, v in kls.items()}, "top1": {str(s): v for s, v in top1.items()}}


def table(result: dict) -> list[str]:
    kls = {float(s): v for s, v in result["kl"].items()}
    ref = kls.get(1.0)
    lines = [f"{result['model']}, {result['set']} set, {result['n']} questions, hypic seam {result['seam']}:", "",
             "| key scale | first-token KL (+-95%) | KL - scale 1.0 (+-95%) | lower on | top-1 agree |", "|---:|---|---|---:|---:|"]
    for s, v in sorted(kls.items()):
        m, half = mean_ci(v)
        if ref is None or s == 1.0:
            paired, lower = "", ""
        else:
            d, dh = mean_ci([a - b for a, b in zip(v, ref)])
            paired, lower = f"{d:+.4f} (+-{dh:.4f})", f"{sum(a < b for a, b in zip(v, ref))}/{len(v)}"
        lines.append(f"| {s:g} | {m:.4f} (+-{half:.4f}) | {paired} | {lower} | {result['top1'][str(s)]}/{len(v)} |")
    return lines


def plot(paths: list[Path], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for path in paths:
        result = json.loads(path.read_text())
        kls = {float(s): statistics.fmean(v) for s, v in result["kl"].items()}
        ref = kls.get(1.0, 1.0)
        xs = sorted(kls)
        ax.plot(xs, [kls[x] / ref for x in xs], marker="o",
                label=f"{result['model']}, {result['set']} set ({result['n']} q; KL at 1.0: {ref:.3f})")
    ax.axhline(1.0, color="grey", lw=0.8, ls=":")
    ax.set_xlabel("reused keys' scale k (temperature 1/k on their logits)")
    ax.set_ylabel("first-token KL from full / KL at k = 1")
    ax.set_title("Rung 4: hypic seam 8, first-token KL against the key scale")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out, dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-hybrid-135m")
    ap.add_argument("--set", choices=("real", "short"), default="real")
    ap.add_argument("--n", type=int, default=84)
    ap.add_argument("--scales", type=float, nargs="+", default=[0.85, 0.9, 0.95, 1.0, 1.1])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--json", type=Path, help="also write the per-question KLs here")
    ap.add_argument("--plot", type=Path, help="plot the scans of --from (JSON files of --json) here instead of scanning")
    ap.add_argument("--from", dest="sources", type=Path, nargs="+", default=[])
    args = ap.parse_args()
    if args.plot:
        if not args.sources:
            ap.error("--plot needs --from JSON files")
        return plot(args.sources, args.plot)
    torch.set_num_threads(args.threads)
    result = scan(args.model, args.set, args.n, args.scales)
    print("\n".join(table(result)))
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()

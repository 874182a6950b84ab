"""Warm TTFT of the attention-side ladder's configurations (issue 49) beside `full`, on real checkpoints.

The workload of bench/families.py's real-model rows: a 32-token system prompt, `--chunks` chunks of
`--chunk-len` tokens in a new order per repetition, a 64-token question. Each configuration
(`SEAM[/FRACTION][+p][@R]`, as bench/accuracy_real.py's `--variants`; `@R` a rung-3 recompute budget) gets its own engine over the same
model; its store is filled by one request in another order, then each repetition times `full` and
every configuration warm on the same new order, so the ratios are paired under the same load. With
`+p` the entry prefix is the system prompt (what precedes the first chunk), which is then an exact
snapshot.

    .venv/bin/python bench/ladder_ttft.py --model smollm2-hybrid-135m smollm2-135m-instruct \\
        --configs 8 8+p 8/0.15 8/0.15+p --reps 5
    .venv/bin/python bench/ladder_ttft.py --chunk-len 80 --configs 8 8@0.05 8@0.1 8@0.2 --reps 5   # short documents
    .venv/bin/python bench/ladder_ttft.py --configs 8 --link 4 --reps 5   # what a 4-token link after every chunk costs

With `--link N` every configuration is timed a second time (`<config> +linkN`) on the same requests
with an N-token link segment after every chunk (the layout of a model trained with `hypic tune
--link`; the ids are the first N of SmolLM2's unused special tokens, their values do not change the
work), its ratio taken against the same `full` without links.

With a recompute budget the store is filled by the first request, in another order: the widths a
segment gets depend on its place, so a repetition may still find an entry of its width missing;
those repetitions are filled first (one untimed request in the same order), so every timing is warm.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from hypic_core.config import EngineConfig  # noqa: E402
from hypic_core.engine.engine import Engine  # noqa: E402

from accuracy_real import lever_config, variant  # noqa: E402
from families import real_model  # noqa: E402
from ttft import ttft, ttft_out, workload  # noqa: E402

LINK_IDS = (11, 12, 13, 14, 15, 16)  # SmolLM2's unused special tokens (<jupyter_start> ...)


def measure(model: torch.nn.Module, args) -> dict[str, dict]:
    vocab = min(model.config.vocab_size, 8192)
    system, chunks, questions = workload(args.chunks, args.chunk_len, 64, vocab, 1)
    order = random.Random(0)

    def request(rep):
        perm = chunks[:]
        order.shuffle(perm)
        return [system, *perm, questions[rep % len(questions)]]

    def linked(segs):
        return [segs[0], *(s for chunk in segs[1:-1] for s in (chunk, LINK_IDS[: args.link])), segs[-1]]

    full_engine = Engine(model, config=EngineConfig(seam=8))
    engines = {}
    budgeted = set()
    for spec in args.configs:
        label, _, seam, *levers = variant(spec)
        rule = levers[2]
        engine = Engine(model, config=lever_config(levers, system, seam=seam))
        if rule == "gold":
            raise SystemExit(f"{spec}: the gold oracle needs a question set; time a budget (@R) instead")
        if rule:
            budgeted.add(label)
        ttft(engine, request(100), "hypic")  # fills the store (cold), another order
        engines[label] = engine
        if args.link:
            engine = Engine(model, config=lever_config(levers, system, seam=seam))
            ttft(engine, linked(request(100)), "hypic")
            engines[f"{label} +link{args.link}"] = engine
    ttft(full_engine, request(101), "full")  # warms kernels
    times: dict[str, list[float]] = {"full": [], **{label: [] for label in engines}}
    seams: dict[str, int] = {}
    ratios: dict[str, list[float]] = {label: [] for label in engines}
    for rep in range(args.reps):
        segs = request(rep)
        t_full = ttft(full_engine, segs, "full")
        times["full"].append(t_full)
        for label, engine in engines.items():
            mine = linked(segs) if label.endswith(f" +link{args.link}") and args.link else segs
            if label.split(" +link")[0] in budgeted:
                ttft(engine, mine, "hypic")  # the widths this order gives: their entries computed, untimed
            t, out = ttft_out(engine, mine, "hypic")
            assert out.stats.segment_misses == 0, f"{label}: not warm"
            times[label].append(t)
            ratios[label].append(t_full / t)
            seams[label] = out.stats.seam_tokens
    return {label: {"ms": statistics.median(v) * 1000, "full_over": statistics.median(ratios[label]) if label in ratios else 1.0,
                    "range": (min(ratios[label]), max(ratios[label])) if label in ratios else (1.0, 1.0),
                    "seam_tokens": seams.get(label, 0)} for label, v in times.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", nargs="+", default=["smollm2-hybrid-135m", "smollm2-135m-instruct"])
    ap.add_argument("--configs", nargs="+", default=["8", "8+p", "8/0.15", "8/0.15+p"])
    ap.add_argument("--chunks", type=int, default=6)
    ap.add_argument("--chunk-len", type=int, default=300)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--link", type=int, default=0, choices=range(0, len(LINK_IDS) + 1), metavar=f"0-{len(LINK_IDS)}",
                    help="also time each config with a link segment of this many tokens after every chunk")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--json", type=Path, help="also write the results here")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    results = {}
    lines = [f"| model | config | seam tokens | warm TTFT (ms, median of {args.reps}) | full / config (median, range) |",
             "|---|---|---:|---:|---|"]
    for name in args.model:
        model = real_model(name)
        res = results[name] = measure(model, args)
        for label, r in res.items():
            lo, hi = r["range"]
            lines.append(f"| {name} | {label} | {r['seam_tokens']} | {r['ms']:.0f} | "
                         + ("" if label == "full" else f"{r['full_over']:.1f}x ({lo:.1f}-{hi:.1f})") + " |")
        print("\n".join(lines), flush=True)
        del model
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()

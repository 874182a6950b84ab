"""What a rung-3 recompute budget costs a warm request, in the engine's own cost model (no timing).

A warm stitched request runs its seam heads and its question over the whole prompt; `full` runs the
whole prompt. `hypic_core/engine/plan.py` `CostModel` prices both from the model's shapes (tokens
through the weights, plus the attention's query-key pairs), which a loaded machine cannot distort.
This prints full / config for each recompute budget on bench/ladder_ttft.py's workload shape (a 32-token
system prompt, CHUNKS chunks of CHUNK_LEN tokens, a 64-token question, everything but the question
stitched at seam 8), beside the seam tokens each config recomputes. The estimate leaves out a warm
request's fixed costs (lookups, K/V rotation and copies, Python), so it is an upper bound on the
measured speed-up: on a quiet machine the default measured 13.0x (hybrid) and 9.6x (teacher) at 6 x 300
(docs/benchmarks.md), where this model says more.

    .venv/bin/python bench/recompute_cost.py --model smollm2-hybrid-135m smollm2-135m-instruct --chunk-len 80 300
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from hypic_core.config import EngineConfig  # noqa: E402
from hypic_core.engine.engine import Engine  # noqa: E402
from hypic_core.engine.recompute import head_widths  # noqa: E402

from families import real_model  # noqa: E402


def ratios(cost, lengths: list[int], question: int, seam: int, budgets: list[float]) -> list[tuple[float, int, float]]:
    """(budget, seam tokens, full / config) for each budget; lengths are the stitched segments'."""
    prompt = sum(lengths) + question
    full = cost.forward(prompt)
    out = []
    for r in budgets:
        heads = sum(head_widths(lengths, [seam] * len(lengths), r))
        out.append((r, heads, full / cost.stitch(heads + question, prompt)))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", nargs="+", default=["smollm2-hybrid-135m", "smollm2-135m-instruct"])
    ap.add_argument("--chunks", type=int, default=6)
    ap.add_argument("--chunk-len", type=int, nargs="+", default=[80, 300])
    ap.add_argument("--budgets", type=float, nargs="+", default=[0.0, 0.05, 0.1, 0.2])
    ap.add_argument("--json", type=Path, help="also write the first --chunk-len's ratios here, in bench/ladder_ttft.py's "
                    "format (labels as bench/accuracy_real.py's), for bench/ladder_report.py")
    args = ap.parse_args()
    out: dict[str, dict] = {}
    print("| model | chunks | budget r | seam tokens | full / config (cost model) |\n|---|---|---:|---:|---:|")
    for name in args.model:
        cost = Engine(real_model(name), config=EngineConfig(seam=8)).context.cost
        for n in args.chunk_len:
            for r, heads, x in ratios(cost, [32] + [n] * args.chunks, 64, 8, args.budgets):
                print(f"| {name} | {args.chunks} x {n} | {r:g} | {heads} | {x:.1f}x |", flush=True)
                if n == args.chunk_len[0]:
                    label = "hypic s=8" + (f" r={r:g}" if r else "")
                    out.setdefault(name, {"full": {"full_over": 1.0, "seam_tokens": 0}})[label] = {
                        "full_over": x, "seam_tokens": heads}
    if args.json:
        args.json.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()

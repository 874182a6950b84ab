"""Is it cheaper to run several requests' prefill runs (seam heads + question) as one batched forward?

The engine runs each request's stitch as its own forward (a fused stitch patches the linear
layers with that request's spans). Batching the stitches of requests admitted in the same step
would need one patched forward over several rows with different spans; this measures what it
could save: k separate [1, L] forwards against one [k, L] forward on the TTFT benchmark's
random-init model (bench/ttft.py), for typical warm prefill sizes (question + n * seam).

Run:  .venv/bin/python bench/prefill_batching.py [--threads 1] [--reps 5]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from ttft import bench_model  # noqa: E402


def forward(model, rows: int, length: int) -> float:
    from transformers import DynamicCache

    ids = torch.randint(10, model.config.vocab_size, (rows, length))
    pos = torch.arange(length)[None].expand(rows, -1)
    t = time.perf_counter()
    with torch.inference_mode():
        model.base_model(input_ids=ids, position_ids=pos, cache=DynamicCache(config=model.config), use_cache=True)
    return time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--lengths", type=int, nargs="+", default=[64, 144, 256])
    ap.add_argument("--rows", type=int, nargs="+", default=[2, 4, 8])
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    model = bench_model()
    print(f"model: random-init qwen3_5, {sum(p.numel() for p in model.parameters()) / 1e6:.1f}M parameters, "
          f"fp32, CPU, {args.threads} thread(s); median of {args.reps}")
    print("| run tokens | requests | separate (ms) | one batched forward (ms) | saving |")
    print("|---:|---:|---:|---:|---:|")
    for length in args.lengths:
        for rows in args.rows:
            forward(model, rows, length)  # warm-up
            sep = statistics.median(sum(forward(model, 1, length) for _ in range(rows)) for _ in range(args.reps))
            bat = statistics.median(forward(model, rows, length) for _ in range(args.reps))
            print(f"| {length} | {rows} | {sep * 1000:.0f} | {bat * 1000:.0f} | {sep / bat:.2f}x |", flush=True)


if __name__ == "__main__":
    main()

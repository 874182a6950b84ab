"""Plain prefill (no cache reuse): the gateway's forward in several configurations, beside
llama.cpp's `llama-bench` prompt processing on the same model and threads, one run.

Each configuration loads the model as the gateway does (hypic_core.models.loader) and times one
forward of `--tokens` random token ids from an empty cache, the way `full` mode prefills:
either in one call or in `--step` token steps (the engine's max_step_tokens). Variants:
- threads: `--threads` values (torch intra-op threads);
- dtype: fp32 and bf16 (CPU bf16 matmuls: fast only on CPUs with AVX512-BF16 / AMX);
- attention: transformers' `sdpa` and `eager`;
- `compile`: torch.compile of the model (first call excluded: it compiles).
llama.cpp: `llama-bench -p TOKENS -n 0 -t T` on each `--gguf`, median of `--reps`.

    .venv/bin/python bench/prefill.py --model smollm2-135m-instruct --tokens 1024 --threads 1 2 \\
        --llama-bench /path/to/llama.cpp/build/bin/llama-bench --gguf ~/.cache/hypic/gguf/smollm2-135m-instruct-f32.gguf
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Sequence

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def load(model: str, dtype: torch.dtype, attn: str):
    from transformers import AutoModelForCausalLM

    from hypic_core.models import registry

    path = registry.resolve(model).path
    m = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, local_files_only=True, use_safetensors=True,
                                             attn_implementation=attn)
    return m.eval(), path


def time_prefill(model, tokens: int, step: int, reps: int, seed: int = 0) -> float:
    """Median seconds of one prefill of `tokens` ids in steps of `step` (the engine's chunking),
    logits of the last position only, as the engine computes them."""
    from hypic_core.adapters import adapter_for

    adapter = adapter_for(model)
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(100, model.config.vocab_size - 100, (1, tokens), generator=g)
    times = []
    with torch.inference_mode():
        for r in range(reps + 1):  # the first is a warm-up (allocator, kernels, compile)
            cache = adapter.new_cache()
            t = time.perf_counter()
            for s in range(0, tokens, step):
                chunk = ids[:, s:s + step]
                pos = torch.arange(s, s + chunk.shape[1])[None]
                model(input_ids=chunk, position_ids=pos, cache=cache, use_cache=True, logits_to_keep=1)
            if r:
                times.append(time.perf_counter() - t)
    return statistics.median(times)


def llama_bench(binary: str, gguf: str, tokens: int, threads: int, reps: int) -> float:
    out = subprocess.run([binary, "-m", gguf, "-p", str(tokens), "-n", "0", "-t", str(threads), "-r", str(reps),
                          "-b", "2048", "-ub", "512", "-o", "json"], capture_output=True, text=True, check=True).stdout
    row = json.loads(out)[0]
    return tokens / row["avg_ts"]


def main(argv: Sequence[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--step", type=int, nargs="+", default=[512], help="step sizes (the engine's max_step_tokens)")
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    ap.add_argument("--attn", nargs="+", default=["sdpa", "eager"])
    ap.add_argument("--compile", action="store_true", help="also time torch.compile (fp32, sdpa, largest step)")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--llama-bench", help="llama-bench binary")
    ap.add_argument("--gguf", nargs="*", default=[], help="GGUF files for llama-bench")
    args = ap.parse_args(argv)

    rows: list[tuple[str, int, float]] = []
    for dtype in args.dtypes:
        for attn in args.attn:
            model, path = load(args.model, getattr(torch, dtype), attn)
            for threads in args.threads:
                torch.set_num_threads(threads)
                for step in args.step:
                    s = time_prefill(model, args.tokens, step, args.reps)
                    rows.append((f"gateway {dtype} {attn} step {step}", threads, s))
                    print(f"{rows[-1][0]:44s} threads {threads}: {s * 1000:8.0f} ms  {args.tokens / s:7.1f} tok/s", flush=True)
            if args.compile and dtype == "float32" and attn == args.attn[0]:
                compiled = torch.compile(model)
                for threads in args.threads:
                    torch.set_num_threads(threads)
                    s = time_prefill(compiled, args.tokens, max(args.step), args.reps)
                    rows.append((f"gateway {dtype} {attn} compiled step {max(args.step)}", threads, s))
                    print(f"{rows[-1][0]:44s} threads {threads}: {s * 1000:8.0f} ms  {args.tokens / s:7.1f} tok/s", flush=True)
            del model
    for gguf in args.gguf:
        for threads in args.threads:
            s = llama_bench(args.llama_bench, gguf, args.tokens, threads, args.reps)
            rows.append((f"llama.cpp {Path(gguf).name}", threads, s))
            print(f"{rows[-1][0]:44s} threads {threads}: {s * 1000:8.0f} ms  {args.tokens / s:7.1f} tok/s", flush=True)

    print(f"\nCommand: `.venv/bin/python bench/prefill.py {' '.join(shlex.quote(a) for a in (argv or sys.argv[1:]))}`\n")
    print(f"Plain prefill of {args.tokens} tokens, {args.model}, median of {args.reps}:\n")
    print("| configuration | threads | prefill (ms) | tok/s | vs llama.cpp (same threads, first GGUF) |")
    print("|---|---:|---:|---:|---:|")
    first = Path(args.gguf[0]).name if args.gguf else None
    peer = {t: s for name, t, s in rows if first and name == f"llama.cpp {first}"}
    for name, threads, s in rows:
        ratio = f"{s / peer[threads]:.2f}x" if threads in peer else "-"
        print(f"| {name} | {threads} | {s * 1000:.0f} | {args.tokens / s:.0f} | {ratio} |")


if __name__ == "__main__":
    main()

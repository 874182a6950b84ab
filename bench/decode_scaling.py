"""Decode throughput of the engine alone (no HTTP): 1 stream against N streams in one batched forward.

Drives `Engine.step()` in-process, as the gateway's engine thread does, so the numbers show what
continuous batching buys without the event loop, SSE and the load generator sharing the CPU
(bench/serve.py --decode-scaling measures the same thing end to end over HTTP).
Each stream: a 3 x 200-token context + a 20-token question, mode hypic, `--tokens` greedy
tokens with ignore_eos; the clock runs from every stream's first token to the last token.

Run:  .venv/bin/python bench/decode_scaling.py [--model models/hypic-tiny | --bench-model] [--threads 1]
      [--device cuda --dtype bfloat16 --streams 1 8 32]
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from hypic_core.config import EngineConfig, GenerationRequest, SamplingParams  # noqa: E402
from hypic_core.engine.engine import Engine  # noqa: E402


def throughput(engine: Engine, streams: int, tokens: int, rng: random.Random) -> float:
    """Output tokens per second of `streams` concurrent greedy streams, after their prefill."""
    vocab = engine.vocab_size

    def request() -> GenerationRequest:
        segs = tuple(tuple(rng.randrange(10, vocab) for _ in range(n)) for n in (200, 200, 200, 20))
        return GenerationRequest(segs, sampling=SamplingParams(max_tokens=tokens, ignore_eos=True))

    seqs = [engine.add_request(request()) for _ in range(streams)]
    while any(s.num_generated == 0 for s in seqs):
        engine.step()
    start, before = time.perf_counter(), sum(s.num_generated for s in seqs)
    while engine.has_unfinished():
        engine.step()
    return (sum(s.num_generated for s in seqs) - before) / (time.perf_counter() - start)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, default=ROOT / "models" / "hypic-tiny")
    ap.add_argument("--bench-model", action="store_true", help="use bench/ttft.py's random-init 37M model instead")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--streams", type=int, nargs="+", default=[1, 2, 4, 8])
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--device", default="cpu", help="cpu or cuda[:N]")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    config = EngineConfig(max_running=max(args.streams), max_step_tokens=max(512, 700 * max(args.streams)))
    dtype = getattr(torch, args.dtype)
    if args.bench_model:
        from ttft import bench_model

        engine = Engine(bench_model().to(device=args.device, dtype=dtype), config=config)
        name = "bench_model() of bench/ttft.py"
    else:
        engine = Engine.from_pretrained(args.model, config, dtype=dtype, device=args.device)
        name = args.model.name
    params = sum(p.numel() for p in engine.model.parameters()) / 1e6
    where = torch.cuda.get_device_name(args.device) if args.device.startswith("cuda") else f"CPU, {args.threads} torch thread(s)"
    print(f"model: {name} ({params:.1f}M parameters, {args.dtype}, {where}); "
          f"{args.tokens} tokens per stream, median of {args.reps}")
    rng = random.Random(0)
    throughput(engine, 1, 4, rng)  # warm-up
    base = None
    print("| streams | output tok/s | vs 1 stream |")
    print("|---:|---:|---:|")
    for n in args.streams:
        runs = sorted(throughput(engine, n, args.tokens, rng) for _ in range(args.reps))
        tps = runs[len(runs) // 2]
        base = base or tps
        print(f"| {n} | {tps:.1f} | {tps / base:.2f}x |", flush=True)


if __name__ == "__main__":
    main()

"""Decode throughput of the engine alone (no HTTP): 1 stream against N streams in one batched forward.

Drives `Engine.step()` in-process, as the gateway's engine thread does, so the numbers show what
continuous batching buys without the event loop, SSE and the load generator sharing the CPU
(bench/serve.py --decode-scaling measures the same thing end to end over HTTP).
Each stream: a 3 x 200-token context + a 20-token question, mode hypic, `--tokens` greedy
tokens with ignore_eos; the clock runs from every stream's first token to the last token.

With `--churn EVERY`, the decode batch alone under churn: N streams decode while, every EVERY
steps, one stream (a middle row) leaves and a freshly prefilled one (same prompt shape) joins.
It reports the median step at steady state, the membership change (`sync`) of a join step, and
the first forward after it; prefill is done beforehand, so only what decoding pays is timed.
It also counts the bytes the tensor copies of one more leave + join, and of one steady step, write
(no clock: the same on any machine).

Run:  .venv/bin/python bench/decode_scaling.py [--model models/hypic-tiny | --bench-model] [--threads 1]
      [--device cuda --dtype bfloat16 --streams 1 8 32] [--churn 8] [--decode-step lean]
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

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


def prompt(vocab: int, rng: random.Random) -> GenerationRequest:
    return GenerationRequest(tuple(tuple(rng.randrange(10, vocab) for _ in range(n)) for n in (200, 200, 200, 20)))


class CopiedBytes(TorchDispatchMode):
    """Bytes written by the tensor copies (cat, copy_, index_put, pad, gather, new buffers) run inside it."""

    OPS = {"cat", "copy_", "index_put_", "index_put", "constant_pad_nd", "index_select", "index", "clone",
           "zeros", "new_zeros", "empty", "new_empty", "slice_scatter"}

    def __init__(self):
        super().__init__()
        self.bytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func.__name__.split(".")[0]
        if name in self.OPS:
            written = args[1] if name == "copy_" else args[2] if name.startswith("index_put") else out
            if isinstance(written, torch.Tensor):
                self.bytes += written.numel() * written.element_size()
        return out


def churn(engine: Engine, streams: int, steps: int, every: int, rng: random.Random) -> dict[str, float]:
    """Median milliseconds of a steady decode step, of a join step's membership change (one row out,
    one in) and of the forward right after it, with `streams` rows decoding for `steps` steps."""
    joins = (steps - 1) // every  # timed joins; one more, counted, at the end
    pre = [engine.prefill(prompt(engine.vocab_size, rng)) for _ in range(streams + joins + 1)]
    batch = engine.runner.batch
    members = list(range(streams))
    pos = {i: p.position for i, p in enumerate(pre)}
    steady, sync, after = [], [], []
    waiting = iter(range(streams, streams + joins))
    with torch.inference_mode():
        batch.sync(members, {i: pre[i].cache for i in members})
        for step in range(steps):
            joined = step and step % every == 0
            if joined:
                members.remove(members[len(members) // 2])
                members.append(next(waiting))
                t = time.perf_counter()
                batch.sync(members, {members[-1]: pre[members[-1]].cache})
                sync.append(time.perf_counter() - t)
            t = time.perf_counter()
            logits = batch.forward([5] * len(batch), [pos[k] for k in batch.keys])
            int(logits[-1].argmax())
            (after if joined else steady).append(time.perf_counter() - t)
            for k in batch.keys:
                pos[k] += 1
        counted = {}  # one more leave + join and one steady step, untimed, with their copies counted
        members.remove(members[len(members) // 2])
        members.append(len(pre) - 1)
        with CopiedBytes() as c:
            batch.sync(members, {members[-1]: pre[members[-1]].cache})
        counted["sync_mb"] = c.bytes / 1e6
        with CopiedBytes() as c:
            batch.forward([5] * len(batch), [pos[k] for k in batch.keys])
        counted["step_mb"] = c.bytes / 1e6
        batch.sync([], {})
    med = lambda xs: 1e3 * sorted(xs)[len(xs) // 2]  # noqa: E731
    return {"steady": med(steady[1:]), "sync": med(sync), "after": med(after), **counted}


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
    ap.add_argument("--churn", type=int, default=0, metavar="EVERY",
                    help="measure the decode batch under churn: a row leaves and one joins every EVERY steps")
    ap.add_argument("--steps", type=int, default=64, help="decode steps per --churn run")
    ap.add_argument("--decode-step", default="module", choices=["module", "lean"],
                    help="the batched decode forward (EngineConfig.decode_step; bench/decode.py compares the two)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    config = EngineConfig(max_running=max(args.streams), max_step_tokens=max(512, 700 * max(args.streams)),
                          decode_step=args.decode_step)
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
          f"{args.tokens} tokens per stream, median of {args.reps}; decode step: {engine.runner.decode_step}")
    rng = random.Random(0)
    throughput(engine, 1, 4, rng)  # warm-up
    if args.churn:
        print(f"churn: a row leaves and one joins every {args.churn} steps, {args.steps} steps, median of {args.reps}")
        print("| streams | steady step ms | steady tok/s | join: sync ms | join: next step ms | join: MB copied | step: MB copied |")
        print("|---:|---:|---:|---:|---:|---:|---:|")
        for n in args.streams:
            runs = [churn(engine, n, args.steps, args.churn, rng) for _ in range(args.reps)]
            m = {k: sorted(r[k] for r in runs)[len(runs) // 2] for k in runs[0]}
            print(f"| {n} | {m['steady']:.2f} | {1e3 * n / m['steady']:.1f} | {m['sync']:.2f} | {m['after']:.2f} "
                  f"| {m['sync_mb']:.1f} | {m['step_mb']:.1f} |", flush=True)
        return
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

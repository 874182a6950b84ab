"""Cold-request TTFT with parallel cold prefill: the engine alone vs 1, 2, ... prefill workers, in one run.

Workload: 8 new chunks of 512 to 4096 tokens (18,432 tokens) and a 64-token question, mode hypic,
seam 8, on the benchmark model of bench/make_bench_model.py (random-init qwen3_5, 37M parameters,
32k context; built into --model when that directory does not exist yet). Every measurement starts
from an empty segment store, so every chunk is cold; each repetition uses new chunks.

- in-process  the engine computes the cold entries itself, as the gateway does with
              HYPIC_PREFILL_WORKERS=0 (a `--step-tokens` budget per step, `--threads` torch threads);
- N workers   a prefill pool of N local processes (HYPIC_PREFILL_WORKERS=N), each with
              `--worker-threads` torch threads (default: the cores divided by N).

Reported per configuration: median TTFT, speed-up vs in-process, efficiency (speed-up / workers),
and whether the generated tokens equal the in-process ones. With --byte-check (default on) the
entries the workers computed are also compared tensor by tensor with the engine's own
`compute_entries` of each chunk (they must be the same bytes).

--split-accuracy P [P ...] measures instead what splitting long cold segments into pieces of at
most P tokens (HYPIC_PREFILL_SPLIT_TOKENS) costs in accuracy, on the bundled model and held-out
questions whose 10 documents form one chunk: first-token KL and top-1 agreement against the
unsplit entry, and exact match of the greedy answers.

Run:  .venv/bin/python bench/cold_prefill.py                         (1 and 2 workers; writes docs/benchmarks.md)
      .venv/bin/python bench/cold_prefill.py --workers 1 2 4 8       (a bigger machine)
      .venv/bin/python bench/cold_prefill.py --model models/hypic-tiny --chunk-lens 64 96 128 160 192 224 256 288 \\
          --reps 1 --out /tmp/cold.md                                (a quick check that it runs)
      .venv/bin/python bench/cold_prefill.py --split-accuracy 64 128 --model models/hypic-tiny
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from hypic_core.cache.store import MemorySegmentStore  # noqa: E402
from hypic_core.config import EngineConfig, GenerationRequest, SamplingParams  # noqa: E402
from hypic_core.engine.engine import Engine  # noqa: E402
from hypic_core.prefill_pool import PrefillPool, ReplicaSpec  # noqa: E402

from markdown_section import write_section  # noqa: E402  (bench/ is the script directory)

DEFAULT_LENS = [512, 1024, 1536, 2048, 2560, 3072, 3584, 4096]


def workload(lens, question_len: int, vocab: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    rand = lambda n: tuple(torch.randint(10, vocab, (n,), generator=g).tolist())  # noqa: E731
    return [rand(n) for n in lens], rand(question_len)


def cold_run(engine: Engine, chunks, question, seam: int, tokens: int) -> tuple[float, list[int]]:
    """(seconds to the first token, the generated token ids) of one request on an empty store."""
    req = GenerationRequest((*chunks, question), seam=seam, sampling=SamplingParams(max_tokens=tokens, ignore_eos=True))
    t = time.perf_counter()
    first, ids = None, []
    for out in engine.generate(req):
        if first is None:
            first = time.perf_counter() - t
        if out.token_id is not None:
            ids.append(out.token_id)
    return first, ids


def tensor_bytes(entry) -> dict:
    return {n: (str(t.dtype), tuple(t.shape), t.contiguous().view(torch.uint8).numpy().tobytes())
            for n, t in entry.to_tensors().items()}


def kl(p_logits: torch.Tensor, q_logits: torch.Tensor) -> float:
    p = torch.log_softmax(p_logits, -1)
    return float(torch.sum(p.exp() * (p - torch.log_softmax(q_logits, -1))))


def split_accuracy(args) -> None:
    """First-token KL / top-1 / exact match of split entries against unsplit ones (see the docstring)."""
    from hypic_core.algebra.keys import SegmentKey
    from hypic_core.prefill_pool.split import join_pieces, split_points
    from training import world

    engine = Engine.from_pretrained(args.model, EngineConfig(seam=args.seam))
    tok, runner = engine.tokenizer, engine.runner
    examples = world.heldout_examples(args.examples, k_values=(10,), kinds=("single", "two_hop"))
    rows: dict[str, list[tuple[float, float, float]]] = {"unsplit": [], **{f"split {p}": [] for p in args.split_accuracy}}
    lengths = []

    def answer(e: Engine, segs) -> tuple[str, torch.Tensor]:
        req = GenerationRequest(segs, seam=args.seam, exact_prefix=1, sampling=SamplingParams(max_tokens=8))
        pre = e.prefill(req)
        return "".join(o.text for o in e.generate(req, prefilled=pre)).strip(), pre.logits

    for i, ex in enumerate(examples):
        texts, gold = world.prompt_segments(ex)
        ids = [tuple(tok.encode(t, add_special_tokens=False)) for t in texts]
        chunk = tuple(t for seg in ids[1:-1] for t in seg)  # the 10 documents as one chunk
        segs = (ids[0], chunk, ids[-1])
        lengths.append(len(chunk))
        base = Engine(engine.model, tok, engine.config, MemorySegmentStore(1 << 30), engine.model_id)
        ref_text, ref_logits = answer(base, segs)
        rows["unsplit"].append((0.0, 1.0, float(ref_text == gold)))
        for piece in args.split_accuracy:
            with torch.inference_mode():
                parts = [chunk[a:b] for a, b in split_points(len(chunk), piece)]
                entries = [runner.compute_entries([p], args.seam if j == 0 else 0, len(p))[0] for j, p in enumerate(parts)]
                joined = join_pieces(entries, runner.adapter)
            e = Engine(engine.model, tok, engine.config, MemorySegmentStore(1 << 30), engine.model_id)
            e.store.insert(SegmentKey.of(e.fingerprint, args.seam, chunk), joined)
            text, logits = answer(e, segs)
            rows[f"split {piece}"].append((kl(ref_logits, logits), float(logits.argmax() == ref_logits.argmax()),
                                           float(text == gold)))
        print(f"example {i + 1}/{len(examples)}: chunk {len(chunk)} tokens, gold {gold!r}, unsplit {ref_text!r}", flush=True)
    n = len(examples)
    lines = [
        "<!-- cold-prefill-split:begin -->",
        "### Splitting long cold segments",
        "",
        f"Command: `{' '.join(['.venv/bin/python', 'bench/cold_prefill.py', *sys.argv[1:]])}`  ",
        f"Model: {args.model.name}; {n} held-out questions (single-hop and two-hop), their 10 documents as one chunk "
        f"({min(lengths)}-{max(lengths)} tokens, mean {statistics.mean(lengths):.0f}) after the system prompt (exact), "
        f"seam {args.seam}, greedy. Each split entry joins pieces of at most P tokens computed alone "
        "(`HYPIC_PREFILL_SPLIT_TOKENS=P`).",
        "",
        "| entry | first-token KL vs unsplit (mean) | top-1 agreement | exact match |",
        "|---|---:|---:|---:|",
    ]
    for name, vals in rows.items():
        lines.append(f"| {name} | {statistics.mean(v[0] for v in vals):.4f} | {100 * statistics.mean(v[1] for v in vals):.0f}% "
                     f"| {100 * statistics.mean(v[2] for v in vals):.0f}% |")
    lines.append("<!-- cold-prefill-split:end -->")
    section = "\n".join(lines)
    print(section)
    write_section(args.out, section, "cold-prefill-split")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=Path("/tmp/bench-model"),
                    help="checkpoint directory (built with bench/make_bench_model.py when missing)")
    ap.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--chunk-lens", type=int, nargs="+", default=DEFAULT_LENS)
    ap.add_argument("--question-len", type=int, default=64)
    ap.add_argument("--seam", type=int, default=8)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=4, help="tokens generated per request (compared across configurations)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads of the engine (the gateway's default: 1)")
    ap.add_argument("--worker-threads", type=int, default=None, help="torch threads per worker (default: cores / workers)")
    ap.add_argument("--step-tokens", type=int, default=EngineConfig().max_step_tokens,
                    help="the engine's per-step token budget (HYPIC_MAX_STEP_TOKENS)")
    ap.add_argument("--no-byte-check", dest="byte_check", action="store_false")
    ap.add_argument("--out", type=Path, default=ROOT / "docs" / "benchmarks.md")
    ap.add_argument("--split-accuracy", type=int, nargs="+", metavar="P",
                    help="measure the accuracy cost of splitting segments into pieces of at most P tokens instead")
    ap.add_argument("--examples", type=int, default=10, help="--split-accuracy: questions per kind")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if args.split_accuracy:
        return split_accuracy(args)

    if not (args.model / "config.json").is_file():
        print(f"building the benchmark model in {args.model}", flush=True)
        subprocess.run([sys.executable, str(ROOT / "bench" / "make_bench_model.py"), str(args.model)], check=True)
    engine = Engine.from_pretrained(args.model, EngineConfig(seam=args.seam, max_step_tokens=args.step_tokens))
    model, tokenizer = engine.model, engine.tokenizer
    params = sum(p.numel() for p in model.parameters())
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    if sum(args.chunk_lens) + args.question_len + args.tokens > engine.max_positions:
        sys.exit(f"the workload ({sum(args.chunk_lens)} chunk tokens) does not fit the model's {engine.max_positions} positions")

    pools: dict[int, PrefillPool] = {}
    for w in args.workers:
        pools[w] = PrefillPool(ReplicaSpec(str(args.model), model.dtype, "cpu", args.worker_threads), w)
    started = time.perf_counter()
    for w, pool in pools.items():
        ready = pool.wait_ready(600)
        if ready != w:
            sys.exit(f"only {ready} of {w} prefill workers started")
    print(f"model {args.model}: {params / 1e6:.1f}M parameters; {cores} cores; workers ready in "
          f"{time.perf_counter() - started:.1f} s", flush=True)

    def engine_for(w: int) -> Engine:
        return Engine(model, tokenizer, engine.config, MemorySegmentStore(8 << 30), engine.model_id,
                      prefill_pool=pools[w] if w else None)

    configs = [0, *args.workers]
    names = {0: "in-process", **{w: f"{w} worker{'s' if w > 1 else ''}" for w in args.workers}}
    warm_chunks, warm_q = workload([min(64, n) for n in args.chunk_lens[:2]], 8, engine.vocab_size, 99)
    for w in configs:  # warm-up: kernels and allocators of the engine and of every worker
        cold_run(engine_for(w), warm_chunks, warm_q, args.seam, 1)
        if w:
            pools[w].compute_entries(workload([64] * (2 * w), 8, engine.vocab_size, 98)[0], args.seam)
    times = {w: [] for w in configs}
    same = {w: True for w in configs}
    bytes_ok: dict[int, bool] = {}
    for rep in range(args.reps):
        chunks, question = workload(args.chunk_lens, args.question_len, engine.vocab_size, rep)
        ref_ids = None
        for w in configs:
            e = engine_for(w)
            seconds, ids = cold_run(e, chunks, question, args.seam, args.tokens)
            times[w].append(seconds)
            ref_ids = ids if w == 0 else ref_ids
            same[w] &= ids == ref_ids
            if w and args.byte_check and rep == 0:
                with torch.inference_mode():
                    local = [engine.runner.compute_entries([c], args.seam, len(c))[0] for c in chunks]
                stored = e.segment_entries(tuple(chunks), args.seam)
                bytes_ok[w] = all(stored.hits) and all(tensor_bytes(a) == tensor_bytes(b) for a, b in zip(stored.entries, local))
        print(f"rep {rep + 1}/{args.reps}: " + ", ".join(f"{names[w]} {times[w][-1] * 1000:.0f} ms" for w in configs)
              + ("" if all(same.values()) else "  OUTPUTS DIFFER"), flush=True)
    for pool in pools.values():
        pool.close()

    med = {w: statistics.median(v) * 1000 for w, v in times.items()}
    threads = {0: args.threads, **{w: pools[w].threads for w in args.workers}}
    lines = [
        "<!-- cold-prefill:begin -->",
        "## Cold prefill on parallel workers",
        "",
        f"Command: `{' '.join(['.venv/bin/python', 'bench/cold_prefill.py', *sys.argv[1:]])}`  ",
        f"Model: {args.model.name} ({model.config.model_type}), {params / 1e6:.1f}M parameters, fp32, CPU, {cores} cores.  ",
        f"Workload: {len(args.chunk_lens)} new chunks ({min(args.chunk_lens)}-{max(args.chunk_lens)} tokens, "
        f"{sum(args.chunk_lens)} in all) + {args.question_len}-token question, mode hypic, seam {args.seam}, empty "
        f"segment store; engine step budget {args.step_tokens} tokens; median of {args.reps}.",
        "",
        "| configuration | torch threads each | cold TTFT (ms) | speed-up | efficiency | tokens identical | entry bytes identical |",
        "|---|---:|---:|---:|---:|---|---|",
    ]
    for w in configs:
        speed = med[0] / med[w]
        eff = f"{speed / w:.2f}" if w else "-"
        check = "-" if not w else ("yes" if bytes_ok.get(w) else "NO") if args.byte_check else "not checked"
        lines.append(f"| {names[w]} | {threads[w]} | {med[w]:.0f} | {speed:.2f}x | {eff} | {'yes' if same[w] else 'NO'} | {check} |")
    lines += ["", "Target on a 2-core machine: >= 1.7x with 2 workers"
              + (f" (measured {med[0] / med[2]:.2f}x)." if 2 in med else "."), "<!-- cold-prefill:end -->"]
    section = "\n".join(lines)
    print(section)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    write_section(args.out, section, "cold-prefill")
    if not all(same.values()) or not all(bytes_ok.values()):
        sys.exit("outputs differ between configurations")


if __name__ == "__main__":
    main()

"""TTFT benchmark: full vs prefix vs pic-naive vs hypic (cold, warm) vs the floor, in one run.

Workload: a system prompt, N chunks of L tokens (default 10 x 512) and a 64-token question, on
a random-init qwen3_5 model (Gated DeltaNet + gated attention, 3:1) large enough that prefill
dominates. Each repetition uses a fresh ordering of the chunks, so the warm caches were filled
by requests that saw the same chunks in another order (the RAG case):

- full       one forward over the whole prompt (HF `generate`'s prefill);
- prefix     exact prefix reuse (the system prompt matches; chunks in a new order do not);
- pic-naive  cached K/V + summed linear states, seams recomputed;
- hypic-cold empty segment store: chunks computed together in one batch, then stitched;
- hypic-warm every chunk's entry in memory: only seams + question run;
- floor      prefill of only the question + seam tokens over an already assembled context.

Run:  .venv/bin/python bench/ttft.py            (writes docs/benchmarks.md's TTFT section)
      .venv/bin/python bench/ttft.py --sweep    (also TTFT vs context length -> docs/ttft_vs_context.png)
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from hypic_core.cache.store import MemorySegmentStore  # noqa: E402
from hypic_core.config import EngineConfig, GenerationRequest, SamplingParams  # noqa: E402
from hypic_core.engine.engine import Engine  # noqa: E402
from hypic_core.testing import slow_decay  # noqa: E402

from markdown_section import write_section  # noqa: E402  (bench/ is the script directory)

MODES = ["full", "prefix", "pic-naive", "hypic-cold", "hypic-warm", "floor"]


def bench_model(seed: int = 0) -> torch.nn.Module:
    """~40M-parameter qwen3_5-style model: 8 layers (6 Gated DeltaNet, 2 gated attention), width 512."""
    from transformers import AutoModelForCausalLM, Qwen3_5TextConfig

    cfg = Qwen3_5TextConfig(
        vocab_size=8192, hidden_size=512, intermediate_size=1536, num_hidden_layers=8,
        num_attention_heads=8, num_key_value_heads=2, head_dim=64,
        linear_key_head_dim=128, linear_value_head_dim=128, linear_num_key_heads=4, linear_num_value_heads=4,
        linear_conv_kernel_dim=4, max_position_embeddings=32768, tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    slow_decay(model, seed)
    return model


def ttft(engine: Engine, segments, mode: str) -> float:
    """Seconds from request to the first sampled token."""
    req = GenerationRequest(tuple(segments), mode=mode, sampling=SamplingParams(max_tokens=1))
    t = time.perf_counter()
    next(iter(engine.generate(req)))
    return time.perf_counter() - t


def floor(engine: Engine, segments, seam: int) -> float:
    """Seconds to prefill the question + every seam head over an already assembled context."""
    context = [t for s in segments[:-1] for t in s]
    tail = [t for s in segments[1:-1] for t in s[:seam]] + list(segments[-1])
    with torch.inference_mode():
        cache = engine.runner.new_cache()
        engine.runner.forward(context, 0, cache)
        t = time.perf_counter()
        logits = engine.runner.forward(tail, len(context), cache, logits=True)
        int(logits.argmax())
    return time.perf_counter() - t


def workload(n_chunks: int, chunk_len: int, question_len: int, vocab: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    rand = lambda n: tuple(torch.randint(10, vocab, (n,), generator=g).tolist())  # noqa: E731
    return rand(32), [rand(chunk_len) for _ in range(n_chunks)], [rand(question_len) for _ in range(8)]


def run(args) -> tuple[dict[str, list[float]], dict[str, int], int]:
    model = bench_model()
    params = sum(p.numel() for p in model.parameters())
    system, chunks, questions = workload(args.chunks, args.chunk_len, args.question_len, model.config.vocab_size, 1)
    engine = Engine(model, config=EngineConfig(seam=args.seam))
    order = random.Random(0)

    def request(rep):
        perm = chunks[:]
        order.shuffle(perm)
        return [system, *perm, questions[rep % len(questions)]]

    # Warm-up: fills the segment store and the exact runs with one ordering, and warms kernels.
    for mode in ("hypic", "pic-naive", "prefix", "full"):
        ttft(engine, request(7), mode)
    times: dict[str, list[float]] = {m: [] for m in MODES}
    for rep in range(args.reps):
        segs = request(rep)
        times["full"].append(ttft(engine, segs, "full"))
        times["prefix"].append(ttft(engine, segs, "prefix"))
        times["pic-naive"].append(ttft(engine, segs, "pic-naive"))
        cold = Engine(model, config=engine.config, store=MemorySegmentStore(4 << 30))
        times["hypic-cold"].append(ttft(cold, segs, "hypic"))
        times["hypic-warm"].append(ttft(engine, segs, "hypic"))
        times["floor"].append(floor(engine, segs, args.seam))
        print(f"rep {rep + 1}/{args.reps}: " + ", ".join(f"{m} {times[m][-1] * 1000:.0f} ms" for m in MODES), flush=True)
    entries, _ = engine.segment_entries(tuple(chunks[:1]), args.seam)
    return times, entries[0].bytes_by_kind(), params


def sweep(args) -> list[tuple[int, float, float]]:
    model = bench_model()
    engine = Engine(model, config=EngineConfig(seam=args.seam))
    rows = []
    for n in (1, 2, 4, 6, 8, 10, 16):
        system, chunks, questions = workload(n, args.chunk_len, args.question_len, model.config.vocab_size, 2)
        segs = [system, *chunks, questions[0]]
        ttft(engine, segs, "hypic")  # fill the store
        full = statistics.median(ttft(engine, segs, "full") for _ in range(2))
        warm = statistics.median(ttft(engine, segs, "hypic") for _ in range(2))
        tokens = sum(len(s) for s in segs)
        rows.append((tokens, full, warm))
        print(f"{tokens} tokens: full {full * 1000:.0f} ms, hypic-warm {warm * 1000:.0f} ms", flush=True)
    return rows


def plot(rows, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.6))
    ax.plot([r[0] for r in rows], [r[1] * 1000 for r in rows], "o-", label="full prefill")
    ax.plot([r[0] for r in rows], [r[2] * 1000 for r in rows], "s-", label="hypic (warm)")
    ax.set_xlabel("prompt tokens")
    ax.set_ylabel("TTFT (ms)")
    ax.set_title("TTFT vs context length (CPU, 37M random qwen3_5, 512-token chunks)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def report(args, times, bytes_by_kind, params, sweep_rows) -> str:
    med = {m: statistics.median(v) * 1000 for m, v in times.items()}
    full = med["full"]
    lines = [
        "<!-- ttft:begin -->",
        "## TTFT: full vs prefix vs pic-naive vs hypic",
        "",
        f"Command: `{' '.join(['.venv/bin/python', 'bench/ttft.py', *sys.argv[1:]])}`  ",
        f"Model: random-init qwen3_5, {params / 1e6:.1f}M parameters, fp32, CPU ({torch.get_num_threads()} threads).  ",
        f"Workload: 32-token system prompt + {args.chunks} chunks x {args.chunk_len} tokens + {args.question_len}-token "
        f"question, seam {args.seam}; chunks in a new order on every repetition; median of {args.reps}.",
        "",
        "| mode | TTFT (ms) | speed-up vs full | vs floor |",
        "|---|---:|---:|---:|",
    ]
    for m in MODES:
        lines.append(f"| {m} | {med[m]:.0f} | {full / med[m]:.2f}x | {med[m] / med['floor']:.2f}x |")
    lines += [
        "",
        f"Targets: warm hypic >= 5x faster than full (measured {full / med['hypic-warm']:.2f}x); warm hypic within "
        f"1.5x of the floor (measured {med['hypic-warm'] / med['floor']:.2f}x); cold hypic no slower than full "
        f"(measured {med['hypic-cold'] / full:.2f}x of full).",
        "",
        f"Bytes per cached {args.chunk_len}-token segment: "
        + ", ".join(f"{k} {v / 2**20:.2f} MiB" for k, v in bytes_by_kind.items())
        + f" (total {sum(bytes_by_kind.values()) / 2**20:.2f} MiB).",
    ]
    if sweep_rows:
        lines += ["", "TTFT vs context length (`--sweep`):", "", "![TTFT vs context length](ttft_vs_context.png)", "",
                  "| prompt tokens | full (ms) | hypic warm (ms) | speed-up |", "|---:|---:|---:|---:|"]
        lines += [f"| {t} | {f * 1000:.0f} | {w * 1000:.0f} | {f / w:.1f}x |" for t, f, w in sweep_rows]
    lines.append("<!-- ttft:end -->")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--chunks", type=int, default=10)
    ap.add_argument("--chunk-len", type=int, default=512)
    ap.add_argument("--question-len", type=int, default=64)
    ap.add_argument("--seam", type=int, default=8)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--sweep", action="store_true", help="also measure TTFT vs context length and plot it")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (1: stable on a shared 2-core machine)")
    ap.add_argument("--out", type=Path, default=ROOT / "docs" / "benchmarks.md")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    times, bytes_by_kind, params = run(args)
    rows = sweep(args) if args.sweep else []
    if rows:
        plot(rows, args.out.parent / "ttft_vs_context.png")
    section = report(args, times, bytes_by_kind, params, rows)
    print(section)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    write_section(args.out, section, "ttft")


if __name__ == "__main__":
    main()

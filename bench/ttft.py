"""TTFT benchmark: full vs prefix vs pic-naive vs hypic (cold, warm) vs the floor, in one run.

Workload: a system prompt, N chunks of L tokens (default 10 x 512) and a 64-token question, on
a random-init qwen3_5 model (Gated DeltaNet + gated attention, 3:1) large enough that prefill
dominates. Each repetition uses a fresh ordering of the chunks, so the warm caches were filled
by requests that saw the same chunks in another order (the RAG case):

- full       one forward over the whole prompt (HF `generate`'s prefill);
- prefix     exact prefix reuse (the system prompt matches; chunks in a new order do not);
- pic-naive  cached K/V + summed linear states, seams recomputed;
- hypic-cold empty segment store, as the gateway serves it (`--cold`, default auto: one exact
             forward when the cost model says the cold entries and the stitch cost more; the
             entries are then computed after the first token, outside the TTFT);
- hypic-cold-stitch  empty segment store: chunks computed together in one batch, then stitched;
- hypic-warm every chunk's entry in memory: only seams + question run;
- floor      prefill of only the question + seam tokens over an already assembled context.

Run:  .venv/bin/python bench/ttft.py            (writes docs/benchmarks.md's TTFT section)
      .venv/bin/python bench/ttft.py --sweep    (also TTFT vs context length, 0.6k-33k tokens -> docs/ttft_vs_context.png)
"""

from __future__ import annotations

import argparse
import dataclasses
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

MODES = ["full", "prefix", "pic-naive", "hypic-cold", "hypic-cold-stitch", "hypic-warm", "floor"]
SWEEP_CHUNKS = (1, 2, 4, 8, 16, 32, 64)  # x 512 tokens: 0.6k to 33k tokens of prompt


def bench_model(seed: int = 0) -> torch.nn.Module:
    """~40M-parameter qwen3_5-style model: 8 layers (6 Gated DeltaNet, 2 gated attention), width 512."""
    from transformers import AutoModelForCausalLM, Qwen3_5TextConfig

    cfg = Qwen3_5TextConfig(
        vocab_size=8192, hidden_size=512, intermediate_size=1536, num_hidden_layers=8,
        num_attention_heads=8, num_key_value_heads=2, head_dim=64,
        linear_key_head_dim=128, linear_value_head_dim=128, linear_num_key_heads=4, linear_num_value_heads=4,
        linear_conv_kernel_dim=4, max_position_embeddings=65536, tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    slow_decay(model, seed)
    return model


def ttft(engine: Engine, segments, mode: str) -> float:
    """Seconds from request to the first sampled token."""
    return ttft_out(engine, segments, mode)[0]


def ttft_out(engine: Engine, segments, mode: str):
    """(seconds from request to the first sampled token, that first output: its `stats`)."""
    req = GenerationRequest(tuple(segments), mode=mode, sampling=SamplingParams(max_tokens=1))
    t = time.perf_counter()
    out = next(iter(engine.generate(req)))
    return time.perf_counter() - t, out


def cold_engine(model, config: EngineConfig, choice: str) -> Engine:
    """An engine with an empty segment store, serving cold requests with `cold_prefill` = `choice`."""
    return Engine(model, config=dataclasses.replace(config, cold_prefill=choice), store=MemorySegmentStore(4 << 30))


def drained(engine: Engine) -> float:
    """Seconds to compute the deferred cold work a cold request left (off its critical path)."""
    t = time.perf_counter()
    engine.drain_background()
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
        times["hypic-cold"].append(ttft(cold_engine(model, engine.config, args.cold), segs, "hypic"))
        times["hypic-cold-stitch"].append(ttft(cold_engine(model, engine.config, "stitch"), segs, "hypic"))
        times["hypic-warm"].append(ttft(engine, segs, "hypic"))
        times["floor"].append(floor(engine, segs, args.seam))
        print(f"rep {rep + 1}/{args.reps}: " + ", ".join(f"{m} {times[m][-1] * 1000:.0f} ms" for m in MODES), flush=True)
    entries, _ = engine.segment_entries(tuple(chunks[:1]), args.seam)
    return times, entries[0].bytes_by_kind(), params


def sweep(args) -> list[tuple[int, float, float, float, float, float]]:
    """TTFT vs context length: (prompt tokens, full, cold, cold-stitch, warm, background) in seconds;
    background is the deferred entry work the cold request left, computed after its first token."""
    model = bench_model()
    config = EngineConfig(seam=args.seam)
    engine = Engine(model, config=config)
    ttft(engine, [tuple(range(10, 74)), tuple(range(10, 42))], "full")  # warms kernels
    rows = []
    for n in args.sweep_chunks:
        system, chunks, questions = workload(n, args.chunk_len, args.question_len, model.config.vocab_size, 2)
        segs = [system, *chunks, questions[0]]
        reps = 2 if n <= 8 else 1
        full = statistics.median(ttft(engine, segs, "full") for _ in range(reps))
        colds, backgrounds, warms = [], [], []
        for _ in range(reps):
            cold = cold_engine(model, config, args.cold)
            colds.append(ttft(cold, segs, "hypic"))
            backgrounds.append(drained(cold))
            warms.append(ttft(cold, segs, "hypic"))  # hits the entries the background work stored
        stitch = statistics.median(ttft(cold_engine(model, config, "stitch"), segs, "hypic") for _ in range(reps))
        tokens = sum(len(s) for s in segs)
        row = (tokens, full, statistics.median(colds), stitch, statistics.median(warms), statistics.median(backgrounds))
        rows.append(row)
        print(f"{tokens} tokens: full {full * 1000:.0f} ms, hypic-cold {row[2] * 1000:.0f} ms, hypic-cold-stitch "
              f"{stitch * 1000:.0f} ms, hypic-warm {row[4] * 1000:.0f} ms, background {row[5] * 1000:.0f} ms", flush=True)
    return rows


def plot(rows, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    x = [r[0] for r in rows]
    ax.plot(x, [r[1] * 1000 for r in rows], "o-", label="full prefill")
    ax.plot(x, [r[2] * 1000 for r in rows], "^-", label="hypic cold (auto: exact forward or stitch)")
    ax.plot(x, [r[3] * 1000 for r in rows], "v--", label="hypic cold, stitched")
    ax.plot(x, [r[4] * 1000 for r in rows], "s-", label="hypic warm")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("prompt tokens")
    ax.set_ylabel("TTFT (ms)")
    ax.set_title("TTFT vs context length (CPU, 37M random qwen3_5, 512-token chunks)", fontsize=9)
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8)
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
        f"(measured {med['hypic-cold'] / full:.2f}x of full with `--cold {args.cold}`; the stitched cold path "
        f"{med['hypic-cold-stitch'] / full:.2f}x).",
        "",
        f"Bytes per cached {args.chunk_len}-token segment: "
        + ", ".join(f"{k} {v / 2**20:.2f} MiB" for k, v in bytes_by_kind.items())
        + f" (total {sum(bytes_by_kind.values()) / 2**20:.2f} MiB).",
    ]
    if sweep_rows:
        lines += ["", *sweep_lines(sweep_rows)]
    lines.append("<!-- ttft:end -->")
    return "\n".join(lines)


def rows_from(logs: list[Path]) -> list[tuple[int, float, float, float, float, float]]:
    """The sweep rows `sweep` printed in these saved outputs, by prompt length."""
    import re

    pat = re.compile(r"^(\d+) tokens: full (\d+) ms, hypic-cold (\d+) ms, hypic-cold-stitch (\d+) ms, hypic-warm (\d+) ms, "
                     r"background (\d+) ms")
    rows = {}
    for log in logs:
        for line in log.read_text().splitlines():
            m = pat.match(line)
            if m:
                t, *ms = map(int, m.groups())
                rows[t] = (t, *(v / 1000 for v in ms))
    return [rows[t] for t in sorted(rows)]


def sweep_lines(rows) -> list[str]:
    lines = ["TTFT vs context length (`--sweep`; median of 2 up to 8 chunks, one run beyond; background: the "
             "deferred entries' work after the cold request's first token, off its critical path):", "",
             "![TTFT vs context length](ttft_vs_context.png)", "",
             "| prompt tokens | full (ms) | hypic cold (ms) | cold / full | hypic cold, stitched (ms) | stitched / full "
             "| hypic warm (ms) | full / warm | background (ms) |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    lines += [f"| {t} | {f * 1000:.0f} | {c * 1000:.0f} | {c / f:.2f}x | {st * 1000:.0f} | {st / f:.2f}x | {w * 1000:.0f} "
              f"| {f / w:.1f}x | {b * 1000:.0f} |" for t, f, c, st, w, b in rows]
    return lines


def report_sweep(args, rows) -> str:
    return "\n".join(["<!-- ttft-sweep:begin -->", "### TTFT vs context length, to 32k tokens", "",
                      f"Command: `{' '.join(['.venv/bin/python', 'bench/ttft.py', *sys.argv[1:]])}`  ",
                      f"Model: bench/ttft.py's random-init qwen3_5 (37.0M parameters), fp32, CPU ({torch.get_num_threads()} "
                      f"thread{'s' if torch.get_num_threads() > 1 else ''}); system prompt + N chunks x {args.chunk_len} "
                      f"tokens + {args.question_len}-token question, seam {args.seam}; cold: `--cold {args.cold}`.", "",
                      *sweep_lines(rows), "<!-- ttft-sweep:end -->"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--chunks", type=int, default=10)
    ap.add_argument("--chunk-len", type=int, default=512)
    ap.add_argument("--question-len", type=int, default=64)
    ap.add_argument("--seam", type=int, default=8)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--sweep", action="store_true", help="also measure TTFT vs context length and plot it")
    ap.add_argument("--sweep-chunks", type=int, nargs="*", default=list(SWEEP_CHUNKS), help="chunk counts of the sweep")
    ap.add_argument("--sweep-only", action="store_true", help="only the sweep (the TTFT table is not measured)")
    ap.add_argument("--plot-from", type=Path, nargs="*", help="no measurement: join the sweep rows these runs printed "
                    "(their output, saved) into the plot and the sweep section")
    ap.add_argument("--cold", choices=["auto", "exact", "stitch"], default="auto", help="cold_prefill of hypic-cold")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (1: stable on a shared 2-core machine)")
    ap.add_argument("--out", type=Path, default=ROOT / "docs" / "benchmarks.md")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if args.plot_from or args.sweep_only:
        rows = rows_from(args.plot_from) if args.plot_from else sweep(args)
        plot(rows, args.out.parent / "ttft_vs_context.png")
        section = report_sweep(args, rows)
        print(section)
        write_section(args.out, section, "ttft-sweep")
        return
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

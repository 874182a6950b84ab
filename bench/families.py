"""TTFT by model family: full vs hypic cold vs hypic warm, every family in hypic_core/adapters, one run.

Each family gets a bench-size random model (`bench_config`: hypic_core.testing's tiny config
widened to `--hidden`, `--layers` deep, slow-decaying linear heads) and the same workload: a
32-token system prompt, `--chunks` chunks of `--chunk-len` tokens in a new order per repetition,
a 64-token question, seam `--seam`. TTFT is bench/ttft.py's (request to first sampled token,
through the engine):
- full: no cache;
- cold: an empty segment store, served as the gateway serves it (`--cold`, default auto: one exact
  forward over the prompt when the cost model says the cold entries and the stitch cost more, the
  entries then computed after the first token; the table says which path it took);
- cold stitched: an empty segment store, every chunk's entry computed in one batch, then stitched;
- warm: every entry in memory (seam heads and the question in one fused forward), here the entries
  the cold request's background work stored, the chunks in another order.

`--model NAME` adds rows for real checkpoints (a named model or a directory), e.g.
`smollm2-hybrid-135m` (where warm should be 5x faster than full or more at top_k 6).

    .venv/bin/python bench/families.py --threads 1 --reps 2
    .venv/bin/python bench/families.py --families --model smollm2-hybrid-135m --chunks 6 --chunk-len 300
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Sequence

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from hypic_core.cache.store import MemorySegmentStore  # noqa: E402
from hypic_core.config import EngineConfig  # noqa: E402
from hypic_core.engine.engine import Engine  # noqa: E402
from hypic_core.testing import FAMILIES, slow_decay, tiny_config  # noqa: E402

from markdown_section import write_section  # noqa: E402
from ttft import cold_engine, drained, ttft, ttft_out, workload  # noqa: E402

ADAPTER_OF = {}  # family -> adapter class name, filled as models are built


def layer_pattern(family: str, layers: int) -> dict:
    """The family's layer-type override for `layers` layers: 3 linear : 1 attention (Qwen3.5's ratio)."""
    attn = [i for i in range(layers) if i % 4 == 2]
    if family in ("qwen3", "llama", "falcon_h1"):
        return {}
    if family == "bamba":
        return {"attn_layer_indices": attn}
    if family == "granitemoehybrid":
        return {"layer_types": ["attention" if i in attn else "mamba" for i in range(layers)]}
    if family == "nemotron_h":
        return {"hybrid_override_pattern": "".join("*" if i in attn else "M" for i in range(layers))}
    if family == "zamba2":
        return {"layers_block_type": ["hybrid" if i in attn else "mamba" for i in range(layers)]}
    return {"layer_types": ["full_attention" if i in attn else "linear_attention" for i in range(layers)]}


def bench_config(family: str, hidden: int, layers: int):
    """hypic_core.testing's tiny config of `family`, `hidden` wide and `layers` deep."""
    heads = hidden // 64
    width = {"hidden_size": hidden, "intermediate_size": 3 * hidden, "num_hidden_layers": layers,
             "num_attention_heads": heads, "num_key_value_heads": max(1, heads // 4), "vocab_size": 8192,
             "max_position_embeddings": 32768, **layer_pattern(family, layers)}
    if family not in ("zamba2",):
        width["head_dim"] = 64
    if family in ("qwen3_5", "qwen3_5_moe", "qwen3_next", "olmo_hybrid", "olmo_hybrid_nope"):
        width.update(linear_key_head_dim=64, linear_value_head_dim=64, linear_num_key_heads=heads // 2,
                     linear_num_value_heads=heads)
    if family in ("qwen3_5_moe", "qwen3_next"):
        width.update(moe_intermediate_size=hidden, shared_expert_intermediate_size=hidden)
    if family in ("bamba", "granitemoehybrid", "falcon_h1"):
        width.update(mamba_n_heads=2 * hidden // 64, mamba_d_head=64, mamba_d_state=64, mamba_chunk_size=64)
    if family == "falcon_h1":
        width.update(mamba_d_ssm=2 * hidden)
    if family == "granitemoehybrid":
        width.update(shared_intermediate_size=hidden)
    if family == "nemotron_h":
        width.update(mamba_num_heads=2 * hidden // 64, mamba_head_dim=64, ssm_state_size=64, chunk_size=64)
    if family == "zamba2":
        width.update(n_mamba_heads=2 * hidden // 64, mamba_d_state=64, chunk_size=64, mamba_headdim=64)
    if family == "kimi_linear":
        width.update(num_key_value_heads=heads, linear_head_dim=64, linear_num_heads=heads, kv_lora_rank=64,
                     qk_rope_head_dim=16, qk_nope_head_dim=48, v_head_dim=64, moe_intermediate_size=hidden)
    if family == "minimax":
        width.update(block_size=64)
    return tiny_config(family, **width)


def bench_model(family: str, hidden: int, layers: int, seed: int = 0) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(bench_config(family, hidden, layers), dtype=torch.float32).eval()
    slow_decay(model, seed)
    return model


def real_model(name: str) -> torch.nn.Module:
    from hypic_core.models import registry
    from hypic_core.models.loader import load_local

    model, _ = load_local(registry.resolve(name).path)
    return model


def measure(model: torch.nn.Module, args) -> dict[str, float]:
    """Median TTFT (ms) of full, hypic cold (as served), hypic cold stitched and hypic warm on one model;
    also the background work (ms) the cold request left and the path it took."""
    vocab = min(model.config.vocab_size, 8192)
    system, chunks, questions = workload(args.chunks, args.chunk_len, 64, vocab, 1)
    config = EngineConfig(seam=args.seam)
    engine = Engine(model, config=config)
    order = random.Random(0)

    def request(rep):
        perm = chunks[:]
        order.shuffle(perm)
        return [system, *perm, questions[rep % len(questions)]]

    ttft(engine, request(7), "hypic")  # warms kernels
    ttft(engine, request(6), "full")
    times: dict[str, list[float]] = {"full": [], "cold": [], "stitch": [], "warm": [], "background": []}
    ratios, paths, work = [], set(), set()
    for rep in range(args.reps):
        segs = request(rep)
        cold = cold_engine(model, config, args.cold)
        # full and cold alternate which runs first, so neither always follows the other (or the
        # stitched engine's teardown); their ratio is taken per repetition, as a pair.
        if rep % 2:
            t_cold, out = ttft_out(cold, segs, "hypic")
            t_full, full_out = ttft_out(engine, segs, "full")
        else:
            t_full, full_out = ttft_out(engine, segs, "full")
            t_cold, out = ttft_out(cold, segs, "hypic")
        times["full"].append(t_full)
        times["cold"].append(t_cold)
        ratios.append(t_cold / t_full)
        paths.add("exact" if out.stats.exact_forward else "stitch")
        if out.stats.exact_forward:  # the same forward as full's: same tokens, same steps
            work.add((out.stats.computed_tokens, out.stats.prefill_steps) ==
                     (full_out.stats.computed_tokens, full_out.stats.prefill_steps))
        times["background"].append(drained(cold))
        times["warm"].append(ttft(cold, request(rep + 100), "hypic"))
        times["stitch"].append(ttft(cold_engine(model, config, "stitch"), segs, "hypic"))
    result = {m: statistics.median(v) * 1000 for m, v in times.items()}
    result["ratio"], result["ratio_lo"], result["ratio_hi"] = statistics.median(ratios), min(ratios), max(ratios)
    result["path"] = "/".join(sorted(paths))
    result["same_work"] = "" if not work else ("yes" if work == {True} else "NO")
    return result


def report(args, rows: list[tuple[str, str, float, dict[str, float]]]) -> str:
    lines = [
        "<!-- families:begin -->",
        "## TTFT by family: full vs hypic cold vs hypic warm",
        "",
        f"Command: `{' '.join(['.venv/bin/python', 'bench/families.py', *sys.argv[1:]])}`  ",
        f"Models: random init, {args.layers} layers (3 linear : 1 attention where the family mixes them), width "
        f"{args.hidden}, fp32, CPU ({args.threads} torch thread{'s' if args.threads > 1 else ''}).  ",
        f"Workload: 32-token system prompt + {args.chunks} chunks x {args.chunk_len} tokens in a new order per "
        f"repetition + 64-token question, seam {args.seam}; median of {args.reps}. Cold: `--cold {args.cold}` "
        f"(path: what it chose); cold / full: the median of the per-repetition ratios (full and cold alternate "
        f"which runs first), range: their lowest and highest; same work: the exact path ran full's tokens in "
        f"full's steps; stitched: the cold entries then the stitch; background: the entries' work "
        f"after the cold request's first token; warm: a new order, hitting what the background stored.",
        "",
        "| family | adapter | parameters | full (ms) | cold (ms) | path | cold / full | range | same work "
        "| stitched (ms) | stitched / full | background (ms) | warm (ms) | full / warm |",
        "|---|---|---:|---:|---:|---|---:|---|---|---:|---:|---:|---:|---:|",
    ]
    for family, adapter, params, t in rows:
        lines.append(f"| {family} | {adapter} | {params / 1e6:.1f}M | {t['full']:.0f} | {t['cold']:.0f} | {t['path']} | "
                     f"{t['ratio']:.2f}x | {t['ratio_lo']:.2f}-{t['ratio_hi']:.2f} | {t['same_work']} | {t['stitch']:.0f} | {t['stitch'] / t['full']:.2f}x | "
                     f"{t['background']:.0f} | {t['warm']:.0f} | {t['full'] / t['warm']:.1f}x |")
    lines.append("<!-- families:end -->")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--families", nargs="*", default=list(FAMILIES), help="test families (none: only --model)")
    ap.add_argument("--model", nargs="*", default=[], help="real checkpoints to add (named or directories)")
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--chunks", type=int, default=6)
    ap.add_argument("--chunk-len", type=int, default=512)
    ap.add_argument("--seam", type=int, default=8)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--cold", choices=["auto", "exact", "stitch"], default="auto", help="cold_prefill of the cold column")
    ap.add_argument("--markdown", type=Path, help="write the families section of this file (docs/benchmarks.md)")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    from hypic_core.adapters import adapter_for

    rows = []
    for name in [*args.families, *args.model]:
        t = time.perf_counter()
        model = bench_model(name, args.hidden, args.layers) if name in FAMILIES else real_model(name)
        adapter = type(adapter_for(model)).__name__
        params = sum(p.numel() for p in model.parameters())
        times = measure(model, args)
        rows.append((name, adapter, params, times))
        print(f"{name:18s} {adapter:22s} {params / 1e6:6.1f}M  full {times['full']:6.0f}  cold {times['cold']:6.0f} "
              f"({times['path']})  stitched {times['stitch']:6.0f}  background {times['background']:6.0f}  "
              f"warm {times['warm']:6.0f} ms  cold/full {times['ratio']:.2f}x ({times['ratio_lo']:.2f}-{times['ratio_hi']:.2f}) "
              f"full/warm {times['full'] / times['warm']:.1f}x  ({time.perf_counter() - t:.0f} s)", flush=True)
        del model
    section = report(args, rows)
    print(section)
    if args.markdown:
        write_section(args.markdown, section, "families")


if __name__ == "__main__":
    main()

"""Speculative decoding with prompt-lookup drafts, measured: acceptance, tokens per step, TPOT.

For each model (the lean decode step), two workloads: `rag` (questions of data/real_qa with 6
of their passages in the prompt, as /query builds it: answers copy from the documents) and
`nocopy` (the same questions with no document: whatever the model writes, nothing to copy
but the question). Every prompt decodes `--tokens` greedy tokens (ignore_eos, as forced
answers) at 1 stream and at 8 streams in one batch, with speculation off and on, interleaved
(off, on, off, on ...) so a machine's drift hits both alike. The clock runs from every stream's
first token to its last; prefill is untimed. Greedy outputs are compared: they must be equal.

Run:  .venv/bin/python bench/speculation.py [--models smollm2-135m-instruct smollm2-hybrid-135m]
      [--questions 8] [--tokens 128] [--streams 1 8] [--threads 2] [--write docs/benchmarks.md]
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

from app.service.prompter import Prompter  # noqa: E402
from app.service.settings import Settings  # noqa: E402
import harness  # noqa: E402  (bench/ is the script directory)
from hypic_core.config import GenerationRequest, SamplingParams  # noqa: E402
from hypic_core.engine.engine import Engine  # noqa: E402
from hypic_core.models.registry import resolve  # noqa: E402
from markdown_section import write_section  # noqa: E402
from real_qa import build_context, load_real_qa  # noqa: E402
from retrieval.document import Chunk, chunk_id_for  # noqa: E402
from retrieval.index import SearchHit  # noqa: E402


def prompts(prompter: Prompter, n: int, workload: str) -> list[tuple[tuple[int, ...], ...]]:
    out = []
    for pair in load_real_qa()[:n]:
        chunks = build_context(pair, min(6, len(pair.distractors) + 1))[0] if workload == "rag" else []
        hits = [SearchHit(float(i), Chunk(chunk_id_for(t), f"c{i}", "", "real_qa", 0, t, 0)) for i, t in enumerate(chunks)]
        out.append(tuple(prompter.query(pair.question, hits, reserve=256).segments))
    return out


def decode(engine: Engine, batch: list, tokens: int, speculation: bool) -> dict:
    """Decode `batch` (prompts) together; the time, steps and outputs of the decode after every first token."""
    engine.speculation.drafted = engine.speculation.accepted = engine.speculation.verify_steps = 0
    seqs = [engine.add_request(GenerationRequest(p, mode="full", speculation=speculation,
                                                 sampling=SamplingParams(max_tokens=tokens, ignore_eos=True))) for p in batch]
    while any(s.num_generated == 0 for s in seqs):
        engine.step()
    before, steps, t0 = sum(s.num_generated for s in seqs), 0, time.perf_counter()
    while engine.has_unfinished():
        engine.step()
        steps += 1
    seconds = time.perf_counter() - t0
    made = sum(s.num_generated for s in seqs) - before
    return {"seconds": seconds, "tokens": made, "steps": steps, "outputs": [list(s.output_ids) for s in seqs],
            "drafted": engine.speculation.drafted, "accepted": engine.speculation.accepted}


def run(engine: Engine, prompts_: list, streams: int, tokens: int) -> dict:
    """Off and on, interleaved, over groups of `streams` prompts; sums per setting."""
    total = {False: {"seconds": 0.0, "tokens": 0, "steps": 0, "drafted": 0, "accepted": 0, "tpot": []},
             True: {"seconds": 0.0, "tokens": 0, "steps": 0, "drafted": 0, "accepted": 0, "tpot": []}}
    same, identical, n = True, 0, 0
    groups = [prompts_[i:i + streams] for i in range(0, len(prompts_) - streams + 1, streams)]
    for g, group in enumerate(groups):
        outs = {}
        for spec in (False, True) if g % 2 == 0 else (True, False):
            r = decode(engine, group, tokens, spec)
            t = total[spec]
            for k in ("seconds", "tokens", "steps", "drafted", "accepted"):
                t[k] += r[k]
            t["tpot"].append(r["seconds"] / max(1.0, r["tokens"] / len(group)))  # per stream: time per output token
            outs[spec] = r["outputs"]
        same &= outs[False] == outs[True]
        identical += sum(a == b for a, b in zip(outs[False], outs[True]))
        n += len(group)
        print(f"  {streams} stream(s), group {g + 1}/{len(groups)}: off {total[False]['tokens']} tok, on "
              f"{total[True]['tokens']} tok ({total[True]['accepted']}/{total[True]['drafted']} drafts kept)", flush=True)
    return {"off": total[False], "on": total[True], "same": same, "identical": identical, "n": n}


def row(model: str, workload: str, streams: int, r: dict) -> str:
    off, on = r["off"], r["on"]
    tps_off, tps_on = off["tokens"] / off["steps"], on["tokens"] / on["steps"]
    tpot_off, tpot_on = statistics.median(off["tpot"]) * 1000, statistics.median(on["tpot"]) * 1000
    agg_off, agg_on = off["tokens"] / off["seconds"], on["tokens"] / on["seconds"]
    rate = on["accepted"] / on["drafted"] if on["drafted"] else float("nan")
    return (f"| {model} | {workload} | {streams} | {rate:.2f} | {tps_off:.2f} / **{tps_on:.2f}** | {tpot_off:.1f} / "
            f"**{tpot_on:.1f}** ({tpot_on / tpot_off:.2f}x) | {agg_off:.1f} / **{agg_on:.1f}** | "
            f"{'yes' if r['same'] else '**no**'} ({r['identical']}/{r['n']} prompts) |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=["smollm2-135m-instruct", "smollm2-hybrid-135m"])
    parser.add_argument("--workloads", nargs="+", default=["rag", "nocopy"], choices=["rag", "nocopy"])
    parser.add_argument("--questions", type=int, default=8, help="prompts per workload (data/real_qa has 84)")
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--streams", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--decode-kernel", default="native", choices=["torch", "native", "native-f16", "native-bf16", "native-i8", "native-q8"],
                        help="the lean step's matmuls (EngineConfig.decode_kernel; the gateway's default is native)")
    parser.add_argument("--write", default=None, help="write the table into this markdown file's section")
    parser.add_argument("--note", default="", help="a line under the table (e.g. what else ran on the machine)")
    parser.add_argument("--tag", default="speculation", help="the section of --write (another tag: a section beside it)")
    parser.add_argument("--title", default="Speculative decoding (prompt-lookup drafts)", help="the section's heading")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    lines = ["| model | workload | streams | drafts kept | tokens / step (off / **on**) | TPOT ms (off / **on**) | "
             "aggregate tok/s (off / **on**) | same greedy tokens |", "|---|---|---:|---:|---:|---:|---:|---|"]
    for name in args.models:
        engine = harness.engine(name, seam=8, decode_step="lean", decode_kernel=args.decode_kernel)
        engine_kernel = engine.runner.decode_kernel
        assert engine_kernel is not None, f"{name}: no lean decode step, nothing to speculate on"
        settings = Settings(_env_file=None, model=name)
        prompter = Prompter(engine.tokenizer, settings.prompt_layout(engine.tokenizer, resolve(name).prompt),
                            engine.max_positions)
        with torch.inference_mode():
            for workload in args.workloads:
                ps = prompts(prompter, args.questions, workload)
                for streams in args.streams:
                    print(f"{name} {workload}: {len(ps)} prompts of {statistics.median(sum(map(len, p)) for p in ps):.0f} "
                          f"tokens (median)", flush=True)
                    lines.append(row(name, workload, streams, run(engine, ps, streams, args.tokens)))
                    print(lines[-1], flush=True)
        del engine
    command = "python bench/speculation.py " + " ".join(sys.argv[1:])
    text = "\n".join(lines) + f"\n\nCommand: `{command}`, {args.threads} threads, lean decode step on the " \
        f"{engine_kernel} kernels, " \
        f"{args.questions} prompts per workload, {args.tokens} forced greedy tokens each.{(' ' + args.note) if args.note else ''}\n"
    print(text)
    if args.write:
        heading = "##" if args.tag == "speculation" else "###"
        section = (f"<!-- {args.tag}:begin -->\n{heading} {args.title}\n\n"
                   "Acceptance, tokens per decode step and time per output token with speculation off and on "
                   f"(bench/speculation.py; greedy outputs compared).\n\n{text}<!-- {args.tag}:end -->")
        write_section(Path(args.write), section, args.tag)


if __name__ == "__main__":
    main()

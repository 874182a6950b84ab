"""Decode precision on the real questions: the native kernels on fp16, bf16 and int8 copies of the weights
against fp32.

Each of data/real_qa's questions is asked as bench/accuracy_real.py asks it (its gold passage among
distractors, 3-10 chunks drawn with the same seed, the gateway's prompt layout), prefilled once in
`full` mode (fp32, exact), then answered greedily (`--max-tokens`) by the lean decode step on each
kernel (`--kernels`; `native` is the fp32 reference) from its own copy of that prefill, so only the
decode step's weights differ. Reported per kernel: answers that contain the gold answer (with a
Wilson 95% interval), answers lost and gained against fp32's, answers identical to fp32's word for
word, the tokens generated before the first one that differs from fp32's, and the decode step's time
(median ms per token over all answers; one thread count, `--threads`).

Run:  .venv/bin/python bench/decode_precision.py --model smollm2-hybrid-135m [--n 84] [--max-tokens 32]
      [--kernels native native-f16 native-i8] [--markdown docs/accuracy.md --section decode-precision-hybrid]
Progress goes to stderr, one line per question.
"""

from __future__ import annotations

import argparse
import copy
import json
import random
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from accuracy_real import contains, prompt_segments, wilson  # noqa: E402
from app.service.prompter import Prompter  # noqa: E402
from app.service.settings import Settings  # noqa: E402
from hypic_core.config import EngineConfig, GenerationRequest, SamplingParams  # noqa: E402
from hypic_core.engine.engine import Engine, PrefillResult  # noqa: E402
from hypic_core.models.registry import resolve  # noqa: E402
from markdown_section import write_section  # noqa: E402
from real_qa import build_context, load_real_qa  # noqa: E402
from storage_precision import agreement  # noqa: E402  (tokens alike before the first difference)


def answer(engine: Engine, request: GenerationRequest, pre: PrefillResult) -> tuple[list[int], str, list[float]]:
    """Greedy tokens, text and the seconds between tokens of `request` decoded by `engine` from a copy of `pre`."""
    mine = PrefillResult(copy.deepcopy(pre.cache), pre.position, pre.logits, pre.stats)
    ids, text, gaps, last = [], [], [], None
    for event in engine.generate(request, prefilled=mine):
        now = time.perf_counter()
        if event.token_id is not None:
            ids.append(event.token_id)
            if last is not None:
                gaps.append(now - last)
            last = now
        text.append(event.text)
    return ids, "".join(text).strip(), gaps


def evaluate(args) -> dict:
    torch.set_num_threads(args.threads)
    model = resolve(args.model)
    settings = Settings(_env_file=None, model=args.model)
    engines = {}
    for kernel in args.kernels:  # each on its own copy of the model: a kernel's weight copies stay its own
        engine = Engine.from_pretrained(model.path, EngineConfig(seam=8, decode_step="lean", decode_kernel=kernel,
                                                                 speculation=False), model_id=settings.served_model_name)
        if engine.runner.decode_kernel != kernel:
            sys.exit(f"kernel {kernel} is not available for {args.model} here (see the warning above)")
        engines[kernel] = engine
    ref = engines[args.kernels[0]]
    layout = settings.prompt_layout(ref.tokenizer, model.prompt)
    prompter = Prompter(ref.tokenizer, layout, ref.max_positions)
    rows: dict[str, list[dict]] = {k: [] for k in args.kernels}
    gaps: dict[str, list[float]] = {k: [] for k in args.kernels}
    rng = random.Random(args.seed)
    pairs = load_real_qa()[: args.n]
    t0 = time.perf_counter()
    for i, pair in enumerate(pairs):
        n_chunks = rng.randint(3, min(10, len(pair.distractors) + 1))  # as bench/accuracy_real.py draws it
        chunks, _ = build_context(pair, n_chunks, seed=args.seed)
        request = GenerationRequest(prompt_segments(prompter, pair.question, chunks), mode="full",
                                    sampling=SamplingParams(max_tokens=args.max_tokens))
        pre = ref.prefill(request)
        base = None
        for kernel, engine in engines.items():
            ids, text, g = answer(engine, request, pre)
            gaps[kernel] += g
            base = base or (ids, text)
            rows[kernel].append({"id": pair.id, "answer": text, "acc": contains(text, pair.answers),
                                 "same": text == base[1], "matched": agreement(ids, base[0]), "tokens": len(ids)})
        print(f"[{i + 1}/{len(pairs)}] {time.perf_counter() - t0:.0f} s; "
              + "; ".join(f"{k}: {r[-1]['answer'][:30]!r}" for k, r in rows.items()), file=sys.stderr, flush=True)
    return {"model": args.model, "n": len(pairs), "max_tokens": args.max_tokens, "threads": args.threads,
            "seed": args.seed, "seconds": round(time.perf_counter() - t0), "kernels": args.kernels,
            "ms_per_token": {k: 1e3 * statistics.median(v) if v else None for k, v in gaps.items()}, "rows": rows}


def table(result: dict) -> list[str]:
    rows, kernels = result["rows"], result["kernels"]
    ref = rows[kernels[0]]
    n = len(ref)
    lines = ["| kernel | weights | answers (95% CI) | lost / gained vs fp32 | identical to fp32 | fp32's answer tokens "
             "matched before the first difference | decode ms / token |",
             "|---|---|---:|---|---:|---:|---:|"]
    weights = {"native": "fp32", "native-f16": "fp16 copy", "native-bf16": "bf16 copy", "native-i8": "int8 copy, per-row scales",
               "native-q8": "int8 copy, a scale per 32 weights", "torch": "fp32 (torch)"}
    for k in kernels:
        r = rows[k]
        acc = sum(x["acc"] for x in r)
        lo, hi = wilson(acc, n)
        lost = sum(a["acc"] and not b["acc"] for a, b in zip(ref, r))
        gained = sum(b["acc"] and not a["acc"] for a, b in zip(ref, r))
        same = sum(x["same"] for x in r)
        share = sum(x["matched"] for x in r) / max(1, sum(x["tokens"] for x in ref))
        ms = result["ms_per_token"][k]
        lines.append(f"| {k} | {weights.get(k, k)} | {acc}/{n} ({lo:.0f}-{hi:.0f}%) | {lost} / {gained} | "
                     f"{same}/{n} | {100 * share:.0f}% | {ms:.1f} |")
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-hybrid-135m")
    ap.add_argument("--n", type=int, default=84, help="the first N questions of data/real_qa")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--kernels", nargs="+", default=["native", "native-f16", "native-i8"],
                    help="decode kernels; the first is the reference the others are paired with")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", help="write the raw rows here (JSON)")
    ap.add_argument("--markdown", type=Path, help="write the table into this file's section (--section)")
    ap.add_argument("--section", default="decode-precision")
    ap.add_argument("--render", type=Path, help="no run: print (and write) the table of a saved --out JSON")
    args = ap.parse_args()
    result = json.loads(args.render.read_text()) if args.render else evaluate(args)
    cmd = result.get("command") or "python " + " ".join(sys.argv)
    result["command"] = cmd
    lines = [f"**{result['model']}**, {result['n']} questions, full mode, greedy, at most {result['max_tokens']} answer "
             f"tokens, {result['threads']} threads ({result['seconds']} s). Command: `{cmd}`", "", *table(result)]
    print("\n".join(lines))
    if args.out and not args.render:
        Path(args.out).write_text(json.dumps(result, indent=1))
    if args.markdown:
        write_section(args.markdown, f"<!-- {args.section}:begin -->\n" + "\n".join(lines) + f"\n<!-- {args.section}:end -->",
                      args.section)


if __name__ == "__main__":
    main()

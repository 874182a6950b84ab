"""Multi-turn RAG chat: exact prefix + PIC against plain hypic, prefix and full, turn by turn.

A conversation on the bundled model's held-out world: each turn the user asks a question, the
gateway retrieves its documents (here: the example's own, shuffled with distractors) and puts
them in the last user turn; the assistant's gold answer joins the history. Prompts are built by
the gateway's own prompter (app/service/prompter.py), so the history is one segment per message and is
the request's exact prefix. Configurations, each on its own engine (its own caches, warmed only
by the conversation itself):

- `full`: everything computed;
- `prefix`: the longest exactly cached run of leading segments reused, the rest computed;
- `hypic`: every context segment (history included) reused by composition, seam recomputed;
- `hypic+exact`: the history restored exactly from the previous turn's snapshot (or computed
  exactly), only the retrieved documents composed.

Per turn: prefill time (engine-level TTFT: the first token's logits), prompt tokens by kind
(exact, composed, seam, fresh), first-token KL from full and top-1 agreement.

Run:  .venv/bin/python bench/multiturn.py [--conversations 20] [--turns 5] [--docs 4] [--threads 1]
Writes its section into docs/benchmarks.md (<!-- multiturn:begin/end -->) unless --no-write.
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
sys.path.insert(0, str(ROOT / "bench"))

from app.service.prompter import Prompter  # noqa: E402
from app.service.settings import Settings  # noqa: E402
from hypic_core.config import EngineConfig, GenerationRequest  # noqa: E402
from hypic_core.engine.engine import Engine  # noqa: E402
from hypic_core.models.registry import resolve  # noqa: E402
from markdown_section import write_section  # noqa: E402
from retrieval.document import Chunk, chunk_id_for  # noqa: E402
from retrieval.index import SearchHit  # noqa: E402
from training import world  # noqa: E402

CONFIGS = [("full", "full", False), ("prefix", "prefix", False), ("hypic", "hypic", False), ("hypic+exact", "hypic", True)]


def conversations(n: int, turns: int, docs: int) -> list[list[tuple[str, str, list[str]]]]:
    """`n` conversations of `turns` (question, answer, document texts) from the held-out world."""
    examples = [e for e in world.heldout_examples(n * turns, k_values=(docs,), kinds=("single",))]
    random.Random(0).shuffle(examples)
    return [[(e.question, e.answer, [d.text for d in e.docs]) for e in examples[i * turns:(i + 1) * turns]] for i in range(n)]


def kl(p_logits: torch.Tensor, q_logits: torch.Tensor) -> float:
    p = torch.log_softmax(p_logits, -1)
    return max(0.0, float(torch.sum(p.exp() * (p - torch.log_softmax(q_logits, -1)))))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="hypic-tiny")
    ap.add_argument("--conversations", type=int, default=20)
    ap.add_argument("--turns", type=int, default=5)
    ap.add_argument("--docs", type=int, default=4)
    ap.add_argument("--seam", type=int, default=8)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--no-write", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    model = resolve(args.model)
    settings = Settings(_env_file=None, model=args.model)
    engines = {}
    for label, _, _ in CONFIGS:
        base = next(iter(engines.values()), None)
        engines[label] = (Engine(base.model, base.tokenizer, EngineConfig(seam=args.seam), model_id=args.model) if base
                          else Engine.from_pretrained(model.path, EngineConfig(seam=args.seam), model_id=args.model))
    tokenizer = engines["full"].tokenizer
    prompter = Prompter(tokenizer, settings.prompt_layout(tokenizer, model.prompt),
                        engines["full"].max_positions)
    convs = conversations(args.conversations, args.turns, args.docs)
    # rows[label][turn] -> list of (ms, exact, composed, seam, fresh, kl, top1)
    rows = {label: [[] for _ in range(args.turns)] for label, _, _ in CONFIGS}
    started = time.perf_counter()
    for c, conv in enumerate(convs):
        history: list[dict] = []
        for t, (question, answer, docs) in enumerate(conv):
            messages = history + [{"role": "user", "content": f"Question: {question}"}]
            hits = [SearchHit(float(i), Chunk(chunk_id_for(d), f"d{i}", "", "world", 0, d, 0)) for i, d in enumerate(docs)]
            prompt = prompter.chat(messages, hits, [], reserve=8)
            full_logits = None
            for label, mode, exact in CONFIGS:
                request = GenerationRequest(tuple(prompt.segments), mode=mode, seam=args.seam,
                                            exact_prefix=prompt.exact_prefix if exact else 0)
                t0 = time.perf_counter()
                out = engines[label].prefill(request)
                ms = (time.perf_counter() - t0) * 1000
                full_logits = out.logits if full_logits is None else full_logits
                s = out.stats
                rows[label][t].append((ms, s.exact_tokens, s.composed_tokens, s.seam_tokens, s.fresh_tokens,
                                       kl(full_logits, out.logits), float(out.logits.argmax() == full_logits.argmax())))
            history = messages + [{"role": "assistant", "content": answer}]
        print(f"[{c + 1}/{len(convs)}] {time.perf_counter() - started:.0f} s", file=sys.stderr, flush=True)

    head = "| turn | config | prefill ms (median) | exact | composed | seam | fresh | first-token KL (mean) | top-1 agree % |"
    lines = [head, "|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for t in range(args.turns):
        for label, _, _ in CONFIGS:
            r = rows[label][t]
            med = statistics.median(x[0] for x in r)
            mean = [statistics.fmean(x[i] for x in r) for i in range(1, 7)]
            lines.append(f"| {t + 1} | {label} | {med:.1f} | {mean[0]:.0f} | {mean[1]:.0f} | {mean[2]:.0f} | {mean[3]:.0f} "
                         f"| {mean[4]:.4f} | {100 * mean[5]:.0f} |")
    print("\n".join(lines))
    if args.no_write:
        return
    command = (f".venv/bin/python bench/multiturn.py --conversations {args.conversations} --turns {args.turns} "
               f"--docs {args.docs} --threads {args.threads}")
    section = "\n".join([
        "<!-- multiturn:begin -->",
        "## Multi-turn chat: exact prefix + PIC",
        "",
        f"Command: `{command}` ({args.model}, seam {args.seam}, {args.docs} retrieved documents per turn, "
        f"{args.conversations} conversations; token columns are means per request).",
        "",
        *lines,
        "<!-- multiturn:end -->",
    ])
    write_section(ROOT / "docs" / "benchmarks.md", section, "multiturn")


if __name__ == "__main__":
    main()

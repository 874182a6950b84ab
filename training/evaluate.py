"""Exact match of a Hugging Face checkpoint on the held-out world, with plain transformers.

Full prefill of the whole prompt (chat template, see ``world.prompt_segments``), greedy
``generate`` until ``<|im_end|>``; the decoded answer (special tokens skipped, whitespace
stripped) must equal the gold answer. Reports EM per question kind and per number of
documents k.

Usage: ``python -m training.evaluate models/hypic-tiny [--n 50] [--json out.json]``
"""

from __future__ import annotations

import argparse
import collections
import json

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from training import world

K_VALUES = (1, 2, 5, 10)


def load(model_dir: str):
    """(model, tokenizer) from a local directory, fp32, offline."""
    tok = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(model_dir, local_files_only=True, dtype=torch.float32)
    return model.eval(), tok


@torch.no_grad()
def answer(model, tok, example: world.Example, max_new_tokens: int = 8) -> str:
    """Greedy answer with full prefill of the example's prompt."""
    segments, _ = world.prompt_segments(example)
    ids = tok("".join(segments), add_special_tokens=False, return_tensors="pt")["input_ids"]
    out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False,
                         max_new_tokens=max_new_tokens, eos_token_id=tok.eos_token_id,
                         pad_token_id=tok.pad_token_id)
    return tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True).strip()


def evaluate(model, tok, examples: list[world.Example]) -> dict[str, dict[str, float]]:
    """{'kind': {'all': em, 'k=1': em, ...}} plus the number of examples per cell."""
    hits = collections.defaultdict(lambda: collections.defaultdict(list))
    for ex in examples:
        ok = answer(model, tok, ex) == ex.answer
        hits[ex.kind]["all"].append(ok)
        hits[ex.kind][f"k={len(ex.docs)}"].append(ok)
    return {kind: {cell: sum(v) / len(v) for cell, v in cells.items()} | {"n": len(cells["all"])}
            for kind, cells in hits.items()}


def format_table(scores: dict[str, dict[str, float]]) -> str:
    cols = ["all"] + [f"k={k}" for k in K_VALUES]
    lines = ["| kind | n | " + " | ".join(cols) + " |", "|---" * (len(cols) + 2) + "|"]
    for kind in world.KINDS:
        if kind in scores:
            row = scores[kind]
            cells = [f"{100 * row[c]:.1f}" if c in row else "-" for c in cols]
            lines.append(f"| {kind} | {row['n']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description="EM of a checkpoint on the held-out split")
    p.add_argument("model_dir")
    p.add_argument("--n", type=int, default=50, help="examples per (kind, k)")
    p.add_argument("--kinds", default=",".join(world.KINDS))
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--json", help="also write the scores here")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    model, tok = load(args.model_dir)
    examples = world.heldout_examples(args.n, K_VALUES, kinds=tuple(args.kinds.split(",")))
    scores = evaluate(model, tok, examples)
    print(format_table(scores))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(scores, f, indent=2)


if __name__ == "__main__":
    main()

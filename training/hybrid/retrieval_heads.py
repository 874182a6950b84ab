"""Which of the teacher's attention heads copy from the documents when it answers (retrieval heads).

Layer sensitivity (training/hybrid/sensitivity.py) measures KL on plain text, where copying a
fact from a document far back is rare; a head that only matters when the model answers from
its documents barely shows there. This measures copying directly, on the teacher's own RAG
answers (data/distill/rag.jsonl.gz, in the gateway's layout): at every reply position p whose
next token continues a span of the documents (the pair ids[p], ids[p+1] occurs in the prompt),
a head "copies" when its strongest attention weight falls on a prompt position j holding that
next token (ids[j] == ids[p+1]). A head's retrieval score is the share of such positions where
it copies (the retrieval-head score of the long-context literature, on this model's own
answers). Heads that copy often, in a layer that became a mixer, are reading ability the hybrid
has to relearn with a recurrent state.

    python -m training.hybrid.retrieval_heads --samples 64 --json models/smollm2-hybrid-135m/retrieval_heads.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from training.hybrid.distill import copy_positions, reply_start


def copy_hits(attn: torch.Tensor, ids: torch.Tensor, positions: list[int], start: int) -> torch.Tensor:
    """Per head, how many of `positions` put their strongest prompt attention (on ids[:start],
    before the reply) on a position holding the next token. attn: [heads, q, k] of one layer."""
    rows = attn[:, positions, :start]  # [heads, n, prompt]
    where = rows.argmax(-1)  # [heads, n]
    target = ids[torch.tensor(positions) + 1]  # [n]
    return (ids[:start][where] == target[None]).sum(-1)


def measure(teacher, samples: list[list[int]], turn: int, say=print) -> tuple[torch.Tensor, int]:
    """Copy hits per [layer, head] over the samples, and the number of copy positions."""
    cfg = teacher.config
    hits = torch.zeros(cfg.num_hidden_layers, cfg.num_attention_heads, dtype=torch.long)
    total = 0
    t0 = time.time()
    for n, ids in enumerate(samples):
        x = torch.tensor(ids)
        start = reply_start(ids, turn) + 2  # after "<|im_start|>assistant\n"
        positions = copy_positions(ids, start)
        if not positions:
            continue
        with torch.no_grad():
            out = teacher(x[None], output_attentions=True)
        for layer, a in enumerate(out.attentions):
            hits[layer] += copy_hits(a[0].float(), x, positions, start)
        total += len(positions)
        if (n + 1) % 8 == 0:
            say(f"{n + 1}/{len(samples)} answers, {total} copy positions ({time.time() - t0:.0f}s)")
    return hits, total


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--samples", type=int, default=64, help="teacher RAG answers to read (the shipped ones, in order)")
    p.add_argument("--top", type=int, default=20, help="heads to list")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from hypic_core.models import hybrid as C
    from training.hybrid.distill import _unique_samples, non_answer, reply_text
    from training.hybrid.teacher import teacher_dir

    path = teacher_dir()
    tok = AutoTokenizer.from_pretrained(path)
    teacher = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()
    turn = tok.convert_tokens_to_ids("<|im_start|>")
    rag = [ids for _, ids in _unique_samples(None, "rag") if not non_answer(reply_text(tok, ids))]  # the shipped answers
    say = lambda m: print(f"[{time.strftime('%H:%M:%S')}] {m}", file=sys.stderr, flush=True)  # noqa: E731
    hits, total = measure(teacher, rag[: args.samples], turn, say)
    score = hits.double() / max(1, total)
    kept = set(C.attn_layers(teacher.config.num_hidden_layers))
    order = sorted(((float(score[l, h]), l, h) for l in range(score.shape[0]) for h in range(score.shape[1])), reverse=True)
    per_layer = {l: round(float(score[l].max()), 4) for l in range(score.shape[0])}
    lines = [f"{total} copy positions in {min(args.samples, len(rag))} teacher answers; top heads (layer.head score, * = a mixer now):"]
    lines += [f"  {l:2d}.{h}  {s:.3f}{'' if l in kept else '  *'}" for s, l, h in order[: args.top]]
    lines.append("best head per layer: " + " ".join(f"{l}:{s:.2f}{'' if l in kept else '*'}" for l, s in per_layer.items()))
    print("\n".join(lines))
    if args.json:
        Path(args.json).write_text(json.dumps({"answers": min(args.samples, len(rag)), "copy_positions": total,
                                               "score": [[round(float(v), 4) for v in row] for row in score],
                                               "attn_layers": sorted(kept)}, indent=1) + "\n")


if __name__ == "__main__":
    main()

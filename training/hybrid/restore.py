"""Which mixer of the trained hybrid costs the most when it answers, measured on the teacher's
RAG answers: each given back the teacher's attention, and each put alone into the teacher.

`sensitivity.py` chooses the layers to convert on the teacher, before any training, with
untrained mixers. Once the hybrid is trained that ranking can be out of date: the layers around a
mixer have adapted to it, and a mixer that looked harmless on plain text may be the one that
loses a fact between the documents and the answer. KL(teacher || model) is measured at the
answer positions of RAG sequences, and at the ones that predict a word copied from the documents
(`distill.copy_weighted`: the words an answer is judged by); same sequences, same teacher
log-probs for every model. `--measure restore`: every mixer of a trained checkpoint is, alone,
swapped back for the teacher's attention of its layer (zero correction, everything else as
trained: `distill.relayer_states`). Its attention then meets neighbours trained around its mixer,
so that number also measures the adaptation it undoes. `--measure alone`: each trained mixer is
put alone into the teacher (every other layer the teacher's own, no adapters), the harm that
mixer does by itself to the answers. `--give-back N` names the N mixers that do the most (answer
KL alone): the layers this recipe's ATTN_LAYERS gives back their attention.

    python -m training.hybrid.restore --run var/hybrid --samples 24 --give-back 2 --json models/smollm2-hybrid-135m/restore.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from hypic_core.models import hybrid as C
from training.hybrid import distill as D
from training.hybrid.teacher import load_teacher


def answer_kl(teacher_logp: list[torch.Tensor], model, seqs: list[torch.Tensor], spans: list[tuple[list[int], list[int]]]) -> dict[str, float]:
    """Mean KL(teacher || model) over the answer positions and over the copy positions of `seqs`
    (teacher_logp: the teacher's log-probs at each sequence's answer positions)."""
    tot = {"answer": [0.0, 0], "copy": [0.0, 0]}
    with torch.no_grad():
        for t, s, (answer, copy) in zip(teacher_logp, seqs, spans):
            logp = torch.log_softmax(model(s[None].long()).logits[0, answer].float(), -1)
            per = (t.exp() * (t - logp)).sum(-1)
            tot["answer"][0] += float(per.sum())
            tot["answer"][1] += len(answer)
            if copy:
                pos = torch.tensor([answer.index(p) for p in copy])
                tot["copy"][0] += float(per[pos].sum())
                tot["copy"][1] += len(copy)
    return {k: s / max(n, 1) for k, (s, n) in tot.items()}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--run", default=str(D.ROOT / "var" / "hybrid"), help="a run folder (its stage2.pt); else the shipped mixers")
    p.add_argument("--samples", type=int, default=24, help="RAG sequences measured (the pool's first, held-back ones included)")
    p.add_argument("--rag-window", type=int, default=768)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--measure", choices=("restore", "alone", "both"), default="both",
                   help="give each layer back its attention, put each mixer alone into the teacher, or both")
    p.add_argument("--give-back", type=int, default=2, help="mixers to name for their attention back (worst alone first)")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    say = lambda m: print(f"[{time.strftime('%H:%M:%S')}] {m}", file=sys.stderr, flush=True)  # noqa: E731
    t0 = time.time()
    path, teacher, tok = load_teacher()
    teacher_cfg = json.loads((path / "config.json").read_text())
    tsd = C.load_teacher_state(path)
    ckpt = Path(args.run) / "stage2.pt"
    if ckpt.is_file():  # a run of any layout: measured in its own
        blob = torch.load(ckpt)
        states, step, attn = blob["states"], blob["step"], list(blob["attn_layers"])
    else:
        shipped = D.SHIPPED / "mixers.safetensors"
        attn, step = C.mixers_config(shipped), None
        states = D.shipped_states(C.bamba_config(teacher_cfg, attn=attn), shipped)
    cfg = C.bamba_config(teacher_cfg, attn=attn)
    turn = tok.convert_tokens_to_ids("<|im_start|>")
    seqs = D.pools(tok, Path(args.run), 512, args.rag_window, long_window=0)["rag"][:args.samples]
    spans, t_logp = [], []
    with torch.no_grad():
        for s in seqs:
            ids = s.tolist()
            answer = list(range(D.reply_start(ids, turn) + 1, len(ids) - 1))  # positions predicting the answer (after "assistant\n")
            spans.append((answer, D.copy_weighted(ids, turn)))  # all of them answer positions
            t_logp.append(torch.log_softmax(teacher(s[None].long()).logits[0, answer].float(), -1))
    say(f"{len(seqs)} RAG sequences, {sum(len(a) for a, _ in spans)} answer positions, {sum(len(c) for _, c in spans)} copy positions")

    def measure(attn_layers: list[int]) -> dict[str, float]:
        c = C.bamba_config(teacher_cfg, attn=attn_layers)
        model, _ = D.build_student(c, tsd, D.relayer_states(states, attn, attn_layers))
        model.eval()
        return answer_kl(t_logp, model, seqs, spans)

    base = measure(attn)
    say(f"as trained: answer KL {base['answer']:.4f}, copy KL {base['copy']:.4f}")
    per_layer = {}
    mixers = [i for i in range(cfg.num_hidden_layers) if i not in attn]
    for i in mixers if args.measure != "alone" else []:
        per_layer[i] = measure(sorted(attn + [i]))
        say(f"layer {i:2d} back to attention: answer KL {per_layer[i]['answer']:.4f}, copy KL {per_layer[i]['copy']:.4f}")
    alone = {}
    if args.measure != "restore":
        every = list(range(cfg.num_hidden_layers))
        for i in mixers:
            mixer_only = {k: v for k, v in states[i].items() if not C.is_adapter_key(k)}
            model, _ = D.build_student(C.bamba_config(teacher_cfg, attn=[j for j in every if j != i]), tsd, {i: mixer_only})
            model.eval()
            alone[str(i)] = answer_kl(t_logp, model, seqs, spans)
            say(f"layer {i:2d}'s mixer alone in the teacher: answer KL {alone[str(i)]['answer']:.4f}, copy KL {alone[str(i)]['copy']:.4f}")
    result = {"step": step, "attn_layers": attn, "samples": len(seqs),
              "answer_positions": sum(len(a) for a, _ in spans), "copy_positions": sum(len(c) for _, c in spans),
              "as_trained": base, "restored": {str(i): v for i, v in per_layer.items()},
              "alone": alone,
              "give_back": sorted(int(i) for i in sorted(alone, key=lambda i: -alone[i]["answer"])[:args.give_back]),
              "seconds": round(time.time() - t0)}
    print(json.dumps(result, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()

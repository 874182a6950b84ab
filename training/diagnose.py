"""Measurements quoted in docs/training.md and the model card.

``validate CKPT...``: teacher-forced exact match (equal to greedy EM) of training checkpoints on
the *validation* world (seed 8), 48 questions per kind and k in {1, 5, 10}: how runs were
compared without touching the held-out world.

``memory MODEL_DIR``: how much linear-attention state survives one document: the median over 40
held-out documents of the spectral norm of each Gated DeltaNet head's transition T (the
cached operator of ``hypic_core``). ~0 means the head forgets a document within it.

``lookup CKPT``: single-hop questions with ten documents (validation world): exact match per
relation, and where the supervised lookup head (head 0 of the first full-attention layer) puts
its strongest attention from the last prompt token: on the answer's source token, on the same
attribute of another entity in the prompt (a binding error: "a city" found, the wrong person's),
or elsewhere.

``binding CKPT``: how well the residual entering the first full-attention layer tells which
entity a prompt token belongs to. A linear probe (``train.BindingProbe``) is fitted on a frozen
checkpoint with prompts of training worlds (a new one per batch: fitted on one world, a probe
also learns that world's facts, e.g. which person is the only chemist), then scored on the
validation world: accuracy at
choosing, among the prompt's ten entity names, the one whose document (or question) the token
is in; name tokens themselves are left out of the score (their embedding gives them away). It
is also reported alone at the last prompt token, where the lookup's query is formed.

Usage: ``python -m training.diagnose validate var/trainD/last.pt``,
``python -m training.diagnose memory models/hypic-tiny``,
``python -m training.diagnose lookup var/trainF/step5324.pt``,
``python -m training.diagnose binding var/trainF/step5324.pt``
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import random

import torch

from training import world


def _load(path: str):
    """(step, model in eval mode, tokenizer) of a training checkpoint (its run's tokenizer/)."""
    from transformers import PreTrainedTokenizerFast, Qwen3_5TextConfig

    from training.train import build_model

    state = torch.load(path, weights_only=False)
    tok = PreTrainedTokenizerFast.from_pretrained(os.path.join(os.path.dirname(path), "tokenizer"))
    model = build_model(Qwen3_5TextConfig.from_dict(state["config"]))
    model.load_state_dict(state["model"])
    return state["step"], model.eval(), tok


def validate(paths: list[str], per_cell: int = 48) -> dict[str, dict[str, float]]:
    from training.train import validate as scores

    examples = world.heldout_examples(per_cell, k_values=(1, 5, 10), world_seed=world.VALID_SEED, seed=99)
    out = {}
    for path in paths:
        step, model, tok = _load(path)
        hits = scores(model, tok, examples, batch_size=per_cell)
        out[path] = {"step": step} | {k: round(v, 3) for k, v in hits.items()}
    return out


@torch.no_grad()
def lookup(path: str, k: int = 10, n: int = 128, batch_size: int = 32) -> dict:
    """Single-hop EM per relation and (attention target, right/wrong) counts; see the module doc."""
    from training.train import AUX_HEAD, answer_scores, collate, encode

    step, model, tok = _load(path)
    w, rng = world.World(world.VALID_SEED), random.Random(0)
    examples = [w.example(rng, "single", k) for _ in range(n)]
    relations, looks = collections.defaultdict(list), collections.Counter()
    for i in range(0, n, batch_size):
        chunk = examples[i:i + batch_size]
        encoded = [encode(tok, e) for e in chunk]
        batch = collate(encoded, tok.pad_token_id)
        out = model(input_ids=batch.input_ids, output_attentions=True)
        _, exact = answer_scores(out.logits, batch.labels)
        for b, (e, enc, ok) in enumerate(zip(chunk, encoded, exact.tolist())):
            top = out.attentions[0][b, AUX_HEAD, batch.query_pos[b]].argmax().item()
            entity = w.by_name[e.docs[e.sources[0][0]].title]  # the answer's document is the subject's
            attr = world._SINGLE[e.relation][1]
            others = {w.by_name[d.title].get(attr) for d in e.docs
                      if d.title != entity.name and w.by_name[d.title].kind == entity.kind}
            where = ("source" if top in enc.source_pos else
                     "same attribute, other entity" if tok.convert_ids_to_tokens(enc.ids[top]) in others else
                     "elsewhere")
            looks[f"{where} / {'right' if ok else 'wrong'}"] += 1
            relations[e.relation].append(ok)
    return {"step": step, "exact_match": round(sum(sum(v) for v in relations.values()) / n, 3),
            "per_relation": {r: f"{sum(v)}/{len(v)}" for r, v in sorted(relations.items())},
            "strongest_attention": dict(looks.most_common())}


def binding(path: str, steps: int = 150, k: int = 10, batch_size: int = 32, n_eval: int = 128) -> dict:
    """Probe accuracy (non-name tokens, among the prompt's k names) on the validation world."""
    from training.train import BindingProbe, collate, encode, full_attention_layers

    step, model, tok = _load(path)
    torch.manual_seed(0)
    layer = full_attention_layers(model)[0]
    embed = model.model.embed_tokens.weight.detach()
    probe = BindingProbe(model.config.hidden_size)
    opt = torch.optim.Adam(probe.parameters(), lr=3e-3)

    def scores(w, rng, n):
        examples = [w.example(rng, "single", k) for _ in range(n)]
        batch = collate([encode(tok, e) for e in examples], tok.pad_token_id)
        names = torch.tensor([[tok.convert_tokens_to_ids(d.title) for d in e.docs] for e in examples])
        with torch.no_grad():
            hidden = model(input_ids=batch.input_ids, output_hidden_states=True).hidden_states[layer]
        logits = torch.einsum("btd,bnd->btn", probe.proj(hidden), embed[names])
        target = (batch.bind_labels.unsqueeze(-1) == names.unsqueeze(1)).float().argmax(-1)
        mask = batch.bind_labels != -100
        return logits, target, mask, mask & (batch.input_ids != batch.bind_labels), batch.query_pos

    rng = random.Random(0)
    for i in range(steps):  # a new training world per batch, so no world's facts can be learnt
        logits, target, mask, _, _ = scores(world.World(world.TRAIN_SEED_BASE + i), rng, batch_size)
        loss = torch.nn.functional.cross_entropy(logits[mask], target[mask])
        opt.zero_grad()
        loss.backward()
        opt.step()
    with torch.no_grad():
        logits, target, _, scored, query = scores(world.World(world.VALID_SEED), random.Random(0), n_eval)
    right = logits.argmax(-1) == target
    at_query = right[torch.arange(n_eval), query]  # the last prompt token: where the lookup starts
    return {"step": step, "probe_accuracy": round(right[scored].float().mean().item(), 3),
            "at_last_prompt_token": round(at_query.float().mean().item(), 3), "chance": round(1 / k, 3),
            "tokens_scored": int(scored.sum())}


def memory(model_dir: str, n_docs: int = 40) -> dict[int, list[float]]:
    """{linear layer index: median ||T||_2 per head} over ``n_docs`` held-out documents."""
    from hypic_core.config import EngineConfig
    from hypic_core.engine.engine import Engine

    engine = Engine.from_pretrained(model_dir, EngineConfig(seam=0))
    docs = world.World(world.HELDOUT_SEED).all_docs()[:n_docs]
    segments = tuple(tuple(engine.tokenizer.encode(world.document_segment(d), add_special_tokens=False))
                     for d in docs)
    entries, _ = engine.segment_entries(segments, 0)
    return {layer: torch.stack([torch.linalg.matrix_norm(e.operators[p].transition, ord=2) for e in entries])
            .median(0).values.tolist() for p, layer in enumerate(engine.adapter.linear_layers)}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    v = sub.add_parser("validate", help="validation-world EM of training checkpoints")
    v.add_argument("checkpoints", nargs="+")
    m = sub.add_parser("memory", help="per-head state kept across one document")
    m.add_argument("model_dir")
    lk = sub.add_parser("lookup", help="where the lookup head looks on single-hop questions")
    lk.add_argument("checkpoint")
    lk.add_argument("--k", type=int, default=10)
    bd = sub.add_parser("binding", help="probe: which entity each token belongs to, at layer 3's input")
    bd.add_argument("checkpoint")
    bd.add_argument("--steps", type=int, default=150)
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.command == "validate":
        for path, scores in validate(args.checkpoints).items():
            print(path, json.dumps(scores))
    elif args.command == "lookup":
        print(json.dumps(lookup(args.checkpoint, args.k), indent=1))
    elif args.command == "binding":
        print(json.dumps(binding(args.checkpoint, args.steps)))
    else:
        for layer, norms in memory(args.model_dir).items():
            print(f"layer {layer}: median ||T||_2 per head:", " ".join(f"{x:.2g}" for x in norms))


if __name__ == "__main__":
    main()

"""Two measurements quoted in docs/training.md and the model card.

``validate CKPT...``: teacher-forced exact match (equal to greedy EM) of training checkpoints on
the *validation* world (seed 8), 48 questions per kind and k in {1, 5, 10}: how runs were
compared without touching the held-out world.

``memory MODEL_DIR``: how much linear-attention state survives one document: the median over 40
held-out documents of the spectral norm of each Gated DeltaNet head's transition T (the
cached operator of ``hypic_core``). ~0 means the head forgets a document within it.

Usage: ``python -m training.diagnose validate var/trainD/last.pt``,
``python -m training.diagnose memory models/hypic-tiny``
"""

from __future__ import annotations

import argparse
import json
import os

import torch

from training import world


def validate(paths: list[str], per_cell: int = 48) -> dict[str, dict[str, float]]:
    from transformers import PreTrainedTokenizerFast, Qwen3_5TextConfig

    from training.train import build_model, validate as scores

    examples = world.heldout_examples(per_cell, k_values=(1, 5, 10), world_seed=world.VALID_SEED, seed=99)
    out = {}
    for path in paths:
        state = torch.load(path, weights_only=False)
        tok = PreTrainedTokenizerFast.from_pretrained(os.path.join(os.path.dirname(path), "tokenizer"))
        model = build_model(Qwen3_5TextConfig.from_dict(state["config"]))
        model.load_state_dict(state["model"])
        hits = scores(model, tok, examples, batch_size=per_cell)
        out[path] = {"step": state["step"]} | {k: round(v, 3) for k, v in hits.items()}
    return out


def memory(model_dir: str, n_docs: int = 40) -> dict[int, list[float]]:
    """{linear layer index: median ||T||_2 per head} over ``n_docs`` held-out documents."""
    from hypic_core.config import EngineConfig
    from hypic_core.engine import Engine

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
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.command == "validate":
        for path, scores in validate(args.checkpoints).items():
            print(path, json.dumps(scores))
    else:
        for layer, norms in memory(args.model_dir).items():
            print(f"layer {layer}: median ||T||_2 per head:", " ".join(f"{x:.2g}" for x in norms))


if __name__ == "__main__":
    main()

"""Which attention layers of the teacher can become Mamba2 mixers: measured, one layer at a time.

For every layer i the teacher is run with layer i's attention swapped for its initialised,
untrained mixer (hypic_core/models/hybrid.py's mapping; its norm scale fitted by least squares on
calibration text, as stage 1 does before training), and KL(teacher || swapped) of the next-token
distributions is measured on held-back text (training-style sequences that are not in
data/real_qa). The least sensitive layers are the ones to convert. Cheap: a few hundred tokens
per layer, one thread.

Plain text rarely needs a fact copied from far back, so this KL barely sees the heads that copy
from the documents when the model answers; `--retrieval` takes their measurement
(training/hybrid/retrieval_heads.py) and keeps attention in every layer with a head that copies
on at least `--copy-threshold` of the answers' copy positions, converting the least sensitive of
the others. `--reuse` takes the per-layer KL of an earlier run instead of measuring it again.

    python -m training.hybrid.sensitivity --retrieval models/smollm2-hybrid-135m/retrieval_heads.json \
        --reuse models/smollm2-hybrid-135m/sensitivity.json --json models/smollm2-hybrid-135m/sensitivity.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
from torch import nn

from hypic_core.models import hybrid as C


class MixerAsAttention(nn.Module):
    """A mixer in an attention slot of a llama decoder layer (returns `(output, None)`)."""

    def __init__(self, mixer):
        super().__init__()
        self.mixer = mixer

    def forward(self, hidden_states, **kwargs):
        return self.mixer(hidden_states), None


def fit_norm_scale(mixer, x: torch.Tensor, y: torch.Tensor) -> None:
    """Scale the mixer's norm so its output best matches `y` in least squares (one scalar)."""
    with torch.no_grad():
        pred = mixer(x)
        mixer.norm.weight.mul_(float((pred * y).sum() / pred.pow(2).sum().clamp_min(1e-12)))


def kl(t_logits: torch.Tensor, s_logits: torch.Tensor) -> float:
    t = torch.log_softmax(t_logits.float(), -1)
    return float((t.exp() * (t - torch.log_softmax(s_logits.float(), -1))).sum(-1).mean())


def measure(teacher, cfg, tsd, calib: torch.Tensor, held: torch.Tensor, layers=None, say=print) -> dict[int, float]:
    """KL(teacher || teacher with layer i's attention as its initialised mixer) per layer i."""
    layers = list(range(cfg.num_hidden_layers)) if layers is None else layers
    with torch.no_grad():
        t_logits = teacher(held).logits
    out = {}
    for i in layers:
        slot = teacher.model.layers[i]
        attn = slot.self_attn
        rec = {}
        h = attn.register_forward_hook(lambda m, a, kw, r: rec.update(x=kw["hidden_states"], y=r[0]), with_kwargs=True)
        with torch.no_grad():
            teacher(calib)
        h.remove()
        mixer = C.make_mixer(cfg, i, tsd)
        fit_norm_scale(mixer, rec["x"], rec["y"])
        slot.self_attn = MixerAsAttention(mixer)
        try:
            with torch.no_grad():
                out[i] = kl(t_logits, teacher(held).logits)
        finally:
            slot.self_attn = attn
        say(f"layer {i:2d}: KL {out[i]:.4f}")
    return out


def measure_set(teacher, cfg, tsd, calib, held, convert: list[int]) -> float:
    """KL(teacher || teacher with every layer of `convert` swapped at once), initialised mixers."""
    with torch.no_grad():
        t_logits = teacher(held).logits
    saved = {}
    try:
        for i in convert:
            slot = teacher.model.layers[i]
            rec = {}
            h = slot.self_attn.register_forward_hook(lambda m, a, kw, r: rec.update(x=kw["hidden_states"], y=r[0]), with_kwargs=True)
            with torch.no_grad():
                teacher(calib)
            h.remove()
            mixer = C.make_mixer(cfg, i, tsd)
            fit_norm_scale(mixer, rec["x"], rec["y"])
            saved[i] = slot.self_attn
            slot.self_attn = MixerAsAttention(mixer)
        with torch.no_grad():
            return kl(t_logits, teacher(held).logits)
    finally:
        for i, attn in saved.items():
            teacher.model.layers[i].self_attn = attn


def copying_layers(retrieval: dict, threshold: float) -> list[int]:
    """Layers with a head whose retrieval score (retrieval_heads.py's json) reaches `threshold`."""
    return [i for i, row in enumerate(retrieval["score"]) if max(row) >= threshold]


def choose(per_layer: dict[int, float], keep: int, protected: list[int] = ()) -> list[int]:
    """The layers to convert: the least sensitive, never a protected one, leaving `keep` attention layers."""
    order = sorted((i for i in per_layer if i not in set(protected)), key=per_layer.get)
    n_convert = len(per_layer) - keep
    if n_convert > len(order):
        raise ValueError(f"{len(protected)} protected layers leave too few to convert {n_convert}")
    return sorted(order[:n_convert])


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=256, help="tokens per sequence")
    p.add_argument("--json", default=None)
    p.add_argument("--keep", type=int, default=15, help="attention layers to keep")
    p.add_argument("--retrieval", default=None, help="retrieval_heads.py's json: its copying layers keep attention")
    p.add_argument("--copy-threshold", type=float, default=0.15, help="retrieval score that makes a layer a copying one")
    p.add_argument("--reuse", default=None, help="a json of an earlier run: take its per-layer KL instead of measuring")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    from training.hybrid.data import build_sequences
    from training.hybrid.teacher import load_teacher

    path, teacher, tok = load_teacher()
    cfg = C.bamba_config(json.loads((path / "config.json").read_text()), attn=[])
    tsd = C.load_teacher_state(path)
    seqs, _ = build_sequences(tok, args.tokens, seed=7)
    calib, held = torch.tensor(seqs[:2]), torch.tensor(seqs[2:4])  # a plain and a prompt-shaped one, mostly
    say = lambda m: print(f"[{time.strftime('%H:%M:%S')}] {m}", file=sys.stderr, flush=True)  # noqa: E731
    t0 = time.time()
    if args.reuse:
        per_layer = {int(k): v for k, v in json.loads(Path(args.reuse).read_text())["kl_per_layer"].items()}
    else:
        per_layer = measure(teacher, cfg, tsd, calib, held, say=say)
    n = cfg.num_hidden_layers
    protected = copying_layers(json.loads(Path(args.retrieval).read_text()), args.copy_threshold) if args.retrieval else []
    convert = choose(per_layer, args.keep, protected)
    every_other = [i for i in range(n) if i % 2 == 0]
    sets = {"chosen": convert, "least sensitive (copying layers not kept)": choose(per_layer, args.keep),
            "every other (0, 2, ...)": every_other}
    together = {name: measure_set(teacher, cfg, tsd, calib, held, s) for name, s in sets.items()}
    result = {"tokens_per_layer": int(held.numel()), "seconds": round(time.time() - t0), "kl_per_layer_reused": bool(args.reuse),
              "kl_per_layer": per_layer,
              "copying_layers": protected, "copy_threshold": args.copy_threshold if args.retrieval else None,
              "convert": convert, "attn_layers": sorted(set(range(n)) - set(convert)),
              "kl_together_init": {k: {"layers": sets[k], "kl": v} for k, v in together.items()}}
    print(json.dumps(result, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()

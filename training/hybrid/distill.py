"""Distil SmolLM2-135M-Instruct into the Bamba hybrid of training/hybrid/convert.py.

Stage 1, attention transfer (`stage1`): one teacher pass over `--record` training sequences
records, at every converted layer, the attention's input (the normed hidden state) and output;
each mixer is then fitted alone to reproduce its layer's attention output from those inputs
(normalised MSE). Layers are independent, so this is cheap and resumable layer by layer.

Stage 2, end to end (`stage2`): the assembled hybrid is trained on KL(teacher || hybrid) of the
next-token distribution at every position of real text, updating only the mixers' trained
parameters (LoRA factors of the projections, conv, dt, A, D, norm). Checkpoints every
`--save-every` steps; rerunning the command resumes.

`export` writes the shipped file (bf16 mixers) and `evaluate` reports perplexity on held-back
text for teacher and hybrid.

    python -m training.hybrid.distill stage1 --out var/hybrid
    python -m training.hybrid.distill stage2 --out var/hybrid --minutes 60
    python -m training.hybrid.distill export --out var/hybrid
    python -m training.hybrid.distill evaluate --model smollm2-hybrid-135m
    python -m training.hybrid.distill memory --model smollm2-hybrid-135m

Progress goes to stderr; every step's numbers to `<out>/log.jsonl`.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
import time
from pathlib import Path

import torch

from hypic_core import hybrid as C

ROOT = Path(__file__).resolve().parents[2]
SHIPPED = ROOT / "models" / "smollm2-hybrid-135m"


def teacher_dir() -> Path:
    from hypic_core.registry import resolve

    return resolve("smollm2-135m-instruct").path


def _log(out: Path, record: dict) -> None:
    with open(out / "log.jsonl", "a") as f:
        f.write(json.dumps(record) + "\n")


def _say(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def _sequences(tokenizer, seq_len: int, out: Path):
    cache = out / f"sequences_{seq_len}.pt"
    if cache.is_file():
        blob = torch.load(cache)
        return blob["seqs"], blob["info"]
    from training.hybrid.data import build_sequences

    seqs, info = build_sequences(tokenizer, seq_len)
    seqs = torch.tensor(seqs, dtype=torch.int32)
    torch.save({"seqs": seqs, "info": info}, cache)
    return seqs, info


def _load_teacher():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = teacher_dir()
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    for p in model.parameters():
        p.requires_grad_(False)
    return path, model, AutoTokenizer.from_pretrained(path)


# ---------------------------------------------------------------- stage 1


def record(teacher, seqs: torch.Tensor, layers: list[int], out: Path, n: int) -> None:
    """Record attention inputs/outputs of `layers` over the first `n` sequences (bf16, per layer)."""
    done = [i for i in layers if (out / f"acts_{i}.pt").is_file()]
    if len(done) == len(layers):
        return
    ins = {i: [] for i in layers}
    outs = {i: [] for i in layers}
    hooks = []
    for i in layers:
        attn = teacher.model.layers[i].self_attn

        def hook(mod, args, kwargs, result, i=i):
            ins[i].append(kwargs["hidden_states"].to(torch.bfloat16))
            outs[i].append(result[0].to(torch.bfloat16))

        hooks.append(attn.register_forward_hook(hook, with_kwargs=True))
    t0 = time.time()
    with torch.no_grad():
        for s in range(0, n, 4):
            teacher(seqs[s:min(n, s + 4)].long())  # (already cut to the window)
            _say(f"record: {min(n, s + 4)}/{n} sequences ({time.time() - t0:.0f}s)")
    for h in hooks:
        h.remove()
    for i in layers:
        torch.save({"x": torch.cat(ins[i]), "y": torch.cat(outs[i])}, out / f"acts_{i}.pt")


def stage1(args) -> None:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    path, teacher, tok = _load_teacher()
    cfg = C.bamba_config(json.loads((path / "config.json").read_text()))
    tsd = C.load_teacher_state(path)
    layers = [i for i in range(cfg.num_hidden_layers) if i not in cfg.attn_layer_indices]
    seqs, info = _sequences(tok, args.seq_len, out)
    _say(f"training text: {info}")
    record(teacher, seqs[:, :args.window], layers, out, args.record)
    del teacher
    state_file = out / "stage1.pt"
    states = torch.load(state_file) if state_file.is_file() else {}
    for i in layers:
        if i in states:
            continue
        acts = torch.load(out / f"acts_{i}.pt")
        x, y = acts["x"], acts["y"]
        n_val = max(2, len(x) // 16)
        xv, yv, xt, yt = x[:n_val].float(), y[:n_val].float(), x[n_val:], y[n_val:]
        mixer = C.make_mixer(cfg, i, tsd)
        params = [p for p in C.mixer_state(mixer).values()]
        opt = torch.optim.AdamW(params, lr=args.lr, weight_decay=0.0)
        sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=args.lr, total_steps=args.steps, pct_start=0.1)
        scale = float(yt.float().pow(2).mean())
        g = torch.Generator().manual_seed(i)

        def val() -> float:
            with torch.no_grad():
                return float((mixer(xv) - yv).pow(2).mean() / yv.pow(2).mean())

        with torch.no_grad():  # scale the norm so the initial output has the target's size (least squares)
            pred = mixer(xv)
            mixer.norm.weight.mul_(float((pred * yv).sum() / pred.pow(2).sum()))
        v0, t0 = val(), time.time()
        for step in range(args.steps):
            idx = torch.randint(0, len(xt), (args.batch,), generator=g)
            loss = (mixer(xt[idx].float()) - yt[idx].float()).pow(2).mean() / scale
            opt.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
            sched.step()
            if step % 50 == 0 or step == args.steps - 1:
                _say(f"stage1 layer {i}: step {step + 1}/{args.steps} loss {loss.item():.4f} ({time.time() - t0:.0f}s)")
        v1 = val()
        _say(f"stage1 layer {i}: held-back normalised MSE {v0:.4f} -> {v1:.4f}")
        _log(out, {"stage": 1, "layer": i, "val_nmse_init": v0, "val_nmse": v1, "steps": args.steps, "seconds": time.time() - t0})
        states[i] = {k: v.detach().clone() for k, v in C.mixer_state(mixer).items()}
        torch.save(states, state_file)


# ---------------------------------------------------------------- stage 2


def build_student(cfg, tsd, states: dict[int, dict]):
    """The hybrid with trainable LoRA mixers (mixers from `states`), everything else frozen."""
    from transformers import BambaForCausalLM

    model = BambaForCausalLM(cfg)
    model.load_state_dict(C.hybrid_state_dict(cfg, tsd, {}), strict=False)
    for p in model.parameters():
        p.requires_grad_(False)
    trainable = []
    for i, layer in enumerate(model.model.layers):
        if i in cfg.attn_layer_indices:
            continue
        mixer = C.make_mixer(cfg, i, tsd)
        if i in states:
            C.load_mixer_state(mixer, states[i])
        layer.mamba = mixer
        trainable += list(C.mixer_state(mixer).values())
    model.tie_weights()
    return model, trainable


def stage2(args) -> None:
    out = Path(args.out)
    path, teacher, tok = _load_teacher()
    cfg = C.bamba_config(json.loads((path / "config.json").read_text()))
    tsd = C.load_teacher_state(path)
    seqs, _ = _sequences(tok, args.seq_len, out)
    ckpt = out / "stage2.pt"
    if ckpt.is_file():
        blob = torch.load(ckpt)
        states, step0, opt_state = blob["states"], blob["step"], blob["opt"]
    else:
        states, step0, opt_state = torch.load(out / "stage1.pt"), 0, None
    model, params = build_student(cfg, tsd, states)
    model.train()
    opt = torch.optim.AdamW(params, lr=args.lr, weight_decay=0.0)
    if opt_state is not None:
        opt.load_state_dict(opt_state)
    order = list(range(args.record, len(seqs)))  # stage 1's recorded sequences come first; use the rest
    random.Random(1).shuffle(order)
    deadline = time.time() + args.minutes * 60
    step, t0 = step0, time.time()

    def save():
        st = {i: {k: v.detach().clone() for k, v in C.mixer_state(model.model.layers[i].mamba).items()}
              for i in range(cfg.num_hidden_layers) if i not in cfg.attn_layer_indices}
        tmp = ckpt.with_suffix(".tmp")
        torch.save({"states": st, "step": step, "opt": opt.state_dict()}, tmp)
        tmp.replace(ckpt)

    while step < args.steps and time.time() < deadline:
        ids = seqs[order[(step * args.batch) % len(order):][:args.batch], :args.window].long()
        with torch.no_grad():
            t_logp = torch.log_softmax(teacher(ids).logits.float(), -1)
        s_logp = torch.log_softmax(model(ids).logits.float(), -1)
        loss = (t_logp.exp() * (t_logp - s_logp)).sum(-1).mean()
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        lr = args.lr * min(1.0, (step + 1) / 20)
        for gr in opt.param_groups:
            gr["lr"] = lr
        opt.step()
        step += 1
        _log(out, {"stage": 2, "step": step, "kl": loss.item(), "lr": lr})
        _say(f"stage2 step {step}/{args.steps} KL {loss.item():.4f} ({time.time() - t0:.0f}s)")
        if step % args.save_every == 0:
            save()
    save()
    _say(f"stage2 stopped at step {step}; checkpoint {ckpt}")


# ---------------------------------------------------------------- export / evaluate


def export(args) -> None:
    from safetensors.torch import save_file

    out = Path(args.out)
    src = out / "stage2.pt"
    states = torch.load(src)["states"] if src.is_file() and not args.stage1 else torch.load(out / "stage1.pt")
    flat = {f"layers.{i}.{k}": v.to(torch.bfloat16).contiguous() for i, st in states.items() for k, v in st.items()}
    SHIPPED.mkdir(parents=True, exist_ok=True)
    save_file(flat, str(SHIPPED / "mixers.safetensors"), metadata={"format": "pt", "recipe_version": str(C.RECIPE_VERSION)})
    _say(f"wrote {SHIPPED / 'mixers.safetensors'} ({(SHIPPED / 'mixers.safetensors').stat().st_size / 1e6:.1f} MB)")


def perplexity(model, tok, text: str, seq_len: int = 512) -> float:
    ids = tok.encode(text, add_special_tokens=False)
    nll, count = 0.0, 0
    with torch.no_grad():
        for s in range(0, len(ids) - 1, seq_len):
            chunk = torch.tensor([ids[s:s + seq_len + 1]])
            if chunk.shape[1] < 2:
                break
            logits = model(chunk[:, :-1]).logits.float()
            nll += float(torch.nn.functional.cross_entropy(logits[0], chunk[0, 1:], reduction="sum"))
            count += chunk.shape[1] - 1
    return math.exp(nll / count)


def evaluate(args) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from hypic_core.registry import resolve

    text = (ROOT / "data" / "real_qa" / "held_out.txt").read_text()
    rows = {}
    for name in ("smollm2-135m-instruct", args.model):
        path = resolve(name).path
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        tok = AutoTokenizer.from_pretrained(path)
        t0 = time.time()
        rows[name] = perplexity(model, tok, text)
        _say(f"{name}: held-out perplexity {rows[name]:.2f} ({time.time() - t0:.0f}s)")
    print(json.dumps(rows))


def memory(args) -> dict:
    """How long each Mamba2 head's state persists on real text: for every data/real_qa passage the
    engine's cached transition T of the passage (the fraction of the incoming state that survives
    it, per head), and the half-life in tokens that T implies, ln 0.5 / (ln T / length). Medians
    over passages, per layer and head."""
    from hypic_core.config import EngineConfig
    from hypic_core.engine import Engine
    from hypic_core.registry import resolve

    engine = Engine.from_pretrained(resolve(args.model).path, EngineConfig(seam=0))
    texts = [json.loads(line)["text"] for line in (ROOT / "data" / "real_qa" / "passages.jsonl").read_text().splitlines()]
    segments = tuple(tuple(engine.tokenizer.encode("Document: " + t + "\n\n", add_special_tokens=False)) for t in texts)
    entries = engine.segment_entries(segments, 0).entries
    lengths = torch.tensor([len(s) for s in segments], dtype=torch.float64)
    rows = {}
    for pos, layer in enumerate(engine.adapter.linear_layers):
        T = torch.stack([e.operators[pos].transition.double().reshape(-1) for e in entries])  # [docs, heads]
        half = math.log(0.5) / (torch.log(T.clamp_min(1e-300)) / lengths[:, None])
        rows[layer] = {"T_median": T.median(0).values.tolist(), "half_life_median": half.median(0).values.tolist()}
    lines = [f"median passage length {int(lengths.median())} tokens; per linear layer, per head: median T over "
             f"{len(segments)} passages (state surviving one passage) and median half-life in tokens"]
    for layer, r in rows.items():
        lines.append(f"layer {layer:2d}: T " + " ".join(f"{x:7.2g}" for x in r["T_median"])
                     + " | half-life " + " ".join(f"{x:6.0f}" for x in r["half_life_median"]))
    print("\n".join(lines))
    if args.json:
        Path(args.json).write_text(json.dumps({"model": args.model, "passages": len(segments),
                                               "median_length": float(lengths.median()), "layers": rows}, indent=1))
    return rows


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    for name in ("stage1", "stage2", "export"):
        s = sub.add_parser(name)
        s.add_argument("--out", default=str(ROOT / "var" / "hybrid"))
        s.add_argument("--seq-len", type=int, default=512)
        s.add_argument("--record", type=int, default=128, help="sequences recorded for stage 1")
        s.add_argument("--window", type=int, default=256, help="tokens of each sequence trained on")
    sub.choices["stage1"].add_argument("--steps", type=int, default=80)
    sub.choices["stage1"].add_argument("--batch", type=int, default=4)
    sub.choices["stage1"].add_argument("--lr", type=float, default=3e-3)
    sub.choices["stage2"].add_argument("--steps", type=int, default=100000)
    sub.choices["stage2"].add_argument("--minutes", type=float, default=60)
    sub.choices["stage2"].add_argument("--batch", type=int, default=1)
    sub.choices["stage2"].add_argument("--lr", type=float, default=3e-4)
    sub.choices["stage2"].add_argument("--save-every", type=int, default=10)
    sub.choices["export"].add_argument("--stage1", action="store_true", help="export stage 1's mixers")
    e = sub.add_parser("evaluate")
    e.add_argument("--model", default="smollm2-hybrid-135m")
    m = sub.add_parser("memory", help="how long each mixer head's state persists on real text")
    m.add_argument("--model", default="smollm2-hybrid-135m")
    m.add_argument("--json", default=None, help="also write the numbers here")
    args = p.parse_args(argv)
    torch.set_num_threads(max(1, torch.get_num_threads()))
    {"stage1": stage1, "stage2": stage2, "export": export, "evaluate": evaluate, "memory": memory}[args.cmd](args)


if __name__ == "__main__":
    main()

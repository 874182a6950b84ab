"""Accuracy of cache reuse on the bundled model: full vs prefix vs pic-naive vs hypic (seam sweep).

On the held-out world (entities never seen in training), for k = 2, 5, 10 documents and every
question kind, each prompt is answered greedily under every configuration, and compared with
the gold answer (exact match, token F1) and with full prefill (first-token KL, greedy
agreement). Question kinds are reported in two groups:

- lookup (single, two_hop): the answer is copied from one document;
- cross-document (count, first_last, follows): the answer depends on information carried
  across documents. For `follows` ("which record comes right after the record about X?") the
  next document's name must know the document before it: with attention confined to each cached
  document, only the linear layers' composed state (or a seam recomputed in context) carries it.

It also compares two seam-state semantics for hypic at the default seam:
(a) `body`: the body operator applied after the seam head recomputed in context (our engine);
(b) `whole`: the whole-segment operator applied to the state before the segment, the
    recomputed seam affecting outputs (K/V) only.

Run:  .venv/bin/python bench/accuracy.py [--n 20] [--model models/hypic-tiny]
Writes bench/results/accuracy_bundled.md and bench/results/accuracy_vs_seam.png beside it.
"""

from __future__ import annotations

import argparse
import collections
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from hypic_core.config import EngineConfig, GenerationRequest, Mode, SamplingParams  # noqa: E402
from hypic_core.engine.engine import Engine  # noqa: E402
from training import world  # noqa: E402

SEAMS = (0, 2, 4, 8, 16, 32)
GROUPS = {"single": "lookup", "two_hop": "lookup", "count": "cross-document", "first_last": "cross-document",
          "follows": "cross-document"}


def configs(default_seam: int) -> list[tuple[str, str, int]]:
    """(label, mode, seam) of every configuration, full first."""
    out = [("full", "full", 0), ("prefix", "prefix", 0)]
    out += [(f"pic-naive w={w}", "pic-naive", w) for w in sorted({0, default_seam})]
    out += [(f"hypic w={w}", "hypic", w) for w in SEAMS]
    out.append((f"hypic-whole w={default_seam}", "whole", default_seam))
    return out


def segments(engine: Engine, example) -> tuple[tuple[int, ...], ...]:
    texts, _ = world.prompt_segments(example)
    return tuple(tuple(engine.tokenizer.encode(t, add_special_tokens=False)) for t in texts)


def prefill_whole_semantics(engine: Engine, segs, seam: int):
    """Semantics (b): S <- T_whole S_before + E_whole; the recomputed seam only contributes K/V."""
    context = segs[:-1]
    whole, _ = engine.segment_entries(context, 0)  # seam 0: the operator spans the whole segment
    runner, adapter = engine.runner, engine.adapter
    with torch.inference_mode():
        cache, pos = runner.new_cache(), 0
        for seg, entry in zip(context, whole):
            w = min(seam, len(seg))
            before = [tuple(x.clone() for x in adapter.linear_state_or_zero(cache, p)) for p in range(len(adapter.linear_layers))]
            if w:
                runner.forward(seg[:w], pos, cache)
            for j, layer in enumerate(adapter.attention_layers):
                k = adapter.rotate_keys(entry.keys[j][:, w:], pos)[None]
                cache.layers[layer].update(k, entry.values[j][None, :, w:])
            for p, (conv, state) in enumerate(before):
                tail = entry.conv_tails[p].to(conv.dtype)
                new_conv = torch.cat([conv, tail], dim=-1)[:, -conv.shape[-1]:]
                adapter.write_linear_state(cache, p, new_conv, entry.operators[p].apply(state))
            pos += len(seg)
        logits = runner.forward(segs[-1], pos, cache, logits=True)
    return cache, pos + len(segs[-1]), logits


def greedy(engine: Engine, segs, mode: str, seam: int, max_tokens: int) -> tuple[str, torch.Tensor]:
    """(answer text, first-token logits) under one configuration."""
    sampling = SamplingParams(max_tokens=max_tokens)
    if mode == "whole":
        from hypic_core.engine.engine import PrefillResult, PrefillStats

        cache, pos, logits = prefill_whole_semantics(engine, segs, seam)
        req = GenerationRequest(segs, mode=Mode.HYPIC, seam=seam, sampling=sampling)
        pre = PrefillResult(cache, pos, logits, PrefillStats("whole", seam))
    else:
        req = GenerationRequest(segs, mode=mode, seam=seam, sampling=sampling)
        pre = engine.prefill(req)
    text = "".join(e.text for e in engine.generate(req, prefilled=pre))
    return text.strip(), pre.logits


def f1(pred: str, gold: str) -> float:
    p, g = pred.lower().split(), gold.lower().split()
    common = sum((collections.Counter(p) & collections.Counter(g)).values())
    if not common:
        return 0.0
    precision, recall = common / len(p), common / len(g)
    return 2 * precision * recall / (precision + recall)


def kl(p_logits: torch.Tensor, q_logits: torch.Tensor) -> float:
    p = torch.log_softmax(p_logits, -1)
    return float(torch.sum(p.exp() * (p - torch.log_softmax(q_logits, -1))))


def evaluate(args) -> tuple[dict, list[tuple[str, str, int]], Engine]:
    engine = Engine.from_pretrained(args.model, EngineConfig(seam=args.seam, memory_budget_bytes=8 << 30))
    examples = world.heldout_examples(args.n, k_values=tuple(args.k))
    cfgs = configs(args.seam)
    # results[label][(group, k)] -> list of (em, f1, kl, agree)
    results: dict[str, dict[tuple[str, int], list[tuple[float, float, float, float]]]] = {
        label: collections.defaultdict(list) for label, _, _ in cfgs}
    t0 = time.perf_counter()
    for i, ex in enumerate(examples):
        segs = segments(engine, ex)
        full_text, full_logits = None, None
        for label, mode, seam in cfgs:
            text, logits = greedy(engine, segs, mode, seam, args.max_tokens)
            if label == "full":
                full_text, full_logits = text, logits
            row = (float(text == ex.answer), f1(text, ex.answer), kl(full_logits, logits), float(text == full_text))
            for key in ((GROUPS[ex.kind], len(ex.docs)), (ex.kind, len(ex.docs))):
                results[label][key].append(row)
        if (i + 1) % 10 == 0 or i + 1 == len(examples):
            el = time.perf_counter() - t0
            print(f"[{i + 1}/{len(examples)}] {el:.0f} s elapsed, ~{el / (i + 1) * (len(examples) - i - 1):.0f} s left", flush=True)
    return results, cfgs, engine


def mean(rows, idx):
    return 100.0 * statistics.fmean(r[idx] for r in rows) if rows else float("nan")


def table(results, cfgs, group: str, ks) -> list[str]:
    head = "| configuration | " + " | ".join(f"EM k={k}" for k in ks) + " | EM all | F1 all | first-token KL | agree w/ full |"
    lines = [head, "|---|" + "---:|" * (len(ks) + 4)]
    for label, _, _ in cfgs:
        rows_all = [r for k in ks for r in results[label][(group, k)]]
        ems = " | ".join(f"{mean(results[label][(group, k)], 0):.1f}" for k in ks)
        kl_all = statistics.fmean(r[2] for r in rows_all) if rows_all else float("nan")
        lines.append(f"| {label} | {ems} | {mean(rows_all, 0):.1f} | {mean(rows_all, 1):.1f} | {kl_all:.2e} | {mean(rows_all, 3):.1f} |")
    return lines


def plot(results, cfgs, ks, path: Path, default_seam: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(9, 3.6), sharey=True)
    for ax, group in zip(axes, ("lookup", "cross-document")):
        em = lambda label: mean([r for k in ks for r in results[label][(group, k)]], 0)  # noqa: E731
        ax.plot(SEAMS, [em(f"hypic w={w}") for w in SEAMS], "o-", label="hypic")
        ax.axhline(em("full"), color="k", ls="--", label="full")
        ax.axhline(em(f"pic-naive w={default_seam}"), color="r", ls=":", label=f"pic-naive (w={default_seam})")
        ax.axhline(em("pic-naive w=0"), color="m", ls="-.", label="pic-naive (w=0)")
        ax.set_xscale("symlog", linthresh=2)
        ax.set_xticks(SEAMS, [str(w) for w in SEAMS])
        ax.set_title(f"{group} questions (k = {', '.join(map(str, ks))})")
        ax.set_xlabel("seam width (tokens)")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("exact match (%)")
    axes[0].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=str(ROOT / "models" / "hypic-tiny"))
    ap.add_argument("--n", type=int, default=20, help="examples per (kind, k)")
    ap.add_argument("--k", type=int, nargs="+", default=[2, 5, 10])
    ap.add_argument("--seam", type=int, default=8, help="default seam (pic-naive and the semantics comparison)")
    ap.add_argument("--max-tokens", type=int, default=6)
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "accuracy_bundled.md")
    args = ap.parse_args()
    torch.manual_seed(0)
    results, cfgs, engine = evaluate(args)
    ks = args.k
    cmd = " ".join([".venv/bin/python", "bench/accuracy.py", *sys.argv[1:]])
    lines = ["# Accuracy of cache reuse", "",
             f"Command: `{cmd}`  ",
             f"Model: `{Path(args.model).name}` ({engine.adapter.family}, {len(engine.adapter.linear_layers)} linear + "
             f"{len(engine.adapter.attention_layers)} attention layers); training recipe and whether attention "
             "supervision was used: see the model's README.  ",
             f"Held-out world, {args.n} examples per (question kind, k), greedy, up to {args.max_tokens} tokens. "
             "EM and F1 against the gold answer; KL(full || config) of the first token; agreement = same answer as full.",
             "", "![accuracy vs seam width](accuracy_vs_seam.png)", ""]
    for group, what in (("lookup", "single-hop and two-hop: the answer is read from documents"),
                        ("cross-document", "count, first/last and follows: the answer needs information "
                                           "carried across documents")):
        lines += [f"## {group.capitalize()} questions ({what})", ""] + table(results, cfgs, group, ks) + [""]
    lines += ["## Per kind (EM over all k)", "", "| configuration | " + " | ".join(world.KINDS) + " |",
              "|---|" + "---:|" * len(world.KINDS)]
    for label, _, _ in cfgs:
        lines.append(f"| {label} | " + " | ".join(
            f"{mean([r for k in ks for r in results[label][(kind, k)]], 0):.1f}" for kind in world.KINDS) + " |")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    plot(results, cfgs, ks, args.out.parent / "accuracy_vs_seam.png", args.seam)
    args.out.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()

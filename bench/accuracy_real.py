"""Accuracy of cache reuse on real text: full vs prefix vs pic-naive vs hypic (seam sweep).

Each question of data/real_qa/ (real documentation passages, hand-written questions) is asked
with a retrieved-style context: its gold passage among 2 to 9 distractor passages, in a shuffled
order (3 to 10 chunks, the count drawn per question). The prompt is built exactly as the gateway
builds it (app/service/prompter.py, the model's named layout), and answered greedily under every
configuration. Against the gold answer: `acc` (the normalised gold answer or an alias occurs in
the normalised answer: chat models answer in sentences) and token F1. Against full prefill:
`agree` (the same greedy answer, word for word), first-token `KL(full || mode)`, `top1` (the
same first token), and `cont KL`: the mean KL(full || mode) of the next-token distributions over
full's answer (up to --max-tokens tokens), teacher-forced, so a config is judged on the whole
answer and not on its first token alone. 95% confidence intervals: Wilson for proportions, t-free normal for means.

Configurations beyond the plain seams (`--variants`, the attention-side ladder of issue 49), each
`SEAM[/FRACTION][~SCALE][+p][@RULE]`: hypic with the seam head max(SEAM, ceil(FRACTION * chunk length))
(`EngineConfig.seam_fraction`), with `~S` (rung 4) the reused bodies' keys multiplied by S
(`EngineConfig.reuse_key_scale`: a temperature of 1/S on the logits over reused tokens, read by
every later token: `reuse_key_scope` "all"; `~Sq`: by the prompt's own tokens only, scope "prompt":
the bodies' keys are set back to 1x once the prefill ends, so the answer reads them as computed), with `+p` every entry computed after the prompt's fixed head
(`EngineConfig.entry_prefix`: the chat template's system part and the user turn's opening, what
precedes the first document in every prompt), and with `@R` (rung 3, selective recompute) a
budget of R x the reused tokens spent widening seam heads, nearest the question first
(hypic_core/engine/recompute.py `head_widths`), or `@gold`: an oracle that computes the gold
document whole in context (what a perfect query-aware choice of one document would give). Each variant runs on its own engine over the same
loaded model. Every config is also paired per question against `full` (answers lost and gained, the
accuracy difference with a paired 95% interval) and against `hypic s=8` (first-token KL difference).

Run:  .venv/bin/python bench/accuracy_real.py --model smollm2-135m-instruct
      [--n 84] [--seams 0 2 4 8 16 32] [--naive-seams 8] [--variants 8+p 8/0.15 8~0.9 8@0.1 8@gold] [--max-tokens 32] [--tag real-smollm2]

`--set short` asks data/short_qa/'s 61 questions instead (six ~80-token documents each, in the
prompter's retrieval order, the best next to the question; `--order shuffled` for a random order).
Writes its section into docs/accuracy.md (between <!-- TAG:begin/end -->) and the raw rows to
bench/results/accuracy_real_<model>.json; progress goes to stderr.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
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
from hypic_core.config import EngineConfig, GenerationRequest, SamplingParams  # noqa: E402
from hypic_core.engine.engine import Engine  # noqa: E402
from hypic_core.models.registry import resolve  # noqa: E402
from markdown_section import write_section  # noqa: E402
from real_qa import build_context, load_real_qa, normalize_answer, score  # noqa: E402
from short_qa import load_short_qa  # noqa: E402
from stats import mcnemar_exact  # noqa: E402
from retrieval.document import Chunk, chunk_id_for  # noqa: E402
from retrieval.index import SearchHit  # noqa: E402


def configs(seams: list[int], naive_seams: list[int], prefix: bool = True,
            variants: list[str] = ()) -> list[tuple[str, str, int, float, bool, str, float, str]]:
    """(label, mode, seam, seam fraction, entry prefix, recompute rule, key scale, its scope) of every configuration,
    `full` first."""
    out = [("full", "full", 0, *PLAIN)] + ([("prefix", "prefix", 0, *PLAIN)] if prefix else [])
    out += [(f"pic-naive s={s}", "pic-naive", s, *PLAIN) for s in naive_seams]
    out += [(f"hypic s={s}", "hypic", s, *PLAIN) for s in seams]
    out += [variant(v) for v in variants]
    return out


PLAIN = (0.0, False, "", 1.0, "")  # no seam fraction, entry prefix or recompute rule; keys as computed, for every token


def is_plain(levers) -> bool:
    """Whether a stored config's levers (what follows label, mode, seam; older runs stored fewer) are all off."""
    return all(a == b for a, b in zip(levers, PLAIN))


def variant(spec: str) -> tuple[str, str, int, float, bool, str, float, str]:
    """`SEAM[/FRACTION][~SCALE[q]][+p][@RULE]` -> a hypic config (see the module docstring)."""
    spec, at, rule = spec.partition("@")
    if at and rule != "gold":
        try:
            ratio = float(rule)
        except ValueError:
            raise SystemExit(f"variant {spec}@{rule}: the rule is a budget ratio (e.g. @0.1) or 'gold'") from None
        if not 0.0 <= ratio <= 1.0:
            raise SystemExit(f"variant {spec}@{rule}: the budget ratio must be in [0, 1]")
    body, plus, flag = spec.partition("+")
    if plus and flag != "p":
        raise SystemExit(f"variant {spec!r}: only '+p' (entry prefix) may follow the seam")
    body, tilde, key_scale = body.partition("~")
    scope = "prompt" if key_scale.endswith("q") else ""
    scale = float(key_scale.removesuffix("q")) if tilde else 1.0
    seam, _, frac = body.partition("/")
    fraction = float(frac) if frac else 0.0
    label = (f"hypic s={int(seam)}" + (f" f={fraction:g}" if fraction else "") + (f" k={scale:g}" if tilde else "") + (" (prompt only)" if scope else "")
             + (" +prefix" if plus else "")
             + ("" if not at else " gold whole (oracle)" if rule == "gold" else f" r={float(rule):g}"))
    return label, "hypic", int(seam), fraction, bool(plus), rule, scale, scope


def lever_config(levers, entry_prefix: tuple[int, ...], **fields) -> EngineConfig:
    """The engine settings of a config's levers (what follows its label, mode and seam): `entry_prefix`
    where it asks for one, a recompute budget (`@R`) as `recompute_ratio`, `fields` (seam, budgets) as given.
    The gold oracle (`@gold`) is the caller's (`install_gold`)."""
    fraction, prefixed, rule, scale, scope = levers
    ratio = float(rule) if rule and rule != "gold" else 0.0
    return EngineConfig(seam_fraction=fraction, entry_prefix=entry_prefix if prefixed else (), reuse_key_scale=scale,
                        reuse_key_scope=scope or "all", recompute_ratio=ratio, **fields)


def install_gold(engine: Engine) -> dict:
    """The `@gold` oracle on `engine`: the segment the returned dict's "gold" names (the benchmark sets it
    per question) is computed whole in context, every other stitched segment gets its usual head. It
    replaces the engine's context-cache manager's `head` on this engine only; entries of every width are
    keyed by it. (A budget `@R` is the engine's own `recompute_ratio`, not this.)"""
    context = engine.context
    plain = context.head  # the bound method: the sequence's own heads
    state: dict = {"gold": None}

    def head(seq, segment):
        return len(segment) if segment == state["gold"] else plain(seq, segment)

    context.head = head
    return state


def kl(p_logits: torch.Tensor, q_logits: torch.Tensor) -> float:
    p = torch.log_softmax(p_logits.float(), -1)
    return max(0.0, float(torch.sum(p.exp() * (p - torch.log_softmax(q_logits.float(), -1)))))


def contains(prediction: str, answers) -> bool:
    pred = f" {normalize_answer(prediction)} "
    return any(f" {normalize_answer(a)} " in pred for a in answers if normalize_answer(a))


def continuation_logits(engine: Engine, cache, position: int, first: torch.Tensor, forced: list[int]) -> torch.Tensor:
    """[len(forced), vocab] next-token logits over `forced` teacher-forced after a prefill (`cache`
    is mutated: pass a copy): row 0 is the prefill's own logits, row t follows forced[:t]."""
    if len(forced) <= 1:
        return first[None]
    ids = torch.tensor([forced[:-1]], dtype=torch.long, device=first.device)
    pos = torch.arange(position, position + ids.shape[1], device=first.device)[None]
    with torch.inference_mode():
        out = engine.runner.model(input_ids=ids, position_ids=pos, cache=cache, use_cache=True)
    return torch.cat([first[None].float(), out.logits[0].float()])


def mean_kl(p_logits: torch.Tensor, q_logits: torch.Tensor) -> float:
    p = torch.log_softmax(p_logits.float(), -1)
    return max(0.0, float(torch.sum(p.exp() * (p - torch.log_softmax(q_logits.float(), -1)), -1).mean()))


def wilson(successes: float, n: int) -> tuple[float, float]:
    if n == 0:
        return float("nan"), float("nan")
    z, p = 1.96, successes / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return max(0.0, 100 * (centre - half)), min(100.0, 100 * (centre + half))


def mean_ci(values: list[float]) -> tuple[float, float]:
    m = statistics.fmean(values)
    half = 1.96 * statistics.stdev(values) / math.sqrt(len(values)) if len(values) > 1 else float("nan")
    return m, half


def prompt_segments(prompter: Prompter, question: str, chunks: list[str]) -> tuple[tuple[int, ...], ...]:
    # scores rise with the position, so the prompt keeps the shuffled order
    hits = [SearchHit(float(i), Chunk(chunk_id_for(t), f"c{i}", "", "real_qa", 0, t, 0)) for i, t in enumerate(chunks)]
    prompt = prompter.query(question, hits, reserve=64)
    assert prompt.dropped == 0, "context too small for the benchmark's chunks"
    return tuple(prompt.segments)


def entry_prefix(prompter: Prompter) -> tuple[int, ...]:
    """What precedes the first document in every /query prompt: its exact-prefix segments (the chat
    template's system part and the user turn's opening), joined."""
    head = prompter.query("?", [], reserve=0)
    return tuple(t for seg in head.segments[: head.exact_prefix] for t in seg)


def evaluate(args) -> dict:
    model = resolve(args.model)
    settings = Settings(_env_file=None, model=args.model)
    budget = (8 << 30) if not args.variants else (512 << 20)  # several engines (and processes): each keeps less
    engine = Engine.from_pretrained(model.path, EngineConfig(seam=8, memory_budget_bytes=budget), dtype=args.dtype,
                                    model_id=settings.served_model_name)
    layout = settings.prompt_layout(engine.tokenizer, model.prompt)
    prompter = Prompter(engine.tokenizer, layout, engine.max_positions)
    head = entry_prefix(prompter)
    engines = {PLAIN: engine}  # (seam fraction, entry prefix, rule, key scale) -> an engine over the same model
    gold_states = {}  # levers -> what install_gold returned
    for _, _, _, *levers in configs([], [], False, args.variants or []):
        levers = tuple(levers)
        rule = levers[2]
        if levers not in engines:
            engines[levers] = Engine(engine.model, engine.tokenizer, lever_config(levers, head, seam=8, memory_budget_bytes=budget),
                                     model_id=settings.served_model_name)
            if rule == "gold":
                gold_states[levers] = install_gold(engines[levers])
    pairs = questions(args)
    cfgs = configs(args.seams, args.seams if args.naive_seams is None else args.naive_seams, not args.no_prefix,
                   args.variants or [])
    rows: dict[str, list[dict]] = {label: [] for label, *_ in cfgs}
    rng = random.Random(args.seed)
    t0 = time.perf_counter()
    for i, pair in enumerate(pairs):
        if args.set == "short":
            n_chunks = len(pair.chunks)
        else:
            n_chunks = rng.randint(3, min(10, len(pair.distractors) + 1))
        if i < args.first or (args.ids and pair.id not in args.ids):  # another share: the draw above keeps
            continue                                                      # the contexts of a whole run
        if args.set == "short":
            chunks, gold = list(pair.chunks), pair.gold
        else:
            chunks, gold = build_context(pair, n_chunks, seed=args.seed)
        segs = prompt_segments(prompter, pair.question, chunks)
        assert tuple(t for s in segs[:2] for t in s)[: len(head)] == head, "the prompt does not open with the entry prefix"
        context = [s for s in segs[:-1] if not prompter.link or s != prompter.link]  # a linked model: its links left out
        docs = context[-len(chunks):]  # the prompter's tail is the question alone
        assert len(docs) == len(chunks) and all(engine.tokenizer.decode(d).count(c[:20]) for d, c in zip(docs, chunks)), \
            "the documents are not the prompt's last context segments"
        for state in gold_states.values():
            state["gold"] = docs[gold]
        full = None
        for label, mode, seam, *levers in cfgs:
            engine = engines[tuple(levers)]
            request = GenerationRequest(segs, mode=mode, seam=seam, sampling=SamplingParams(max_tokens=args.max_tokens))
            pre = engine.prefill(request)
            forked = copy.deepcopy(pre.cache)
            events = list(engine.generate(request, prefilled=pre))
            raw = "".join(e.text for e in events)
            text = raw.strip()
            if full is None:
                ids = [e.token_id for e in events if e.token_id is not None]
                full = (text, pre.logits, ids, None)
            cont = continuation_logits(engine, forked, pre.position, pre.logits, full[2])
            if full[3] is None:
                full = (*full[:3], cont)
            _, f1 = score(text, pair.answer, pair.aliases)
            rows[label].append({"id": pair.id, "chunks": n_chunks, "gold_at": gold, "answer": text,
                                "acc": contains(text, pair.answers), "f1": f1, "agree": text == full[0],
                                "ws": raw[:1].isspace(), "seam_tokens": pre.stats.seam_tokens,
                                "kl": kl(full[1], pre.logits), "cont_kl": mean_kl(full[3], cont), "top1": int(pre.logits.argmax()) == int(full[1].argmax())})
        if args.partial:  # what is done so far, for a run cut short
            Path(args.partial).write_text(json.dumps({"done": i + 1, "rows": rows}))
        el = time.perf_counter() - t0
        print(f"[{i + 1}/{len(pairs)}] {el:.0f} s elapsed; "
              f"full: {rows['full'][-1]['answer'][:60]!r}", file=sys.stderr, flush=True)
    return {"model": args.model, "set": args.set, "order": args.order, "family": engine.adapter.family, "entry_prefix_tokens": len(head), "linear_layers": len(engine.adapter.linear_layers),
            "attention_layers": len(engine.adapter.attention_layers), "dtype": str(engine.runner.model.dtype),
            "n": len(rows["full"]), "first": args.first, "ids": args.ids, "max_tokens": args.max_tokens, "seed": args.seed,
            "seconds": round(time.perf_counter() - t0),
            "configs": [list(c) for c in cfgs], "rows": rows}


def questions(args) -> list:
    """The questions of `--set` (real: data/real_qa's QAPair; short: data/short_qa's ShortQA), the first `--n`."""
    if args.set == "short":
        return load_short_qa(order=args.order, seed=args.seed)[: args.n]
    return load_real_qa()[: args.n]


def table(results: dict) -> list[str]:
    lines = ["| config | answer acc % (95% CI) | F1 % | agree with full % (95% CI) | first-token KL (+-95%) "
             "| answer KL (+-95%) | top-1 agree % | starts with whitespace where full does not |",
             "|---|---|---|---|---|---|---|---|"]
    full_ws = [r.get("ws") for r in results["rows"]["full"]]
    for label, *_ in results["configs"]:
        rows = results["rows"][label]
        n = len(rows)
        acc = sum(r["acc"] for r in rows)
        agree = sum(r["agree"] for r in rows)
        lo, hi = wilson(acc, n)
        alo, ahi = wilson(agree, n)
        k, khalf = mean_ci([r["kl"] for r in rows])
        c, chalf = mean_ci([r.get("cont_kl", float("nan")) for r in rows])
        lines.append(f"| {label} | {100 * acc / n:.1f} ({lo:.1f}-{hi:.1f}) | {100 * statistics.fmean(r['f1'] for r in rows):.1f} "
                     f"| {100 * agree / n:.1f} ({alo:.1f}-{ahi:.1f}) | {k:.4f} (+-{khalf:.4f}) | {c:.4f} (+-{chalf:.4f}) "
                     f"| {100 * statistics.fmean(r['top1'] for r in rows):.1f} | {_ws_cell(rows, full_ws)} |")
    lines += paired_lines(results)
    lines += against_full_lines(results)
    return lines


def against_full_lines(results: dict) -> list[str]:
    """Each config paired per question with `full` (answers lost, gained, the exact McNemar p-value of the two
    counts, the accuracy difference with a paired 95% interval), and with `hypic s=8` where it ran (the first-token KL difference: what a rung
    adds over the old default); the mean seam tokens a prompt recomputed (warm cost)."""
    rows = results["rows"]
    full = rows["full"]
    base = rows.get("hypic s=8")
    out = ["", "| paired, per question | answers lost to full | gained | exact McNemar p | acc - full, points (+-95%) "
           "| first-token KL - hypic s=8 (+-95%) | lower than hypic s=8 on | seam tokens / prompt |",
           "|---|---|---|---|---|---|---|---|"]
    for label, *_ in results["configs"]:
        if label == "full":
            continue
        r = rows[label]
        lost = sum(f["acc"] and not x["acc"] for f, x in zip(full, r))
        gained = sum(x["acc"] and not f["acc"] for f, x in zip(full, r))
        m, half = mean_ci([100.0 * (x["acc"] - f["acc"]) for f, x in zip(full, r)])
        kl_cells = ["", ""]
        if base is not None and label != "hypic s=8":
            diff = [x["kl"] - b["kl"] for x, b in zip(r, base)]
            km, khalf = mean_ci(diff)
            kl_cells = [f"{km:+.4f} (+-{khalf:.4f})", f"{sum(d < 0 for d in diff)}/{len(diff)}"]
        seam = [x["seam_tokens"] for x in r if "seam_tokens" in x]
        seam_cell = f"{statistics.fmean(seam):.0f}" if len(seam) == len(r) else "n/a"
        out.append(f"| {label} | {lost} | {gained} | {mcnemar_exact(lost, gained):.3g} | {m:+.1f} (+-{half:.1f}) | "
                   + " | ".join(kl_cells) + f" | {seam_cell} |")
    return out


def _ws_cell(rows: list[dict], full_ws: list) -> str:
    """How many of a config's raw answers (before the strip that scoring does) start with
    whitespace where `full`'s answer to the same prompt does not; rows of runs that did not
    record it read n/a."""
    if any(r.get("ws") is None for r in rows) or None in full_ws:
        return "n/a"
    return f"{sum(r['ws'] and not f for r, f in zip(rows, full_ws))}/{len(rows)}"


def paired_lines(results: dict) -> list[str]:
    """hypic minus pic-naive per question at every seam both ran (the same prompts, so the paired
    difference is far tighter than the two rows' intervals): what composing the linear states adds."""
    labels = {(mode, seam): label for label, mode, seam, *levers in results["configs"] if is_plain(levers)}
    seams = sorted(s for (m, s) in labels if m == "hypic" and ("pic-naive", s) in labels)
    if not seams:
        return []
    out = ["", "| paired, per question | first-token KL: hypic - pic-naive (+-95%) | hypic lower on | "
           "answer KL: hypic - pic-naive (+-95%) | hypic lower on |", "|---|---|---|---|---|"]
    for s in seams:
        a, b = results["rows"][labels[("hypic", s)]], results["rows"][labels[("pic-naive", s)]]
        cells = []
        for key in ("kl", "cont_kl"):
            diff = [x[key] - y[key] for x, y in zip(a, b)]
            m, half = mean_ci(diff)
            cells += [f"{m:+.4f} (+-{half:.4f})", f"{sum(d < 0 for d in diff)}/{len(diff)}"]
        out.append(f"| seam {s} | " + " | ".join(cells) + " |")
    return out


def _shares_note(results: dict) -> str:
    k = results.get("processes", 1)
    return f", as {k} processes side by side (`--first`, `--save`, `--join`)" if k > 1 else ""


def join(shares: list[dict]) -> dict:
    """One run's results from the shares of it that processes side by side computed (`--first`,
    `--save`): the rows in question order; the wall time of the slowest share."""
    shares = sorted(shares, key=lambda r: r.get("first", 0))
    for a, b in zip(shares, shares[1:]):
        if a["first"] + a["n"] != b["first"] and not a.get("partial"):
            raise SystemExit(f"shares do not tile the questions: {a['first']}+{a['n']} then {b['first']}")
        if (a["model"], a["configs"], a["seed"], a["max_tokens"]) != (b["model"], b["configs"], b["seed"], b["max_tokens"]):
            raise SystemExit("shares come from different runs (model, configs, seed or max tokens differ)")
    out = dict(shares[0])
    out["rows"] = {label: [r for sh in shares for r in sh["rows"][label]] for label in shares[0]["rows"]}
    out["n"], out["first"] = sum(sh["n"] for sh in shares), shares[0]["first"]
    out["seconds"], out["processes"] = max(sh["seconds"] for sh in shares), len(shares)
    out["partial"] = any(sh.get("partial") for sh in shares)
    return out


def partial_share(data: dict, args) -> dict:
    """A share's results from its `--partial` file (a run cut short: the rows of the questions it finished),
    with the run's arguments; what the rows do not say (family, layer counts, dtype) comes from `--merge`."""
    if "configs" in data:
        return data
    ids = [pair.id for pair in questions(args)]
    rows = data["rows"]
    n = len(rows["full"])
    cfgs = configs(args.seams, args.seams if args.naive_seams is None else args.naive_seams, not args.no_prefix,
                   args.variants or [])
    return {"model": args.model, "n": n, "first": ids.index(rows["full"][0]["id"]) if n else 0, "partial": True,
            "max_tokens": args.max_tokens, "seed": args.seed, "seconds": 0, "configs": [list(c) for c in cfgs], "rows": rows}


def merge(results: dict, path: str, label: str) -> None:
    """Add config `label`'s rows from an earlier run on the same prompts (`path`, its raw rows), checked:
    the same questions, and `full`'s answers identical word for word (greedy, fp32: the run is
    deterministic, so its other rows are what this run would have computed)."""
    old = json.loads(Path(path).read_text())
    by_id = {r["id"]: i for i, r in enumerate(old["rows"]["full"])}
    picked = []
    for r in results["rows"]["full"]:
        i = by_id[r["id"]]
        if old["rows"]["full"][i]["answer"] != r["answer"]:
            raise SystemExit(f"{path}: full answers {r['id']} differently; its rows are not this run's")
        picked.append(old["rows"][label][i])
    spec = next(c for c in old["configs"] if c[0] == label)
    results["configs"].insert(1, [*spec, *PLAIN[len(spec) - 3:]])
    results["rows"][label] = picked
    for k in ("family", "linear_layers", "attention_layers", "dtype"):
        results.setdefault(k, old.get(k))
    results.setdefault("merged", []).append(f"`{label}` from `{path}`")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--n", type=int, default=84, help="questions (data/real_qa has 84, data/short_qa 61)")
    parser.add_argument("--set", choices=("real", "short"), default="real",
                        help="real: data/real_qa (3-10 passages of 130-330 tokens); short: data/short_qa (six ~80-token documents)")
    parser.add_argument("--order", choices=("retrieval", "shuffled"), default="retrieval",
                        help="--set short: the documents in the prompter's order (best next to the question) or shuffled")
    parser.add_argument("--seams", type=int, nargs="*", default=[0, 2, 4, 8, 16, 32], help="hypic seams (none: no hypic rows)")
    parser.add_argument("--naive-seams", type=int, nargs="*", default=None,
                        help="seams for pic-naive (default: --seams). On a dense model pic-naive equals hypic at every "
                             "seam (no linear layers to compose), so one is enough as a check.")
    parser.add_argument("--variants", nargs="*", default=None,
                        help="hypic configs SEAM[/FRACTION][~SCALE][+p][@RULE]: a seam fraction of each chunk beside the "
                             "fixed width, ~: the reused keys x SCALE, +p: entries computed after the prompt's fixed head, "
                             "@: a recompute budget or 'gold' (see the module docstring)")
    parser.add_argument("--merge", nargs=2, action="append", default=[], metavar=("JSON", "LABEL"),
                        help="with --join: add config LABEL's rows from an earlier run's raw rows on the same prompts "
                             "(checked: full's answers identical)")
    parser.add_argument("--first", type=int, default=0,
                        help="start at this question (0-based), with the contexts a whole run gives it: a share of "
                             "the run for a second process, whose --partial rows join the first's")
    parser.add_argument("--ids", nargs="+", default=None, help="only these question ids (each with the context a whole run "
                        "gives it), e.g. the questions a config answers differently from full")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--no-prefix", action="store_true", help="leave out `prefix` (equal to full by construction: "
                        "tests/engine/test_stitch.py checks it)")
    parser.add_argument("--partial", default=None, help="rewrite the rows so far to this JSON file after each question")
    parser.add_argument("--tag", default=None, help="docs/accuracy.md section tag (default: real-<model>)")
    parser.add_argument("--raw", default=None, help="file name in bench/results/ of the raw rows (default: accuracy_real_<model>.json)")
    parser.add_argument("--no-write", action="store_true", help="print only")
    parser.add_argument("--save", default=None, help="write this run's results (a share: --first, --n) to this JSON "
                        "file instead of bench/results/; --join makes one run of the shares")
    parser.add_argument("--join", nargs="+", default=None, help="--save files of shares that tile the questions: "
                        "write the docs section and raw rows of them joined (give the run's other arguments)")
    parser.add_argument("--from-json", action="store_true", help="rewrite the docs section from the saved raw rows "
                        "(bench/results/accuracy_real_<model>.json) instead of running; give the run's other arguments")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    name = Path(args.model).name
    raw = args.raw or f"accuracy_real_{name}.json"
    if args.join:
        results = join([partial_share(json.loads(Path(f).read_text()), args) for f in args.join])
        for path, label in args.merge:
            merge(results, path, label)
        if "family" not in results:  # cut-short shares only: the model's shape from an earlier run's raw rows
            for old in sorted((ROOT / "bench" / "results").glob(f"accuracy_real_{Path(args.model).name}*.json"),
                              key=lambda p: p.stat().st_mtime, reverse=True):  # the newest: the model file now
                known = json.loads(old.read_text())
                if "family" in known:
                    results.update({k: known[k] for k in ("family", "linear_layers", "attention_layers", "dtype")})
                    break
    elif args.from_json:
        results = json.loads((ROOT / "bench" / "results" / raw).read_text())
    else:
        results = evaluate(args)
        if args.save:
            Path(args.save).write_text(json.dumps(results))
            print("\n".join(table(results)))
            return
    naive = "" if args.naive_seams is None else " ".join([" --naive-seams", *map(str, args.naive_seams)])
    naive += " --no-prefix" if args.no_prefix else ""
    naive += " ".join([" --variants", *args.variants]) if args.variants else ""
    naive += f" --set short" + (" --order shuffled" if args.order == "shuffled" else "") if args.set == "short" else ""
    naive += " ".join([" --ids", *args.ids]) if args.ids else ""
    naive += f" --tag {args.tag}" if args.tag else ""
    naive += f" --raw {args.raw}" if args.raw else ""
    naive += "".join(f" --merge {path} '{label}'" for path, label in args.merge)
    command = (f".venv/bin/python bench/accuracy_real.py --model {args.model} --n {args.n} --seams {' '.join(map(str, args.seams))}"
               f"{naive} --max-tokens {args.max_tokens}")
    body = table(results)
    print("\n".join(body))
    if args.no_write:
        return
    (ROOT / "bench" / "results" / raw).write_text(json.dumps(results, indent=1))
    tag = args.tag or f"real-{name}"
    wanted = len(args.ids) if args.ids else args.n  # cut short: shares stopped before every question was asked
    cut = bool(results.get("partial")) and results["n"] < wanted
    section = "\n".join([
        f"<!-- {tag}:begin -->",
        f"### {name} on real text ({results['family']}: {results['linear_layers']} linear + "
        f"{results['attention_layers']} attention layers, {results['dtype']})"
        + (f", PARTIAL: {results['n']} of {wanted} questions" if cut else ""),
        "",
        f"`{command}` ({results['n']} questions from "
        + (f"data/short_qa, six ~80-token documents each in {args.order} order, greedy, " if args.set == "short"
           else "data/real_qa, 3-10 chunks each, greedy, ")
        + (f"a run cut short: only the questions its shares finished" if cut
           else "joined from the shares' `--partial` files, no wall time kept" if results.get("partial")
           else f"{results['seconds']} s on this machine's CPU")
        + f"{_shares_note(results)}). Raw rows: `bench/results/{raw}`."
        + (f" Merged: {', '.join(results['merged'])} (full's answers checked identical)." if results.get("merged") else ""),
        "",
        *body,
        f"<!-- {tag}:end -->",
    ])
    write_section(ROOT / "docs" / "accuracy.md", section, tag)


if __name__ == "__main__":
    main()

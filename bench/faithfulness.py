"""Faithfulness of reuse, label-free: does a reused prefill give `full`'s answer, word for word?

No gold answers: `full` is the reference. Each of `--n` RAG prompts (default 1000) holds k documents
(3-8, in a random order) of real text no model here was trained on (bench/data/faithfulness_docs.jsonl.gz:
a held-out slice of the hybrid's docstring corpus, and Debian's /usr/share/doc prose; see
bench/data/make_faithfulness_docs.py), short (~60 words, ~80 tokens) or long (~225 words, ~300 tokens),
and a templated question; the four (source, length) classes take turns. The prompt is built as the
gateway builds it (app/service/prompter.py, the model's layout: bench/accuracy_real.py's helpers).
Documents come from a pool of `--pool` per class, so later prompts reuse earlier prompts' cache entries
as a gateway does (entries are canonical: warm and cold give the same tokens).

Per prompt and per reuse configuration (`--configs MODE:SEAM`, default the engine's `hypic:8`), against
`full`, both greedy for `--max-tokens` (32) tokens through the public engine (`Engine.prefill`,
`Engine.generate`):
- `identical`: the same answer token for token (to EOS or the 32nd token);
- `matched`: tokens until the first difference;
- `first-token KL`: KL(full || reuse) of the first-token distributions, nats;
- `answer KL`: the mean KL(full || reuse) of the next-token distributions over full's answer, teacher-forced
  (bench/accuracy_real.py `continuation_logits`), so a configuration is judged on the whole span.
Each mean comes with a paired bootstrap 95% interval over prompts (bench/stats.py), the identical share
also by source and length. `--forced` skips decoding the reuse answer and reads `identical` and `matched`
from the teacher-forced logits instead (greedy decoding follows full's tokens as long as each argmax does:
the same numbers for about a third less time; the test checks the two agree).

    .venv/bin/python bench/faithfulness.py --model smollm2-hybrid-135m [--n 1000] [--configs hypic:8 pic-naive:8]
        [--save bench/results/faithfulness_smollm2-hybrid-135m.json]
    .venv/bin/python bench/faithfulness.py --report A.json B.json   # one table of saved runs; B vs A per prompt
    .venv/bin/python bench/faithfulness.py --report A.json 'tuned (step 496)=B.json'   # LABEL=PATH names a row

Two processes (one torch thread each) share a run: `--n 500 --save a.json` and `--first 500 --save b.json`, then
`--join a.json b.json --save run.json`.

Progress goes to stderr, the markdown table to stdout; `--save` writes the rows (rewritten every 10
prompts, `"partial": true` until the run ends, so a run cut short keeps what it measured).
"""

from __future__ import annotations

import argparse
import copy
import gzip
import json
import random
import re
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from accuracy_real import continuation_logits, kl, mean_kl, prompt_segments  # noqa: E402
from stats import identical_share, mcnemar_exact, paired_bootstrap_ci  # noqa: E402
from harness import cpu_name  # noqa: E402

DOCS = ROOT / "bench" / "data" / "faithfulness_docs.jsonl.gz"
LENGTHS = {"short": 60, "long": 225}  # words kept of a document (~80 and ~300 SmolLM2 tokens)
LONG_MIN_WORDS = 200  # a unit this long or longer can be a long document
CLASSES = [(s, n) for n in LENGTHS for s in ("docstrings", "debian")]
QUESTIONS = (
    "What does the {ordinal} document say?",
    "Which program, module or option do the documents describe?",
    "Summarise the documents in one sentence.",
    "What does the documentation say about {term}?",
    "According to the documents, what is {term} used for?",
    "Which document mentions {term}, and what does it say about it?",
)
ORDINALS = ("first", "second", "third", "fourth", "fifth", "sixth", "seventh", "eighth")


@dataclass(frozen=True)
class Doc:
    id: str
    source: str  # "docstrings" or "debian"
    where: str
    licence: str
    text: str


@dataclass(frozen=True)
class Prompt:
    id: int
    source: str
    length: str  # "short" or "long"
    doc_ids: tuple[str, ...]
    documents: tuple[str, ...]  # the texts, cut, in prompt order
    question: str


def load_docs(path: Path | str = DOCS) -> list[Doc]:
    with gzip.open(path, "rt", encoding="utf-8") as f:
        return [Doc(r["id"], r["source"], r["where"], r["licence"], r["text"]) for r in map(json.loads, f)]


def cut(text: str, words: int) -> str:
    """The first `words` words of `text` (paragraph breaks kept as spaces), ended at the last sentence end
    in their final third when there is one."""
    ws = text.split()[:words]
    for i in range(len(ws) - 1, (2 * len(ws)) // 3 - 1, -1):
        if ws[i].endswith((".", "!", "?")):
            return " ".join(ws[: i + 1])
    return " ".join(ws)


def build_prompts(docs: list[Doc], n: int, seed: int = 0, pool: int = 100, words: dict[str, int] = LENGTHS) -> list[Prompt]:
    """`n` prompts, the (source, length) classes taking turns; each class draws from its first `pool` units
    (shuffled by `seed`), cut to `words[length]` words. Raises ValueError when a class has fewer than 8 units."""
    rng = random.Random(seed)
    pools = {}
    for source, length in CLASSES:
        units = [d for d in docs if d.source == source and (length == "short" or len(d.text.split()) >= LONG_MIN_WORDS)]
        random.Random(f"{seed}:{source}:{length}").shuffle(units)
        if len(units[:pool]) < 8:
            raise ValueError(f"--pool {pool}: the {source}/{length} class has {len(units[:pool])} documents, fewer than 8")
        pools[source, length] = units[:pool]
    prompts = []
    for i in range(n):
        source, length = CLASSES[i % len(CLASSES)]
        picked = rng.sample(pools[source, length], rng.randint(3, 8))  # a random subset in a random order
        texts = tuple(cut(d.text, words[length]) for d in picked)
        template = rng.choice(QUESTIONS)
        terms = sorted({w.strip(".,;:()\"'") for w in rng.choice(texts).split()
                        if re.fullmatch(r"[A-Za-z][a-z]{6,}[.,;:]?", w)}) or ["it"]
        question = template.format(ordinal=ORDINALS[rng.randrange(len(picked))], term=rng.choice(terms))
        prompts.append(Prompt(i, source, length, tuple(d.id for d in picked), texts, question))
    return prompts


def parse_config(spec: str) -> tuple[str, int]:
    """`MODE:SEAM` (e.g. hypic:8, pic-naive:0) -> (mode, seam). Raises SystemExit naming the bad part."""
    mode, _, seam = spec.partition(":")
    if mode not in ("hypic", "pic-naive", "prefix") or not seam.isdigit():
        raise SystemExit(f"--configs {spec!r}: expected MODE:SEAM with MODE hypic, pic-naive or prefix and SEAM >= 0")
    return mode, int(seam)


def first_difference(a: list[int], b: list[int]) -> int:
    """Tokens until the first difference of two answers (the shorter length when one extends the other)."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return min(len(a), len(b))


def forced_match(cont: torch.Tensor, reference: list[int]) -> int:
    """Tokens of `reference` a greedy decoder would reproduce, read from teacher-forced logits `cont`
    (row t: the next-token logits after reference[:t]): the first t where the argmax departs."""
    top = cont.argmax(-1).tolist()
    return first_difference(top, reference) if len(top) >= len(reference) else first_difference(top, reference[: len(top)])


def answer(engine, segments, mode: str, seam: int, max_tokens: int, decode: bool = True):
    """One prefill of `segments` under (mode, seam) and, with `decode`, its greedy answer: (prefill result,
    token ids or None, text or None, an untouched copy of the prefill's cache)."""
    from hypic_core.config import GenerationRequest, SamplingParams

    request = GenerationRequest(segments, mode=mode, seam=seam, sampling=SamplingParams(max_tokens=max_tokens))
    pre = engine.prefill(request)
    forked = copy.deepcopy(pre.cache)
    if not decode:
        return pre, None, None, forked
    events = list(engine.generate(request, prefilled=pre))
    return pre, [e.token_id for e in events if e.token_id is not None], "".join(e.text for e in events), forked


def measure_prompt(engine, prompter, prompt: Prompt, configs: list[tuple[str, int]], max_tokens: int,
                   forced: bool = False) -> dict:
    """Full and every reuse configuration on one prompt: {"full": {...}, "hypic:8": {...}, ...}."""
    segs = prompt_segments(prompter, prompt.question, list(prompt.documents))
    full_pre, ids, text, full_cache = answer(engine, segs, "full", 0, max_tokens)
    full_cont = continuation_logits(engine, full_cache, full_pre.position, full_pre.logits, ids)
    row = {"full": {"answer": text, "tokens": len(ids), "prompt_tokens": full_pre.position}}
    for mode, seam in configs:
        pre, got, got_text, cache = answer(engine, segs, mode, seam, max_tokens, decode=not forced)
        cont = continuation_logits(engine, cache, pre.position, pre.logits, ids)
        fm = forced_match(cont, ids)
        matched = fm if forced else first_difference(ids, got)
        row[f"{mode}:{seam}"] = {
            "identical": fm == len(ids) if forced else got == ids, "matched": matched, "forced_matched": fm,
            "kl_first": kl(full_pre.logits, pre.logits), "kl_answer": mean_kl(full_cont, cont),
            "answer": got_text, "seam_tokens": pre.stats.seam_tokens}
    return row


def run(args) -> dict:
    from app.service.prompter import Prompter
    from app.service.settings import Settings
    from hypic_core.config import EngineConfig
    from hypic_core.engine.engine import Engine
    from hypic_core.models.registry import resolve

    configs = [parse_config(c) for c in args.configs]
    model = resolve(args.model)
    settings = Settings(_env_file=None, model=args.model)
    engine = Engine.from_pretrained(model.path, EngineConfig(seam=8, memory_budget_bytes=args.memory_mb << 20),
                                    dtype=args.dtype, model_id=settings.served_model_name)
    layout = settings.prompt_layout(engine.tokenizer, model.prompt)
    prompter = Prompter(engine.tokenizer, layout, engine.max_positions)
    words = dict(zip(LENGTHS, args.words))
    prompts = build_prompts(load_docs(args.docs), args.n, args.seed, args.pool, words)
    results = {"model": args.model, "family": engine.adapter.family, "n": 0, "first": args.first, "seed": args.seed, "pool": args.pool, "words": words,
               "max_tokens": args.max_tokens, "configs": [f"{m}:{s}" for m, s in configs], "forced": args.forced,
               "threads": torch.get_num_threads(), "dtype": str(engine.runner.model.dtype), "partial": True, "rows": []}
    t0 = time.perf_counter()
    for i, prompt in enumerate(prompts):
        if i < args.first:  # another process's share: the same prompt list, this one measures from --first on
            continue
        if args.max_minutes and time.perf_counter() - t0 > 60 * args.max_minutes:
            print(f"--max-minutes {args.max_minutes}: stopping after {i} prompts", file=sys.stderr, flush=True)
            break
        row = measure_prompt(engine, prompter, prompt, configs, args.max_tokens, args.forced)
        results["rows"].append({"id": prompt.id, "source": prompt.source, "length": prompt.length, "k": len(prompt.doc_ids),
                                "docs": list(prompt.doc_ids), "question": prompt.question, **row})
        results["n"], results["seconds"] = len(results["rows"]), round(time.perf_counter() - t0, 1)
        first = results["configs"][0]
        same, done = sum(r[first]["identical"] for r in results["rows"]), len(results["rows"])
        el = time.perf_counter() - t0
        print(f"[{i + 1}/{len(prompts)}] {el:.0f} s, ~{el / done * (len(prompts) - i - 1):.0f} s left; "
              f"{first} identical {same}/{done}; full: {row['full']['answer'][:50]!r}", file=sys.stderr, flush=True)
        if args.save and (i + 1) % 10 == 0:
            Path(args.save).write_text(json.dumps(results))
    results["partial"] = False
    return results


def summary(results: dict, config: str) -> dict:
    """The means of one configuration's rows with their paired bootstrap 95% intervals (fractions, nats)."""
    rows = results["rows"]
    out = {"n": len(rows)}
    for key in ("identical", "matched", "kl_first", "kl_answer"):
        out[key] = paired_bootstrap_ci([float(r[config][key]) for r in rows])
    out["identical_wilson"] = identical_share(rows, config)[1]
    for source, length in CLASSES:
        part = [r[config]["identical"] for r in rows if (r["source"], r["length"]) == (source, length)]
        out[f"{source}/{length}"] = paired_bootstrap_ci([float(x) for x in part]) if part else None
    return out


def labelled(arg: str) -> dict:
    """A saved run from `PATH` or `LABEL=PATH` (the label names its rows instead of the model)."""
    label, _, path = arg.rpartition("=")
    res = json.loads(Path(path).read_text())
    if label:
        res["label"] = label
    return res


def table(runs: list[dict]) -> list[str]:
    """One row per (run, configuration); then each later run against the first, prompt by prompt (the same
    prompts), for the configurations both ran: identical answers lost and gained, with the exact McNemar p."""
    lines = ["| model | config | n | identical to full % (95% CI) | tokens matched (95% CI) | first-token KL (95% CI) "
             "| answer KL (95% CI) | identical, by class: " + ", ".join(f"{s}/{n}" for s, n in CLASSES) + " |",
             "|---|---|---:|---|---|---|---|---|"]
    for res in runs:
        for config in res["configs"]:
            s = summary(res, config)
            by_class = ", ".join("n/a" if s[f"{c}/{n}"] is None else f"{100 * s[f'{c}/{n}'].mean:.0f}" for c, n in CLASSES)
            lines.append(f"| {res.get('label', res['model'])} | {config} | {s['n']} | {s['identical'].cell('.1f', 100)} | {s['matched'].cell('.1f')} "
                         f"| {s['kl_first'].cell('.4f')} | {s['kl_answer'].cell('.4f')} | {by_class} |")
    base = runs[0]
    pairs = [(res, c) for res in runs[1:] for c in res["configs"] if c in base["configs"]]
    if pairs:
        lines += ["", f"| against {base.get('label', base['model'])}, same prompts | config | n | identical: lost / gained | exact McNemar p "
                  "| identical, difference in points (95% CI) | answer KL difference (95% CI) |", "|---|---|---:|---|---:|---|---|"]
        for res, config in pairs:
            a, b = _paired_rows(base, res)
            lost = sum(x[config]["identical"] and not y[config]["identical"] for x, y in zip(a, b))
            gained = sum(y[config]["identical"] and not x[config]["identical"] for x, y in zip(a, b))
            diff = paired_bootstrap_ci([float(y[config]["identical"]) for y in b], [float(x[config]["identical"]) for x in a])
            kld = paired_bootstrap_ci([y[config]["kl_answer"] for y in b], [x[config]["kl_answer"] for x in a])
            lines.append(f"| {res.get('label', res['model'])} | {config} | {len(a)} | {lost} / {gained} | {mcnemar_exact(lost, gained):.3g} "
                         f"| {diff.cell('+.1f', 100)} | {kld.cell('+.4f')} |")
    return lines


def write_card(results: dict, path: Path, argv: str) -> None:
    """The release measurement of `results`' first configuration as the model card's faithfulness.json
    (app/service/guard/release.py reads it: the accuracy guard's default threshold is its `low`)."""
    config = results["configs"][0]
    s = summary(results, config)
    card = {"model": results["model"], "config": config, "answer_tokens": results["max_tokens"], "n": s["n"],
            "identical": round(s["identical"].mean, 4), "low": round(s["identical_wilson"].low, 4),
            "high": round(s["identical_wilson"].high, 4), "interval": "Wilson 95%",
            "matched_tokens": round(s["matched"].mean, 2), "kl_answer": round(s["kl_answer"].mean, 5),
            "command": f".venv/bin/python bench/faithfulness.py {argv}", "measured": time.strftime("%Y-%m-%d"),
            "cpu": cpu_name(), "threads": results.get("threads")}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(card, indent=1) + "\n")


def join(shares: list[dict]) -> dict:
    """One run from the `--save` files of processes that measured consecutive shares of the same prompt list
    (`--first`): rows in prompt order, the slowest share's wall time. Raises SystemExit unless they tile it."""
    shares = sorted(shares, key=lambda r: r.get("first", 0))
    for a, b in zip(shares, shares[1:]):
        if any(a.get(k) != b.get(k) for k in ("model", "configs", "seed", "pool", "words", "max_tokens", "forced")):
            raise SystemExit("shares of different runs (model, configs, seed, pool, words, max tokens or --forced differ)")
        if a.get("first", 0) + a["n"] != b.get("first", 0):
            raise SystemExit(f"shares do not tile the prompts: {a.get('first', 0)}+{a['n']} then {b.get('first', 0)}")
    out = dict(shares[0], rows=[r for sh in shares for r in sh["rows"]], first=0)
    out["n"], out["seconds"], out["processes"] = len(out["rows"]), max(sh["seconds"] for sh in shares), len(shares)
    out["partial"] = any(sh.get("partial") for sh in shares)
    return out


def _paired_rows(a: dict, b: dict) -> tuple[list[dict], list[dict]]:
    """The rows of two runs on the prompts both measured; raises SystemExit unless they are the same prompts."""
    if any(a.get(k) != b.get(k) for k in ("seed", "pool", "words", "max_tokens")):
        raise SystemExit(f"{a['model']} and {b['model']}: different prompts (seed, pool, words or max tokens differ)")
    n = min(len(a["rows"]), len(b["rows"]))
    for x, y in zip(a["rows"][:n], b["rows"][:n]):
        if (x["docs"], x["question"]) != (y["docs"], y["question"]):
            raise SystemExit(f"prompt {x['id']}: the runs' prompts differ")
    return a["rows"][:n], b["rows"][:n]


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-hybrid-135m")
    ap.add_argument("--n", type=int, default=1000, help="prompts")
    ap.add_argument("--configs", nargs="+", default=["hypic:8"], help="reuse configurations MODE:SEAM, each against full")
    ap.add_argument("--pool", type=int, default=100, help="documents per (source, length) class the prompts draw from")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--words", type=int, nargs=2, default=list(LENGTHS.values()), metavar=("SHORT", "LONG"),
                    help="words kept of a short and of a long document")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--memory-mb", type=int, default=3072, help="the engine's segment-cache budget")
    ap.add_argument("--docs", default=str(DOCS))
    ap.add_argument("--forced", action="store_true", help="identical and matched from teacher-forced logits (no reuse decode)")
    ap.add_argument("--max-minutes", type=float, default=0, help="stop after this many minutes (the prompts measured "
                    "by then are the run: a prefix of the same prompt list)")
    ap.add_argument("--card", default=None, help="also write the first configuration's identical share as the model's "
                    "release measurement (models/<name>/faithfulness.json, read by the accuracy guard)")
    ap.add_argument("--save", default=None, help="write the results (rows included) to this JSON file")
    ap.add_argument("--first", type=int, default=0, help="start at this prompt (a share of the run for a second process)")
    ap.add_argument("--join", nargs="+", default=None, help="--save files of shares (--first) that tile the prompts: "
                    "one run, written to --save")
    ap.add_argument("--report", nargs="+", default=None, help="print the table of saved runs (PATH or LABEL=PATH) instead of running")
    return ap


def main() -> None:
    args = parser().parse_args()
    if args.report:
        runs = [labelled(p) for p in args.report]
    elif args.join:
        runs = [join([json.loads(Path(p).read_text()) for p in args.join])]
        if args.save:
            Path(args.save).write_text(json.dumps(runs[0], indent=1))
    else:
        if args.n < 1:
            raise SystemExit(f"--n must be >= 1, got {args.n}")
        torch.set_num_threads(args.threads)
        runs = [run(args)]
        if args.save:
            Path(args.save).parent.mkdir(parents=True, exist_ok=True)
            Path(args.save).write_text(json.dumps(runs[0], indent=1))
    if args.card:
        write_card(runs[0], Path(args.card), " ".join(sys.argv[1:]))
    print("\n".join(table(runs)))
    for res in runs:
        print(f"\n{res['model']}: {res['n']} prompts in {res.get('seconds', 0):.0f} s at {res.get('threads', '?')} torch "
              f"thread(s), {statistics.fmean(r['full']['prompt_tokens'] for r in res['rows']):.0f} prompt tokens on average"
              + (" (PARTIAL)" if res.get("partial") else ""))


if __name__ == "__main__":
    main()

"""Distil SmolLM2-135M-Instruct into the Bamba hybrid of hypic_core/models/hybrid.py.

`train` runs both stages and keeps training until `--minutes` run out; rerun it to resume:

Stage 1, attention transfer: one teacher pass over `--record` training windows records, at
every converted layer, the attention's input (the normed hidden state) and output; each mixer
is fitted alone to reproduce its layer's attention output (normalised MSE). Layers are
independent: `stage1.pt` is rewritten after each one, and a rerun skips the finished ones.

Stage 2, end to end: the assembled hybrid is trained on KL(teacher || hybrid) of the next-token
distribution at every position, updating the mixers' trained parameters (LoRA factors of
the projections; conv, dt, A, D, norm in full) and LoRA adapters on the teacher's linears that
stay (hypic_core/models/hybrid.py `ADAPTER_RANKS`: the kept attention layers' projections, every
layer's MLP; zero at the start, so a run from adapter-less mixers starts from the same model).
Each step draws one sequence from a mixture of
the training text (training/hybrid/data.py: CPython documentation, plain and in the gateway's
prompt layout) and the teacher's own samples (training/hybrid/generate.py, re-read at every
checkpoint, so data generated while training runs is used; the samples of earlier runs ship
in data/distill/*.jsonl.gz). The teacher's RAG samples hold 2-5 short documents (median ~330
tokens); the gateway's prompts, and the real-question benchmark's, hold 3-10 retrieved passages
(median ~1,500). The `rag-long` pool (`Lengthener`) rebuilds every RAG sample with distractor
passages up to that length, so the mixers learn to carry a document across ~3,000 tokens; the
teacher's targets are computed on the longer prompt. In a chat or RAG sequence the reply's positions weigh
`--reply-weight` times the prompt's: they are where the student must read the documents (and
a RAG reply's positions that predict a word copied from them `--copy-weight` times more). With
`--hypic-weight`, a RAG sequence's question and reply are also run as the gateway's `hypic` mode
serves them (`HypicView`: the documents stitched from chunks computed alone, `--hypic-seam` tokens
of each recomputed in context), and the KL to the teacher's full-prompt distribution there is added,
so the student's answer is trained on what reuse gives it, not only on a full prefill. Alone, the
cached documents carry no gradient (measured in docs/accuracy.md, it did not close the reuse gap);
`--hypic-documents` keeps their graph, so the loss also trains what each document writes. `stage2.pt` (mixers, optimiser,
step) is written atomically every `--save-minutes`; without any checkpoint in `--out`, stage 2
starts from the shipped `models/smollm2-hybrid-135m/mixers.safetensors` when it is of this
recipe (a machine without the previous run's folder still continues from what was shipped).

`export` writes the shipped file (bf16 mixers, attention layers and step in its metadata) and
the assembled checkpoint; `evaluate` reports perplexity on held-out text for teacher and hybrid.

    python -m training.hybrid.distill train --out var/hybrid --minutes 600
    python -m training.hybrid.distill export --out var/hybrid --assembled var/hybrid-export
    python -m training.hybrid.distill evaluate --hybrid var/hybrid-export
    python -m training.hybrid.distill memory --model smollm2-hybrid-135m
    python -m training.hybrid.distill ship-samples --out var/hybrid   # the teacher's samples into data/distill

Progress goes to stderr; every step's numbers to `<out>/log.jsonl`. One torch thread unless `train --threads`.
"""

from __future__ import annotations

import argparse
import copy
import functools
import json
import math
import random
import re
import sys
import time
from pathlib import Path
from typing import Sequence

import torch

from hypic_core.models import hybrid as C
from training.hybrid.teacher import load_teacher, teacher_dir

ROOT = Path(__file__).resolve().parents[2]
SHIPPED = ROOT / "models" / "smollm2-hybrid-135m"
SAMPLES = ROOT / "data" / "distill"  # the teacher's samples, shipped (ship-samples)
# stage 2's draw per step: (pool, weight); an empty pool's weight goes to the others
MIXTURE = (("docs", 0.15), ("docs-prompt", 0.15), ("continue", 0.15), ("chat", 0.15), ("rag", 0.4), ("rag-long", 0.0))


def _log(out: Path, record: dict) -> None:
    with open(out / "log.jsonl", "a") as f:
        f.write(json.dumps(record) + "\n")


def _say(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def _save(obj, path: Path) -> None:
    tmp = path.with_name(path.name + ".tmp")
    torch.save(obj, tmp)
    tmp.replace(path)


# ---------------------------------------------------------------- data


def _doc_sequences(tokenizer, seq_len: int, out: Path) -> tuple[list[torch.Tensor], list[torch.Tensor], dict]:
    """(plain, prompt-layout) sequences of the training text, cached in `out`."""
    cache = out / f"sequences_{seq_len}.pt"
    if cache.is_file():
        blob = torch.load(cache)
    else:
        from training.hybrid.data import build_sequences

        seqs, info = build_sequences(tokenizer, seq_len)
        turn = tokenizer.convert_tokens_to_ids("<|im_start|>")  # only the prompt-layout sequences hold a chat turn
        kinds = ["docs-prompt" if turn in s else "docs" for s in seqs]
        blob = {"seqs": torch.tensor(seqs, dtype=torch.int32), "kinds": kinds, "info": info}
        _save(blob, cache)
    plain = [s for s, k in zip(blob["seqs"], blob["kinds"]) if k == "docs"]
    prompt = [s for s, k in zip(blob["seqs"], blob["kinds"]) if k == "docs-prompt"]
    return plain, prompt, blob["info"]


# The teacher sometimes does not answer a RAG prompt: it greets ("I'm ready to help. What's your
# question?") or repeats "The answer is:" until its budget ends. Trained on, those teach the
# student not to answer; stage 2 leaves them out of the RAG pool (they stay in data/distill).
_NON_ANSWER = re.compile(r"^I'm ready to|What's your (?:next )?question\?")


def non_answer(reply: str) -> bool:
    """Whether a teacher reply to a RAG prompt is no answer at all (a greeting, or a loop)."""
    reply = reply.strip()
    return bool(_NON_ANSWER.search(reply)) or reply.count("The answer is") >= 2


def reply_start(ids: list[int], turn: int) -> int:
    """Where a sample's last turn (after its last `turn` marker) starts; 0 without one."""
    return len(ids) - ids[::-1].index(turn) if turn in ids else 0


def cut_loop(ids: list[int], turn: int, n: int = 8) -> list[int]:
    """`ids` up to where its last turn (the teacher's reply) starts repeating itself: the first
    run of `n` reply tokens that already occurred earlier in the reply, and everything after it.
    About half of the teacher's greedy RAG replies fall into a loop within their 64 tokens
    (the same sentence again and again, "M, M, M, ..."); trained on at the reply's weight, the
    loop teaches the student to loop and dilutes the positions that read the documents."""
    start = reply_start(ids, turn)
    seen = set()
    for j in range(start, len(ids) - n + 1):
        gram = tuple(ids[j:j + n])
        if gram in seen:
            return ids[:j]
        seen.add(gram)
    return ids


def copy_positions(ids: list[int], start: int) -> list[int]:
    """Reply positions p (from `start`, where the reply starts) whose next token continues a span
    of the prompt: (ids[p], ids[p+1]) occurs as a pair in ids[:start]."""
    pairs = set(zip(ids[: start - 1], ids[1:start]))
    return [p for p in range(start, len(ids) - 1) if (ids[p], ids[p + 1]) in pairs]


def copy_weighted(ids: list[int], turn: int) -> list[int]:
    """The positions of a RAG sample that predict a token the reply copies from its documents:
    every token of a reply span whose consecutive pairs occur in the prompt, its first token
    included (the position before a copy_positions position predicts the span's start, which is
    where an answer's first word is chosen). Empty without a turn."""
    if turn not in ids:
        return []
    start = reply_start(ids, turn) + 2  # after "assistant\n"
    hits = copy_positions(ids, start)
    return sorted(set(hits) | {p - 1 for p in hits if p - 1 >= start - 1})


def reply_text(tokenizer, ids: list[int]) -> str:
    """The text of a sample's last assistant turn (the teacher's reply)."""
    return tokenizer.decode(ids).rsplit("<|im_start|>assistant", 1)[-1].replace("<|im_end|>", "")


def pools(tokenizer, out: Path, window: int, rag_window: int, long_window: int = 3072) -> dict[str, list[torch.Tensor]]:
    """Every training sequence by pool: the training text and the teacher's samples in out/gen
    (a RAG sequence keeps its last `rag_window` tokens, the answer; the others their first `window`;
    a RAG sample whose reply is no answer, `non_answer`, is left out, and one whose reply loops
    is cut where the loop starts, `cut_loop`, or left out when less than 8 reply tokens remain).
    `rag-long` holds every kept RAG sample again, rebuilt by `Lengthener` over 3-10 documents (at most
    `long_window` tokens): the gateway's prompts are that long, the teacher's samples are not."""
    plain, prompt, _ = _doc_sequences(tokenizer, 512, out)
    res = {"docs": [s[:window] for s in plain], "docs-prompt": [s[:window] for s in prompt]}
    turn = tokenizer.convert_tokens_to_ids("<|im_start|>")
    kept_rag: list[list[int]] = []
    for kind in ("continue", "chat", "rag"):
        res[kind] = []
        for _, ids in _unique_samples(out, kind):
            if kind == "rag":
                if non_answer(reply_text(tokenizer, ids)):
                    continue
                ids = cut_loop(ids, turn)
                if len(ids) - reply_start(ids, turn) < 8 + 2:  # "assistant\n" and 8 tokens of answer
                    continue
                kept_rag.append(ids)
            ids = ids[-rag_window:] if kind == "rag" else ids[:window]
            if len(ids) >= 16:
                res[kind].append(torch.tensor(ids, dtype=torch.int32))
    if long_window > 0:
        res["rag-long"] = []
        lengthener = Lengthener(tokenizer)
        for ids in kept_rag:
            longer = lengthener(ids, random.Random(hash_ids(ids)), long_window)
            if longer is not None:
                res["rag-long"].append(torch.tensor(longer, dtype=torch.int32))
    return res


def hash_ids(ids: list[int]) -> int:
    """A seed from a sequence's tokens, the same in every process and Python version."""
    import hashlib

    return int.from_bytes(hashlib.blake2b(json.dumps(ids).encode(), digest_size=8).digest(), "little")


class Lengthener:
    """Rebuilds a teacher RAG sample (the gateway's /query prompt, then the teacher's reply) with
    more documents: its own, and passages of the training documents drawn as distractors, 3-10 in
    all (as many as the real-question benchmark's prompts hold) in a shuffled order, so the document the reply
    reads lands anywhere, up to ~3,000 tokens from the question. The prompt is built by the
    gateway's Prompter, exactly as /query builds it; the reply's tokens stay as the teacher wrote
    them (stage 2 asks the teacher anew for its distribution over the longer prompt, so the
    targets are the teacher's own on that prompt). Distractors: `distractor_passages`."""

    _PROMPT = re.compile(r"<\|im_start\|>user\n(Document: .*)Question: (.*)<\|im_end\|>\n<\|im_start\|>$", re.S)

    def __init__(self, tokenizer, passages: Sequence[str] | None = None) -> None:
        from training.hybrid.generate import RagPrompter

        self.tok, self.prompt = tokenizer, RagPrompter(tokenizer, 8192)  # prompt(question, docs): the /query prompt
        self.turn = tokenizer.convert_tokens_to_ids("<|im_start|>")
        self.passages = passages if passages is not None else distractor_passages()

    def split(self, ids: list[int]) -> tuple[list[str], str, list[int]] | None:
        """(documents, question, reply tokens) of a RAG sample, or None unless its prompt is the
        one the Prompter builds from those documents and question (so `prompt` gives it back)."""
        found = self._PROMPT.search(self.tok.decode(ids[:reply_start(ids, self.turn)]))
        if not found:
            return None
        docs = [d[:-2] if d.endswith("\n\n") else d for d in found.group(1).split("Document: ")[1:]]
        prompt = self.prompt(found.group(2), docs)
        return (docs, found.group(2), ids[len(prompt):]) if ids[:len(prompt)] == prompt else None

    def __call__(self, ids: list[int], rng: random.Random, limit: int) -> list[int] | None:
        parts = self.split(ids)
        if parts is None:
            return None
        docs, question, reply = parts
        want = rng.randint(max(3, len(docs) + 1), 10)
        have = {" ".join(d.split()) for d in docs}
        docs, size = list(docs), len(ids)
        for _ in range(100):  # draws, duplicates included (a short passage list cannot loop forever)
            if len(docs) >= want:
                break
            extra = rng.choice(self.passages)
            cost, key = len(self.tok.encode(extra, add_special_tokens=False)) + 4, " ".join(extra.split())
            if key in have:
                continue
            if size + cost > limit:
                break
            docs.append(extra)
            have.add(key)
            size += cost
        rng.shuffle(docs)
        longer = self.prompt(question, docs) + reply
        return longer if len(longer) <= limit else None


@functools.lru_cache(maxsize=1)
def distractor_passages(lo: int = 100, hi: int = 250) -> tuple[str, ...]:
    """Passages like the benchmark's retrieved chunks (a few paragraphs of one document, `lo`-`hi`
    words): runs of consecutive training paragraphs, and this project's docs, clear of data/real_qa."""
    from training.hybrid.data import documents, excluded_shingles, shingles
    from training.hybrid.generate import project_docs

    docs, _ = documents()  # already clear of data/real_qa
    bad = excluded_shingles()
    res = []
    for paras in [d.split("\n\n") for d in docs] + [[p for p in project_docs() if not shingles(p) & bad]]:
        run: list[str] = []
        for para in paras + [None]:
            words = sum(len(q.split()) for q in run)
            if para is None or (run and words + len(para.split()) > hi):
                if words >= lo:
                    res.append("\n\n".join(run))
                run = []
            if para is not None and len(para.split()) <= hi:
                run.append(para)
    return tuple(res)


class HypicView:
    """A RAG sequence as the gateway's `hypic` mode serves it, with gradients where it can have them.

    The prompt's documents are stitched by the engine itself (hypic_core, `Engine.prefill`): each
    computed alone from an empty state, its first `seam` tokens recomputed in context, the mixers'
    states composed, as /query computes them; then the question and the reply run over that cache
    through the same model with autograd on. So a loss on these logits trains how the question and
    the answer read what hypic serves; the cached documents themselves are computed without
    gradients (what is trained is the reading, not the writing).

    `documents=True` trains the writing too: the same stitch from differentiable pieces, by the
    engine's own runner (hypic_core/runner/model_runner.py): each document's canonical entry
    computed alone with its graph kept (`compute_entries_reference(keep_graph=True)`: K/V, the
    mixers' body operators T and E, conv tails), then one fused stitch forward that rotates the
    keys, runs every seam head in context and advances the mixers' states S <- T S + E between
    them, as `Engine.prefill` does for a cold request. A loss then reaches what each document
    writes into the cache, from how the answer reads it back.

    Either way, with a seam as long as every segment the logits are `full`'s (the engine's
    exactness invariant), and at any seam the two ways give the same logits (tests/engine/test_hybrid.py).
    """

    def __init__(self, tokenizer=None, seam: int = 8, documents: bool = False) -> None:
        # the tokenizer is needed by `segments` only
        self.lengthener = Lengthener(tokenizer, passages=()) if tokenizer is not None else None
        self.seam = seam
        self.documents = documents
        self._runner = None  # (model, ModelRunner) of the last model stitched with documents=True

    def segments(self, ids: list[int]) -> tuple[tuple[int, ...], ...] | None:
        """The /query segments of a RAG sequence's prompt (leading segment, documents, question),
        or None for a sequence that is not one the Prompter builds (cut, or written before it)."""
        parts = self.lengthener.split(ids)
        if parts is None:
            return None
        docs, question, _ = parts
        return self.lengthener.prompt.segments(question, docs)

    def logits(self, model, segments: tuple[tuple[int, ...], ...], ids: list[int]) -> tuple[int, torch.Tensor]:
        """(start, logits [len(ids) - 1 - start, vocab]): the next-token logits at positions
        start..len(ids)-2 of `ids` (the prompt of `segments`, then the reply), the context stitched
        in `hypic` mode at `self.seam`, the question from its second token on and the reply run with
        autograd. The question's first token is part of the engine's prefill (a request needs a
        question), so the logits start at the one after it."""
        stitch = self._stitch_documents if self.documents else self._stitch_by_engine
        cache, position = stitch(model, segments)
        rest = torch.tensor([ids[position:-1]], dtype=torch.long)
        pos = torch.arange(position, len(ids) - 1)[None]
        return position, model(input_ids=rest, position_ids=pos, cache=cache, use_cache=True).logits[0]

    @staticmethod
    def start(segments: tuple[tuple[int, ...], ...]) -> int:
        """The first position `logits` gives: after the context and the question's first token."""
        return sum(len(s) for s in segments[:-1]) + 1

    def _stitch_by_engine(self, model, segments: tuple[tuple[int, ...], ...]):
        """(cache, position): the context and the question's first token prefilled by the engine
        in `hypic` mode (no gradients), the cache copied out as ordinary tensors."""
        from hypic_core.config import EngineConfig, GenerationRequest, Mode
        from hypic_core.engine.engine import Engine

        training = model.training
        try:  # a fresh engine and store: the weights change every step, so no entry may outlive it
            engine = Engine(model, None, EngineConfig(seam=self.seam, memory_budget_bytes=1 << 30))
            request = GenerationRequest(tuple(segments[:-1]) + (segments[-1][:1],), mode=Mode.HYPIC, seam=self.seam)
            pre = engine.prefill(request)
        finally:
            model.train(training)
        # outside inference mode: ordinary tensors, which autograd may read and update
        return copy.deepcopy(pre.cache), pre.position

    def _stitch_documents(self, model, segments: tuple[tuple[int, ...], ...]):
        """(cache, position): the context and the question's first token stitched in `hypic` mode
        with every piece's graph kept, as a cold `Engine.prefill` of the same request computes it:
        every context segment stitched, as bench/accuracy_real.py measures hypic and as the engine
        path above asks (/query computes its leading template segments exactly, `Prompt.exact_prefix`;
        for the first, at position 0 with nothing before it, that is the same thing)."""
        from hypic_core.adapters import adapter_for
        from hypic_core.config import Mode
        from hypic_core.runner.model_runner import ModelRunner

        if self._runner is None or self._runner[0] is not model:
            self._runner = (model, ModelRunner(model, adapter_for(model)))
        runner = self._runner[1]
        context, question = tuple(segments[:-1]), tuple(segments[-1][:1])
        with torch.enable_grad():
            entries = runner.compute_entries_reference(context, self.seam, keep_graph=True)
            cache = runner.new_cache()
            runner.stitch(cache, context, entries, question, Mode.HYPIC)
        return cache, self.start(segments)


def _unique_samples(out: Path | None, kind: str) -> list[tuple[str, list[int]]]:
    """(line, ids) of every readable sample of `kind`, shipped first, each sequence once (the
    shipped samples and this run's folder may hold the same lines; a torn last line is skipped).
    `out` None: the shipped samples only."""
    res, seen = [], set()
    for line in _sample_lines(out, kind):
        try:
            ids = json.loads(line)["ids"]
        except (ValueError, KeyError, TypeError):
            continue  # a line being written
        if tuple(ids) not in seen:
            seen.add(tuple(ids))
            res.append((line, ids))
    return res


def _sample_lines(out: Path | None, kind: str) -> list[str]:
    """The teacher's samples of `kind`: the ones shipped in data/distill (gzipped, so a machine
    without the previous run's folder trains on them too), then this run's out/gen."""
    import gzip

    lines: list[str] = []
    shipped = SAMPLES / f"{kind}.jsonl.gz"
    if shipped.is_file():
        lines += gzip.decompress(shipped.read_bytes()).decode().splitlines()
    f = out / "gen" / f"{kind}.jsonl" if out is not None else None
    if f is not None and f.is_file():
        lines += f.read_text().splitlines()
    return lines


def ship_samples(out: Path) -> dict[str, int]:
    """Merge out/gen's samples into data/distill/<kind>.jsonl.gz (deduplicated, shipped lines
    first); returns the line count of each kind."""
    import gzip

    SAMPLES.mkdir(parents=True, exist_ok=True)
    counts = {}
    for kind in ("continue", "chat", "rag"):
        keep = [line for line, _ in _unique_samples(out, kind)]
        target = SAMPLES / f"{kind}.jsonl.gz"
        tmp = target.with_name(target.name + ".tmp")
        tmp.write_bytes(gzip.compress(("\n".join(keep) + "\n").encode(), mtime=0))
        tmp.replace(target)
        counts[kind] = len(keep)
    return counts


def draw(pool: dict[str, list[torch.Tensor]], step: int, held: int, mixture=MIXTURE, seed: int = 0) -> tuple[str, torch.Tensor]:
    """Step `step`'s sequence: a pool by MIXTURE's weights, then a sequence of it (the first
    `held` of every pool are held back for validation), both from a generator seeded by the step
    and `seed` (a run from the shipped mixers counts steps from 0 again: a new seed gives it new draws)."""
    rng = random.Random(step if seed == 0 else f"{seed}:{step}")
    names = [n for n, _ in mixture if len(pool.get(n, ())) > held]
    kind = rng.choices(names, weights=[w for n, w in mixture if n in names])[0]
    return kind, pool[kind][rng.randrange(held, len(pool[kind]))]


# ---------------------------------------------------------------- stage 1


def record(teacher, windows: torch.Tensor, layers: list[int], out: Path) -> None:
    """Record attention inputs/outputs of `layers` over `windows` (bf16, one file per layer)."""
    if all((out / f"acts_{i}.pt").is_file() for i in layers):
        return
    ins = {i: [] for i in layers}
    outs = {i: [] for i in layers}
    hooks = []
    for i in layers:
        def hook(mod, args, kwargs, result, i=i):
            ins[i].append(kwargs["hidden_states"].to(torch.bfloat16))
            outs[i].append(result[0].to(torch.bfloat16))

        hooks.append(teacher.model.layers[i].self_attn.register_forward_hook(hook, with_kwargs=True))
    t0 = time.time()
    with torch.no_grad():
        for s in range(0, len(windows), 4):
            teacher(windows[s:s + 4].long())
            _say(f"record: {min(len(windows), s + 4)}/{len(windows)} windows ({time.time() - t0:.0f}s)")
    for h in hooks:
        h.remove()
    for i in layers:
        _save({"x": torch.cat(ins[i]), "y": torch.cat(outs[i])}, out / f"acts_{i}.pt")


def stage1(args, teacher, tok, cfg, tsd, out: Path) -> dict:
    from training.hybrid.sensitivity import fit_norm_scale

    layers = [i for i in range(cfg.num_hidden_layers) if i not in cfg.attn_layer_indices]
    state_file = out / "stage1.pt"
    states = torch.load(state_file) if state_file.is_file() else {}
    if all(C.has_mixer_state(states.get(i, {})) for i in layers):
        return states
    pool = pools(tok, out, args.stage1_window, args.stage1_window, long_window=0)
    rng = random.Random(0)
    cand = [s for n, _ in MIXTURE for s in pool.get(n, ()) if len(s) >= args.stage1_window]  # no rag-long here
    rng.shuffle(cand)
    windows = torch.stack(cand[:args.record])
    todo = [i for i in layers if not C.has_mixer_state(states.get(i, {}))]
    record(teacher, windows, todo, out)
    for i in layers:
        if C.has_mixer_state(states.get(i, {})):
            continue
        acts = torch.load(out / f"acts_{i}.pt")
        x, y = acts["x"], acts["y"]
        n_val = max(2, len(x) // 16)
        xv, yv, xt, yt = x[:n_val].float(), y[:n_val].float(), x[n_val:], y[n_val:]
        mixer = C.make_mixer(cfg, i, tsd)
        params = list(C.mixer_state(mixer).values())
        opt = torch.optim.AdamW(params, lr=args.stage1_lr, weight_decay=0.0)
        sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=args.stage1_lr, total_steps=args.stage1_steps, pct_start=0.1)
        scale = float(yt.float().pow(2).mean())
        g = torch.Generator().manual_seed(i)

        def val() -> float:
            with torch.no_grad():
                return float((mixer(xv) - yv).pow(2).mean() / yv.pow(2).mean())

        fit_norm_scale(mixer, xv, yv)
        v0, t0 = val(), time.time()
        for step in range(args.stage1_steps):
            idx = torch.randint(0, len(xt), (args.stage1_batch,), generator=g)
            loss = (mixer(xt[idx].float()) - yt[idx].float()).pow(2).mean() / scale
            opt.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
            sched.step()
            if step % 20 == 0 or step == args.stage1_steps - 1:
                _say(f"stage1 layer {i}: step {step + 1}/{args.stage1_steps} loss {loss.item():.4f} ({time.time() - t0:.0f}s)")
        v1 = val()
        _say(f"stage1 layer {i}: held-back normalised MSE {v0:.4f} -> {v1:.4f}")
        _log(out, {"stage": 1, "layer": i, "val_nmse_init": v0, "val_nmse": v1, "steps": args.stage1_steps,
                   "seconds": time.time() - t0, "time": time.time()})
        states[i] = {**states.get(i, {}), **{k: v.detach().clone() for k, v in C.mixer_state(mixer).items()}}
        _save(states, state_file)
    for i in todo:
        (out / f"acts_{i}.pt").unlink(missing_ok=True)
    return states


def relayer_states(states: dict[int, dict], old_attn: list[int], new_attn: list[int]) -> dict[int, dict]:
    """Trained states of one layout carried to another: every layer keeps its MLP adapters; a
    layer that stays a mixer keeps its mixer, one that stays attention its attention adapters.
    A layer that becomes attention drops its mixer (the teacher's attention, zero correction); one
    that becomes a mixer has none yet (stage 1 fits it from the teacher's attention)."""
    old, new = set(old_attn), set(new_attn)
    res: dict[int, dict] = {}
    for i, state in states.items():
        keep = {}
        for k, v in state.items():
            part = k.split(".", 1)[0]
            if part == "feed_forward" or (part == "self_attn" and i in old and i in new) or (
                    not C.is_adapter_key(k) and i not in old and i not in new):
                keep[k] = v
        res[i] = keep
    return res


def relayer(args) -> None:
    """Start a run of this recipe's layout (ATTN_LAYERS) from a mixers file of another one:
    writes RUN/stage1.pt with what carries over (relayer_states); `train` then fits only the
    layers that became mixers (stage 1) and continues end to end (stage 2, fresh optimiser)."""
    from safetensors.torch import load_file

    out, src = Path(args.out), Path(args.source)
    out.mkdir(parents=True, exist_ok=True)
    if (out / "stage1.pt").is_file() or (out / "stage2.pt").is_file():
        raise SystemExit(f"{out} already holds a run (stage1.pt or stage2.pt): relayer starts a new one")
    old_attn = C.mixers_config(src)
    new_attn = C.attn_layers(json.loads((teacher_dir() / "config.json").read_text())["num_hidden_layers"])
    states: dict[int, dict] = {}
    for name, v in load_file(src).items():
        _, i, key = name.split(".", 2)
        states.setdefault(int(i), {})[key] = v.float()
    moved = relayer_states(states, old_attn, new_attn)
    _save(moved, out / "stage1.pt")
    record = {"stage": "relayer", "from": str(src.relative_to(ROOT) if src.is_relative_to(ROOT) else src),
              "old_attn_layers": old_attn, "attn_layers": new_attn,
              "to_attention": sorted(set(new_attn) - set(old_attn)), "to_mixer": sorted(set(old_attn) - set(new_attn)),
              "time": time.time()}
    _log(out, record)
    _say(f"relayer: {record['to_attention']} get attention back, {record['to_mixer']} become mixers (stage 1 fits them)")


# ---------------------------------------------------------------- stage 2


def build_student(cfg, tsd, states: dict[int, dict]):
    """The hybrid with trainable LoRA mixers and LoRA adapters on the teacher's kept linears
    (both from `states` where it has them: a state without adapter factors starts them at a zero
    correction), everything else frozen."""
    from transformers import BambaForCausalLM

    model = BambaForCausalLM(cfg)
    model.load_state_dict(C.hybrid_state_dict(cfg, tsd, {}), strict=False)
    for p in model.parameters():
        p.requires_grad_(False)
    trainable = []
    for i, layer in enumerate(model.model.layers):
        state = states.get(i, {})
        if i not in cfg.attn_layer_indices:
            mixer = C.make_mixer(cfg, i, tsd)
            if C.has_mixer_state(state):
                C.load_mixer_state(mixer, state)
            layer.mamba = mixer
            trainable += list(C.mixer_state(mixer).values())
        trainable += C.add_adapters(layer, cfg, i, state)
    model.tie_weights()
    return model, trainable


def student_states(model) -> dict[int, dict]:
    """The trained state of every layer (mixer and adapters), detached copies."""
    return {i: {k: v.detach().clone() for k, v in C.layer_state(layer).items()} for i, layer in enumerate(model.model.layers)}


def shipped_states(cfg, f: Path = SHIPPED / "mixers.safetensors") -> dict[int, dict] | None:
    """The shipped mixers as training states, when they are of this recipe and layout."""
    from safetensors import safe_open
    from safetensors.torch import load_file

    if not f.is_file():
        return None
    with safe_open(str(f), "pt") as h:
        meta = h.metadata() or {}
    if meta.get("recipe_version") != str(C.RECIPE_VERSION) or C.mixers_config(f) != list(cfg.attn_layer_indices):
        return None
    ranks = json.loads(meta.get("adapter_ranks", "null"))
    if ranks is not None and ranks != C.ADAPTER_RANKS:
        # its adapter factors cannot be trained on at this recipe's ranks, and dropping them
        # would silently start from another model
        raise SystemExit(f"{f} holds adapters of ranks {ranks}, this recipe trains {C.ADAPTER_RANKS}: "
                         "train with the ranks it was written with, or from a checkpoint folder of this recipe")
    states: dict[int, dict] = {}
    for name, v in load_file(f).items():
        _, i, key = name.split(".", 2)
        states.setdefault(int(i), {})[key] = v.float()
    return states


def kl_loss(t_logits: torch.Tensor, s_logits: torch.Tensor, weights: torch.Tensor | None = None) -> torch.Tensor:
    """KL(teacher || student) per position, averaged (weighted by `weights` [positions] if given)."""
    t = torch.log_softmax(t_logits.float(), -1)
    per = (t.exp() * (t - torch.log_softmax(s_logits.float(), -1))).sum(-1)
    if weights is None:
        return per.mean()
    return (per * weights).sum() / (weights.sum() * per.shape[0])


def reply_weights(ids: torch.Tensor, turn: int, weight: float, copy: float = 1.0) -> torch.Tensor | None:
    """Per-position loss weights for a chat sequence: `weight` from its last turn marker (`turn`,
    the id of <|im_start|>: the assistant's reply, which reads the documents above it) to the end,
    1 before; None for a sequence without a turn. Without it the reply's few dozen positions are
    drowned by the hundreds of document positions, and the student learns to continue text, not
    to answer from it. `copy` multiplies the weight of the reply positions that predict a token
    copied from the documents (`copy_weighted`): the words a question's answer is judged by."""
    seq = ids.tolist()
    if (weight == 1.0 and copy == 1.0) or turn not in seq:
        return None
    w = torch.ones(len(seq))
    w[reply_start(seq, turn) - 1:] = weight  # the marker itself included
    if copy != 1.0:
        positions = copy_weighted(seq, turn)
        if positions:
            w[torch.tensor(positions)] *= copy
    return w


def learning_rate(step: int, peak: float, end: float, decay_steps: int, warmup: int = 20) -> float:
    """Linear warm-up over `warmup` steps, then cosine from `peak` down to `end` at `decay_steps`
    (constant `end` after it); `decay_steps` 0 keeps `peak`. A function of the step alone, so a
    resumed run continues the same schedule."""
    if step < warmup:
        return peak * (step + 1) / warmup
    if decay_steps <= 0:
        return peak
    t = min(1.0, step / decay_steps)
    return end + (peak - end) * 0.5 * (1.0 + math.cos(math.pi * t))


def stage2(args, teacher, tok, cfg, tsd, out: Path, states: dict | None) -> None:
    ckpt = out / "stage2.pt"
    step, opt_state = 0, None
    if ckpt.is_file():
        blob = torch.load(ckpt)
        states, step, opt_state = blob["states"], blob["step"], blob["opt"]
        _say(f"stage2: resuming from {ckpt} at step {step}")
    elif states is None:
        states = shipped_states(cfg)
        if states is None:
            raise SystemExit("stage 2 needs stage 1's mixers or shipped mixers of this recipe")
        _say("stage2: starting from the shipped mixers (no checkpoint in --out)")
    model, params = build_student(cfg, tsd, states)
    model.train()
    opt = torch.optim.AdamW(params, lr=args.lr, weight_decay=0.0)
    if opt_state is not None and len(opt_state["param_groups"][0]["params"]) != len(params):
        # a checkpoint of fewer trained tensors (written before the adapters): its optimiser
        # moments do not map onto these parameters; the weights resume, the moments start afresh
        _say(f"stage2: the checkpoint's optimiser has {len(opt_state['param_groups'][0]['params'])} tensors, "
             f"this student {len(params)}: optimiser state starts afresh")
        opt_state = None
    if opt_state is not None:
        opt.load_state_dict(opt_state)
    pool = pools(tok, out, args.window, args.rag_window, args.long_window)
    turn = tok.convert_tokens_to_ids("<|im_start|>")
    view = HypicView(tok, args.hypic_seam, args.hypic_documents) if args.hypic_weight > 0 else None
    deadline, t0, last_save = time.time() + args.minutes * 60, time.time(), time.time()

    def save():
        _save({"states": student_states(model), "step": step, "opt": opt.state_dict(), "attn_layers": list(cfg.attn_layer_indices),
               "recipe": C.RECIPE_VERSION}, ckpt)

    # bf16 autocast halves a step on a CPU with bf16 units (avx512_bf16/AMX); weights, gradients and
    # optimiser state stay fp32, and the KL is taken in fp32 (kl_loss)
    autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=args.precision == "bf16")
    while step < args.steps and time.time() < deadline:
        kind, seq = draw(pool, step, args.held, args.mix, args.draw_seed)
        ids = seq[None].long()
        ts = time.time()
        with torch.no_grad(), autocast:
            t_logits = teacher(ids).logits
        with autocast:
            s_logits = model(ids).logits
        weights = reply_weights(ids[0], turn, args.reply_weight, args.copy_weight if kind.startswith("rag") else 1.0) \
            if kind in ("chat", "rag", "rag-long") else None
        loss = kl_loss(t_logits, s_logits, weights)
        with torch.no_grad():
            plain = loss if weights is None else kl_loss(t_logits, s_logits)
        seen = {}
        segments = view.segments(seq.tolist()) if view is not None and kind in ("rag", "rag-long") else None
        start = view.start(segments) if segments is not None else 0
        if segments is not None:
            with torch.no_grad():  # unweighted, beside hypic's on the same positions below: the gap being trained
                seen["full_kl_answer"] = kl_loss(t_logits[:, start:-1], s_logits[:, start:-1]).item()
        opt.zero_grad()
        loss.backward()  # before the stitched forward: the full forward's graph is freed first (peak memory)
        del s_logits
        if segments is not None:
            # the same targets for the answer as hypic serves it (HypicView): the teacher's full-prompt
            # distribution, from the question's second token on, with the same position weights;
            # its gradients add to the full loss's
            with autocast:
                at, h_logits = view.logits(model, segments, seq.tolist())
            assert at == start, (at, start)
            hyp = kl_loss(t_logits[:, start:-1], h_logits[None], None if weights is None else weights[start:-1])
            (args.hypic_weight * hyp).backward()
            loss = loss.detach() + args.hypic_weight * hyp.detach()
            with torch.no_grad():
                seen["hypic_kl"] = kl_loss(t_logits[:, start:-1], h_logits[None]).item()
            del h_logits
        norm = torch.nn.utils.clip_grad_norm_(params, 1.0)
        lr = learning_rate(step, args.lr, args.lr_end, args.decay_steps)
        for gr in opt.param_groups:
            gr["lr"] = lr
        opt.step()
        step += 1
        _log(out, {"stage": 2, "step": step, "kind": kind, "tokens": ids.shape[1], "kl": plain.item(), "loss": loss.item(), **seen,
                   "grad_norm": float(norm), "lr": lr, "seconds": round(time.time() - ts, 2), "time": time.time()})
        gap = f" answer KL full {seen['full_kl_answer']:.4f} hypic {seen['hypic_kl']:.4f}" if seen else ""
        _say(f"stage2 step {step} {kind:11s} {ids.shape[1]:4d} tok KL {plain.item():.4f} loss {loss.item():.4f}{gap} ({time.time() - ts:.1f}s)")
        if time.time() - last_save > args.save_minutes * 60:
            save()
            last_save = time.time()
            pool = pools(tok, out, args.window, args.rag_window, args.long_window)  # new samples from generate.py
            _say(f"stage2: checkpoint at step {step}; pools {({k: len(v) for k, v in pool.items()})}")
    save()
    _say(f"stage2 stopped at step {step}; checkpoint {ckpt}")


def validate(args) -> None:
    """KL(teacher || hybrid) on each pool's held-back sequences for the latest checkpoint."""
    out = Path(args.out)
    path, teacher, tok = load_teacher()
    blob = torch.load(out / "stage2.pt") if (out / "stage2.pt").is_file() else {"states": torch.load(out / "stage1.pt"), "step": 0}
    cfg = C.bamba_config(json.loads((path / "config.json").read_text()))
    model, _ = build_student(cfg, C.load_teacher_state(path), blob["states"])
    model.eval()
    pool = pools(tok, out, args.window, args.rag_window, args.long_window)
    res = {}
    # the held-back long RAG prompts' question and reply are also measured as hypic serves them at
    # seam 8 (HypicView), beside `full` on the same positions: the difference is what reuse costs
    view, answer = HypicView(tok, 8), {"full": [], "hypic": []}
    with torch.no_grad():
        for kind, seqs in pool.items():
            vals = []
            for s in seqs[:args.held]:
                t_logits, s_logits = teacher(s[None].long()).logits, model(s[None].long()).logits
                vals.append(float(kl_loss(t_logits, s_logits)))
                segments = view.segments(s.tolist()) if kind == "rag-long" else None
                if segments is not None:
                    start, h_logits = view.logits(model, segments, s.tolist())
                    answer["full"].append(float(kl_loss(t_logits[:, start:-1], s_logits[:, start:-1])))
                    answer["hypic"].append(float(kl_loss(t_logits[:, start:-1], h_logits[None])))
            if vals:
                res[kind] = sum(vals) / len(vals)
        for how, vals in answer.items():
            if vals:
                res[f"rag-long answer, {how}"] = sum(vals) / len(vals)
    _log(out, {"stage": "validate", "step": blob["step"], "held_kl": res, "time": time.time()})
    print(json.dumps({"step": blob["step"], "held_kl": res}))


def train(args) -> None:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    path, teacher, tok = load_teacher()
    cfg = C.bamba_config(json.loads((path / "config.json").read_text()))
    tsd = C.load_teacher_state(path)
    states = None  # stage 2 resumes its checkpoint, else starts from stage 1's mixers, else from the shipped ones
    if not (out / "stage2.pt").is_file() and ((out / "stage1.pt").is_file() or shipped_states(cfg) is None):
        states = stage1(args, teacher, tok, cfg, tsd, out)
    stage2(args, teacher, tok, cfg, tsd, out, states)


# ---------------------------------------------------------------- export / evaluate


def write_mixers(states: dict[int, dict], cfg, step: int, file: Path) -> None:
    """The shipped file: bf16 mixer states and adapter factors keyed `layers.{i}.{name}`, with
    the recipe version, the attention layers, the adapter ranks and the stage-2 step in its
    metadata; written atomically."""
    from safetensors.torch import save_file

    flat = {f"layers.{i}.{k}": v.detach().to(torch.bfloat16).contiguous() for i, st in sorted(states.items()) for k, v in st.items()}
    meta = {"format": "pt", "recipe_version": str(C.RECIPE_VERSION), "attn_layers": json.dumps(list(cfg.attn_layer_indices)),
            "stage2_step": str(step), "adapter_ranks": json.dumps(C.ADAPTER_RANKS)}
    file.parent.mkdir(parents=True, exist_ok=True)
    tmp = file.with_name(file.name + ".tmp")
    save_file(flat, str(tmp), metadata=meta)
    tmp.chmod(0o644)
    tmp.replace(file)


def export(args) -> None:
    out = Path(args.out)
    src = out / "stage2.pt"
    if src.is_file() and not args.stage1:
        blob = torch.load(src)
        states, step = blob["states"], blob["step"]
    else:
        states, step = torch.load(out / "stage1.pt"), 0
    path = teacher_dir()
    cfg = C.bamba_config(json.loads((path / "config.json").read_text()))
    target = Path(args.to)
    write_mixers(states, cfg, step, target / "mixers.safetensors")
    _say(f"wrote {target / 'mixers.safetensors'} ({(target / 'mixers.safetensors').stat().st_size / 1e6:.1f} MB, stage-2 step {step})")
    if args.assembled:
        C.assemble(path, target / "mixers.safetensors", Path(args.assembled), stamp={"named": "smollm2-hybrid-135m", "stage2_step": step})
        _say(f"assembled the checkpoint in {args.assembled}")


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
    """Perplexity on the held-out texts of data/real_qa (never trained on) for teacher and hybrid."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from hypic_core.models.registry import resolve

    texts = {name: (ROOT / "data" / "real_qa" / name).read_text()[: args.chars] for name in args.texts}
    models = {"smollm2-135m-instruct": resolve("smollm2-135m-instruct").path}
    for h in args.hybrid:
        models[h] = Path(h) if Path(h).is_dir() else resolve(h).path
    rows = {}
    for name, path in models.items():
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        tok = AutoTokenizer.from_pretrained(path)
        rows[name] = {}
        for tname, text in texts.items():
            t0 = time.time()
            rows[name][tname] = perplexity(model, tok, text)
            _say(f"{name} on {tname}: perplexity {rows[name][tname]:.2f} ({time.time() - t0:.0f}s)")
    print(json.dumps(rows, indent=1))


def memory(args) -> dict:
    """How long each Mamba2 head's state persists on real text: for every data/real_qa passage the
    engine's cached transition T of the passage (the fraction of the incoming state that survives
    it, per head), and the half-life in tokens that T implies, ln 0.5 / (ln T / length). Medians
    over passages, per layer and head."""
    from hypic_core.config import EngineConfig
    from hypic_core.engine.engine import Engine
    from hypic_core.models.registry import resolve

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


def _mixture(text: str) -> tuple[tuple[str, float], ...]:
    pairs = tuple((k, float(v)) for k, v in (item.split("=") for item in text.split(",")))
    unknown = {k for k, _ in pairs} - {k for k, _ in MIXTURE}
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown pool(s) {sorted(unknown)}; pools: {[k for k, _ in MIXTURE]}")
    return pairs


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    for name in ("train", "export", "validate", "ship-samples", "relayer"):
        s = sub.add_parser(name)
        s.add_argument("--out", default=str(ROOT / "var" / "hybrid"), help="checkpoints, recorded activations, generated data, log")
        s.add_argument("--window", type=int, default=512, help="tokens of each training sequence (a RAG one: --rag-window)")
        s.add_argument("--rag-window", type=int, default=768)
        s.add_argument("--long-window", type=int, default=3072, help="tokens of a rag-long sequence at most (0: no rag-long pool)")
        s.add_argument("--held", type=int, default=4, help="sequences of each pool held back for validation")
    t = sub.choices["train"]
    t.add_argument("--record", type=int, default=96, help="windows recorded for stage 1")
    t.add_argument("--stage1-window", type=int, default=256)
    t.add_argument("--stage1-steps", type=int, default=100)
    t.add_argument("--stage1-batch", type=int, default=4)
    t.add_argument("--stage1-lr", type=float, default=3e-3)
    t.add_argument("--steps", type=int, default=10**9)
    t.add_argument("--minutes", type=float, default=60)
    t.add_argument("--lr", type=float, default=1e-3)
    t.add_argument("--lr-end", type=float, default=1e-4, help="stage 2's learning rate at --decay-steps (cosine from --lr)")
    t.add_argument("--decay-steps", type=int, default=0, help="stage-2 step where the cosine decay ends (0: constant --lr)")
    t.add_argument("--precision", choices=("bf16", "fp32"), default="bf16",
                   help="stage 2's forwards under bf16 autocast (about 2x faster on a CPU with bf16 units) or fp32")
    t.add_argument("--save-minutes", type=float, default=5)
    t.add_argument("--threads", type=int, default=1, help="torch threads (1: leaves the other cores to the machine's other work)")
    t.add_argument("--reply-weight", type=float, default=8.0,
                   help="loss weight of a chat or RAG sequence's reply positions against its prompt's (1: plain mean)")
    t.add_argument("--copy-weight", type=float, default=1.0,
                   help="multiplies the reply weight of a RAG reply's positions that predict a token copied from its documents")
    t.add_argument("--draw-seed", type=int, default=0,
                   help="seeds stage 2's draws with the step (0: the step alone); give a run from the shipped mixers a new one")
    t.add_argument("--hypic-weight", type=float, default=0.0,
                   help="adds this times the KL of a RAG sequence's question and reply as hypic serves them (HypicView; 0: off)")
    t.add_argument("--hypic-seam", type=int, default=8, help="the seam of --hypic-weight's stitched prompts")
    t.add_argument("--hypic-documents", action="store_true",
                   help="--hypic-weight's loss also trains what the documents write into the cache (their entries "
                        "keep the graph: HypicView(documents=True)); without it only the reading is trained")
    t.add_argument("--mix", type=_mixture, default=MIXTURE, help="stage 2's pool weights, e.g. docs=0.2,rag=0.8 (default: "
                   + ",".join(f"{n}={w}" for n, w in MIXTURE) + ")")
    x = sub.choices["export"]
    x.add_argument("--stage1", action="store_true", help="export stage 1's mixers")
    x.add_argument("--to", default=str(SHIPPED), help="folder of the mixers file (default: the shipped model's)")
    x.add_argument("--assembled", default=None, help="also assemble the full checkpoint here")
    r = sub.choices["relayer"]
    r.add_argument("--source", default=str(SHIPPED / "mixers.safetensors"), help="a mixers file of another layout")
    e = sub.add_parser("evaluate")
    e.add_argument("--hybrid", nargs="+", default=["smollm2-hybrid-135m"], help="named models or checkpoint directories")
    e.add_argument("--texts", nargs="+", default=["held_out_prose.txt", "held_out.txt"])
    e.add_argument("--chars", type=int, default=20000, help="characters of each text (the start)")
    m = sub.add_parser("memory", help="how long each mixer head's state persists on real text")
    m.add_argument("--model", default="smollm2-hybrid-135m")
    m.add_argument("--json", default=None, help="also write the numbers here")
    args = p.parse_args(argv)
    torch.set_num_threads(getattr(args, "threads", 1))
    if args.cmd == "ship-samples":
        print(json.dumps(ship_samples(Path(args.out))))
        return
    {"train": train, "relayer": relayer, "export": export, "validate": validate, "evaluate": evaluate, "memory": memory}[args.cmd](args)


if __name__ == "__main__":
    main()

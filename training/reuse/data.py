"""Training prompts for reuse-aware training, and the documents every reuse measurement holds out.

A training `Sample` is a RAG prompt as the gateway hands it to the engine (`Layout`: the leading
segment, one segment per document, the question last, and how many leading segments the engine
computes exactly) and the reply whose span the loss is taken on (None: the teacher writes it).

Sources:
- `distill_samples`: the teacher's RAG samples shipped in data/distill/rag.jsonl.gz (SmolLM2's
  /query layout; its question, the document it asked about and its greedy reply), each rebuilt
  with 3-8 documents in a random order: its own and distractors from the docstring corpus;
- `corpus_samples`: any list of texts (the docstring corpus, or what a user ingested), k documents
  (3-8) in a random order and a templated question; the teacher writes the reply.

Held out: the docstring corpus is split by a hash of each document's origin (`split_of`): about one
document in ten is `heldout`, never trained on here, and no distilled sample sharing an 8-word run
with one is used. bench/faithfulness.py measures on `heldout_documents()`.
"""

from __future__ import annotations

import functools
import gzip
import hashlib
import json
import random
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator, Sequence

ROOT = Path(__file__).resolve().parents[2]
RAG_SAMPLES = ROOT / "data" / "distill" / "rag.jsonl.gz"
HELDOUT_SALT = "hypic-reuse-heldout-v1"
HELDOUT_BUCKETS = 10  # one document in ten is held out
K_DOCUMENTS = (3, 8)
QUESTIONS = (
    "What does the document about {topic} say?", "Summarise what the documents say about {topic}.",
    "Which document describes {topic}, and what does it say?", "What is {topic} used for?",
    "Explain {topic} briefly, using the documents.", "What should I know about {topic}?",
)


@dataclass(frozen=True)
class Layout:
    """A prompt as /query hands it to the engine: context segments, the question last; the first
    `exact_prefix` context segments are computed exactly (system prompt), the others composed."""

    segments: tuple[tuple[int, ...], ...]
    exact_prefix: int

    @property
    def ids(self) -> list[int]:
        return [t for s in self.segments for t in s]

    def without(self, link: Sequence[int]) -> "Layout":
        """The layout with every link segment (`link`'s ids, written after each document) left out:
        the prompt as a model served without links reads it (the teacher's)."""
        if not link:
            return self
        link = tuple(link)
        kept = tuple(s for i, s in enumerate(self.segments) if i < self.exact_prefix or s != link)
        return Layout(kept, self.exact_prefix)


# A function building the gateway's layout of (question, documents) for one model: the app layer
# supplies it (app/service/prompter.py), so this package never imports the gateway.
LayoutFn = Callable[[str, Sequence[str]], Layout]


@dataclass(frozen=True)
class Sample:
    layout: Layout
    reply: tuple[int, ...] | None  # None: the teacher writes it
    source: str


def split_of(where: str) -> str:
    """"heldout" or "train" for a corpus document named `where` (a stable hash, the same in every process)."""
    h = int.from_bytes(hashlib.blake2b(f"{HELDOUT_SALT}:{where}".encode(), digest_size=8).digest(), "little")
    return "heldout" if h % HELDOUT_BUCKETS == 0 else "train"


@functools.lru_cache(maxsize=1)
def _corpus() -> tuple[tuple[str, str], ...]:
    """(where, text) of the docstring corpus (training/hybrid/data.py), clear of data/real_qa."""
    from training.hybrid.data import _paragraphs, excluded_shingles, pydoc_topics, shingles, stdlib_docstrings

    bad = excluded_shingles()
    out = []
    for where, text in stdlib_docstrings() + pydoc_topics():
        paras = [p for p in _paragraphs(text) if not shingles(p) & bad]
        if paras:
            out.append((where, "\n\n".join(paras)))
    return tuple(out)


def heldout_documents() -> list[tuple[str, str]]:
    """(where, text) of the docstring-corpus documents reuse training never sees (`split_of`)."""
    return [(w, t) for w, t in _corpus() if split_of(w) == "heldout"]


def training_documents() -> list[tuple[str, str]]:
    """(where, text) of the docstring-corpus documents reuse training may use."""
    return [(w, t) for w, t in _corpus() if split_of(w) == "train"]


def passages(texts: Sequence[str], lo: int = 40, hi: int = 200) -> list[str]:
    """Retrieval-sized passages of `texts`: runs of consecutive paragraphs of `lo`-`hi` words."""
    out = []
    for text in texts:
        run: list[str] = []
        for para in text.split("\n\n") + [None]:
            words = sum(len(q.split()) for q in run)
            if para is None or (run and words + len(para.split()) > hi):
                if words >= lo:
                    out.append("\n\n".join(run))
                run = []
            if para is not None and len(para.split()) <= hi:
                run.append(para)
    return out


def pieces(texts: Sequence[str], lo: int = 30, hi: int = 90) -> list[str]:
    """Passages of `lo`-`hi` words cut from `texts` of any length (a user's ingested chunks, a few
    hundred tokens each, of which one or two fill a training prompt): runs of consecutive sentences,
    a paragraph break kept where a run spans one; a sentence longer than `hi` words is cut into
    `hi`-word windows. Every word of a text lands in one piece, except a last run shorter than `lo`;
    a text too short for any piece is one piece as it is."""
    out = []
    for text in texts:
        before = len(out)
        sentences: list[str] = []
        for para in re.split(r"\n\s*\n", text.strip()):
            parts = [p for p in re.split(r"(?<=[.!?:;])\s+", para.strip()) if p]
            for i, sentence in enumerate(parts):
                words = sentence.split()
                for k in range(0, len(words), hi):
                    sentences.append(("\n\n" if i == 0 and k == 0 and sentences else "") + " ".join(words[k:k + hi]))
        run: list[str] = []
        count = 0
        for sentence in sentences + [None]:
            n = 0 if sentence is None else len(sentence.split())
            if sentence is None or (run and count + n > hi):
                if count >= lo:
                    out.append(" ".join(run).replace(" \n\n", "\n\n").strip())
                run, count = [], 0
            if sentence is not None:
                run.append(sentence.lstrip("\n") if not run else sentence)
                count += n
        if len(out) == before and text.strip():
            out.append(text.strip())
    return out


@functools.lru_cache(maxsize=1)
def _heldout_shingles() -> frozenset:
    from training.hybrid.data import shingles

    out: set = set()
    for _, text in heldout_documents():
        out |= shingles(text)
    return frozenset(out)


_PROMPT = re.compile(r"<\|im_start\|>user\n(Document: .*)Question: (.*)<\|im_end\|>\n<\|im_start\|>$", re.S)


def distilled_rag(tokenizer, layout: "LayoutFn", link: Sequence[int] = ()) -> list[tuple[list[str], str, list[int]]]:
    """(documents, question, reply ids) of every usable shipped teacher RAG sample: its prompt
    exactly `layout`'s of its documents and question (without the `link` segments, which the
    teacher's prompts never had), answers only (`non_answer`), cut where the
    reply starts looping (`cut_loop`), >= 8 reply tokens, and none sharing an 8-word run with a
    held-out document."""
    from training.hybrid.data import shingles
    from training.hybrid.distill import cut_loop, non_answer, reply_start, reply_text

    turn = tokenizer.convert_tokens_to_ids("<|im_start|>")
    held = _heldout_shingles()
    out, seen = [], set()
    for line in gzip.decompress(RAG_SAMPLES.read_bytes()).decode().splitlines():
        ids = json.loads(line)["ids"]
        if tuple(ids) in seen or non_answer(reply_text(tokenizer, ids)):
            continue
        seen.add(tuple(ids))
        ids = cut_loop(ids, turn)
        found = _PROMPT.search(tokenizer.decode(ids[:reply_start(ids, turn)]))
        if not found:
            continue
        docs = [d[:-2] if d.endswith("\n\n") else d for d in found.group(1).split("Document: ")[1:]]
        prompt = layout(found.group(2), docs).without(link).ids
        reply = ids[len(prompt):]
        if ids[:len(prompt)] != prompt or len(reply) < 8 or any(shingles(d) & held for d in docs):
            continue
        out.append((docs, found.group(2), reply))
    return out


def distill_samples(tokenizer, layout: LayoutFn, distractors: Sequence[str], seed: int, start: int = 0,
                    max_tokens: int = 512, link: Sequence[int] = ()) -> Iterator[Sample]:
    """Endless samples from the shipped teacher RAG samples, from cursor `start` on: sample i is
    a shuffled pass's i-th (pass p = i // n, shuffled by `seed` + p), with 3-8 documents (its own,
    then distractors drawn by `seed` and i, as many as keep the prompt within `max_tokens`) in a
    random order. The same (seed, i) gives the same
    sample in every process, so a resumed run continues the sequence. `link`: the ids of the
    link segments `layout` writes, if any (the samples carry them; the teacher's prompts did not)."""
    rag = distilled_rag(tokenizer, layout, link)
    if not rag:
        raise ValueError(f"{RAG_SAMPLES}: no usable RAG sample")
    i = start
    while True:
        p, j = divmod(i, len(rag))
        order = list(range(len(rag)))
        random.Random(seed * 1_000_003 + p).shuffle(order)
        docs, question, reply = rag[order[j]]
        rng = random.Random(f"{seed}:{i}")
        docs = list(docs)
        want = rng.randint(max(K_DOCUMENTS[0], len(docs)), max(K_DOCUMENTS[1], len(docs)))
        for _ in range(4 * want):
            if len(docs) >= want or not distractors:
                break
            extra = rng.choice(distractors)
            if extra not in docs and len(layout(question, docs + [extra]).ids) <= max_tokens:
                docs.append(extra)
        rng.shuffle(docs)
        yield Sample(layout(question, docs), tuple(reply), "distill")
        i += 1


def topic_of(text: str, rng: random.Random) -> str:
    """A short topic phrase from a document: its first sentence's first few words."""
    words = re.split(r"(?<=[.!?])\s", text.strip(), maxsplit=1)[0].split()
    n = min(len(words), rng.randint(3, 6))
    return " ".join(words[:n]).strip(".,:;") or "this"


def corpus_samples(texts: Sequence[str], layout: LayoutFn, seed: int, start: int = 0,
                   max_tokens: int = 512) -> Iterator[Sample]:
    """Endless samples over `texts` (passages), from cursor `start`: k documents (3-8, fewer when
    there are fewer texts or the prompt would pass `max_tokens`) in a random order, a templated
    question about the first of them; the reply
    is the teacher's (None here). Deterministic in (seed, i)."""
    if not texts:
        raise ValueError("corpus_samples needs at least one document")
    i = start
    while True:
        rng = random.Random(f"corpus:{seed}:{i}")
        k = min(len(texts), rng.randint(*K_DOCUMENTS))
        docs = rng.sample(list(texts), k)
        question = rng.choice(QUESTIONS).format(topic=topic_of(docs[0], rng))
        built = layout(question, docs)
        while len(built.ids) > max_tokens and len(docs) > 1:
            docs.pop()
            built = layout(question, docs)
        order = list(range(len(docs)))
        rng.shuffle(order)
        yield Sample(layout(question, [docs[j] for j in order]), None, "corpus")
        i += 1


def mixed(sources: Sequence[Iterator[Sample]], weights: Sequence[float], seed: int, start: int = 0) -> Iterator[tuple[int, Sample]]:
    """(cursor, sample): sample i drawn from source `pick(i)`; each source advanced only when
    drawn. Resuming at cursor `start` needs each source started at how many it gave before
    `start` (`counts`)."""
    i = start
    while True:
        yield i, next(sources[pick(i, weights, seed)])
        i += 1


def pick(i: int, weights: Sequence[float], seed: int) -> int:
    r = random.Random(f"mix:{seed}:{i}").random() * sum(weights)
    for k, w in enumerate(weights):
        r -= w
        if r < 0:
            return k
    return len(weights) - 1


def counts(n: int, weights: Sequence[float], seed: int) -> list[int]:
    """How many of the first `n` draws each source gave (where to start each source on resume)."""
    out = [0] * len(weights)
    for i in range(n):
        out[pick(i, weights, seed)] += 1
    return out

"""Training text for the hybrid's distillation: real English prose, offline, one licence.

Source: the docstrings of CPython's standard library (`Lib/**/*.py`: module, class and function
docstrings of 40 words or more, via `ast`) and the Language Reference topics in
`Lib/pydoc_data/topics.py`; PSF-2.0. Every paragraph that shares a run of 8 words with a
`data/real_qa` passage, question, `held_out.txt` or `held_out_prose.txt` is dropped, so neither
the accuracy benchmark's passages nor the perplexity texts are trained on. Test suites, `idlelib`, `lib2to3` and
`site-packages` are skipped.

Half of the training sequences are laid out as the gateway lays out a question with retrieved
documents (the model's chat template, "Document: ..." parts, a question), so the student also
sees the prompt shape it is served with; the rest are plain packed text.
"""

from __future__ import annotations

import ast
import json
import random
import re
import sysconfig
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SKIP_DIRS = {"test", "tests", "idlelib", "lib2to3", "site-packages", "turtledemo", "ensurepip", "__pycache__"}
QUESTIONS = (
    "What is this about?", "Which function or option does the documentation describe?",
    "Summarise the documents in one sentence.", "What does the first document say?",
    "What is the default value mentioned?", "Which module is described?",
)


def _paragraphs(text: str) -> list[str]:
    paras = [re.sub(r"[ \t]*\n[ \t]*", " ", p).strip() for p in re.split(r"\n\s*\n", text)]
    return [p for p in paras if len(p.split()) >= 8]


def shingles(text: str, n: int = 8) -> set[tuple[str, ...]]:
    words = re.findall(r"\w+", text.lower())
    return {tuple(words[i:i + n]) for i in range(len(words) - n + 1)}


def excluded_shingles() -> set[tuple[str, ...]]:
    out: set[tuple[str, ...]] = set()
    qa = ROOT / "data" / "real_qa"
    for line in (qa / "passages.jsonl").read_text().splitlines():
        out |= shingles(json.loads(line)["text"])
    for line in (qa / "questions.jsonl").read_text().splitlines():
        out |= shingles(json.loads(line)["question"])
    for name in ("held_out.txt", "held_out_prose.txt"):
        out |= shingles((qa / name).read_text())
    return out


def stdlib_docstrings(min_words: int = 40) -> list[tuple[str, str]]:
    """(where, docstring) for every long docstring of the standard library, in a stable order."""
    lib = Path(sysconfig.get_paths()["stdlib"])
    out = []
    for path in sorted(lib.rglob("*.py")):
        if SKIP_DIRS & set(path.relative_to(lib).parts):
            continue
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError, ValueError):
            continue
        for node in [tree, *ast.walk(tree)]:
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                doc = ast.get_docstring(node)
                if doc and len(doc.split()) >= min_words:
                    out.append((f"{path.relative_to(lib)}:{getattr(node, 'name', '<module>')}", doc))
    return out


def pydoc_topics() -> list[tuple[str, str]]:
    from pydoc_data.topics import topics

    return [(f"pydoc_data.topics:{k}", topics[k]) for k in sorted(topics)]


def documents() -> tuple[list[str], dict]:
    """The training documents (paragraph lists joined back), after removing evaluation overlap."""
    bad = excluded_shingles()
    docs, dropped, kept_words = [], 0, 0
    for _where, text in stdlib_docstrings() + pydoc_topics():
        paras = []
        for p in _paragraphs(text):
            if shingles(p) & bad:
                dropped += 1
                continue
            paras.append(p)
            kept_words += len(p.split())
        if paras:
            docs.append("\n\n".join(paras))
    return docs, {"documents": len(docs), "paragraphs_dropped_for_overlap": dropped, "words": kept_words}


def build_sequences(tokenizer, seq_len: int, seed: int = 0, prompt_share: float = 0.5,
                    system_prompt: str = "Answer the question using the documents. Answer briefly.") -> tuple[list[list[int]], dict]:
    """Token sequences of exactly `seq_len` tokens: packed plain text, and gateway-style prompts
    (chat template, 2-6 documents, a question) cut or padded by more text to `seq_len`."""
    docs, info = documents()
    rng = random.Random(seed)
    rng.shuffle(docs)
    stream: list[int] = []
    for d in docs:
        stream += tokenizer.encode(d, add_special_tokens=False) + [tokenizer.eos_token_id]
    plain = [stream[i:i + seq_len] for i in range(0, len(stream) - seq_len, seq_len)]
    n_prompt = int(len(plain) * prompt_share / (1 - prompt_share)) if prompt_share < 1 else len(plain)
    prompts = []
    for _ in range(n_prompt):
        parts = rng.sample(docs, rng.randint(2, 6))
        body = "".join(f"Document: {p[:1500]}\n\n" for p in parts) + f"Question: {rng.choice(QUESTIONS)}"
        text = tokenizer.apply_chat_template(
            [{"role": "system", "content": system_prompt}, {"role": "user", "content": body}],
            tokenize=False, add_generation_prompt=True)
        ids = tokenizer.encode(text, add_special_tokens=False)
        if len(ids) >= seq_len:
            ids = ids[-seq_len:]
        else:
            start = rng.randrange(0, max(1, len(stream) - seq_len))
            ids = ids + stream[start:start + seq_len - len(ids)]
        prompts.append(ids)
    seqs = plain + prompts
    rng.shuffle(seqs)
    info.update({"plain_sequences": len(plain), "prompt_sequences": len(prompts), "tokens": len(stream), "seq_len": seq_len})
    return seqs, info

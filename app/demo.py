"""`hypic demo`: one multi-segment request in every mode on the bundled model, side by side.

Loads the bundled model, takes a demo question with its source documents plus distractors
from the demo corpus, and runs the same request as full, prefix, pic-naive, hypic (cold:
empty segment store) and hypic (warm: the documents cached by an earlier request that saw
them in another order). Prints TTFT, reuse and the answer of each.
"""

from __future__ import annotations

import json
import random
import re
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

from hypic_core.config import EngineConfig, GenerationRequest, SamplingParams
from hypic_core.engine.engine import Engine
from hypic_core.models.registry import resolve
from retrieval.document import Chunk, chunk_id_for
from retrieval.index import SearchHit

from .service.prompter import Prompter
from .service.settings import Settings


def demo_questions(path: Path) -> list[tuple[str, str, list[str]]]:
    """(question, answer, source document ids) rows of the demo questions table, those the
    bundled model answered correctly (its "model answer" column) first."""
    rows = []
    for line in path.read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) >= 4 and cells[0] in ("single", "two_hop"):
            answered = len(cells) > 4 and cells[4] == cells[2]
            rows.append((not answered, (cells[1], cells[2], re.findall(r"`([^`]+)`", cells[3]))))
    return [row for _, row in sorted(rows, key=lambda r: r[0])]


def run_demo(settings: Settings, n_docs: int = 3, max_tokens: int = 16, console: Console | None = None) -> None:
    console = console or Console()
    corpus = {d["id"]: d for d in map(json.loads, Path(settings.corpus_path).read_text().splitlines()) if d}
    questions = demo_questions(Path(settings.corpus_path).with_name("demo_questions.md"))
    question, answer, sources = questions[0]
    rng = random.Random(0)
    distractors = rng.sample([i for i in corpus if i not in sources], n_docs - len(sources))
    docs = [corpus[i]["text"] for i in sources + distractors]

    t = time.perf_counter()
    with console.status(f"loading {settings.model}"):
        model = resolve(settings.model, settings.models_dir)
        engine = Engine.from_pretrained(model.path, EngineConfig(seam=settings.seam), dtype=settings.dtype,
                                        device=settings.device, model_id=settings.served_model_name)
    console.print(f"loaded {settings.model} ({engine.adapter.family}: {len(engine.adapter.linear_layers)} linear + "
                  f"{len(engine.adapter.attention_layers)} attention layers) in {time.perf_counter() - t:.1f} s")
    layout = settings.prompt_layout(engine.tokenizer, model.prompt)
    prompter = Prompter(engine.tokenizer, layout, engine.max_positions)

    def request(order: list[str], mode: str) -> GenerationRequest:
        # scores rise with the position, so the prompt keeps this order (worst first)
        hits = [SearchHit(float(i), Chunk(chunk_id_for(d), f"doc{i}", "", "demo", 0, d, 0)) for i, d in enumerate(order)]
        segs = prompter.query(question, hits, reserve=max_tokens).segments
        return GenerationRequest(tuple(segs), mode=mode, sampling=SamplingParams(max_tokens=max_tokens))

    shuffled = docs[:]
    rng.shuffle(shuffled)
    runs = [("full", "full", docs), ("prefix", "prefix", docs), ("hypic (cold)", "hypic", docs),
            ("pic-naive", "pic-naive", shuffled), ("hypic (warm, new order)", "hypic", shuffled)]
    table = Table(title=f"Q: {question}  (expected: {answer})")
    for col in ("mode", "TTFT ms", "prompt", "exact", "composed", "seam", "hits/misses", "answer"):
        table.add_column(col, justify="right" if col not in ("mode", "answer") else "left")
    for label, mode, order in runs:
        req = request(order, mode)
        t = time.perf_counter()
        outputs = iter(engine.generate(req))  # the step loop the gateway runs
        first = next(outputs)
        ttft = (time.perf_counter() - t) * 1000
        text = first.text + "".join(o.text for o in outputs)
        s = first.stats
        table.add_row(label, f"{ttft:.0f}", str(s.prompt_tokens), str(s.exact_tokens), str(s.composed_tokens), str(s.seam_tokens),
                      f"{s.segment_hits}/{s.segment_misses}", text.strip())
    console.print(table)
    console.print(f"segment store: {engine.store.stats()}")

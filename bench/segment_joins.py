"""How many real_qa prompts join their segments as the whole prompt text is tokenized.

    .venv/bin/python bench/segment_joins.py [--model smollm2-135m-instruct] [--seed 0]

Builds each of the 84 data/real_qa/ questions' /query prompt as bench/accuracy_real.py does
(3-10 passages, the gold one at a shuffled position) with the model's tokenizer and prompt
layout, concatenates the segments' ids, and compares them with the ids of the same text
tokenized in one piece. Prints how many prompts match and how many joins have different ids
before them. Tokenizer only: no model is loaded, nothing is timed.
"""

from __future__ import annotations

import argparse
import random
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from transformers import AutoTokenizer  # noqa: E402

from app.service.prompter import Prompter  # noqa: E402
from app.service.settings import Settings  # noqa: E402
from hypic_core.models.registry import resolve  # noqa: E402
from real_qa import build_context, load_real_qa  # noqa: E402
from retrieval.document import Chunk, chunk_id_for  # noqa: E402
from retrieval.index import SearchHit  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    model = resolve(args.model)
    tokenizer = AutoTokenizer.from_pretrained(model.path)
    layout = Settings(_env_file=None, model=args.model).prompt_layout(tokenizer, model.prompt)
    prompter = Prompter(tokenizer, layout, 1 << 20)
    rng = random.Random(args.seed)
    pairs = load_real_qa()
    same = joins = differing = 0
    for pair in pairs:
        chunks, _ = build_context(pair, rng.randint(3, min(10, len(pair.distractors) + 1)), seed=args.seed)
        hits = [SearchHit(float(i), Chunk(chunk_id_for(t), f"c{i}", "", "real_qa", 0, t, 0)) for i, t in enumerate(chunks)]
        segments = prompter.query(pair.question, hits, reserve=64).segments
        ids = sum(segments, ())
        text = tokenizer.decode(list(ids), clean_up_tokenization_spaces=False)
        whole = tuple(tokenizer.encode(text, add_special_tokens=False))
        same += ids == whole
        end = 0
        for segment in segments[:-1]:
            end += len(segment)
            joins += 1
            differing += ids[:end] != whole[:end]
    print(f"{args.model}: {same} of {len(pairs)} prompts tokenized as their whole text; "
          f"{differing} of {joins} joins with different ids before them")


if __name__ == "__main__":
    main()

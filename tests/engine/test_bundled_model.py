"""The committed model in models/hypic-tiny loads offline and answers held-out questions.

Full prefill, greedy decoding with plain transformers (``training.evaluate.answer``).
"""

import dataclasses
import os

import pytest

from training import world

MODEL_DIR = os.path.join(os.path.dirname(__file__), "..", "..", "models", "hypic-tiny")

pytestmark = pytest.mark.skipif(not os.path.exists(os.path.join(MODEL_DIR, "model.safetensors")),
                                reason="models/hypic-tiny has not been exported yet")

# Thresholds sit one below what the committed model (step 7400) scored: 20 of 20 fixed questions,
# 8 of 8 edited documents followed, 5 of 5 hand-written prompts. The follows questions use
# 4 documents: measured full 16 of 16 correct, hypic (seam 8) the same answer as full on 16,
# pic-naive and hypic without a seam 0 correct each (step 5324 had 9, 16, 4 and 4). A randomly
# initialised model of the same config scored 0 on the first three (step-1804 measurement).
MIN_FIXED = 19      # of 20 held-out single-hop questions with one document
MIN_FOLLOWED = 7    # of 8 questions whose document was edited to a new answer
MIN_LITERAL = 4     # of 5 hand-written prompts
FOLLOWS_N = 16
FOLLOWS_K = 4
MIN_FOLLOWS_FULL = 14
MAX_FOLLOWS_CACHED_ALONE = 2

# Hand-written prompts (independent of the generator's sampling): documents, question, answer.
LITERAL = [
    (["Mutra was born in 1959 in Zeirul and is a chemist at Thidal.",
      "The Stimen is a river in Reime that flows into the Thizirk Sea."],
     "In which year was Mutra born?", "1959"),
    (["Founded in 1842, Houlend is a city of Lober on the Meitor river, with mayor Bruveix.",
      "Born in Hovain in 1872, Redrin works as a banker at Kramox.",
      "Born in Hovain in 1863, Koru works as a butcher at Krabrein."],
     "What is the profession of Koru?", "butcher"),
    (["Midreim is a shipping company founded in 1838 by Thimail and based in Jasteirk.",
      "Founded by Breitherk in 1952, Grabraind is a silk firm based in Choucher."],
     "Who founded Grabraind?", "Breitherk"),
    (["The Stimen river runs through Reime and ends in the Thizirk Sea."],
     "Into which sea does the Stimen flow?", "Thizirk"),
    (["Koru is a potter born in Hovain in 1863. Koru works for Krabrein."],
     "Which company does Koru work for?", "Krabrein"),
]


@pytest.fixture(scope="module")
def bundled():
    import torch

    from training.evaluate import load
    torch.set_num_threads(1)
    return load(MODEL_DIR)


def _ask(bundled, ex: world.Example) -> str:
    from training.evaluate import answer
    model, tok = bundled
    return answer(model, tok, ex)


def test_loads_offline_as_qwen3_5(bundled):
    model, tok = bundled
    assert model.config.model_type in ("qwen3_5", "qwen3_5_text")
    kinds = set(model.config.layer_types)
    assert kinds == {"linear_attention", "full_attention"}
    assert tok.eos_token == "<|im_end|>" and tok.chat_template


def test_answers_hand_written_prompts(bundled):
    answers = []
    for texts, question, gold in LITERAL:
        docs = [world.Doc(id=f"doc-{i}", title="", text=t) for i, t in enumerate(texts)]
        answers.append(_ask(bundled, world.Example("single", "literal", question, gold, docs)))
    assert sum(a == gold for a, (_, _, gold) in zip(answers, LITERAL)) >= MIN_LITERAL, answers


def test_answers_fixed_heldout_single_hop_questions(bundled):
    examples = world.heldout_examples(20, k_values=(1,), kinds=("single",), seed=123)
    answers = [_ask(bundled, ex) for ex in examples]
    correct = sum(a == ex.answer for a, ex in zip(answers, examples))
    assert correct >= MIN_FIXED, list(zip(answers, [ex.answer for ex in examples]))


def test_answer_follows_the_document_not_memory(bundled):
    """Rewrite the relevant document's answer word: the model must answer the new word."""
    followed = 0
    for ex in world.heldout_examples(8, k_values=(1,), kinds=("single",), seed=321):
        doc_index, word = ex.sources[0]
        replacement = next(v for v in _same_kind_values(word) if v not in ex.docs[doc_index].text)
        docs = list(ex.docs)
        docs[doc_index] = dataclasses.replace(docs[doc_index], text=docs[doc_index].text.replace(word, replacement))
        followed += _ask(bundled, dataclasses.replace(ex, docs=docs, answer=replacement)) == replacement
    assert followed >= MIN_FOLLOWED


def _same_kind_values(word: str) -> list[str]:
    """Other words of the same vocabulary as ``word`` (city for a city, year for a year...)."""
    for pool in (*world.NAME_POOLS.values(), world.PROFESSIONS, world.INDUSTRIES, world.YEARS):
        if word in pool:
            return [v for v in pool if v != word]
    raise ValueError(word)


@pytest.fixture(scope="module")
def engine():
    import torch

    from hypic_core.config import EngineConfig
    from hypic_core.engine.engine import Engine
    torch.set_num_threads(1)
    return Engine.from_pretrained(MODEL_DIR, EngineConfig(seam=8))


def _engine_answer(engine, ex: world.Example, mode: str, seam: int | None = None) -> str:
    from hypic_core.config import GenerationRequest, SamplingParams

    texts, _ = world.prompt_segments(ex)
    segments = tuple(tuple(engine.tokenizer.encode(t, add_special_tokens=False)) for t in texts)
    request = GenerationRequest(segments, mode=mode, seam=seam, sampling=SamplingParams(max_tokens=8))
    return "".join(e.text for e in engine.generate(request)).strip()


def test_engine_answers_with_full_and_hypic(engine):
    """The serving engine answers the fixed questions in `full` and in `hypic` (cached documents reused)."""
    examples = world.heldout_examples(20, k_values=(1,), kinds=("single",), seed=123)
    full = [_engine_answer(engine, ex, "full") for ex in examples]
    hypic = [_engine_answer(engine, ex, "hypic") for ex in examples]
    gold = [ex.answer for ex in examples]
    assert sum(a == g for a, g in zip(full, gold)) >= MIN_FIXED, list(zip(full, gold))
    assert sum(a == g for a, g in zip(hypic, gold)) >= MIN_FIXED, list(zip(hypic, gold))
    before = engine.store.stats()
    warm = [_engine_answer(engine, ex, "hypic") for ex in examples]
    after = engine.store.stats()
    assert after.misses == before.misses and after.hits["memory"] - before.hits["memory"] == 2 * len(examples)
    assert warm == hypic  # every segment from the cache now, and the same answers


def test_follows_needs_the_composed_state_or_the_seam(engine):
    """"Which record comes right after the record about X?" is answered by the next document's
    name, which must know the document before it. A document cached on its own does not
    (pic-naive, and hypic with no seam); hypic's seam recomputes the name on top of the composed
    state and answers as full prefill does."""
    examples = world.heldout_examples(FOLLOWS_N, k_values=(FOLLOWS_K,), kinds=("follows",), seed=77)
    gold = [ex.answer for ex in examples]
    full = [_engine_answer(engine, ex, "full") for ex in examples]
    hypic = [_engine_answer(engine, ex, "hypic", seam=8) for ex in examples]
    naive = [_engine_answer(engine, ex, "pic-naive", seam=0) for ex in examples]
    no_seam = [_engine_answer(engine, ex, "hypic", seam=0) for ex in examples]
    assert sum(a == g for a, g in zip(full, gold)) >= MIN_FOLLOWS_FULL, list(zip(full, gold))
    assert sum(a == f for a, f in zip(hypic, full)) >= FOLLOWS_N - 1, list(zip(hypic, full))
    assert sum(a == g for a, g in zip(naive, gold)) <= MAX_FOLLOWS_CACHED_ALONE, list(zip(naive, gold))
    assert sum(a == g for a, g in zip(no_seam, gold)) <= MAX_FOLLOWS_CACHED_ALONE, list(zip(no_seam, gold))


def test_only_the_memory_heads_carry_state_across_a_document():
    """The committed model's pinned heads (head 3 of linear layers 0-2) keep most of their state
    over a document; every other linear head forgets it (measured: 0.77-0.80 vs < 1e-8)."""
    import torch

    from training.diagnose import memory
    torch.set_num_threads(1)
    norms = memory(MODEL_DIR, n_docs=10)
    for layer, heads in norms.items():
        for head, norm in enumerate(heads):
            if layer in (0, 1, 2) and head == 3:
                assert norm > 0.5, (layer, head, norm)
            else:
                assert norm < 1e-3, (layer, head, norm)

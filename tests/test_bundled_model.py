"""The committed model in models/hypic-tiny loads offline and answers held-out questions.

Full prefill, greedy decoding with plain transformers (``training.evaluate.answer``).
"""

import dataclasses
import os

import pytest

from training import world

MODEL_DIR = os.path.join(os.path.dirname(__file__), "..", "models", "hypic-tiny")

pytestmark = pytest.mark.skipif(not os.path.exists(os.path.join(MODEL_DIR, "model.safetensors")),
                                reason="models/hypic-tiny has not been exported yet")

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


@pytest.mark.parametrize("texts,question,gold", LITERAL)
def test_answers_hand_written_prompts(bundled, texts, question, gold):
    docs = [world.Doc(id=f"doc-{i}", title="", text=t) for i, t in enumerate(texts)]
    assert _ask(bundled, world.Example("single", "literal", question, gold, docs)) == gold


def test_answers_fixed_heldout_single_hop_questions(bundled):
    examples = world.heldout_examples(8, k_values=(2, 5), kinds=("single",), seed=123)
    answers = [_ask(bundled, ex) for ex in examples]
    correct = sum(a == ex.answer for a, ex in zip(answers, examples))
    assert correct >= 14, list(zip(answers, [ex.answer for ex in examples]))


def test_answer_follows_the_document_not_memory(bundled):
    """Rewrite the relevant document's answer word: the model must answer the new word."""
    w = world.World(world.HELDOUT_SEED)
    for ex in world.heldout_examples(4, k_values=(3,), kinds=("single",), seed=321):
        doc_index, word = ex.sources[0]
        replacement = next(v for v in _same_kind_values(w, word) if v not in "".join(d.text for d in ex.docs))
        docs = list(ex.docs)
        docs[doc_index] = dataclasses.replace(docs[doc_index], text=docs[doc_index].text.replace(word, replacement))
        edited = dataclasses.replace(ex, docs=docs, answer=replacement)
        assert _ask(bundled, ex) == word
        assert _ask(bundled, edited) == replacement


def _same_kind_values(w: world.World, word: str) -> list[str]:
    """Other words of the same vocabulary as ``word`` (city for a city, year for a year...)."""
    for pool in (*world.NAME_POOLS.values(), world.PROFESSIONS, world.INDUSTRIES, world.YEARS):
        if word in pool:
            return [v for v in pool if v != word]
    raise ValueError(word)

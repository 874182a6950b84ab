"""Segments join as the whole prompt text is tokenized (app/service/prompter.py, `SafeEncoder.encode`'s
`followed_by`), checked on SmolLM2's tokenizer and on a byte-level BPE trained here with the
merges that make joins differ (`\\n\\n`, ` Document`).

A byte-level BPE splits a run of whitespace by what follows it: `"a.\\n\\n"` alone ends in one
`\\n\\n` token, but followed by `Document` the run is two `\\n` tokens. Each segment is still
tokenized alone (its ids, and so its cache entry, do not depend on its neighbours), but as if
followed by what follows a segment in this layout; the properties below hold the concatenated
segments to the whole text's tokenization, and name the joins where they cannot be.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from transformers import AutoTokenizer

from app.service.prompter import GENERIC, Prompter, PromptLayout, SafeEncoder
from hypic_core.models.registry import SMOLLM2_PROMPT
from retrieval.document import Chunk, chunk_id_for
from retrieval.index import SearchHit

PROPERTY = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
LAYOUTS = {"raw": GENERIC["raw"], "chat": GENERIC["chat"], "smollm2": PromptLayout(**(GENERIC["chat"].__dict__ | SMOLLM2_PROMPT))}


@pytest.fixture(scope="module")
def joining_tokenizer():
    """Byte-level BPE (GPT-2 pre-tokenizer) trained on text full of paragraph breaks, so `\\n\\n`
    and ` Document` are tokens, with a ChatML template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    text = ["Document: The river Alna flows through Varo.\n\nDocument: Its mayor is Ines Kell.\n\n",
            "Question: who founded Brill?\n\nAnswer: Tam Oke. A Document and a Question.\n\n\n"] * 40
    tok.train_from_iterator(text, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    fast.chat_template = (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    assert fast.encode("\n\n", add_special_tokens=False) != fast.encode("\n", add_special_tokens=False) * 2
    return fast


@pytest.fixture(scope="module")
def smollm2_tokenizer(smollm2_dir):
    return AutoTokenizer.from_pretrained(smollm2_dir)


@pytest.fixture(params=["trained", "smollm2"])
def tokenizer(request, joining_tokenizer, smollm2_tokenizer):
    return joining_tokenizer if request.param == "trained" else smollm2_tokenizer


def hit(text: str, score: float) -> SearchHit:
    return SearchHit(score, Chunk(chunk_id_for(text), f"doc-{score}", "", "test", 0, text, 0))


def whole(tokenizer, ids) -> tuple[int, ...]:
    """The ids of the text `ids` spell, tokenized in one piece (template markers as special tokens)."""
    return tuple(tokenizer.encode(tokenizer.decode(list(ids), clean_up_tokenization_spaces=False), add_special_tokens=False))


def test_the_reported_join(tokenizer):
    """Before: `"a.\\n\\n" + "Document"` gave `\\n\\n` where the whole text gives `\\n`, `\\n`."""
    encoder = SafeEncoder(tokenizer)
    joined = encoder.encode([("a.\n\n", False)], followed_by="Document") + encoder.text("Document")
    assert joined == tuple(tokenizer.encode("a.\n\nDocument", add_special_tokens=False))
    assert encoder.encode([("a.\n\n", False)]) == tuple(tokenizer.encode("a.\n\n", add_special_tokens=False))  # at the end: as alone


words = st.sampled_from(["Varo", "river", "Alna", "flows", "mayor", "1999", "café", "Document", "Question", "a", "(b)", "x,"])
seps = st.sampled_from([" ", " ", " ", ". ", ", ", "\n", "\n\n", ".\n\n", " - ", ":\n", "\n\n\n", "  "])
texts = st.lists(st.tuples(words, seps), min_size=1, max_size=12).map(lambda ws: "".join(w + s for w, s in ws).strip()).filter(bool)


@PROPERTY
@given(docs=st.lists(texts, min_size=1, max_size=5), question=texts, layout=st.sampled_from(sorted(LAYOUTS)))
def test_a_query_prompt_is_its_text_tokenized_whole(tokenizer, docs, question, layout):
    """Before: on SmolLM2 every document followed by another (`...\\n\\n` + `Document:`) or by the
    question joined as two tokens fewer or more than the whole text; the system prompt too."""
    prompter = Prompter(tokenizer, LAYOUTS[layout], context=1 << 20)
    prompt = prompter.query(question, [hit(d, 0.9 - i / 10) for i, d in enumerate(docs)], reserve=1)
    ids = sum(prompt.segments, ())
    assert ids == whole(tokenizer, ids)


@PROPERTY
@given(messages=st.lists(texts, min_size=1, max_size=4), segments=st.lists(texts, max_size=3), docs=st.lists(texts, max_size=3))
def test_a_chat_prompt_is_its_text_tokenized_whole(tokenizer, messages, segments, docs):
    prompter = Prompter(tokenizer, LAYOUTS["smollm2"], context=1 << 20)
    convo = [{"role": "user" if (len(messages) - 1 - i) % 2 == 0 else "assistant", "content": m} for i, m in enumerate(messages)]
    prompt = prompter.chat(convo, [hit(d, 0.9 - i / 10) for i, d in enumerate(docs)], segments, reserve=1)
    ids = sum(prompt.segments, ())
    assert ids == whole(tokenizer, ids)


@pytest.mark.parametrize("before,after", [("a. ", "Document"), ("a\n\n", " Question")], ids=["space-then-word", "break-then-space"])
def test_where_a_join_cannot_match(tokenizer, before, after):
    """What the join cannot repair, since a segment is tokenized without its neighbour: a segment
    ending in a space (a byte-level BPE puts the space on the next word: ` Document`), and one
    followed by text that starts with whitespace where the layout's next segment does not. Such
    a join differs from the whole text's tokens (one more, here), never in its text."""
    encoder = SafeEncoder(tokenizer)
    joined = encoder.encode([(before, False)], followed_by="Document") + encoder.text(after)
    assert tokenizer.decode(list(joined)) == before + after
    assert len(joined) == len(tokenizer.encode(before + after, add_special_tokens=False)) + 1

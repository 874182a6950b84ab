"""The synthetic world and its tokenizer: determinism, split hygiene, prompt layout."""

import random

import pytest

from training import world
from training.tokenizer import build_tokenizer


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer()


def _sample(seed: int, n: int = 40) -> list[world.Example]:
    w, rng = world.World(seed), random.Random(seed)
    return [w.example(rng, world.KINDS[i % 4], 1 + i % 10 if i % 4 in (0, 2) else 2 + i % 9)
            for i in range(n)]


def test_world_is_deterministic_per_seed():
    assert world.World(3).docs == world.World(3).docs
    assert world.World(3).docs != world.World(4).docs
    assert [(e.question, e.answer, e.docs) for e in _sample(11)] == \
           [(e.question, e.answer, e.docs) for e in _sample(11)]
    a = world.heldout_examples(3)
    b = world.heldout_examples(3)
    assert [(e.question, e.answer, e.docs) for e in a] == [(e.question, e.answer, e.docs) for e in b]


def test_heldout_entities_never_occur_in_training_worlds():
    heldout = {e for ents in world.World(world.HELDOUT_SEED).entities.values() for e in ents}
    valid = {e for ents in world.World(world.VALID_SEED).entities.values() for e in ents}
    stream_seeds = [world.TRAIN_SEED_BASE + s * 100_000 + i for s in (0, 1) for i in range(100)]
    for seed in stream_seeds:
        train = {e for ents in world.World(seed).entities.values() for e in ents}
        assert not train & heldout
        assert not train & valid
    assert not heldout & valid


def test_world_is_consistent():
    w = world.World(world.HELDOUT_SEED)
    for person in w.entities["person"]:
        assert person.get("city") in w.by_name and person.get("employer") in w.by_name
    for city in w.entities["city"]:
        assert w.by_name[city.get("mayor")].kind == "person"


@pytest.mark.parametrize("kind", world.KINDS)
def test_answers_and_layout(kind):
    w, rng = world.World(5), random.Random(kind)
    for k in range(world.min_docs(kind), 11):
        ex = w.example(rng, kind, k)
        segments, answer = world.prompt_segments(ex)
        assert len(segments) == k + 2 and answer == ex.answer
        prompt = "".join(segments)
        if kind in ("single", "two_hop", "first_last", "follows"):
            doc_index, word = ex.sources[0]
            assert word == answer and answer in ex.docs[doc_index].text
        if kind == "count":
            assert 0 <= int(answer) <= k
        assert prompt.startswith("<|im_start|>system\n") and prompt.endswith("<|im_start|>assistant\n")


def test_follows_answer_is_the_next_documents_name():
    w, rng = world.World(5), random.Random("follows")
    for k in range(2, 11):
        ex = w.example(rng, "follows", k)
        asked = next(i for i, d in enumerate(ex.docs) if ex.question == world.FOLLOWS_QUESTION.format(name=d.title))
        assert asked < k - 1 and ex.answer == ex.docs[asked + 1].title
        assert ex.sources == [(asked + 1, ex.answer)] and ex.answer in ex.docs[asked + 1].text
        assert len({d.id for d in ex.docs}) == k


def test_every_document_names_its_entity_before_any_attribute():
    """A value's representation can then carry which record it belongs to (causal attention)."""
    w = world.World(world.HELDOUT_SEED)
    for ent in w.by_name.values():
        text = w.docs[ent.name].text
        first_value = min(text.index(f" {v}") for _, v in ent.attrs)
        assert text.index(ent.name) < first_value, text


def test_single_hop_answer_is_in_exactly_the_source_document():
    for ex in world.heldout_examples(20, kinds=("single",)):
        doc_index, _ = ex.sources[0]
        assert ex.answer in ex.docs[doc_index].text
        assert f" {ex.answer}" in "".join(world.prompt_segments(ex)[0])


def test_names_and_values_are_single_tokens(tok):
    for word in world.vocabulary():
        assert len(tok(word)["input_ids"]) == 1, word
        assert tok(f"born in {word}.")["input_ids"][-2] == tok(word)["input_ids"][0], word
    assert len(tok("Kelmarbrook")["input_ids"]) > 1  # ordinary words are still split by BPE


def test_segments_tokenize_like_the_whole_prompt_and_match_chat_template(tok):
    for ex in _sample(9, 12):
        segments, _ = world.prompt_segments(ex)
        whole = tok("".join(segments))["input_ids"]
        assert whole == [t for s in segments for t in tok(s)["input_ids"]]
        templated = tok.apply_chat_template(world.chat_messages(ex), tokenize=False, add_generation_prompt=True)
        assert templated == "".join(segments)
    assert tok.eos_token == "<|im_end|>" and tok.pad_token == "<|endoftext|>"


def test_train_stream_document_counts():
    import collections
    import itertools

    def counts(dist):
        stream = world.train_stream(3, lambda: 10, {"single": 1.0}, dist)
        return collections.Counter(len(e.docs) for e in itertools.islice(stream, 3000))

    uniform, linear = counts("uniform"), counts("linear")
    assert set(uniform) == set(linear) == set(range(1, 11))
    mean = lambda c: sum(k * n for k, n in c.items()) / sum(c.values())  # noqa: E731
    assert 5.2 < mean(uniform) < 5.8 and 6.7 < mean(linear) < 7.3  # 5.5 and 7 expected
    assert linear[10] > 4 * linear[1]  # weight 10 vs 1
    # the uniform stream is the one earlier runs trained on (randint and choice draw alike)
    rng = random.Random("train/3")
    rng.choices(["single"], [1.0])
    assert len(next(world.train_stream(3, lambda: 10, {"single": 1.0})).docs) == rng.randint(1, 10)
    with pytest.raises(ValueError, match="docs_dist"):
        next(world.train_stream(3, lambda: 10, {"single": 1.0}, "zipf"))

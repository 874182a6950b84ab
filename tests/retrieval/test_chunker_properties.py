"""Properties of the chunker (retrieval/chunker.py), checked by hypothesis on documents of
sentences, paragraphs, runs of whitespace and arbitrary text, with small chunk sizes so that
documents cut into many chunks. Tokenizers: the test one (byte-level BPE), the bundled model's,
and MiniLM's WordPiece (which drops some characters from its tokens).

- Every chunk is an exact span of the document (line endings normalised), in order, apart.
- The chunks cover every non-whitespace character.
- Every chunk has at most `max_tokens` tokens, and `token_count` is its real count.
- Chunking is deterministic.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from transformers import AutoTokenizer

from hypic_core.models.registry import REPO_ROOT
from retrieval import Chunker, Document, minilm_model_dir

PROPERTY = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])

words = st.sampled_from(["Varo", "river", "the", "mayor", "1999", "naïve", "émigrés", "x" * 30, "a.b", "Dr.", "?!"])
separators = st.sampled_from([" ", " ", ". ", "! ", "? ", "\n", "\n\n", "\r\n", "\r\n\r\n", "\t", "  \n \n", ".\u201d "])
pieces = st.one_of(words, separators, st.text(max_size=8))
documents = st.lists(pieces, min_size=1, max_size=60).map("".join).filter(lambda t: t.strip())
sizes = st.tuples(st.integers(1, 12), st.integers(0, 12), st.integers(0, 12)).map(
    lambda s: (s[0], s[0] + s[1], max(1, s[0] - s[2])))  # target, max, min


@pytest.fixture(scope="module")
def bundled_tokenizer():
    return AutoTokenizer.from_pretrained(REPO_ROOT / "models" / "hypic-tiny")


@pytest.fixture(scope="module")
def minilm_tokenizer():
    return AutoTokenizer.from_pretrained(str(minilm_model_dir()), local_files_only=True)


@pytest.fixture(params=["test", "bundled", "wordpiece"])
def tokenizer(request, tiny_tokenizer, bundled_tokenizer, minilm_tokenizer):
    return {"test": tiny_tokenizer, "bundled": bundled_tokenizer, "wordpiece": minilm_tokenizer}[request.param]


def spans(text: str, chunks) -> list[tuple[int, int]]:
    """Where each chunk lies in `text`, found left to right; fails if one is not a span after the last."""
    out, position = [], 0
    for chunk in chunks:
        start = text.find(chunk.text, position)
        assert start >= 0, f"chunk {chunk.chunk_index} {chunk.text!r} is not a span of the text after {position}"
        out.append((start, start + len(chunk.text)))
        position = start + len(chunk.text)
    return out


@PROPERTY
@given(text=documents, size=sizes)
def test_chunks_are_exact_spans_in_order(tokenizer, text, size):
    target, most, least = size
    chunks = Chunker(tokenizer, target, most, least).chunk(Document("doc", text))
    normalised = text.replace("\r\n", "\n").replace("\r", "\n")
    spans(normalised, chunks)
    assert [c.chunk_index for c in chunks] == list(range(len(chunks)))
    assert all(c.text and c.text == c.text.strip() for c in chunks)


@PROPERTY
@given(text=documents, size=sizes)
def test_chunks_cover_every_non_whitespace_character(tokenizer, text, size):
    target, most, least = size
    chunks = Chunker(tokenizer, target, most, least).chunk(Document("doc", text))
    normalised = text.replace("\r\n", "\n").replace("\r", "\n")
    covered = set()
    for start, end in spans(normalised, chunks):
        covered.update(range(start, end))
    missing = [i for i, c in enumerate(normalised) if not c.isspace() and i not in covered]
    assert not missing, f"characters outside every chunk: {[normalised[i] for i in missing]!r}"


@PROPERTY
@given(text=documents, size=sizes)
def test_chunks_respect_max_tokens_and_count_them(tokenizer, text, size):
    target, most, least = size
    chunker = Chunker(tokenizer, target, most, least)
    chunks = chunker.chunk(Document("doc", text))
    counts = chunker.count_tokens([c.text for c in chunks])
    assert [c.token_count for c in chunks] == counts
    # One character is never cut, even when it alone has more tokens than the limit (byte-level).
    assert all(n <= most or len(c.text) == 1 for n, c in zip(counts, chunks)), list(zip(counts, [c.text for c in chunks]))
    assert chunker.chunk(Document("doc", text)) == chunks


def test_long_cjk_sentences_are_cut_without_repeating_a_character(bundled_tokenizer):
    """Japanese text has no '.', so a paragraph is one unit cut into token windows; a cut inside
    a character's byte tokens used to put that character at the end of one chunk and the start
    of the next (320 characters came back as 340)."""
    text = "日本語のテキスト" * 40
    chunks = Chunker(bundled_tokenizer, 32, 48, 16).chunk(Document("ja", text))
    assert "".join(c.text for c in chunks) == text
    assert all(c.token_count <= 48 for c in chunks)

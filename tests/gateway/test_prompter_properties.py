"""Properties of safe tokenization and prompt templates (app/service/prompter.py), checked by hypothesis
on the test tokenizer (conftest) and the bundled model's (which also has non-special added
tokens: whole names and words).

- Untrusted text never becomes a special token, whatever it spells, and decodes back to itself.
- Text that spells no special token is tokenized exactly as the plain tokenizer does.
- Trusted text turns special-token strings into their ids and nothing else.
- `fill` renders a template as `str.format` does, its literals trusted, its values not.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from transformers import AutoTokenizer

from app.service.prompter import SafeEncoder, check_template, fill
from hypic_core.models.registry import REPO_ROOT

SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
PROPERTY = settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])

# Text that tends to spell, or almost spell, special tokens, between arbitrary text (no surrogates:
# hypothesis's default; a lone surrogate cannot be tokenized at all, see tests/gateway/test_gateway_fuzz.py).
pieces = st.one_of(st.text(max_size=12), st.sampled_from(SPECIALS + ("<|", "|>", "im_end", "\n", " ", "Vavux", "paper")))
texts = st.lists(pieces, max_size=8).map("".join)


@pytest.fixture(scope="module")
def bundled_tokenizer():
    return AutoTokenizer.from_pretrained(REPO_ROOT / "models" / "hypic-tiny")


@pytest.fixture(params=["test", "bundled"])
def tokenizer(request, tiny_tokenizer, bundled_tokenizer):
    return tiny_tokenizer if request.param == "test" else bundled_tokenizer


def special_ids(tokenizer) -> set[int]:
    return {i for i, t in tokenizer.added_tokens_decoder.items() if t.special}


@PROPERTY
@given(text=texts)
def test_untrusted_text_never_becomes_a_special_token_and_decodes_to_itself(tokenizer, text):
    ids = SafeEncoder(tokenizer).text(text)
    assert not set(ids) & special_ids(tokenizer)
    assert tokenizer.decode(list(ids), clean_up_tokenization_spaces=False) == text


@PROPERTY
@given(text=texts.filter(lambda t: not any(s in t for s in SPECIALS)))
def test_without_special_strings_safe_encoding_is_plain_encoding(tokenizer, text):
    assert SafeEncoder(tokenizer).text(text) == tuple(tokenizer.encode(text, add_special_tokens=False))


@PROPERTY
@given(parts=st.lists(st.tuples(texts, st.booleans()), max_size=6))
def test_special_ids_come_only_from_special_strings_in_trusted_parts(tokenizer, parts):
    ids = SafeEncoder(tokenizer).encode(parts)
    wanted = sum(text.count(s) for text, trusted in parts if trusted for s in SPECIALS)
    # Counting by str.count is exact here: no special-token string overlaps another.
    assert sum(i in special_ids(tokenizer) for i in ids) == wanted
    assert tokenizer.decode(list(ids), clean_up_tokenization_spaces=False) == "".join(text for text, _ in parts)


@PROPERTY
@given(parts=st.lists(st.tuples(texts, st.booleans()), max_size=6))
def test_encoding_is_deterministic_and_splits_at_part_boundaries_only_for_specials(tokenizer, parts):
    encoder = SafeEncoder(tokenizer)
    assert encoder.encode(parts) == encoder.encode(list(parts))
    # Untrusted parts merge into one run: how the text is split into parts does not matter.
    joined = "".join(text for text, _ in parts)
    assert encoder.encode([(text, False) for text, _ in parts]) == encoder.text(joined)


# --- templates ---------------------------------------------------------------------------
literals = st.text(max_size=10).map(lambda s: s.replace("{", "{{").replace("}", "}}"))
names = st.sampled_from(["text", "title", "question"])
values = st.fixed_dictionaries({n: st.text(max_size=10) for n in ("text", "title", "question")})


@st.composite
def templates(draw, formats: bool = False) -> tuple[str, list[str]]:
    """A format string of literals and fields, and the fields in order; with `formats`, the fields
    may carry conversions and format specs, valid or not."""
    template, fields = draw(literals), []
    for _ in range(draw(st.integers(0, 4))):
        name = draw(names)
        suffix = draw(st.sampled_from(["", "!r", "!s", "!x", ":>8", ":^3", ":d", ":=4", ":{title}"])) if formats else ""
        template += "{" + name + suffix + "}" + draw(literals)
        fields.append(name)
    return template, fields


@settings(max_examples=100, deadline=None)
@given(shape=templates(), values=values)
def test_fill_renders_like_format_with_only_the_values_untrusted(shape, values):
    template, fields = shape
    parts = fill(template, **values)
    assert "".join(text for text, _ in parts) == template.format(**values)
    assert [text for text, trusted in parts if not trusted] == [values[name] for name in fields]
    assert all(text for text, trusted in parts if trusted)  # no empty literal parts


@settings(max_examples=100, deadline=None)
@given(shape=templates())
def test_check_template_accepts_exactly_templates_with_the_required_field(shape):
    template, fields = shape
    if "text" in fields:
        assert check_template(template, {"text", "title"} | set(fields), "text") == template
    else:
        with pytest.raises(ValueError, match="must contain"):
            check_template(template, {"text", "title", "question"}, "text")


@settings(max_examples=100, deadline=None)
@given(shape=templates(formats=True), values=values)
def test_a_template_check_template_accepts_fills_with_any_values(shape, values):
    """Settings templates are checked once, at startup; `fill` then runs on every request."""
    template, _ = shape
    try:
        check_template(template, {"text", "title", "question"}, "text")
    except ValueError:
        return
    parts = fill(template, **values)
    assert sum(not trusted for _, trusted in parts) == template.count("{") - 2 * template.count("{{")


@settings(max_examples=100, deadline=None)
@given(template=st.text(max_size=30))
def test_check_template_raises_only_value_error(template):
    try:
        check_template(template, {"text", "title"}, "text")
    except ValueError:
        pass

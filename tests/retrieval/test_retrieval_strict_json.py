"""`retrieval.strict_json` and document ids: JSON that would break a UTF-8 encoder or the
stack is refused with the place named; ids are NFC and at most 256 characters."""

from __future__ import annotations

import json

import pytest

from retrieval.document import MAX_DOCUMENT_ID_CHARS, Document, normalize_document_id
from retrieval.errors import InvalidInputError, MalformedItemError, MalformedLineError
from retrieval.formats import parse_json, parse_jsonl, read_documents
from retrieval.strict_json import JSONInputError, MAX_DEPTH, format_path, lone_surrogate, loads


@pytest.mark.parametrize("text,path,reason", [
    ('{"a": [1, "x\\ud800"]}', ("a", 1), "surrogate"),
    ('{"a": {"b\\udc00": 1}}', ("a",), "key"),
    ('["ok", "\\udbff\\udbff"]', (1,), "surrogate"),  # two high surrogates are not a pair
    ("[" * (MAX_DEPTH + 1) + "]" * (MAX_DEPTH + 1), (), "nested deeper"),
    ("[" * 100_000 + "]" * 100_000, (), "nested deeper"),
    ('{"n": ' + "7" * 5000 + "}", (), "digits"),
    ('{"a": ', (), "malformed JSON"),
], ids=["string", "key", "two-highs", "limit+1", "100k", "long-int", "malformed"])
def test_loads_refuses_with_the_place(text, path, reason):
    with pytest.raises(JSONInputError) as caught:
        loads(text.encode())
    assert caught.value.path == path and reason in caught.value.reason


def test_loads_accepts_what_json_does_within_the_limits():
    deepest = "[" * MAX_DEPTH + "]" * MAX_DEPTH
    assert loads(deepest) == json.loads(deepest)
    assert loads('{"emoji": "\\ud83d\\ude00", "text": "caf\u00e9"}'.encode()) == {"emoji": "\U0001F600", "text": "caf\u00e9"}
    assert loads("\ufeff[1]".encode()) == [1]  # a UTF-8 byte-order mark is dropped


@pytest.mark.parametrize("data", [b'"\xed\xa0\x80"', b'"\xff"', '"x"'.encode("utf-16")], ids=["encoded-surrogate", "ff", "utf-16"])
def test_loads_takes_utf8_only(data):
    with pytest.raises(JSONInputError, match="not UTF-8"):
        loads(data)


def test_paths_and_surrogates():
    assert format_path(("messages", 0, "content")) == "messages[0].content"
    assert format_path(()) == "body" and format_path((2, "text")) == "[2].text"
    assert format_path(("k" * 100,)) == "k" * 64 + "…"
    assert lone_surrogate("ok \U0001F600") == -1 and lone_surrogate("ab\udc00") == 2


def test_document_ids_are_nfc_and_bounded():
    assert Document("cafe\u0301", "text").document_id == "caf\u00e9" == normalize_document_id("caf\u00e9")
    assert len(Document("x" * MAX_DOCUMENT_ID_CHARS, "text").document_id) == MAX_DOCUMENT_ID_CHARS
    with pytest.raises(InvalidInputError, match="at most 256") as caught:
        Document("x" * 100_000, "text")
    assert len(str(caught.value)) < 100  # the id is not repeated
    for bad in ({"document_id": "a\ud800"}, {"text": "t\ud800"}, {"title": "\udc00"}):
        with pytest.raises(InvalidInputError, match="surrogate"):
            Document(**({"document_id": "a", "text": "t"} | bad))


def test_json_documents_name_the_item_and_field():
    with pytest.raises(MalformedItemError) as caught:
        parse_json(b'[{"id": "a", "text": "t"}, {"id": "b", "text": "\\ud800"}]')
    assert (caught.value.item, caught.value.field) == (1, "text")
    with pytest.raises(MalformedItemError) as caught:
        parse_json(json.dumps({"id": "i" * 300, "text": "t"}).encode())
    assert (caught.value.item, caught.value.field) == (None, "id")
    with pytest.raises(MalformedItemError) as caught:
        parse_json(json.dumps([{"id": "cafe\u0301", "text": "a"}, {"id": "caf\u00e9", "text": "b"}]).encode())
    assert (caught.value.item, caught.value.field) == (1, "id") and "duplicate" in caught.value.reason


def test_jsonl_lines_too_deep_or_with_surrogates_are_named():
    deep = '{"id": "d", "text": "t", "meta": ' + "[" * 5000 + "]" * 5000 + "}"
    for body, words in [(f'{{"id": "a", "text": "t"}}\n{deep}\n', "nested deeper"),
                        ('{"id": "a", "text": "t\\ud800"}\n', "surrogate"),
                        ('{"id": "a", "text": "t"\n', "invalid JSON")]:
        with pytest.raises(MalformedLineError) as caught:
            parse_jsonl(body.encode())
        assert words in caught.value.reason, caught.value


def test_html_declaring_a_codec_that_makes_surrogates_is_refused():
    page = b'<html><head><meta charset="unicode_escape"></head><body><p>a\\ud800b \xff</p></body></html>'  # \xff: not UTF-8
    with pytest.raises(InvalidInputError, match="surrogate"):
        read_documents(page, "page.html", "page.html", "page.html")

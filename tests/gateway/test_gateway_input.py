"""Hostile input against a live server: every bad value is a 400 naming the field in the
documented shape, never a 5xx or a `failure` event in a stream.

Lone UTF-16 surrogates in any text field, seeds outside 64 bits, JSON nested past the limit or
not UTF-8, long or non-NFC document ids, and huge values echoed into error messages. Also the
/query stream's event ids, keep-alive comments and probes logged at debug level.
"""

from __future__ import annotations

import json
import logging
import time

import httpx
import pytest

from app.http.sse import KEEPALIVE, parse

import gateways

CORPUS = [{"id": "city-varo", "title": "Varo", "text": "Varo is a city on the river Alna. Its mayor is Ines Kell."},
          {"id": "firm-brill", "title": "Brill", "text": "Brill is a company founded by Tam Oke in 1999."}]
SURROGATE = "\\ud800"  # as written in JSON: a lone high surrogate
DEEP = "[" * 100_000 + "]" * 100_000


@pytest.fixture(scope="module")
def server(tiny_tokenizer, tmp_path_factory):
    with gateways.gateway(tmp_path_factory.mktemp("gateway-input"), tiny_tokenizer, CORPUS, max_new_tokens=64, sse_keepalive_s=0.001) as live:
        yield live


@pytest.fixture()
def client(server):
    with httpx.Client(base_url=server.url, timeout=60, headers={"X-Requested-With": "test"}) as c:  # form uploads need it without a key
        yield c


def refused(r: httpx.Response, param: str, status: int = 400) -> str:
    """The message of a `status` error naming `param` in the documented shape."""
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["param"] == param and error["message"].startswith(f"{param}: "), error
    return error["message"]


def post_json(client: httpx.Client, path: str, text: str, **kwargs) -> httpx.Response:
    """POST `text` as it is (escapes and all) as a JSON body."""
    return client.post(path, content=text.encode(), headers={"content-type": "application/json"}, **kwargs)


CHAT = '{"model": "tiny", "max_tokens": 2, "messages": [{"role": "user", "content": %s}]}'


@pytest.mark.parametrize("path,body,param", [
    ("/query", '{"question": "who\\ud800?", "max_tokens": 2}', "question"),
    ("/query", '{"question": "who\\ud800?", "max_tokens": 2, "stream": true}', "question"),
    ("/query", '{"question": "who?", "document_ids": ["city-varo", "x\\udfff"]}', "document_ids[1]"),
    ("/v1/chat/completions", CHAT % '"hi \\ud800"', "messages[0].content"),
    ("/v1/chat/completions", CHAT % '[{"type": "text", "text": "\\udc00"}]', "messages[0].content[0].text"),
    ("/v1/chat/completions", '{"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "segments": ["ok", "\\ud800"]}', "segments[1]"),
    ("/v1/completions", '{"model": "tiny", "prompt": "x\\ud800", "max_tokens": 2}', "prompt"),
    ("/v1/completions", '{"model": "tiny", "prompt": ["x\\ud800"], "max_tokens": 2, "stream": true}', "prompt[0]"),
    ("/v1/completions", '{"model": "tiny", "prompt": "x", "user": "\\ud800"}', "user"),  # an ignored field too
    ("/search", '{"query": "\\ud800"}', "query"),
    ("/documents", '{"id": "s1", "text": "x\\ud800"}', "body.text"),
    ("/documents", '{"id": "s\\ud800", "text": "x"}', "body.id"),
    ("/documents", '[{"id": "s1", "text": "fine"}, {"id": "s2", "text": "x", "title": "\\udbff"}]', "body[1].title"),
], ids=["query", "query-stream", "document-ids", "chat", "chat-part", "segments", "prompt", "prompt-stream", "extra-field",
        "search", "document-text", "document-id", "document-title"])
def test_lone_surrogates_are_400s_naming_the_field(client, path, body, param):
    refused(post_json(client, path, body), param)
    assert client.get("/health").status_code == 200


def test_lone_surrogates_in_jsonl_keys_raw_bytes_and_multipart(client):
    jsonl = '{"id": "ok", "text": "fine"}\n{"id": "s1", "text": "x\\ud800"}\n'
    message = refused(client.post("/documents", content=jsonl, headers={"content-type": "application/jsonl"}), "body")
    assert "line 2" in message and "surrogate" in message
    refused(post_json(client, "/query", '{"question": "q", "\\ud800": 1}'), "body")  # in a key
    raw = client.post("/query", content=b'{"question": "\xed\xa0\x80"}', headers={"content-type": "application/json"})
    assert "UTF-8" in refused(raw, "body")  # a surrogate encoded as UTF-8 bytes is not UTF-8
    upload = client.post("/documents", files={"file": ("docs.jsonl", b'{"id": "s1", "text": "x\\udc00"}\n')})
    assert "surrogate" in refused(upload, "file")
    # A multipart body may name its charset; UTF-7 decodes "+2AA-" to a lone surrogate.
    form = (b"--b\r\nContent-Disposition: form-data; name=\"id\"\r\n\r\n+2AA-\r\n"
            b"--b\r\nContent-Disposition: form-data; name=\"file\"; filename=\"a.txt\"\r\n\r\nsome text\r\n--b--\r\n")
    refused(client.post("/documents", content=form, headers={"content-type": "multipart/form-data; boundary=b; charset=utf-7"}), "id")
    ids = {d["document_id"] for d in client.get("/documents").json()["data"]}
    assert {"s1", "ok"}.isdisjoint(ids)  # nothing of a refused body was stored


@pytest.mark.parametrize("seed", [2**64, -1, 10**30], ids=["2**64", "-1", "10**30"])
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_seed_outside_64_bits_is_a_400(client, seed, stream):
    refused(client.post("/query", json={"question": "q", "max_tokens": 2, "temperature": 1, "seed": seed, "stream": stream}), "seed")
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "q"}], "max_tokens": 2, "seed": seed, "stream": stream}
    refused(client.post("/v1/chat/completions", json=chat), "seed")
    refused(client.post("/v1/completions", json={"model": "tiny", "prompt": "q", "max_tokens": 2, "seed": seed, "stream": stream}), "seed")


@pytest.mark.parametrize("mode", ["", "  "], ids=["empty", "blank"])
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_an_empty_mode_is_a_400_naming_mode_not_the_default(client, mode, stream):
    refused(client.post("/query", json={"question": "q", "max_tokens": 2, "mode": mode, "stream": stream}), "mode")
    refused(client.get("/query", params={"question": "q", "max_tokens": 2, "mode": mode, "stream": stream}), "mode")
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "q"}], "max_tokens": 2, "mode": mode, "stream": stream}
    refused(client.post("/v1/chat/completions", json=chat), "mode")
    refused(client.post("/v1/completions", json={"model": "tiny", "prompt": "q", "max_tokens": 2, "mode": mode,
                                                 "stream": stream}), "mode")


def test_largest_seed_samples_reproducibly(client):
    body = {"question": "Who founded Brill?", "max_tokens": 4, "temperature": 1.0, "seed": 2**64 - 1}
    first, second = client.post("/query", json=body), client.post("/query", json=body)
    assert first.status_code == 200, first.text
    assert first.json()["answer"] == second.json()["answer"]


def test_completion_max_tokens_null_means_the_servers_limit(client):
    r = client.post("/v1/completions", json={"model": "tiny", "prompt": "Varo is", "max_tokens": None, "temperature": 0})
    assert r.status_code == 200, r.text
    assert 0 <= r.json()["usage"]["completion_tokens"] <= 64  # max_new_tokens


@pytest.mark.parametrize("body", [DEEP, '{"question": %s}' % ("[" * 200 + "]" * 200), '{"question": "q", "seed": %s}' % ("9" * 5000)],
                         ids=["100k-arrays", "deep-field", "5000-digit-int"])
def test_deep_or_unreadable_json_bodies_are_400s_naming_the_body(client, body):
    message = refused(post_json(client, "/query", body), "body")
    assert "nested deeper than" in message or "digits" in message


def test_invalid_utf8_and_malformed_json_have_the_documented_shape(client):
    assert "not UTF-8" in refused(client.post("/query", content=b'{"question": "\xff"}', headers={"content-type": "application/json"}), "body")
    assert "malformed JSON" in refused(post_json(client, "/query", '{"question": '), "body")


def test_deep_documents_are_400s_naming_the_line_or_item(client):
    jsonl = '{"id": "ok", "text": "fine"}\n{"id": "d", "text": "x", "meta": %s}\n' % DEEP
    message = refused(client.post("/documents", content=jsonl, headers={"content-type": "application/jsonl"}), "body")
    assert "line 2" in message and "nested deeper than" in message
    assert "nested deeper than" in refused(post_json(client, "/documents", DEEP), "body")
    upload = client.post("/documents", files={"file": ("deep.jsonl", jsonl.encode())})
    assert "line 2" in refused(upload, "file")


def test_document_ids_are_bounded(client):
    long_id = "x" * 100_000
    message = refused(post_json(client, "/documents", json.dumps({"id": long_id, "text": "t"})), "body.id")
    assert "256" in message and len(message) < 300
    refused(client.post("/documents", params={"id": "y" * 257}, content="# T\n\nbody", headers={"content-type": "text/markdown"}), "id")
    refused(client.post("/documents", files={"file": ("a.txt", b"text")}, data={"id": "z" * 257}), "id")
    refused(client.post("/documents", files={"file": ("n" * 300 + ".txt", b"text")}), "file")
    in_url = "x" * 1000  # a URL of 100 KB would meet the limit on a request's head first
    for r in (client.get(f"/documents/{in_url}"), client.delete(f"/documents/{in_url}")):
        assert len(refused(r, "document_id")) < 300
    assert len(refused(client.post("/search", json={"query": "q", "document_ids": [long_id]}), "document_ids")) < 300
    ok = client.post("/documents", params={"id": "w" * 256}, content="# T\n\nbody", headers={"content-type": "text/markdown"})
    assert ok.status_code == 201, ok.text


def test_document_ids_are_one_document_whether_composed_or_decomposed(client):
    composed, decomposed = "caf\u00e9-notes", "cafe\u0301-notes"
    r = client.post("/documents", json={"id": decomposed, "text": "The cafe on the Alna serves tea."})
    assert r.status_code == 201 and r.json()["document_ids"] == [composed]
    again = client.post("/documents", json={"id": composed, "text": "The cafe on the Alna serves coffee."})
    assert again.json()["replaced"] == 1
    assert client.get(f"/documents/{decomposed}").json()["document_id"] == composed
    hits = client.post("/search", json={"query": "cafe coffee", "document_ids": [decomposed]}).json()["data"]
    assert [h["document_id"] for h in hits] == [composed]
    page = client.get("/documents", params={"after": "cafe\u0301", "limit": 1}).json()  # "café" < "café-notes"
    assert page["first_id"] == composed
    duplicate = client.post("/documents", json=[{"id": composed, "text": "a"}, {"id": decomposed, "text": "b"}])
    assert "duplicate" in refused(duplicate, "body[1].id")
    assert client.delete(f"/documents/{decomposed}").json()["document_id"] == composed


def test_echoed_input_is_clipped_in_error_messages(client):
    big = "m" * 1_000_000
    r = client.post("/v1/completions", json={"model": big, "prompt": "x"})
    assert r.status_code == 404 and len(r.content) < 1000 and "..." in r.json()["error"]["message"]
    r = client.post("/v1/chat/completions", json={"model": "tiny", "messages": [{"role": "user", "content": "q"}], "tools": [big]})
    assert len(refused(r, "tools")) < 500
    r = client.post("/query", json={"question": "q", big: 1})  # an unknown field's name is echoed as its param
    assert r.status_code == 400 and len(r.content) < 1000
    r = client.post("/query", json={"question": "q", "mode": big, "max_tokens": 2})
    assert len(refused(r, "mode")) < 500


def test_query_stream_numbers_its_events_and_fills_silences_with_comments(client):
    with client.stream("POST", "/query", json={"question": "Who founded Brill?", "max_tokens": 6, "stream": True}) as r:
        assert r.status_code == 200
        text = r.read().decode()
    messages = [m for m in text.split("\n\n") if m]
    assert KEEPALIVE.strip() in messages  # sse_keepalive_s=0.001: prefill alone is longer
    events = [m for m in messages if not m.startswith(":")]
    assert [line for m in events for line in m.split("\n") if line.startswith("id:")] == [f"id: {i}" for i in range(1, len(events) + 1)]
    names = [name for name, _ in parse(text.split("\n"))]
    assert names[0] == "sources" and names[-1] == "done"


def test_probes_are_logged_at_debug_level(client, caplog):
    with caplog.at_level(logging.DEBUG, logger="hypic.access"):
        client.get("/ready")
        client.get("/health")
        client.get("/documents")
        deadline = time.monotonic() + 5  # the access line is written just after the response is sent
        while len([r for r in caplog.records if r.name == "hypic.access"]) < 3 and time.monotonic() < deadline:
            time.sleep(0.01)
    levels = {r.path: r.levelno for r in caplog.records if r.name == "hypic.access"}
    assert levels == {"/ready": logging.DEBUG, "/health": logging.DEBUG, "/documents": logging.INFO}

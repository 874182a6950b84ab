"""Sizes, counts, timing and disconnects against a live server: what a hostile or careless client
sends that is well-formed but too much.

- Text is tokenized on a thread of anyio's pool, never on the event loop, so /health (and every other
  request) answers while a large prompt is tokenized.
- Before anything is tokenized, the request's text is bounded (`max_text_bytes`, the fields
  together), and so are the counts of messages, segments and stop strings and the bytes of the
  stop strings: each a 400 naming the field.
- A client that disconnects before its body is complete is counted as 499, not 500, and is
  not logged as an error.
"""

from __future__ import annotations

import logging
import re
import socket
import threading
import time

import httpx
import pytest

import gateways

CORPUS = [{"id": "city-varo", "title": "Varo", "text": "Varo is a city on the river Alna. Its mayor is Ines Kell."}]
LIMITS = dict(max_text_bytes=20_000, max_messages=50, max_segments=8, max_stop_strings=4, max_stop_bytes=64, max_document_ids=16)


@pytest.fixture(scope="module")
def server(tiny_tokenizer, tmp_path_factory):
    with gateways.gateway(tmp_path_factory.mktemp("gateway-limits"), tiny_tokenizer, CORPUS, max_new_tokens=16, **LIMITS) as live:
        yield live


def chat(content: str = "hi", **extra) -> dict:
    return {"model": "tiny", "max_tokens": 2, "messages": [{"role": "user", "content": content}], **extra}


def refused(r: httpx.Response, param: str, code: str) -> str:
    assert r.status_code == 400, r.text[:300]
    error = r.json()["error"]
    assert (error["param"], error["code"]) == (param, code) and error["message"].startswith(f"{param}: "), error
    return error["message"]


# --- the event loop is never busy tokenizing -----------------------------------------------
class HeldTokenizer:
    """The engine's tokenizer, except that encoding a text holding `MARK` waits until `release`
    (at most 20 s): a tokenization that takes as long as the test likes."""

    MARK = "HELD"

    def __init__(self, tokenizer) -> None:
        self._tokenizer = tokenizer
        self.entered = threading.Event()
        self.release = threading.Event()

    def encode(self, text, *args, **kwargs):
        if self.MARK in text:
            self.entered.set()
            self.release.wait(20)
        return self._tokenizer.encode(text, *args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._tokenizer, name)


@pytest.mark.parametrize("path,body", [
    ("/v1/completions", {"model": "tiny", "prompt": "HELD words", "max_tokens": 2}),
    ("/v1/chat/completions", chat("HELD words")),
    ("/query", {"question": "HELD words", "max_tokens": 2}),
], ids=["completions", "chat", "query"])
def test_health_answers_while_a_request_is_tokenized(server, path, body):
    """Before: the prompt was tokenized on the event loop, so while an 8 MB prompt was
    tokenized (20 s) /health and every other request waited. Here the tokenization takes
    until /health has answered; on the loop, /health would wait for it (up to 20 s)."""
    encoder = server.server.config.app.state.runtime.prompter.encoder
    held = encoder.tokenizer = HeldTokenizer(encoder.tokenizer)
    answers: list[httpx.Response] = []
    worker = threading.Thread(target=lambda: answers.append(httpx.post(server.url + path, json=body, timeout=60)))
    try:
        worker.start()
        assert held.entered.wait(10), "the request was never tokenized"
        started = time.monotonic()
        health = httpx.get(f"{server.url}/health", timeout=5)
        waited = time.monotonic() - started
        assert health.status_code == 200 and waited < 2.0, waited
        assert worker.is_alive()  # the held request is still being tokenized
    finally:
        held.release.set()
        worker.join(30)
        encoder.tokenizer = held._tokenizer
    assert answers and answers[0].status_code == 200, answers and answers[0].text[:300]


# --- sizes and counts, checked before tokenizing --------------------------------------------
BIG = "Varo is a city. " * 1300  # 20,800 bytes: past max_text_bytes (20,000) alone


@pytest.mark.parametrize("path,body,param,code", [
    ("/v1/completions", {"model": "tiny", "prompt": BIG, "max_tokens": 2}, "prompt", "text_too_long"),
    ("/v1/completions", {"model": "tiny", "prompt": [BIG], "max_tokens": 2}, "prompt[0]", "text_too_long"),
    ("/v1/completions", {"model": "tiny", "prompt": "hi", "segments": ["a" * 12_000, "b" * 12_000]}, "segments[1]", "text_too_long"),
    ("/v1/chat/completions", chat(BIG), "messages[0].content", "text_too_long"),
    ("/v1/chat/completions", {**chat(), "messages": [{"role": "user", "content": "x" * 15_000}] * 2}, "messages[1].content",
     "text_too_long"),
    ("/v1/chat/completions", {**chat(), "messages": [{"role": "user", "content": [{"type": "text", "text": BIG}]}]},
     "messages[0].content", "text_too_long"),
    ("/v1/chat/completions", chat("x" * 15_000, segments=["y" * 6_000]), "segments[0]", "text_too_long"),
    ("/v1/chat/completions", {**chat(), "messages": [{"role": "user", "content": ""}] * 50_000}, "messages", "too_many_items"),
    ("/v1/chat/completions", chat(segments=["s"] * 9), "segments", "too_many_items"),
    ("/v1/chat/completions", chat(stop=["a", "b", "c", "d", "e"]), "stop", "too_many_items"),
    ("/v1/completions", {"model": "tiny", "prompt": "hi", "stop": ["x" * 40, "y" * 40]}, "stop", "too_many_items"),
    ("/v1/completions", {"model": "tiny", "prompt": "hi", "stop": "é" * 33}, "stop", "too_many_items"),  # 66 bytes
    ("/query", {"question": BIG}, "question", "text_too_long"),
    ("/search", {"query": BIG}, "query", "text_too_long"),
    ("/search", {"query": "Varo", "document_ids": ["city-varo"] * 17}, "document_ids", "too_many_items"),
    ("/query", {"question": "Varo?", "document_ids": ["city-varo"] * 100_000}, "document_ids", "too_many_items"),
    ("/v1/chat/completions", chat(rag={"document_ids": ["city-varo"] * 17}), "rag.document_ids", "too_many_items"),
], ids=["prompt", "prompt-list", "segments-total", "chat", "messages-total", "chat-part", "chat-segments", "50000-messages",
        "segment-count", "stop-count", "stop-bytes", "stop-string-bytes", "question", "search",
        "search-document-ids", "query-100000-document-ids", "chat-rag-document-ids"])
def test_too_much_is_a_400_naming_the_field(server, path, body, param, code):
    """Before: each was tokenized first (the prompt ones then failed the context check, after
    ~0.6 s per MB on the event loop; 50,000 empty messages took 8.9 s), or accepted (stop
    strings: 1,000 of them made an answer 2.6x slower, 10,000 took 131 s; document_ids: 500,000
    of them, 3 MB, took 2.7 s of retrieval)."""
    started = time.monotonic()
    refused(httpx.post(server.url + path, json=body, timeout=60), param, code)
    assert time.monotonic() - started < 5


def test_limits_are_inclusive(server):
    """At each limit, the request is served."""
    ok = [("/v1/chat/completions", chat(stop=["a", "b", "c", "d"], segments=["s"] * 8)),
          ("/v1/chat/completions", {**chat(), "messages": [{"role": "user", "content": "hi"}] * 50}),
          ("/v1/completions", {"model": "tiny", "prompt": "hi", "max_tokens": 2, "stop": ["x" * 32, "y" * 32]}),
          ("/search", {"query": "Varo " * 4000}),  # 20,000 bytes
          ("/search", {"query": "Varo", "document_ids": ["city-varo"] * 16})]
    for path, body in ok:
        r = httpx.post(server.url + path, json=body, timeout=60)
        assert r.status_code == 200, (path, r.text[:300])


# --- document fields echoed in every listing ------------------------------------------------
HEADERS = {"X-Requested-With": "test"}


@pytest.mark.parametrize("method,path,kwargs,param", [
    ("POST", "/documents", dict(json={"id": "long-title", "text": "t", "title": "T" * 513}), "body.title"),
    ("POST", "/documents", dict(json=[{"id": "a", "text": "t"}, {"id": "b", "text": "t", "source": "s" * 1025}]), "body[1].source"),
    ("POST", "/documents?id=plain&title=" + "T" * 513, dict(content=b"some text", headers={"Content-Type": "text/plain"}), "title"),
    ("POST", "/documents", dict(files={"file": ("a.txt", b"some text")}, data={"title": "T" * 513}), "title"),
    ("GET", "/documents?after=" + "a" * 257, {}, "after"),
], ids=["json-title", "json-source", "text-title", "form-title", "after"])
def test_document_fields_are_bounded(server, method, path, kwargs, param):
    """Before: title, source and ?after= took any length (a 1 MB title was stored and echoed in
    every listing and search hit; a 1 MB `after` was accepted). Now a client's title past 512
    characters, source past 1024 or `after` past 256 (the longest id) is a 400 naming it."""
    headers = HEADERS | kwargs.pop("headers", {})
    r = httpx.request(method, server.url + path, headers=headers, timeout=30, **kwargs)
    assert r.status_code == 400, r.text[:300]
    error = r.json()["error"]
    assert error["param"] == param and error["message"].startswith(f"{param}: ") and len(r.content) < 1000, error
    at_limit = {"POST": dict(json={"id": "at-limit", "text": "t", "title": "T" * 512, "source": "s" * 1024})}
    assert httpx.post(server.url + "/documents", headers=HEADERS, timeout=30, **at_limit["POST"]).status_code == 201
    assert httpx.get(server.url + "/documents", params={"after": "a" * 256}, timeout=30).status_code == 200


def test_derived_titles_and_sources_are_cut_not_refused(server):
    """A title or source the gateway derives (a Markdown heading, an uploaded file's name) is cut
    to its limit: the upload is not the client's field, so it is not refused for it."""
    files = {"file": ("n" * 2000 + ".md", b"# " + b"H" * 5000 + b"\n\nVaro has a harbour.")}
    r = httpx.post(server.url + "/documents", headers=HEADERS, files=files, data={"id": "long-heading"}, timeout=30)
    assert r.status_code == 201, r.text[:300]
    doc = httpx.get(server.url + "/documents/long-heading", timeout=30).json()
    assert (len(doc["title"]), len(doc["source"])) == (512, 1024) and doc["title"].endswith("…")
    listing = httpx.get(server.url + "/documents", params={"limit": 1000}, timeout=30).json()["data"]
    assert max(len(d["title"]) for d in listing) <= 512 and max(len(d["source"]) for d in listing) <= 1024


# --- a client leaving mid-body ------------------------------------------------------------
def requests_by_status(server, route: str) -> dict[str, float]:
    text = httpx.get(f"{server.url}/metrics").text
    found = re.findall(r'hypic_requests_total\{([^}]*)\} ([0-9.e+]+)', text)
    out = {}
    for labels, value in found:
        if f'route="{route}"' in labels:
            out[re.search(r'status="(\d+)"', labels).group(1)] = float(value)
    return out


FORM_HEAD = 'multipart/form-data; boundary=b'


@pytest.mark.parametrize("path,content_type", [
    ("/query", "application/json"), ("/v1/chat/completions", "application/json"), ("/v1/completions", "application/json"),
    ("/search", "application/json"), ("/documents", "application/json"), ("/documents", FORM_HEAD),
], ids=["query", "chat", "completions", "search", "documents", "documents-multipart"])
def test_a_client_leaving_mid_body_is_a_499_not_a_logged_500(server, path, content_type, caplog):
    """Before: Starlette's ClientDisconnect escaped every POST route: a logged 500 with a
    traceback per connection (1,000 connections: 1,000 500s and 4 MB of log), and anyone could
    inflate the 5xx count. Now it is counted as 499 and logged at info level, no traceback."""
    before = requests_by_status(server, path)
    partial = b'--b\r\nContent-Disposition: form-data; name="file"; filename="a.txt"\r\n\r\nsome' if "multipart" in content_type \
        else b'{"question": "who'
    head = (f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: {content_type}\r\nX-Requested-With: t\r\n"
            f"Content-Length: 1000\r\n\r\n").encode()
    with caplog.at_level(logging.INFO):
        for _ in range(3):
            with socket.create_connection(("127.0.0.1", server.port), timeout=10) as s:
                s.sendall(head + partial)
                time.sleep(0.05)
        deadline = time.monotonic() + 10
        while requests_by_status(server, path).get("499", 0) < before.get("499", 0) + 3 and time.monotonic() < deadline:
            time.sleep(0.05)
    after = requests_by_status(server, path)
    assert after.get("499", 0) == before.get("499", 0) + 3, after
    assert after.get("500", 0) == before.get("500", 0), after
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING], [r.getMessage() for r in caplog.records]
    assert httpx.get(f"{server.url}/health").status_code == 200


def test_the_limits_are_in_the_settings_table():
    """docs/api.md names every limit's setting and default."""
    from pathlib import Path

    table = (Path(__file__).parents[2] / "docs" / "api.md").read_text()
    for name in ("MAX_TEXT_BYTES", "MAX_MESSAGES", "MAX_SEGMENTS", "MAX_DOCUMENT_IDS", "MAX_STOP_STRINGS", "MAX_STOP_BYTES",
                 "BODY_DEADLINE_S"):
        assert f"`HYPIC_{name}`" in table, name


def test_a_body_refused_before_routing_is_counted_under_its_route(server):
    """A body declared over `max_body_bytes` is answered 413 before routing. Before: counted as
    route="unmatched", with the 404s; now under the route its path names. A path no route has
    stays "unmatched"."""
    from urllib.parse import urlsplit

    before = requests_by_status(server, "/query").get("413", 0.0)
    address = urlsplit(server.url)
    with socket.create_connection((address.hostname, address.port), timeout=30) as s:
        s.sendall(b"POST /query HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                  b"Content-Length: 999999999999\r\nConnection: close\r\n\r\n")
        reply = s.recv(65536)
    assert reply.startswith(b"HTTP/1.1 413"), reply[:200]
    assert requests_by_status(server, "/query").get("413", 0.0) == before + 1
    unmatched = requests_by_status(server, "unmatched").get("404", 0.0)
    assert httpx.get(server.url + "/no/such/route", timeout=30).status_code == 404
    assert requests_by_status(server, "unmatched").get("404", 0.0) == unmatched + 1
    assert "413" not in requests_by_status(server, "unmatched")

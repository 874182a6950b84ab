"""POST /query (JSON and SSE), the documents endpoints and bad input, against a live uvicorn server.

The engine is a tiny random model (answers are noise), so tests check the protocol: shapes,
event order, determinism of greedy answers, cache reuse, and 4xx errors naming the field.
"""

from __future__ import annotations

import json

import httpx
import pytest

from app.http.sse import parse

import gateways

CORPUS = [
    {"id": "city-varo", "title": "Varo", "text": "Varo is a city on the river Alna. Its mayor is Ines Kell."},
    {"id": "firm-brill", "title": "Brill", "text": "Brill is a company founded by Tam Oke in 1999."},
    {"id": "river-alna", "title": "Alna", "text": "The Alna is a river that flows into the sea near Varo."},
    {"id": "cafe", "title": "Cafe", "text": "The cafe opened in 1999; naive emigres came to it."},
]


@pytest.fixture(scope="module")
def server(tiny_tokenizer, tmp_path_factory):
    with gateways.gateway(tmp_path_factory.mktemp("gateway-query"), tiny_tokenizer, CORPUS, max_top_k=8, max_new_tokens=256) as live:
        yield live


@pytest.fixture()
def client(server):
    with httpx.Client(base_url=server.url, timeout=30) as c:
        yield c


def sse_events(client: httpx.Client, body: dict) -> list[tuple[str, dict]]:
    with client.stream("POST", "/query", json=body) as response:
        assert response.status_code == 200, response.read()
        assert response.headers["content-type"].startswith("text/event-stream")
        return [(name, json.loads(data)) for name, data in parse(response.iter_lines())]


def test_corpus_is_ingested_at_startup(client):
    ids = {d["document_id"] for d in client.get("/documents").json()["data"]}
    assert {d["id"] for d in CORPUS} <= ids


def test_query_returns_answer_sources_usage_timings(client):
    r = client.post("/query", json={"question": "Who is the mayor of Varo?", "top_k": 2, "max_tokens": 6})
    assert r.status_code == 200, r.text
    body = r.json()
    assert set(body) >= {"answer", "sources", "usage", "timings"}
    assert len(body["sources"]) == 2
    assert body["sources"][0]["document_id"] == "city-varo"  # hashing embedder: most shared words
    assert set(body["sources"][0]) == {"chunk_id", "document_id", "title", "score", "text", "collection"}
    assert body["usage"]["completion_tokens"] <= 6 and body["usage"]["prompt_tokens"] > 0
    assert set(body["timings"]) == {"retrieval_ms", "prefill_ms", "ttft_ms", "total_ms"}
    assert 0 < body["timings"]["ttft_ms"] <= body["timings"]["total_ms"]
    assert r.headers["x-request-id"]


def test_sse_events_in_order_and_match_non_streaming_answer(client):
    body = {"question": "Who founded Brill?", "top_k": 3, "max_tokens": 12, "mode": "hypic"}
    events = sse_events(client, {**body, "stream": True})
    names = [name for name, _ in events]
    assert names[0] == "sources" and names[-1] == "done"
    assert set(names[1:-1]) <= {"delta"} and names.count("sources") == 1
    assert len(events[0][1]["sources"]) == 3
    done = events[-1][1]
    assert done["finish_reason"] in ("stop", "length")
    assert done["usage"]["completion_tokens"] >= 1 and done["timings"]["ttft_ms"] > 0
    streamed = "".join(data["text"] for name, data in events if name == "delta")
    assert streamed == client.post("/query", json=body).json()["answer"]  # greedy: same answer


def test_get_query_streams_sse_for_event_source(client):
    params = {"question": "Who founded Brill?", "top_k": 2, "max_tokens": 4, "document_ids": ["firm-brill", "cafe"]}
    with client.stream("GET", "/query", params=params) as response:
        assert response.status_code == 200 and response.headers["content-type"].startswith("text/event-stream")
        events = [(name, json.loads(data)) for name, data in parse(response.iter_lines())]
    assert events[0][0] == "sources" and events[-1][0] == "done"
    assert {s["document_id"] for s in events[0][1]["sources"]} == {"firm-brill", "cafe"}
    bad = client.get("/query", params={"question": "q", "top_k": "x"})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "top_k"


def test_repeat_request_reuses_cached_segments_and_full_mode_does_not(client):
    body = {"question": "When did the cafe open?", "top_k": 3, "max_tokens": 4, "mode": "hypic"}
    first = client.post("/query", json=body).json()
    second = client.post("/query", json=body).json()
    assert second["usage"]["composed_tokens"] > 0 and second["usage"]["cached_tokens"] > 0  # chunks; the system prompt
    assert second["usage"]["composed_tokens"] >= first["usage"]["composed_tokens"]
    assert second["answer"] == first["answer"]  # cold and warm give the same tokens
    full = client.post("/query", json={**body, "mode": "full"}).json()
    assert full["usage"]["cached_tokens"] == full["usage"]["composed_tokens"] == full["usage"]["seam_tokens"] == 0


def test_a_recompute_budget_recomputes_more_of_the_documents(client):
    """`recompute` (the query-aware budget): 1.0 recomputes every document in context (the answer is full's),
    a share recomputes more seam tokens than the default and composes fewer."""
    body = {"question": "Who founded Brill?", "top_k": 3, "max_tokens": 4, "mode": "hypic"}
    client.post("/query", json=body)  # the documents' entries are cached
    plain = client.post("/query", json=body).json()["usage"]
    some = client.post("/query", json={**body, "recompute": 0.5}).json()["usage"]
    assert some["seam_tokens"] > plain["seam_tokens"] and some["composed_tokens"] < plain["composed_tokens"]
    everything = client.post("/query", json={**body, "recompute": 1.0}).json()
    assert everything["usage"]["composed_tokens"] == 0
    assert everything["answer"] == client.post("/query", json={**body, "mode": "full"}).json()["answer"]


def test_document_ids_restrict_retrieval(client):
    body = client.post("/query", json={"question": "mayor of Varo", "document_ids": ["firm-brill"], "max_tokens": 2}).json()
    assert [s["document_id"] for s in body["sources"]] == ["firm-brill"]


def test_documents_add_list_delete(client):
    jsonl = '{"id": "doc-a", "text": "Alpha text about Kell."}\n{"id": "doc-b", "title": "B", "text": "Beta text."}\n'
    r = client.post("/documents", content=jsonl, headers={"content-type": "application/jsonl"})
    assert r.status_code == 201, r.text
    assert r.json()["documents"] == 2 and r.json()["document_ids"] == ["doc-a", "doc-b"]
    r = client.post("/documents?id=notes/c.md", content="# Gamma\n\nGamma body.", headers={"content-type": "text/markdown"})
    assert r.status_code == 201, r.text
    listed = {d["document_id"]: d for d in client.get("/documents").json()["data"]}
    assert listed["notes/c.md"]["title"] == "Gamma" and listed["doc-a"]["chunks"] == 1
    assert client.delete("/documents/notes/c.md").json() == {"document_id": "notes/c.md", "deleted": True, "chunks": 1, "collection": "default"}
    missing = client.delete("/documents/notes/c.md")
    assert missing.status_code == 404 and missing.json()["error"]["param"] == "document_id"


@pytest.mark.parametrize("content,ctype,param,status", [
    ('{"id": "x", "text": "ok"}\n{"id": 3}\n', "application/jsonl", "body", 400),
    ("plain text without an id", "text/plain", "id", 400),
    ("", "text/plain", "id", 400),
    ("x", "application/pdf", "content-type", 415),
], ids=["bad-jsonl-line", "text-without-id", "empty", "unsupported-type"])
def test_bad_document_bodies(client, content, ctype, param, status):
    r = client.post("/documents", content=content, headers={"content-type": ctype, "x-requested-with": "test"})
    assert r.status_code == status, r.text
    assert r.json()["error"]["param"] == param and param in r.json()["error"]["message"]


LONG = "Varo " * 3000  # > 2048 tokens, the tiny model's context


@pytest.mark.parametrize("body,param", [
    (b'{"question": "unterminated', "body"),
    ({}, "question"),
    ({"question": "   "}, "question"),
    ({"question": 42}, "question"),
    ({"question": "q", "top_k": "many"}, "top_k"),
    ({"question": "q", "top_k": 0}, "top_k"),
    ({"question": "q", "top_k": 100}, "top_k"),
    ({"question": "q", "temperature": -0.5}, "temperature"),
    ({"question": "q", "temperature": 9}, "temperature"),
    ({"question": "q", "top_p": 0}, "top_p"),
    ({"question": "q", "max_tokens": 0}, "max_tokens"),
    ({"question": "q", "max_tokens": 100000}, "max_tokens"),
    ({"question": "q", "mode": "bogus"}, "mode"),
    ({"question": "q", "seam": -1}, "seam"),
    ({"question": "q", "recompute": 1.5}, "recompute"),
    ({"question": "q", "recompute": "most"}, "recompute"),
    ({"question": "q", "document_ids": ["no-such-doc"]}, "document_ids"),
    ({"question": "q", "document_ids": "city-varo"}, "document_ids"),
    ({"question": "q", "topk": 3}, "topk"),
    ({"question": LONG}, "question"),
], ids=["malformed-json", "missing-question", "blank-question", "question-type", "top_k-type", "top_k-zero",
        "top_k-too-big", "temperature-negative", "temperature-too-big", "top_p-zero", "max_tokens-zero",
        "max_tokens-too-big", "unknown-mode", "negative-seam", "recompute-too-big", "recompute-type", "unknown-document", "document_ids-type",
        "unknown-field", "prompt-too-long"])
@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
def test_bad_query_is_4xx_naming_the_field(client, body, param, stream):
    if isinstance(body, dict):
        r = client.post("/query", json={**body, "stream": stream})
    else:
        r = client.post("/query", content=body, headers={"content-type": "application/json"})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and error["message"].startswith(param), error
    assert r.headers["x-request-id"]


def test_server_keeps_serving_after_bad_input(client):
    assert client.post("/query", content=b"{", headers={"content-type": "application/json"}).status_code == 400
    assert client.post("/query", json={"question": "Who is the mayor of Varo?", "max_tokens": 2}).status_code == 200


def test_client_request_id_is_echoed_and_unknown_route_is_json_404(client):
    r = client.get("/health", headers={"X-Request-ID": "trace-123"})
    assert r.headers["x-request-id"] == "trace-123"
    assert client.get("/health", headers={"X-Request-ID": "bad id\twith spaces"}).headers["x-request-id"] != "bad id\twith spaces"
    r = client.get("/nope")
    assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error" and r.headers["x-request-id"]


def test_hypic_query_command_streams_the_answer(server, client):
    from typer.testing import CliRunner

    from app.cli import cli

    question = "Who is the mayor of Varo?"
    result = CliRunner().invoke(cli, ["query", question, "--url", server.url, "--max-tokens", "5", "--sources"])
    assert result.exit_code == 0, result.output
    answer = client.post("/query", json={"question": question, "max_tokens": 5}).json()["answer"]
    assert result.stdout == answer + "\n"
    assert "city-varo" in result.stderr and "tokens" in result.stderr
    bad = CliRunner().invoke(cli, ["query", question, "--url", server.url, "--mode", "bogus"])
    assert bad.exit_code == 1 and "mode" in bad.stderr

"""Documents API against a live server: JSON and multipart uploads, pages, one document, /search."""

from __future__ import annotations

import gzip

import httpx
import pytest

import gateways

PAGE = b"<html><head><title>Tide tables</title><script>var x = 'hidden';</script></head><body><p>The Moon pulls the sea.</p></body></html>"


@pytest.fixture(scope="module")
def server(tiny_tokenizer, tmp_path_factory):
    with gateways.gateway(tmp_path_factory.mktemp("documents-api"), tiny_tokenizer, [], corpus_path=None, max_top_k=8,
                          max_body_bytes=1 << 16) as live:
        yield live


@pytest.fixture()
def client(server):
    with httpx.Client(base_url=server.url, timeout=30, headers={"X-Requested-With": "test"}) as c:
        yield c


def ids(client: httpx.Client) -> set[str]:
    return {d["document_id"] for d in all_pages(client, 1000)}


def all_pages(client: httpx.Client, limit: int) -> list[dict]:
    data, after = [], None
    while True:
        page = client.get("/documents", params={"limit": limit} | ({"after": after} if after else {})).json()
        data += page["data"]
        if not page["has_more"]:
            return data
        after = page["last_id"]


def error(r: httpx.Response, status: int = 400) -> tuple[str, str]:
    assert r.status_code == status, r.text
    body = r.json()["error"]
    assert body["message"].startswith(f"{body['param']}: ") or status == 415
    return body["param"], body["message"]


def test_json_object_and_list(client):
    r = client.post("/documents", json={"id": "json-one", "text": "Varo lies on the river Alna.", "title": "Varo"})
    assert r.status_code == 201, r.text
    assert (r.json()["documents"], r.json()["document_ids"]) == (1, ["json-one"])
    items = [{"id": "json-a", "text": "Brill was founded by Tam Oke."}, {"id": "json/b", "text": "The cafe opened in 1999.", "source": "notes"}]
    r = client.post("/documents", json=items)
    assert r.status_code == 201 and r.json()["document_ids"] == ["json-a", "json/b"]
    doc = client.get("/documents/json/b").json()
    assert (doc["document_id"], doc["title"], doc["source"], doc["chunks"]) == ("json/b", "json/b", "notes", 1)
    assert doc["content"] == [{"chunk_id": doc["content"][0]["chunk_id"], "chunk_index": 0, "text": "The cafe opened in 1999.",
                               "tokens": doc["tokens"]}]


@pytest.mark.parametrize("body, param, message", [
    ([{"id": "bad-0", "text": "fine"}, {"id": "bad-1", "text": "  "}], "body[1].text", "field 'text' must be a non-empty string"),
    ([{"id": "bad-0", "text": "fine"}, {"id": "bad-0", "text": "again"}], "body[1].id", "duplicate id 'bad-0' (first in item 0)"),
    ([{"id": "bad-0", "text": "fine"}, "just a string"], "body[1]", "expected a JSON object, got str"),
    ({"text": "no id"}, "body.id", "field 'id' must be a non-empty string"),
    ({"id": "bad-0", "text": "x", "title": 3}, "body.title", "field 'title' must be a string"),
    ([], "body", "no documents (an empty list)"),
    (42, "body", "expected a document object or a list of them, got int"),
])
def test_bad_json_items_are_400_naming_item_and_field_and_change_nothing(client, body, param, message):
    before = ids(client)
    assert error(client.post("/documents", json=body)) == (param, f"{param}: {message}")
    assert ids(client) == before


def test_malformed_json_and_unknown_content_type(client):
    assert error(client.post("/documents", content=b'{"id": "x", ', headers={"content-type": "application/json"}))[0] == "body"
    param, message = error(client.post("/documents", content=b"<doc/>", headers={"content-type": "application/xml"}), 415)
    assert param == "content-type" and "multipart/form-data" in message and "application/json" in message


def test_multipart_files_take_their_names_as_ids(client):
    files = [("file", ("guide.md", b"# Brewing guide\n\nUse fine grounds.", "text/markdown")),
             ("file", ("tides.html.gz", gzip.compress(PAGE), "application/gzip")),
             ("file", ("lines.jsonl", b'{"id": "upload-line", "text": "From an uploaded JSONL file."}\n', "application/jsonl"))]
    r = client.post("/documents", files=files)
    assert r.status_code == 201, r.text
    assert r.json()["document_ids"] == ["guide.md", "tides.html.gz", "upload-line"]
    tides = client.get("/documents/tides.html.gz").json()
    assert (tides["title"], tides["source"], [c["text"] for c in tides["content"]]) == ("Tide tables", "tides.html.gz", ["The Moon pulls the sea."])
    assert client.get("/documents/guide.md").json()["title"] == "Brewing guide"


def test_multipart_single_file_with_id_and_title(client):
    r = client.post("/documents", files={"file": ("draft.txt", b"Plain words about rivers.")}, data={"id": "notes/final", "title": "Final"})
    assert r.status_code == 201 and r.json()["document_ids"] == ["notes/final"]
    doc = client.get("/documents/notes/final").json()
    assert (doc["title"], doc["source"]) == ("Final", "draft.txt")


@pytest.mark.parametrize("files, data, param, message", [
    ([("file", ("ok.txt", b"fine")), ("file", ("slides.pdf", b"%PDF"))], {}, "file[1]", "slides.pdf: unsupported file type '.pdf'"),
    ([("file", ("ok.txt", b"fine")), ("file", ("empty.md", b"   "))], {}, "file[1]", "empty.md: empty, nothing to ingest"),
    ([("file", ("ok.txt", b"fine")), ("file", ("bad.txt.gz", b"not gzip"))], {}, "file[1]", "bad.txt.gz: not a valid gzip file"),
    ([("file", ("bomb.txt.gz", gzip.compress(b"a" * (1 << 21))))], {}, "file", "bomb.txt.gz: decompresses to more than"),
    ([("file", ("ok.txt", b"fine")), ("file", ("dup.jsonl", b'{"id": "ok.txt", "text": "same id"}'))], {}, "file[1]", "dup.jsonl: document id 'ok.txt' also comes from file[0]"),
    ([("file", ("a.txt", b"one")), ("file", ("b.txt", b"two"))], {"id": "both"}, "id", "names one document, but 2 files were sent"),
    ([("file", ("a.jsonl", b'{"id": "x1", "text": "1"}\n{"id": "x2", "text": "2"}'))], {"title": "T"}, "title", "a.jsonl holds 2 documents"),
    ([("file", ("a.txt", b"one"))], {"id": " "}, "id", "must be a non-empty text field"),
    ([("files", ("a.txt", b"one"))], {}, "files", "unknown form field"),
    ([], {"id": "only-an-id"}, "file", "no files"),
])
def test_bad_uploads_are_400_naming_the_file_and_change_nothing(client, files, data, param, message):
    before = ids(client)
    r = client.post("/documents", files=files or None, data=data,
                    headers={} if files else {"content-type": "multipart/form-data; boundary=x"})
    if not files:  # httpx sends an empty form as urlencoded: build the multipart body by hand
        r = client.post("/documents", content=b'--x\r\nContent-Disposition: form-data; name="id"\r\n\r\nonly-an-id\r\n--x--\r\n',
                        headers={"content-type": "multipart/form-data; boundary=x"})
    got_param, got_message = error(r)
    assert got_param == param and got_message.startswith(f"{param}: {message}"), got_message
    assert ids(client) == before


def test_pages_follow_the_after_cursor(client):
    for n in range(5):
        client.post("/documents", json={"id": f"page-{n}", "text": f"Page document number {n}."})
    everything = all_pages(client, 1000)
    assert [d["document_id"] for d in everything] == sorted(d["document_id"] for d in everything)
    assert all_pages(client, 2) == everything
    first = client.get("/documents", params={"limit": 2}).json()
    assert (first["object"], len(first["data"]), first["has_more"]) == ("list", 2, True)
    assert (first["first_id"], first["last_id"]) == (everything[0]["document_id"], everything[1]["document_id"])
    tail = client.get("/documents", params={"after": "page-3"}).json()
    assert [d["document_id"] for d in tail["data"]][:1] == ["page-4"] and tail["has_more"] is False
    end = client.get("/documents", params={"after": everything[-1]["document_id"]}).json()
    assert end == {"object": "list", "data": [], "first_id": None, "last_id": None, "has_more": False,
                   "collection": "default"}
    assert error(client.get("/documents", params={"limit": 0}))[0] == "limit"
    assert error(client.get("/documents", params={"limit": 1001}))[0] == "limit"


def test_get_and_delete_one_document(client):
    client.post("/documents?id=dir/sub/doc.md", content="# Title\n\nFirst paragraph.", headers={"content-type": "text/markdown"})
    doc = client.get("/documents/dir/sub/doc.md").json()
    assert (doc["document_id"], doc["title"], doc["content"][0]["chunk_index"]) == ("dir/sub/doc.md", "Title", 0)
    assert client.delete("/documents/dir/sub/doc.md").json()["deleted"] is True
    r = client.get("/documents/dir/sub/doc.md")
    assert error(r, 404) == ("document_id", "document_id: document 'dir/sub/doc.md' is not in the index")
    assert r.json()["error"]["code"] == "document_not_found"


def test_search_returns_ranked_chunks_without_generating(client):
    client.post("/documents", json=[{"id": "s-river", "text": "The Alna is a river that flows into the sea near Varo.", "title": "Alna"},
                                    {"id": "s-firm", "text": "Brill is a company founded by Tam Oke in 1999."}])
    r = client.post("/search", json={"query": "river Alna sea", "top_k": 3})
    assert r.status_code == 200, r.text
    hits = r.json()["data"]
    assert len(hits) == 3 and hits[0]["document_id"] == "s-river" and hits[0]["title"] == "Alna"
    assert set(hits[0]) == {"chunk_id", "document_id", "title", "source", "chunk_index", "text", "tokens", "score", "collection"}
    assert [h["score"] for h in hits] == sorted((h["score"] for h in hits), reverse=True)
    only = client.post("/search", json={"query": "river", "document_ids": ["s-firm"]}).json()["data"]
    assert [h["document_id"] for h in only] == ["s-firm"]


@pytest.mark.parametrize("body, param", [
    ({"query": "  "}, "query"),
    ({}, "query"),
    ({"query": "x", "top_k": 9}, "top_k"),
    ({"query": "x", "top_k": 0}, "top_k"),
    ({"query": "x", "document_ids": ["no-such-document"]}, "document_ids"),
    ({"query": "x", "mode": "full"}, "mode"),
])
def test_bad_search_is_400_naming_the_field(client, body, param):
    assert error(client.post("/search", json=body))[0] == param

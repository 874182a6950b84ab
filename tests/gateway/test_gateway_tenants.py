"""Tenants on a live gateway with several keys: each tenant's documents and cache are its own.

Keys: "legacy" (HYPIC_API_KEY, the tenant 'default', which holds the startup corpus), "key-a"
(alice), "key-b" (bob), "key-c" (carol, used for the quotas), "key-d" (dora: the probe, whose
first request is in the cache test), "key-e" (erin: several collections at once). Every tenant may
keep 6 documents. Collection "public" is shared, written
by alice. Cache hits are read from `usage` (cached_tokens: exact reuse; composed_tokens: reuse by
composition), never from timings.
"""

from __future__ import annotations

import json
import socket
import time

import httpx
import pytest

from app.service.settings import Settings
from app.service.tenants import Collections, TenantLabels, cache_salt
from app.testing import tiny_gateway

import gateways

CORPUS = [{"id": "corpus-varo", "title": "Varo", "text": "Varo is a city on the river Alna. Its mayor is Ines Kell."}]
KEYS = {"key-a": "alice", "key-b": "bob", "key-c": "carol", "key-d": "dora", "key-e": "erin"}
SECRET = ("The vault code of Brill is 4417. Tam Oke keeps the key in the cafe on the river Alna, "
          "and Ines Kell knows where the second key is hidden.")
PUBLIC = "The river Alna flows through Varo into the sea; the cafe by the bridge opened in 1999."


@pytest.fixture(scope="module")
def gateway(tiny_tokenizer, tmp_path_factory):
    app = tiny_gateway(tmp_path_factory.mktemp("tenants"), tiny_tokenizer, CORPUS, api_key="legacy",
                       api_keys=json.dumps(KEYS), shared_collections={"public": ["alice"]}, cold_prefill="stitch",
                       tenant_max_documents=6, tenant_max_bytes=2000, tenant_max_requests=2, metrics_tenant_labels=True)
    with gateways.served(app, headers={"Authorization": "Bearer legacy"}) as live:
        yield live, app


def client(gateway, key: str) -> httpx.Client:
    live, _ = gateway
    return httpx.Client(base_url=live.url, timeout=60, headers={"Authorization": f"Bearer {key}"})


@pytest.fixture()
def alice(gateway):
    with client(gateway, "key-a") as c:
        yield c


@pytest.fixture()
def bob(gateway):
    with client(gateway, "key-b") as c:
        yield c


def add(c: httpx.Client, doc_id: str, text: str, collection: str | None = None) -> httpx.Response:
    params = {"collection": collection} if collection else {}
    return c.post("/documents", params=params, json={"id": doc_id, "text": text})


def ask(c: httpx.Client, body: dict) -> dict:
    r = c.post("/query", json={"max_tokens": 1} | body)
    assert r.status_code == 200, r.text
    return r.json()


def reused(usage: dict) -> int:
    return usage["cached_tokens"] + usage["composed_tokens"]


def param_of(r: httpx.Response) -> str:
    return r.json()["error"]["param"]


def test_a_tenant_never_sees_lists_or_deletes_another_tenants_documents(alice, bob, gateway):
    assert add(alice, "secret", SECRET).status_code == 201
    assert add(alice, "notes-1", SECRET, collection="notes").status_code == 201
    assert [d["document_id"] for d in alice.get("/documents").json()["data"]] == ["secret"]
    assert bob.get("/documents").json()["data"] == []  # not the corpus (the legacy key's), not alice's
    with client(gateway, "legacy") as legacy:
        assert [d["document_id"] for d in legacy.get("/documents").json()["data"]] == ["corpus-varo"]
    assert bob.get("/documents/secret").status_code == 404
    assert bob.delete("/documents/secret").status_code == 404
    assert alice.get("/documents/secret").status_code == 200
    r = bob.get("/documents", params={"collection": "notes"})  # alice's collection name: bob has none of that name
    assert r.status_code == 400 and r.json()["error"]["code"] == "collection_not_found" and param_of(r) == "collection"
    assert bob.post("/search", json={"query": "vault code of Brill"}).json()["data"] == []
    r = bob.post("/query", json={"question": "What is the vault code?", "document_ids": ["secret"]})
    assert r.status_code == 400 and param_of(r) == "document_ids"
    r = bob.post("/query", json={"question": "What is the vault code?", "collections": ["notes"]})
    assert r.status_code == 400 and param_of(r) == "collections[0]"
    answer = ask(bob, {"question": "What is the vault code of Brill?"})
    assert answer["sources"] == []
    chat = bob.post("/v1/chat/completions", json={"model": "tiny", "max_tokens": 1, "rag": {"top_k": 4},
                                                  "messages": [{"role": "user", "content": "vault code of Brill?"}]})
    assert chat.status_code == 200 and chat.json()["sources"] == []
    names = {c["name"] for c in alice.get("/collections").json()["data"]}
    assert names == {"default", "notes", "public"} and {c["name"] for c in bob.get("/collections").json()["data"]} == {"default", "public"}


def test_no_cache_hit_across_tenants_on_the_same_chunk_text(alice, gateway):
    """Dora holds the same text as alice and asks the same question: nothing alice's requests cached
    (the system prompt's snapshot, the chunk's entry) serves hers, as the tenant is in every key;
    her own repeat then hits her own entries."""
    assert add(alice, "probe", SECRET + " Probe.", collection="probe").status_code == 201
    question = {"question": "Where does Tam Oke keep the key?", "collections": ["probe"]}
    ask(alice, question)
    assert reused(ask(alice, question)["usage"]) > 0  # the cache works for alice
    dora = client(gateway, "key-d")
    assert add(dora, "probe", SECRET + " Probe.", collection="probe").status_code == 201
    first = ask(dora, question)
    assert first["sources"][0]["text"] == SECRET + " Probe."
    assert reused(first["usage"]) == 0
    by_kind = _tenant_tokens(dora, "dora")  # /metrics agrees: dora's prompt tokens were all computed for her
    assert by_kind.get("exact", 0) == by_kind.get("composed", 0) == 0 and by_kind["fresh"] > 0
    assert reused(ask(dora, question)["usage"]) > 0  # dora's own entries serve dora
    # The OpenAI route, with alice's chunk text sent verbatim as a segment: no hit for bob either.
    body = {"model": "tiny", "max_tokens": 1, "segments": [SECRET + " Segment.", PUBLIC + " Segment."],
            "messages": [{"role": "user", "content": "Who keeps the key?"}]}
    alice.post("/v1/chat/completions", json=body)
    hit = alice.post("/v1/chat/completions", json=body).json()["usage"]["prompt_tokens_details"]
    assert hit["cached_tokens"] + hit["composed_tokens"] > 0
    probe = dora.post("/v1/chat/completions", json=body | {"prompt_cache_key": "alice"}).json()["usage"]["prompt_tokens_details"]
    assert probe["composed_tokens"] == 0  # no segment entry of alice's; cached_tokens: dora's own system prompt
    dora.close()


def test_a_shared_collection_is_read_by_all_written_by_its_writers_and_shares_entries(alice, bob):
    assert add(alice, "alna", PUBLIC, collection="public").status_code == 201
    r = add(bob, "mine", "Bob's text.", collection="public")
    assert r.status_code == 403 and r.json()["error"]["code"] == "collection_read_only" and param_of(r) == "collection"
    assert bob.delete("/documents/alna", params={"collection": "public"}).status_code == 403
    question = {"question": "When did the cafe by the bridge open?", "collections": ["public"]}
    ask(alice, question)
    shared = ask(bob, question)  # the same public chunk: its entry is shared by configuration
    assert shared["sources"][0]["collection"] == "public" and shared["usage"]["composed_tokens"] > 0


def test_store_false_keeps_nothing(alice, gateway):
    _, app = gateway
    engine = app.state.runtime.engine
    text = "Nothing of this request is kept: the lantern of Varo is green and the bell of Brill is silent."
    assert add(alice, "unkept", text, collection="unkept").status_code == 201
    question = {"question": "What colour is the lantern of Varo?", "collections": ["unkept"]}
    entries, snapshots, sightings = len(engine.store), len(engine.exact_runs._index), len(engine.exact_runs._seen)
    for _ in range(2):
        ask(alice, question | {"cache": {"store": False}})
    body = {"model": "tiny", "max_tokens": 1, "cache": {"store": False}, "segments": [text + " Once more."],
            "messages": [{"role": "user", "content": "Which bell is silent?"}]}
    assert alice.post("/v1/chat/completions", json=body).status_code == 200
    assert (len(engine.store), len(engine.exact_runs._index), len(engine.exact_runs._seen)) == (entries, snapshots, sightings)
    # Nothing was kept for the next request either (cached_tokens: alice's system prompt, kept before).
    assert ask(alice, question)["usage"]["composed_tokens"] == 0


@pytest.mark.parametrize("body, param", [
    ({"collections": []}, "collections"),
    ({"collections": "public"}, "collections"),
    ({"collections": ["../bob"]}, "collections[0]"),
    ({"collections": ["Public"]}, "collections[0]"),
    ({"cache": {"store": "no"}}, "cache.store"),
    ({"cache": {"keep": True}}, "cache.keep"),
    ({"cache": False}, "cache"),
])
def test_malformed_tenant_fields_are_400s_naming_the_field(alice, body, param):
    r = alice.post("/query", json={"question": "Where is Varo?"} | body)
    assert r.status_code == 400 and param_of(r) == param, r.text


def test_malformed_openai_and_document_fields_are_400s_naming_the_field(alice):
    base = {"model": "tiny", "max_tokens": 1, "messages": [{"role": "user", "content": "hi"}]}
    r = alice.post("/v1/chat/completions", json=base | {"prompt_cache_key": 5})
    assert r.status_code == 400 and param_of(r) == "prompt_cache_key"
    r = alice.post("/v1/chat/completions", json=base | {"rag": {"collections": ["a/b"]}})
    assert r.status_code == 400 and param_of(r) == "rag.collections[0]"
    r = add(alice, "x", "text", collection="../../etc")
    assert r.status_code == 400 and param_of(r) == "collection"
    r = alice.post("/search", json={"query": "Varo", "collections": ["nope"]})
    assert r.status_code == 400 and param_of(r) == "collections[0]"


def test_document_and_byte_quotas_answer_429_with_retry_after(gateway):
    with client(gateway, "key-c") as carol:
        big = add(carol, "big", "word " * 500)  # 2,500 bytes of chunk text, over 2,000
        assert big.status_code == 429 and big.headers["Retry-After"] == "1"
        assert big.json()["error"]["code"] == "tenant_bytes" and carol.get("/documents").json()["data"] == []
        for n in range(6):
            assert add(carol, f"d{n}", f"Small document {n}.", collection="default" if n < 4 else "other").status_code == 201
        over = add(carol, "d6", "One more.")  # the 7th, counted across collections
        assert over.status_code == 429 and over.json()["error"]["code"] == "tenant_documents" and "Retry-After" in over.headers
        assert add(carol, "d1", "Small document 1, replaced.").status_code == 201  # a replacement adds nothing
        quota = carol.get("/collections").json()["quota"]
        assert quota["documents"] == 6 and quota["max_documents"] == 6


def _tenant_tokens(c: httpx.Client, tenant: str) -> dict[str, float]:
    """`hypic_tenant_prompt_tokens_total` of `tenant`, by kind."""
    found = {}
    for line in c.get("/metrics").text.splitlines():
        if line.startswith("hypic_tenant_prompt_tokens_total{") and f'tenant="{tenant}"' in line:
            found[line.split('kind="')[1].split('"')[0]] = float(line.rsplit(" ", 1)[1])
    return found


def _hold_open(url: str, key: str) -> socket.socket:
    """A request whose body never comes: in flight until the socket closes."""
    host, port = url.removeprefix("http://").split(":")
    s = socket.create_connection((host, int(port)))
    s.sendall(f"POST /documents HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {key}\r\n"
              "Content-Type: application/json\r\nContent-Length: 100\r\n\r\n{".encode())
    return s


def _in_flight(c: httpx.Client, tenant: str) -> float:
    for line in c.get("/metrics").text.splitlines():
        if line.startswith(f'hypic_tenant_requests_in_flight{{') and f'tenant="{tenant}"' in line:
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def _wait_for(c: httpx.Client, tenant: str, n: float) -> None:
    deadline = time.monotonic() + 20
    while _in_flight(c, tenant) != n:
        assert time.monotonic() < deadline, f"{tenant} never had {n} requests in flight"
        time.sleep(0.02)


def test_concurrent_requests_past_the_tenants_limit_answer_429_others_pass(gateway, alice):
    live, _ = gateway
    with client(gateway, "key-c") as carol:
        held = [_hold_open(live.url, "key-c") for _ in range(2)]
        try:
            _wait_for(carol, "carol", 2)
            r = carol.get("/documents")
            assert r.status_code == 429 and r.headers["Retry-After"] == "1" and r.json()["error"]["code"] == "tenant_requests"
            assert alice.get("/documents").status_code == 200  # another tenant is not held back
        finally:
            for s in held:
                s.close()
        _wait_for(carol, "carol", 0)
        assert carol.get("/documents").status_code == 200
        metrics = carol.get("/metrics").text
        assert 'hypic_tenant_quota_refusals_total{limit="requests",model_name="tiny",tenant="carol"} 1.0' in metrics
        assert 'hypic_tenant_requests_total{model_name="tiny",status="429",tenant="carol"}' in metrics
        assert 'tenant="alice"' in metrics and "key-a" not in metrics


def test_keys_settings_are_checked_at_startup(tmp_path):
    with pytest.raises(ValueError, match="api_keys"):
        Settings(_env_file=None, api_keys='{"k": "Bad Name"}')
    with pytest.raises(ValueError, match="api_keys"):
        Settings(_env_file=None, api_keys='["k"]')
    with pytest.raises(ValueError, match="two tenants"):
        Settings(_env_file=None, api_key="k", api_keys='{"k": "alice"}')
    keys = tmp_path / "keys.json"
    keys.write_text(json.dumps({"file-key": "dora"}))
    settings = Settings(_env_file=None, api_key="k0", api_keys='{"k1": "alice"}', api_keys_file=keys)
    assert settings.tenant_keys == {"k0": "default", "k1": "alice", "file-key": "dora"}
    with pytest.raises(ValueError, match="api_keys_file"):
        Settings(_env_file=None, api_keys_file=tmp_path / "missing.json")


def test_the_default_collection_cannot_be_shared(monkeypatch):
    """Shared, 'default' would make every tenant's upload without a collection everyone's, and hide the operator's index."""
    with pytest.raises(ValueError, match="shared_collections: 'default' is every tenant's own collection"):
        Settings(_env_file=None, shared_collections={"default": ["alice"]})
    monkeypatch.setenv("HYPIC_SHARED_COLLECTIONS", '{"public": [], "default": []}')
    with pytest.raises(ValueError, match="shared_collections: 'default'"):
        Settings(_env_file=None)
    monkeypatch.setenv("HYPIC_SHARED_COLLECTIONS", '{"public": ["alice"]}')
    assert Settings(_env_file=None).shared_collections == {"public": ["alice"]}


def test_tenant_labels_are_bounded_and_salts_differ():
    labels = TenantLabels([f"t{i}" for i in range(100)], limit=10, named=True)
    assert len({labels(f"t{i}") for i in range(100)}) <= 11 and labels("stranger") == "other"
    assert {TenantLabels(["alice"])(t) for t in ("alice", "default", "stranger")} == {"all"}  # names only when opted in
    assert cache_salt("default") == "" and cache_salt("alice") != cache_salt("bob")
    assert Collections.__doc__


def test_get_query_takes_collections_as_repeated_parameters(alice):
    r = alice.get("/query", params={"question": "When did the cafe open?", "collections": ["public", "default"],
                                    "stream": "false", "max_tokens": 1})
    assert r.status_code == 200, r.text
    assert all(s["collection"] in ("public", "default") for s in r.json()["sources"])


def test_the_guard_checks_under_the_requests_salt_and_never_one_that_keeps_nothing(gateway):
    from prometheus_client import CollectorRegistry

    from app.service.guard import Choice, Guard, GuardConfig, check_requests
    from hypic_core.config import GenerationRequest, Mode

    _, app = gateway
    guard = Guard(GuardConfig(sample_rate=1.0, greedy_sample=0.0), app.state.runtime.engine, "tiny", Choice(Mode.HYPIC, 8),
                  CollectorRegistry())
    segments = ((5, 6, 7), (10, 11), (8, 9))
    assert not guard.offer(GenerationRequest(segments, cache_salt="tenant:alice", cache_store=False))
    assert guard.offer(GenerationRequest(segments, cache_salt="tenant:alice"))
    assert {r.cache_salt for r in check_requests(guard._queue[0], 4)} == {"tenant:alice"}


def test_a_tenant_creates_at_most_max_tenant_collections(tmp_path, monkeypatch):
    from app.service import tenants
    from app.service.errors import QuotaExceededError
    from retrieval import HashingEmbedder, VectorIndex

    monkeypatch.setattr(tenants, "MAX_TENANT_COLLECTIONS", 2)
    collections = Collections(tmp_path / "collections", VectorIndex(tmp_path / "index", HashingEmbedder(64)), {"public": []})
    second = collections.writable("alice", "second")
    second.upsert([tenants.Chunk("c", "d", "", "", 0, "Some text.", 3)])
    with pytest.raises(QuotaExceededError) as refused:
        collections.writable("alice", "third")
    assert refused.value.limit == "collections"
    assert collections.writable("alice", "second") is second and collections.names("alice") == ["default", "second", "public"]
    assert collections.names("bob") == ["default", "public"]


def test_ray_routing_uses_prompt_cache_key_and_names_no_chunks_of_other_collections():
    import hashlib

    from app.serve_ray.keys import chunk_key, hint_key, routing_keys, tenant_of_headers

    def search(query, top_k, document_ids):
        return ["c0"]

    chat = {"model": "m", "messages": [{"role": "user", "content": "q"}], "rag": {}, "prompt_cache_key": "team-x"}
    assert routing_keys("POST", "/v1/chat/completions", b"", json.dumps(chat).encode(), search) == (chunk_key("c0"), hint_key("team-x"))
    other = chat | {"rag": {"collections": ["manuals"]}}
    assert routing_keys("POST", "/v1/chat/completions", b"", json.dumps(other).encode(), search) == (hint_key("team-x"),)
    assert routing_keys("POST", "/query", b"", b'{"question": "q", "collections": ["manuals"]}', search) == ()
    assert routing_keys("GET", "/query", b"question=q&collections=manuals", b"", search) == ()
    assert routing_keys("POST", "/query", b"", b'{"question": "q"}', None) == ()  # another tenant: the ingress does not search
    tenants = {hashlib.sha256(b"key-a").digest(): "alice", hashlib.sha256(b"legacy").digest(): "default"}
    assert tenant_of_headers([(b"authorization", b"Bearer key-a")], tenants) == "alice"
    assert tenant_of_headers([(b"authorization", b"Bearer legacy")], tenants) == "default"
    assert tenant_of_headers([(b"authorization", b"Bearer nope")], tenants) is None
    assert tenant_of_headers([], {}) == "default"


def test_a_collection_written_beside_the_gateway_is_served_to_its_tenant_only(gateway, alice, bob):
    """As `hypic ingest --index-dir <collections>/<tenant>/<name>` leaves it."""
    from app.service.tenants import Chunk
    from retrieval import HashingEmbedder, VectorIndex

    _, app = gateway
    root = app.state.runtime.settings.collections_root
    VectorIndex(root / "alice" / "books", HashingEmbedder(64)).upsert([Chunk("b0", "atlas", "Atlas", "", 0, "Maps of the Alna.", 5)])
    hits = alice.post("/search", json={"query": "maps of the Alna", "collections": ["books"]}).json()["data"]
    assert [(h["document_id"], h["collection"]) for h in hits] == [("atlas", "books")]
    assert "books" in {c["name"] for c in alice.get("/collections").json()["data"]}
    assert bob.post("/search", json={"query": "maps", "collections": ["books"]}).status_code == 400


def test_several_collections_are_searched_together_and_document_ids_span_them(gateway):
    erin = client(gateway, "key-e")
    assert add(erin, "m1", "The ferry to Varo leaves at noon.", collection="multi-a").status_code == 201
    assert add(erin, "m2", "The ferry back from Varo leaves at six.", collection="multi-b").status_code == 201
    both = {"query": "ferry Varo", "collections": ["multi-a", "multi-b"], "top_k": 4}
    hits = erin.post("/search", json=both).json()["data"]
    assert {(h["document_id"], h["collection"]) for h in hits} == {("m1", "multi-a"), ("m2", "multi-b")}
    assert [h["score"] for h in hits] == sorted((h["score"] for h in hits), reverse=True)
    only = erin.post("/search", json=both | {"document_ids": ["m2"]}).json()["data"]
    assert [h["document_id"] for h in only] == ["m2"]
    r = erin.post("/search", json=both | {"document_ids": ["m2", "nope"]})
    assert r.status_code == 400 and param_of(r) == "document_ids"
    erin.close()


def test_metrics_name_no_tenant_unless_the_operator_opts_in(tiny_tokenizer, tmp_path):
    """/metrics needs no key: by default every tenant is counted under tenant="all" (HYPIC_METRICS_TENANT_LABELS)."""
    app = tiny_gateway(tmp_path, tiny_tokenizer, CORPUS, api_keys=json.dumps(KEYS), cold_prefill="stitch")
    with gateways.served(app) as live, httpx.Client(base_url=live.url, timeout=60,
                                                    headers={"Authorization": "Bearer key-a"}) as alice:
        assert alice.post("/query", json={"question": "Who is the mayor of Varo?", "max_tokens": 1}).status_code == 200
        assert add(alice, "note", "A note of alice's.").status_code == 201
        metrics = httpx.get(f"{live.url}/metrics").text
    assert 'hypic_tenant_requests_total{model_name="tiny",status="200",tenant="all"}' in metrics
    assert 'hypic_tenant_prompt_tokens_total{kind=' in metrics and 'tenant="all"' in metrics
    assert not any(f'tenant="{name}"' in metrics for name in (*KEYS.values(), "default", "other"))

"""A deleted document's text leaves the cache (app/service/forgetting.py, hypic_core/cache/forget.py): its
chunks' segment entries in every tier (memory, disk, Redis) at every seam width, and the exact snapshots
holding them; another tenant's entries of the same text stay, and the same text uploaded again is a cold miss."""

from __future__ import annotations

import json

import httpx
import pytest
import torch

from hypic_core.algebra.keys import SegmentKey
from hypic_core.cache import DiskTier, RedisTier, build_store
from hypic_core.cache.exact_runs import ExactRuns, ExactSnapshot, chain_hashes
from hypic_core.cache.forget import SegmentPattern
from hypic_core.cache.redis_tier import SIGNED
from hypic_core.cache.store import MemorySegmentStore
from retrieval.index import SearchHit
from test_cache_serde import make_entry

MODEL = "f" * 64
SECRET = ("The vault code of Brill is 4417. Tam Oke keeps the key in the cafe on the river Alna, "
          "and Ines Kell knows where the second key is hidden.")
OTHER = "Varo is a city on the river Alna. Its mayor is Ines Kell, and its harbour opened in 1921."


def keys(tokens, salt="", widths=(0, 4, 8, 64, 1000), prefix=()):
    return [SegmentKey.of(MODEL, w, tokens, salt, prefix) for w in widths]


# --- the pattern -----------------------------------------------------------------------------
def test_pattern_matches_every_width_of_its_segments_and_salts_only():
    a, b = (1, 2, 3), (4, 5, 6)
    pattern = SegmentPattern.of([SegmentKey.of(MODEL, 0, a, "tenant:alice"), SegmentKey.of(MODEL, 0, b, "")])
    assert all(pattern.matches(k.to_str()) for k in keys(a, "tenant:alice") + keys(b, ""))
    assert not any(pattern.matches(k.to_str()) for k in keys(a, "tenant:bob") + keys(a, "") + keys(b, "tenant:alice"))
    assert not any(pattern.matches(k.to_str()) for k in keys((1, 2), "tenant:alice") + keys(a, "tenant:alice", prefix=(9,)))
    assert not pattern.matches(SegmentKey.of("e" * 64, 4, a, "tenant:alice").to_str())  # another model
    assert pattern.matches_stored(keys(a, "tenant:alice")[1].to_str() + "/auto")
    assert not pattern.matches_stored(keys(a, "tenant:alice")[1].to_str())  # a memory key is not a stored one
    assert not pattern.matches(keys(a, "tenant:alice")[1].to_str().replace("/w4", "/w"))  # no width
    with pytest.raises(ValueError):
        SegmentPattern.of([SegmentKey.of(MODEL, 0, a), SegmentKey.of("e" * 64, 0, a)])


# --- each tier --------------------------------------------------------------------------------
@pytest.fixture()
def doomed_and_kept():
    doomed = keys((1, 2, 3), "tenant:alice")
    kept = keys((1, 2, 3), "tenant:bob") + keys((7, 8, 9), "tenant:alice")
    return doomed, kept, SegmentPattern.of(doomed[:1])


def test_memory_store_forgets(doomed_and_kept):
    doomed, kept, pattern = doomed_and_kept
    store = MemorySegmentStore(1 << 24)
    for k in doomed + kept:
        store.insert(k, make_entry())
    assert store.forget(pattern) == {"memory": len(doomed)}
    assert not any(k in store for k in doomed) and all(k in store for k in kept)


def test_disk_tier_forgets(tmp_path, doomed_and_kept):
    doomed, kept, pattern = doomed_and_kept
    disk = DiskTier(tmp_path / "disk", 1 << 26)
    try:
        for k in doomed + kept:
            assert disk.put(k.to_str() + "/auto", b"x" * (64 << 10))  # a value file, not a row value
        assert disk.forget(pattern) == len(doomed)
        assert not any(k.to_str() + "/auto" in disk for k in doomed)
        assert all(k.to_str() + "/auto" in disk for k in kept)
        assert disk.forget(pattern) == 0
    finally:
        disk.close()
    files = [p for p in (tmp_path / "disk").rglob("*") if p.is_file() and not p.name.startswith("cache.db")]
    assert len(files) == len(kept)  # the forgotten values' files are gone too


def test_redis_tier_forgets(redis_server, doomed_and_kept):
    doomed, kept, pattern = doomed_and_kept
    redis_server.client().flushall()
    tier = RedisTier(redis_server.url, 1 << 24, secret=b"s" * 32)
    try:
        for k in doomed + kept:
            assert tier.put(k.to_str() + "/auto", b"x" * 100)
        assert tier.forget(pattern) == len(doomed)
        assert not any(tier.get(k.to_str() + "/auto") for k in doomed)
        assert all(tier.get(k.to_str() + "/auto") for k in kept)
        signed = 100 + len(SIGNED) + 32  # the header and HMAC tag the tier adds
        assert int(redis_server.client().get("hypic:bytes")) == signed * len(kept)  # the account follows
    finally:
        tier.close()


def test_exact_runs_drop_the_snapshots_holding_a_forgotten_segment():
    runs = ExactRuns(1 << 24)
    system, secret, other = (k.to_str() for k in (SegmentKey.of(MODEL, 0, s, "tenant:a") for s in ((1,), (2,), (3,))))

    def snap(n):
        t = torch.zeros(1, n, 2)
        return ExactSnapshot((t,), (t,), tuple(range(1, n + 1)), tuple(() for _ in range(n)))

    with_secret, without = chain_hashes([system, secret, other]), chain_hashes([system, other])
    runs.insert(with_secret, snap(3))
    runs.insert(without, snap(2))
    runs.see(with_secret)
    assert runs.longest(with_secret).segments == 3
    assert runs.forget([secret]) == 1
    assert runs.longest(with_secret).segments == 1  # only the other snapshot's first segment is left
    assert runs.longest(without).segments == 2
    assert runs.longest(with_secret).seen == 1  # the sightings through the secret are gone, the path before it stays
    assert runs.forget([secret]) == 0


# --- on a live gateway: upload, query, delete -------------------------------------------------------
@pytest.fixture(scope="module")
def gateway(tiny_tokenizer, tmp_path_factory, redis_server):
    import gateways
    import stores

    root = tmp_path_factory.mktemp("forget")
    redis_server.client().flushall()
    # The tiny engine over the tiers under test (host memory, disk, Redis).
    store = build_store(1 << 28, directory=root / "cache", redis_url=redis_server.url, redis_secret="s" * 32)
    app, _ = stores.gateway(root, tiny_tokenizer, [{"id": "corpus", "text": OTHER}], store=store,
                            api_keys=json.dumps({"key-a": "alice", "key-b": "bob"}), cold_prefill="stitch", guard_enabled=False)
    with gateways.served(app, headers={"Authorization": "Bearer key-a"}) as live:
        yield live, app.state.runtime
    store.close()


def client(live, key):
    return httpx.Client(base_url=live.url, timeout=60, headers={"Authorization": f"Bearer {key}"})


def held(rt, tenant, collection, chunks) -> dict[str, int]:
    """Entries of `chunks` under the salts of `tenant`'s `collection`, per tier (stored tiers flushed first)."""
    from app.service.forgetting import chunk_keys, salts_of

    store = rt.engine.store
    store.flush()
    pattern = SegmentPattern.of(chunk_keys(rt, chunks, salts_of(rt, tenant, collection)))
    out = {t.spec.name: sum(map(pattern.matches, t.keys())) for t in store._tiers}
    out["disk"] = sum(pattern.matches_stored(k) for k in store.disk._cache.iterkeys())
    out["redis"] = sum(pattern.matches_stored(bytes(k).decode()[len("hypic:e:"):])
                       for k in store.shared._client.scan_iter(match="hypic:e:*"))
    return out


def test_a_deleted_documents_entries_leave_every_tier(gateway):
    live, rt = gateway
    with client(live, "key-a") as alice, client(live, "key-b") as bob:
        for c, doc in ((alice, "secret"), (bob, "bobs-copy")):
            assert c.post("/documents", params={"collection": "notes"}, json={"id": doc, "text": SECRET}).status_code == 201

        def ask(c, doc):
            r = c.post("/query", json={"question": "What is the vault code of Brill?", "max_tokens": 1,
                                       "collections": ["notes"], "document_ids": [doc]})
            assert r.status_code == 200, r.text
            assert [s["document_id"] for s in r.json()["sources"]] == [doc]
            return r.json()["usage"]

        first = ask(alice, "secret")
        assert first["composed_tokens"] == 0  # cold
        warm = ask(alice, "secret")
        assert warm["cached_tokens"] + warm["composed_tokens"] > first["cached_tokens"] + first["composed_tokens"]
        ask(bob, "bobs-copy")  # the same text under bob's salt
        ask(bob, "bobs-copy")
        chunks = rt.collections.get("alice", "notes").chunks("secret")
        before = held(rt, "alice", "notes", chunks)
        bobs = held(rt, "bob", "notes", chunks)
        assert before["host"] > 0 and before["disk"] > 0 and before["redis"] > 0, before
        assert rt.engine.exact_runs.forget([]) == 0 and len(rt.engine.exact_runs._chains) > 0

        assert alice.delete("/documents/secret", params={"collection": "notes"}).status_code == 200
        assert held(rt, "alice", "notes", chunks) == {"host": 0, "disk": 0, "redis": 0}
        assert held(rt, "bob", "notes", chunks) == bobs  # another tenant's entries are its own
        assert bob.get("/documents/bobs-copy", params={"collection": "notes"}).status_code == 200

        # The same text as a new document of alice's: computed afresh, as the first query was.
        assert alice.post("/documents", params={"collection": "notes"}, json={"id": "again", "text": SECRET}).status_code == 201
        again = ask(alice, "again")
        prompt = rt.prompter.query("What is the vault code of Brill?", [SearchHit(1.0, c) for c in chunks], 1)
        assert len(prompt.segments) == prompt.exact_prefix + 2  # the template's head, the document, the question
        system = sum(map(len, prompt.segments[:prompt.exact_prefix]))  # reused exactly by any request: not the document's
        assert warm["cached_tokens"] + warm["composed_tokens"] > system
        assert again["composed_tokens"] == 0 and again["cached_tokens"] <= system, (system, warm, again)
        assert held(rt, "alice", "notes", chunks)["host"] > 0  # and stored again


def test_a_shared_documents_entries_leave_under_every_salt(tiny_tokenizer, tmp_path):
    """A shared collection's text may be cached under the shared salt and any tenant's: all are forgotten."""
    from app.service.forgetting import salts_of
    from app.service.settings import Settings
    from app.service.tenants import SHARED_SALT, cache_salt

    class Rt:  # the two fields `salts_of` reads
        settings = Settings(_env_file=None, torch_threads=None, api_keys=json.dumps({"key-a": "alice", "key-b": "bob"}),
                            shared_collections={"public": ["alice"]})
        collections = type("C", (), {"shared": {"public": frozenset({"alice"})}})()

    assert salts_of(Rt, "alice", "notes") == [cache_salt("alice")]
    assert sorted(salts_of(Rt, "alice", "public")) == sorted([SHARED_SALT, cache_salt("alice"), cache_salt("bob"), ""])


def test_a_replaced_documents_dropped_chunks_leave_the_cache(gateway):
    live, rt = gateway
    with client(live, "key-a") as alice:
        def put(text):
            r = alice.post("/documents", params={"collection": "drafts"}, json={"id": "draft", "text": text})
            assert r.status_code == 201, r.text
            return rt.collections.get("alice", "drafts").chunks("draft")

        def ask():
            r = alice.post("/query", json={"question": "Who keeps the key?", "max_tokens": 1, "collections": ["drafts"]})
            assert r.status_code == 200, r.text

        first = put(SECRET)
        ask()
        assert held(rt, "alice", "drafts", first)["host"] > 0
        assert put(SECRET) == first  # the same text again: its entries stay
        assert held(rt, "alice", "drafts", first)["host"] > 0
        second = put(OTHER)
        assert held(rt, "alice", "drafts", first) == {"host": 0, "disk": 0, "redis": 0}
        ask()
        assert held(rt, "alice", "drafts", second)["host"] > 0

"""The shared Redis tier against a real redis-server: its byte budget and TTL, lookups through a
TieredSegmentStore, damaged and foreign values, a server down at start or killed mid-request,
and two gateways sharing one server."""

from __future__ import annotations

import hashlib
import json
import logging
import struct
import time
from pathlib import Path

import httpx
import pytest
import torch
from pydantic import ValidationError
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from app.service.metrics import Metrics
from app.service.runtime import store_from_settings as build_store_from_settings
from app.service.settings import Settings
from app.testing import LiveServer, single_torch_thread
from helpers import RedisServer, random_segments
from hypic_core.cache import DiskTier, MemoryTier, RedisTier, TieredSegmentStore
from hypic_core.cache.redis_tier import sign
from hypic_core.cache.serde import _PREFIX, MAGIC
from hypic_core.config import EngineConfig, GenerationRequest, SamplingParams
from hypic_core.engine.engine import Engine
import stores
from test_cache_engine import answer
from test_cache_serde import make_entry
from test_cache_tiered import damaged, key_of

FAST_RETRY = (0.1, 0.5)  # reconnection attempts in tests: first after 0.1 s, then at most every 0.5 s
SECRET = "a test deployment's cache secret"
SIGNING = 8 + 32  # bytes the signature header adds to each value (redis_tier.SIGNED and the HMAC tag)


@pytest.fixture
def server(redis_server):
    """The module's server, emptied for each test."""
    redis_server.client().flushall()
    return redis_server


@pytest.fixture
def tiers():
    """Makes RedisTiers (closed after the test)."""
    made = []

    def make(url, max_bytes=1 << 30, **kw):
        made.append(RedisTier(url, max_bytes, **{"retry_s": FAST_RETRY, "secret": SECRET, **kw}))
        return made[-1]

    yield make
    for tier in made:
        tier.close()


def store_of(shared, disk=None, host_bytes=1 << 26, **kw) -> TieredSegmentStore:
    return TieredSegmentStore("cpu", [MemoryTier("host", "cpu", host_bytes)], disk, shared=shared, **kw)


def wait_until(predicate, timeout=10.0):
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


# --- the tier alone ---------------------------------------------------------------------
def test_values_round_trip_first_writer_wins_and_carry_the_ttl(server, tiers):
    tier = tiers(server.url, ttl_s=60, prefix="a:")
    assert tier.get("k") is None
    assert tier.put("k", b"first") and tier.put("k", b"second")
    assert tier.get("k") == b"first"
    raw = server.client()
    assert 0 < raw.ttl("a:e:k") <= 60 and raw.get("a:bytes") == raw.hget("a:sizes", "k") == str(5 + SIGNING).encode()
    assert tiers(server.url, prefix="b:").get("k") is None  # another prefix shares nothing
    tier.delete("k")
    tier.delete("k")
    assert tier.get("k") is None and raw.get("a:bytes") == b"0" and raw.zcard("a:lru") == 0
    with pytest.raises(TypeError):
        tier.put("k", bytearray(b"x"))
    s = tier.stats()
    assert s.writes == 1 and s.errors == 0 and s.connected and s.bytes == 0


def test_budget_is_shared_and_removes_the_least_recently_used(server, tiers):
    budget = 3 * (300 + SIGNING)
    one, two = tiers(server.url, max_bytes=budget), tiers(server.url, max_bytes=budget)  # two replicas, one budget
    for i in range(3):
        assert (one if i % 2 else two).put(f"k{i}", bytes([i]) * 300)
    assert two.get("k0") == bytes([0]) * 300  # used: k1 is now the least recently used
    assert one.put("k3", b"3" * 300)
    assert one.get("k1") is None and all(two.get(f"k{i}") is not None for i in (0, 2, 3))
    assert not one.put("huge", b"h" * (budget - SIGNING + 1))  # larger than the whole budget: not stored
    raw = server.client()
    assert int(raw.get("hypic:bytes")) == budget == sum(int(v) for v in raw.hvals("hypic:sizes")) == one.stats().bytes
    assert raw.zcard("hypic:lru") == 3 and raw.exists("hypic:e:huge") == 0


def test_expired_and_lost_values_leave_the_account(server, tiers):
    tier = tiers(server.url, ttl_s=1)
    assert tier.put("old", b"o" * 100)
    time.sleep(1.1)  # unused for longer than the TTL: Redis expires it
    assert tier.put("new", b"n" * 10)
    raw = server.client()
    assert raw.get("hypic:bytes") == str(10 + SIGNING).encode() and raw.hkeys("hypic:sizes") == [b"new"]
    raw.delete("hypic:e:new")  # lost by the server (a restart, a server-wide eviction)
    assert tier.get("new") is None and raw.get("hypic:bytes") == b"0" and raw.zcard("hypic:lru") == 0


def test_settings_read_the_environment_and_refuse_bad_values(server, monkeypatch):
    monkeypatch.setenv("HYPIC_REDIS_URL", server.url)
    monkeypatch.setenv("HYPIC_REDIS_MAX_BYTES", "1000")
    monkeypatch.setenv("HYPIC_REDIS_PREFIX", "replicas:")
    monkeypatch.setenv("HYPIC_CACHE_DIR", "none")  # no disk tier in the working directory
    monkeypatch.setenv("HYPIC_CACHE_SECRET", SECRET)
    settings = Settings(_env_file=None)
    assert settings.cache_secret.get_secret_value() == SECRET and SECRET not in repr(settings)
    assert settings.redis_url.get_secret_value() == server.url and "redis://" not in repr(settings)
    store = build_store_from_settings(settings)
    try:
        assert store.shared.max_bytes == 1000 and store.shared.prefix == "replicas:" and store.stats().redis_connected == 1
    finally:
        store.close()
    monkeypatch.delenv("HYPIC_REDIS_URL")
    assert Settings(_env_file=None, cache_dir=None).redis_url is None
    for url in ("http://127.0.0.1:1", f"{server.url}?decode_responses=True"):
        with pytest.raises(ValueError):
            RedisTier(url, 1 << 20, secret=SECRET)
    with pytest.raises(ValueError):
        RedisTier(server.url, 1 << 20, prefix="", secret=SECRET)
    with pytest.raises(ValidationError, match="redis_url"):
        Settings(_env_file=None, redis_url="localhost:6379")
    with pytest.raises(ValidationError, match="redis_ttl_s"):
        Settings(_env_file=None, redis_url=server.url, redis_ttl_s=-1)


# The ACL user docs/deploy-redis.md gives the gateways: only the tier's commands, only its prefix.
TIER_ACL = ("on resetkeys ~hypic:* resetchannels -@all +ping +auth +client|setinfo +script|load +evalsha +eval +get "
            "+set +del +exists +expire +zadd +zrem +zrange +zrangebyscore +hget +hset +hdel +hexists +incrby +decrby +time")


def test_the_documented_acl_user_is_enough_for_the_tier_and_no_more(server, tiers):
    import redis

    doc = (Path(__file__).resolve().parents[2] / "docs" / "deploy-redis.md").read_text()
    assert f"ACL SETUSER hypic {TIER_ACL} >" in " ".join(doc.split())  # the docs give these same rules
    admin = server.client()
    admin.execute_command("ACL", "SETUSER", "hypic", "reset", *TIER_ACL.split(), ">acl-test-password")
    try:
        url = server.url.replace("redis://", "redis://hypic:acl-test-password@")
        e = make_entry(n=40)
        writer = store_of(tiers(url))
        writer.insert(key_of(e), e)
        writer.flush()
        reader = store_of(tiers(url))
        assert reader.lookup(key_of(e), e.token_ids) is not None and reader.stats().hits["redis"] == 1
        reader.evict(key_of(e))
        assert writer.shared.stats().errors == reader.shared.stats().errors == 0 and admin.exists("hypic:bytes")
        limited = redis.Redis.from_url(url, socket_timeout=2)
        for command in (("FLUSHALL",), ("SET", "other:key", "x"), ("CONFIG", "GET", "*"), ("KEYS", "*")):
            with pytest.raises(redis.exceptions.NoPermissionError):
                limited.execute_command(*command)
        limited.close()
    finally:
        admin.execute_command("ACL", "DELUSER", "hypic")


def test_passwords_are_never_logged():
    from hypic_core.cache.redis_tier import redacted

    assert redacted("redis://h:6379/0") == "redis://h:6379/0"
    assert redacted("redis://user:p@ss:w@h:6379/0") == "redis://user:***@h:6379/0"
    assert redacted("rediss://:pw@h") == "rediss://:***@h"
    assert redacted("unix:///run/r.sock?db=0&password=pw&x=1") == "unix:///run/r.sock?db=0&password=***&x=1"


# --- through a TieredSegmentStore -----------------------------------------------------------
def test_a_hit_from_another_replica_is_exact_promoted_and_exported(server, tiers, tmp_path):
    e = make_entry(n=40)
    writer = store_of(tiers(server.url), DiskTier(tmp_path / "a", size_limit=1 << 30))
    writer.insert(key_of(e), e)
    writer.flush()
    disk_b = DiskTier(tmp_path / "b", size_limit=1 << 30)
    reader = store_of(tiers(server.url), disk_b)  # another replica: its own memory and disk
    got = reader.lookup(key_of(e), e.token_ids)
    assert got is not None and all(torch.equal(x, y) for x, y in zip(got.keys, e.keys))
    s = reader.stats()
    assert s.hits == {"host": 0, "disk": 0, "redis": 1} and s.tier_misses == {"host": 1, "disk": 1, "redis": 0}
    assert s.bytes["redis"] > 0 and s.bytes["host"] == e.nbytes and s.redis_connected == 1 and s.corrupt == 0
    assert reader.lookup(key_of(e), e.token_ids) is not None and reader.stats().hits["host"] == 1
    reader.flush()
    assert reader.disk_key(key_of(e)) in disk_b  # promoted to the local disk too
    metrics = Metrics("m")
    metrics.watch_store(reader)
    text = metrics.render().decode()
    assert 'hypic_cache_hits_total{model_name="m",tier="redis"} 1.0' in text
    assert 'hypic_cache_lookups_total{model_name="m",tier="redis"} 1.0' in text
    assert 'hypic_cache_redis_connected{model_name="m"} 1.0' in text
    assert 'hypic_cache_tier_connected{model_name="m",tier="redis"} 1.0' in text
    assert 'hypic_cache_tier_writes_total{model_name="m",tier="disk"} 1.0' in text  # the Redis hit, written locally
    assert 'hypic_cache_tier_errors_total{model_name="m",tier="redis"} 0.0' in text
    writer.close()
    reader.close()


@pytest.mark.parametrize("kind", ["truncated", "flipped_byte", "wrong_schema", "other_model", "not_an_entry"])
def test_damaged_or_foreign_value_is_a_counted_deleted_miss(server, tiers, kind, caplog):
    e = make_entry(n=40)
    store = store_of(tiers(server.url))
    rk = "hypic:e:" + store.disk_key(key_of(e))
    raw = server.client()
    damage = b"\x80\x04pickled?" if kind == "not_an_entry" else damaged(kind, e)
    raw.set(rk, sign(SECRET.encode(), store.disk_key(key_of(e)), damage))  # signed: as a replica that stored it damaged
    with caplog.at_level(logging.WARNING, logger="hypic_core"):
        assert store.lookup(key_of(e), e.token_ids) is None
        assert store.lookup(key_of(e), e.token_ids) is None  # deleted: a plain miss, not logged again
    s = store.stats()
    assert s.corrupt == 1 and s.misses == 2 and s.hits["redis"] == 0 and s.tier_misses["redis"] == 2
    assert raw.exists(rk) == 0 and len([r for r in caplog.records if "in redis" in r.getMessage()]) == 1
    store.insert(key_of(e), e)  # the recomputed entry replaces it
    store.flush()
    assert store_of(tiers(server.url)).lookup(key_of(e), e.token_ids) is not None


def test_a_shared_tier_needs_a_secret_and_refuses_to_start_without_one(server, monkeypatch):
    from typer.testing import CliRunner

    from app.cli import cli
    from hypic_core.cache import build_store

    with pytest.raises(ValidationError, match="HYPIC_CACHE_SECRET"):
        Settings(_env_file=None, redis_url=server.url, cache_dir=None)
    with pytest.raises(ValidationError, match="HYPIC_CACHE_SECRET"):
        Settings(_env_file=None, redis_url=server.url, cache_dir=None, cache_secret="")
    with pytest.raises(TypeError):
        RedisTier(server.url, 1 << 20)  # the secret is a required argument of the tier itself
    for empty in ("", b""):
        with pytest.raises(ValueError, match="secret"):
            RedisTier(server.url, 1 << 20, secret=empty)
    with pytest.raises(ValueError, match="HYPIC_CACHE_SECRET"):
        build_store(1 << 20, redis_url=server.url)
    monkeypatch.delenv("HYPIC_CACHE_SECRET", raising=False)
    monkeypatch.setenv("HYPIC_REDIS_URL", server.url)
    result = CliRunner().invoke(cli, ["serve", "--port", "1"])  # refused before anything loads or binds
    assert result.exit_code == 1 and "HYPIC_CACHE_SECRET" in result.output, result.output


def forged(value: bytes) -> bytes:
    """What whoever can write to Redis, without the secret, can make of a stored entry: its tensors
    changed (halved) and its sha256 recomputed, so that it passes the checksum and every check
    of its metadata (model, key, schema, token ids)."""
    if value.startswith(b"HYPICMAC"):
        value = value[SIGNING:]
    payload = value[_PREFIX.size :]
    (header,) = struct.unpack_from("<Q", payload)
    meta = json.loads(payload[8 : 8 + header])["__metadata__"]
    tensors = {name: t * 0.5 if t.is_floating_point() else t for name, t in st_load(payload).items()}
    payload = st_save(tensors, metadata=meta)
    return _PREFIX.pack(MAGIC, len(payload), hashlib.sha256(payload).digest()) + payload


@pytest.mark.parametrize("how", ["unsigned", "another_secret", "another_keys_value"])
def test_a_forged_entry_is_a_counted_miss_never_an_answer(server, model, request_, how, caplog):
    """Before: an entry planted with a valid sha256 was a Redis hit on every replica, and the
    answer was computed from the planted tensors. Now an entry without this deployment's
    signature (unsigned, signed with another secret, or a genuine value copied under another
    chunk's key) is a counted miss, deleted; the recomputed entry replaces it."""
    n = len(LENGTHS) - 1
    first = store_of(RedisTier(server.url, 1 << 30, secret=SECRET))
    cold_logits, cold_tokens = answer(Engine(model, config=CONFIG, store=first), request_)
    first.close()
    raw = server.client()
    keys = sorted(raw.keys("hypic:e:*"))
    victim = keys[1]
    planted = {"unsigned": lambda: forged(raw.get(victim)),
               "another_secret": lambda: sign(b"another deployment", victim.decode().removeprefix("hypic:e:"),
                                              forged(raw.get(victim))),
               "another_keys_value": lambda: raw.get(keys[2])}[how]()
    raw.set(victim, planted)
    store = store_of(RedisTier(server.url, 1 << 30, secret=SECRET))
    with caplog.at_level(logging.WARNING, logger="hypic_core"):
        logits, tokens = answer(Engine(model, config=CONFIG, store=store), request_)
    s = store.stats()
    assert s.corrupt == 1 and s.hits["redis"] == n - 1 and s.misses == 1, s
    assert (logits - cold_logits).abs().max().item() <= 1e-5 and tokens == cold_tokens
    assert ("unsigned" if how == "unsigned" else "forged") in caplog.text
    store.close()  # writes the recomputed entry
    assert raw.get(victim) not in (planted, None)
    healed = store_of(RedisTier(server.url, 1 << 30, secret=SECRET))
    answer(Engine(model, config=CONFIG, store=healed), request_)
    assert healed.stats().hits["redis"] == n and healed.stats().corrupt == 0
    healed.close()


def test_down_at_start_is_skipped_logged_once_and_reconnected(tmp_path, tiers, caplog):
    later = RedisServer(tmp_path / "later")  # its port is free: nothing listens yet
    e = make_entry(n=40)
    with caplog.at_level(logging.WARNING, logger="hypic_core"):
        store = store_of(tiers(later.url))
        for _ in range(3):
            assert store.lookup(key_of(e), e.token_ids) is None
            store.insert(key_of(e), e)
            store.evict(key_of(e))
        wait_until(lambda: store.stats().redis_errors >= 3)  # failed reconnection attempts, not logged again
    warnings = [r for r in caplog.records if "redis" in r.getMessage()]
    assert len(warnings) == 1 and "unreachable" in warnings[0].getMessage()
    s = store.stats()
    assert s.redis_connected == 0 and s.redis_errors >= 2 and s.redis_dropped_writes == 3
    assert s.tier_misses["redis"] == 0 and s.misses == 3  # a tier that is down is not asked
    later.start()
    try:
        wait_until(lambda: store.stats().redis_connected == 1)
        store.insert(key_of(e), e)
        store.flush()
        assert store_of(tiers(later.url)).lookup(key_of(e), e.token_ids) is not None
    finally:
        later.stop()


def test_a_server_that_never_answers_costs_one_timeout(tiers):
    import socket

    with socket.socket() as silent:  # accepts connections (the backlog) and never answers
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)
        e = make_entry(n=40)
        t0 = time.perf_counter()
        store = store_of(tiers(f"redis://127.0.0.1:{silent.getsockname()[1]}/0", timeout_s=0.2))
        assert 0.2 <= time.perf_counter() - t0 < 5  # the first ping timed out: down
        t0 = time.perf_counter()
        for _ in range(5):
            assert store.lookup(key_of(e), e.token_ids) is None
        assert time.perf_counter() - t0 < 0.2  # skipped while down, never another timeout on the caller
        assert store.stats().redis_connected == 0 and store.stats().tier_misses["redis"] == 0


def test_a_server_that_answers_with_errors_is_not_taken_for_down(server, tiers, caplog):
    e = make_entry(n=40)
    store = store_of(tiers(server.url), host_bytes=0)  # every lookup reaches Redis
    raw = server.client()
    raw.set("hypic:lru", b"not a sorted set")  # every script now fails with WRONGTYPE
    with caplog.at_level(logging.WARNING, logger="hypic_core"):
        for _ in range(2):
            assert store.lookup(key_of(e), e.token_ids) is None
            store.insert(key_of(e), e)
            store.flush()
    s = store.stats()
    assert s.redis_connected == 1 and s.redis_errors == 4 and s.redis_dropped_writes == 2
    logged = [r.getMessage() for r in caplog.records]
    assert len(logged) == 2 and "read refused" in logged[0] and "write refused" in logged[1]  # once per kind
    raw.delete("hypic:lru")
    store.insert(key_of(e), e)  # no reconnection wait: the tier never went down
    store.flush()
    assert store_of(tiers(server.url)).lookup(key_of(e), e.token_ids) is not None


# --- an engine on the tier -----------------------------------------------------------------
LENGTHS = (12, 30, 21, 25, 5)  # system prompt, three chunks, question
CONFIG = EngineConfig(seam=4)


@pytest.fixture(scope="module")
def request_():
    return GenerationRequest(random_segments(LENGTHS, seed=7), sampling=SamplingParams(max_tokens=4))




class KillsServerAfterFirstRead(RedisTier):
    """A real tier whose server is SIGKILLed right after the first value it reads."""

    def __init__(self, server: RedisServer, **kw):
        super().__init__(server.url, 1 << 30, retry_s=FAST_RETRY, secret=SECRET, **kw)
        self.server, self.reads = server, 0

    def get(self, key):
        value = super().get(key)
        self.reads += 1
        if self.reads == 1:
            self.server.kill()
        return value


def test_server_killed_mid_request_never_changes_an_answer(server, model, request_):
    n = len(LENGTHS) - 1
    cold_store = store_of(RedisTier(server.url, 1 << 30, secret=SECRET))
    cold_logits, cold_tokens = answer(Engine(model, config=CONFIG, store=cold_store), request_)
    cold_store.close()
    assert cold_store.stats().misses == n and int(server.client().get("hypic:bytes")) > 0

    shared = KillsServerAfterFirstRead(server)
    store = store_of(shared)
    try:
        logits, tokens = answer(Engine(model, config=CONFIG, store=store), request_)
        s = store.stats()
        assert s.hits["redis"] == 1 and s.misses == n - 1 and s.redis_errors >= 1 and s.redis_connected == 0
        # Segments recomputed alone vs. in the cold run's padded batch: equal up to float rounding.
        assert (logits - cold_logits).abs().max().item() <= 1e-5 and tokens == cold_tokens
    finally:
        server.start()
    wait_until(lambda: shared.available)  # a fresh, empty server: the tier uses it again
    store.close()


def test_corrupted_value_never_changes_an_answer(server, model, request_):
    n = len(LENGTHS) - 1
    first = store_of(RedisTier(server.url, 1 << 30, secret=SECRET))
    cold_logits, cold_tokens = answer(Engine(model, config=CONFIG, store=first), request_)
    first.close()
    raw = server.client()
    victim = sorted(k for k in raw.keys("hypic:e:*"))[1]
    data = bytearray(raw.get(victim))
    data[len(data) // 2] ^= 0xFF  # bit rot in one stored value
    raw.set(victim, bytes(data))
    store = store_of(RedisTier(server.url, 1 << 30, secret=SECRET))
    logits, tokens = answer(Engine(model, config=CONFIG, store=store), request_)
    s = store.stats()
    assert s.corrupt == 1 and s.hits["redis"] == n - 1 and s.misses == 1
    assert (logits - cold_logits).abs().max().item() <= 1e-5 and tokens == cold_tokens
    store.close()  # writes the recomputed entry
    assert raw.get(victim) != bytes(data) and raw.get(victim) is not None
    healed = store_of(RedisTier(server.url, 1 << 30, secret=SECRET))
    answer(Engine(model, config=CONFIG, store=healed), request_)
    assert healed.stats().hits["redis"] == n and healed.stats().corrupt == 0
    healed.close()


# --- two gateways, one Redis ------------------------------------------------------------------
CORPUS = [
    {"id": "city-varo", "title": "Varo", "text": "Varo is a city on the river Alna. Its mayor is Ines Kell."},
    {"id": "firm-brill", "title": "Brill", "text": "Brill is a company founded by Tam Oke in 1999."},
    {"id": "river-alna", "title": "Alna", "text": "The Alna is a river that flows into the sea near Varo."},
]


def gateway(root, tokenizer, redis_url: str):
    """(app, store): a gateway over the tiny engine whose store is built from its settings, as `hypic serve`
    builds it (host memory, a disk tier beside its index, Redis at `redis_url`). No accuracy guard: two
    gateways here run in one process, and a stitch patches functions of transformers' modeling module,
    which every engine in the process shares; one gateway's idle shadow check would run its patched
    forward while the other serves (a gateway process serves one engine: this is the tests' setup only)."""
    return stores.gateway(root, tokenizer, CORPUS, redis_url=redis_url, cache_secret=SECRET, guard_enabled=False)


def test_a_gateway_starts_and_answers_with_redis_down(tiny_tokenizer, tmp_path, caplog):
    nothing = RedisServer(tmp_path / "never")  # a free port: connections are refused
    with caplog.at_level(logging.WARNING, logger="hypic_core"):
        app, store = gateway(tmp_path / "g", tiny_tokenizer, nothing.url)
    try:
        with single_torch_thread(), LiveServer(app) as g:
            g.wait_ready()
            for _ in range(2):
                r = httpx.post(f"{g.url}/query", json={"question": "Who founded Brill?", "top_k": 2, "max_tokens": 4}, timeout=60)
                assert r.status_code == 200, r.text
            metrics = httpx.get(f"{g.url}/metrics").text
    finally:
        store.close()
    assert len([r for r in caplog.records if "redis" in r.getMessage()]) == 1
    assert 'hypic_cache_redis_connected{model_name="tiny"} 0.0' in metrics
    assert store.stats().hits["host"] > 0 and store.stats().tier_misses["redis"] == 0


def test_two_gateways_share_entries_through_redis(server, tiny_tokenizer, tmp_path):
    body = {"question": "Who is the mayor of Varo?", "top_k": 3, "max_tokens": 8}
    app_a, store_a = gateway(tmp_path / "a", tiny_tokenizer, server.url)
    app_b, store_b = gateway(tmp_path / "b", tiny_tokenizer, server.url)
    try:
        with single_torch_thread(), LiveServer(app_a) as a, LiveServer(app_b) as b:
            a.wait_ready()
            b.wait_ready()
            first = httpx.post(f"{a.url}/query", json=body, timeout=60).json()
            store_a.flush()  # A's write-through to Redis is done
            second = httpx.post(f"{b.url}/query", json=body, timeout=60).json()
            metrics = httpx.get(f"{b.url}/metrics").text
    finally:
        store_a.close()
        store_b.close()
    assert second["answer"] == first["answer"]
    assert [s["chunk_id"] for s in second["sources"]] == [s["chunk_id"] for s in first["sources"]]
    chunks = len(first["sources"])
    assert store_a.stats().hits["redis"] == 0 and store_b.stats().hits["redis"] == chunks
    assert first["usage"]["composed_tokens"] == 0 < second["usage"]["composed_tokens"]
    assert second["usage"]["prompt_tokens"] == first["usage"]["prompt_tokens"]
    assert f'hypic_cache_hits_total{{model_name="tiny",tier="redis"}} {float(chunks)}' in metrics

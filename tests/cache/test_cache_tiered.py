"""TieredSegmentStore in one process: promotion, budgets, stats, policy, damaged disk entries, threads."""

from __future__ import annotations

import logging
import threading

import pytest
import torch

from hypic_core.algebra.keys import SCHEMA_VERSION, SegmentKey
from hypic_core.cache import DiskTier, MemoryTier, StoredTier, TieredSegmentStore, TierStats, WriteBehindTier, encode
from test_cache_serde import MODEL, make_entry


def key_of(entry, model=MODEL, schema=SCHEMA_VERSION):
    k = SegmentKey.of(model, 8, entry.token_ids)
    return SegmentKey(k.model, k.seam, k.tokens, schema)


def two_tiers(hot_entries: int, host_entries: int, size: int, disk=None, **kw) -> TieredSegmentStore:
    """A "device" and a "host" tier, both on the CPU (the cascade is the same with a GPU)."""
    tiers = [MemoryTier("device", "cpu", hot_entries * size), MemoryTier("host", "cpu", host_entries * size)]
    return TieredSegmentStore("cpu", tiers, disk, **kw)


@pytest.fixture
def disk(tmp_path):
    d = DiskTier(tmp_path / "cache", size_limit=1 << 30)
    yield d
    d.close()


def test_hits_promote_to_the_hot_tier_and_overflow_moves_down():
    a, b, c = (make_entry(seed=i) for i in range(3))
    store = two_tiers(1, 1, a.nbytes)
    store.insert(key_of(a), a)
    store.insert(key_of(b), b)  # a is pushed down to host
    s = store.stats()
    assert s.bytes == {"device": a.nbytes, "host": a.nbytes} and s.evictions == 0
    got = store.lookup(key_of(a), a.token_ids)  # host hit: a back on top, b down
    assert got is not None and got.token_ids == a.token_ids
    assert store.lookup(key_of(a), a.token_ids) is not None
    s = store.stats()
    assert s.hits == {"device": 1, "host": 1} and s.tier_misses == {"device": 1, "host": 0}
    store.insert(key_of(c), c)  # c on top, a to host, b falls out of memory
    assert store.lookup(key_of(b), b.token_ids) is None
    s = store.stats()
    assert s.evictions == 1 and s.misses == 1 and s.tier_misses == {"device": 2, "host": 1}
    assert all(v >= 0 for v in s.load_seconds.values()) and s.load_seconds["host"] > 0


def test_budgets_are_bytes_and_oversized_entries_are_not_held():
    small, big = make_entry(n=10, seed=1), make_entry(n=200, seed=2)
    store = two_tiers(1, 1, small.nbytes)
    store.insert(key_of(big), big)
    assert store.stats().bytes == {"device": 0, "host": 0} and store.stats().evictions == 1
    assert store.lookup(key_of(big), big.token_ids) is None
    for i in range(5):
        e = make_entry(n=10, seed=10 + i)
        store.insert(key_of(e), e)
        assert sum(store.stats().bytes.values()) <= 2 * small.nbytes


def test_reinserting_a_key_replaces_it_without_leaking_bytes():
    e = make_entry()
    store = two_tiers(4, 4, e.nbytes)
    for _ in range(3):
        store.insert(key_of(e), e)
    assert store.stats().bytes == {"device": e.nbytes, "host": 0}
    store.evict(key_of(e))
    store.evict(key_of(e))  # evicting a missing key is a no-op
    assert store.stats().bytes == {"device": 0, "host": 0}


def test_hash_collision_in_memory_is_a_counted_miss(caplog):
    e = make_entry()
    store = two_tiers(2, 2, e.nbytes)
    store.insert(key_of(e), e)
    with caplog.at_level(logging.WARNING):
        assert store.lookup(key_of(e), tuple(reversed(e.token_ids))) is None
    s = store.stats()
    assert s.corrupt == 1 and s.misses == 1 and s.bytes["device"] == 0 and len(caplog.records) == 1


def test_disk_hit_from_a_fresh_store_is_exact(disk):
    e = make_entry(n=40)
    writer = two_tiers(4, 4, e.nbytes, disk)
    writer.insert(key_of(e), e)
    writer.flush()
    reader = two_tiers(4, 4, e.nbytes, disk)  # a restart: memory tiers empty
    got = reader.lookup(key_of(e), e.token_ids)
    assert got is not None and all(torch.equal(x, y) for x, y in zip(got.keys, e.keys))
    s = reader.stats()
    assert s.hits["disk"] == 1 and s.tier_misses == {"device": 1, "host": 1, "disk": 0} and s.bytes["disk"] > 0
    assert s.load_seconds["disk"] > 0 and s.bytes["device"] == e.nbytes  # promoted to the hot tier
    assert reader.lookup(key_of(e), e.token_ids) is not None and reader.stats().hits["device"] == 1


def test_disk_min_tokens_skips_short_segments(disk):
    short, long = make_entry(n=10, seed=1), make_entry(n=40, seed=2)
    store = two_tiers(0, 0, 1, disk, disk_min_tokens=32)
    store.insert(key_of(short), short)
    store.insert(key_of(long), long)
    store.flush()
    assert store.disk_key(key_of(short)) not in disk and store.disk_key(key_of(long)) in disk
    assert store.lookup(key_of(short), short.token_ids) is None
    assert store.stats().tier_misses["disk"] == 0  # never asked
    assert store.lookup(key_of(long), long.token_ids) is not None


def test_precisions_sharing_a_directory_never_mix(disk):
    e = make_entry(n=40)
    fp32 = two_tiers(0, 0, 1, disk)
    bf16 = two_tiers(0, 0, 1, disk, storage_dtype="bf16")
    bf16.insert(key_of(e), e)
    bf16.flush()
    assert fp32.lookup(key_of(e), e.token_ids) is None
    assert bf16.lookup(key_of(e), e.token_ids).keys[0].dtype == torch.float32


def damaged(kind, e):
    data = encode(e, key_of(e))
    if kind == "truncated":
        return data[: len(data) // 2]
    if kind == "flipped_byte":
        b = bytearray(data)
        b[len(b) - 7] ^= 0x40
        return bytes(b)
    if kind == "wrong_schema":
        return encode(e, key_of(e, schema=SCHEMA_VERSION + 1))
    if kind == "other_model":
        return encode(e, key_of(e, model="f" * 64))
    raise ValueError(kind)


@pytest.mark.parametrize("kind", ["truncated", "flipped_byte", "wrong_schema", "other_model"])
def test_damaged_disk_entry_is_a_counted_logged_evicted_miss(disk, kind, caplog):
    e = make_entry(n=40)
    store = two_tiers(0, 0, 1, disk)
    dk = store.disk_key(key_of(e))
    assert disk.put(dk, damaged(kind, e))
    with caplog.at_level(logging.WARNING, logger="hypic_core"):
        assert store.lookup(key_of(e), e.token_ids) is None
        assert store.lookup(key_of(e), e.token_ids) is None  # now a plain miss: evicted, not logged again
    s = store.stats()
    assert s.corrupt == 1 and s.misses == 2 and s.hits["disk"] == 0 and dk not in disk
    assert len([r for r in caplog.records if "evicted" in r.getMessage()]) == 1
    store.insert(key_of(e), e)  # the recomputed entry replaces it
    store.flush()
    assert two_tiers(0, 0, 1, disk).lookup(key_of(e), e.token_ids) is not None


def test_concurrent_threads_keep_budgets_and_return_right_entries(disk):
    entries = [make_entry(n=12 + i, seed=i) for i in range(12)]
    size = max(e.nbytes for e in entries)
    store = two_tiers(2, 3, size, disk)
    errors = []

    def worker(seed):
        g = torch.Generator().manual_seed(seed)
        try:
            for _ in range(150):
                e = entries[int(torch.randint(len(entries), (1,), generator=g))]
                got = store.lookup(key_of(e), e.token_ids)
                if got is None:
                    store.insert(key_of(e), e)
                elif got.token_ids != e.token_ids or not torch.equal(got.keys[0], e.keys[0]):
                    errors.append("wrong entry")
                s = store.stats()
                if s.bytes["device"] > 2 * size or s.bytes["host"] > 3 * size:
                    errors.append(f"over budget {s.bytes}")
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(repr(exc))

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    store.flush()
    assert not errors, errors[:3]
    s = store.stats()
    assert sum(s.hits.values()) + s.misses == 600 and s.corrupt == 0


def test_close_finishes_writes_and_keeps_memory_serving(tmp_path):
    e, later = make_entry(n=40, seed=1), make_entry(n=40, seed=2)
    store = two_tiers(4, 4, e.nbytes, DiskTier(tmp_path / "c", size_limit=1 << 30))
    store.insert(key_of(e), e)
    store.close()
    store.close()
    store.insert(key_of(later), later)
    assert store.lookup(key_of(later), later.token_ids) is not None
    reopened = DiskTier(tmp_path / "c", size_limit=1 << 30)
    assert store.disk_key(key_of(e)) in reopened and store.disk_key(key_of(later)) not in reopened
    reopened.close()


class DictTier(WriteBehindTier):
    """A stored tier in a dict: what a new tier is (one class against the protocol)."""

    name = "dict"

    def __init__(self, up: bool = True):
        self.values: dict[str, bytes] = {}
        self.up = up
        self._stats = TierStats(connected=up)
        self._start_writer(4)

    @property
    def available(self) -> bool:
        return self.up

    def get(self, key):
        return self.values.get(key)

    def put(self, key, value):
        self.values[key] = value
        self._stats.writes += 1
        return True

    def delete(self, key):
        self.values.pop(key, None)

    def stats(self):
        return TierStats(sum(map(len, self.values.values())), self._stats.writes, self._stats.dropped_writes,
                         connected=self.up)

    def _count_dropped(self):
        self._stats.dropped_writes += 1


def test_a_new_stored_tier_is_one_class_and_one_argument(disk):
    """Stored tiers are asked in order after memory; a later tier's hit is queued into the earlier ones;
    stats are keyed by tier; a tier that is not available is skipped (no miss counted there)."""
    assert isinstance(DictTier(), StoredTier) and isinstance(disk, StoredTier)
    e, other = make_entry(seed=40), make_entry(seed=41)
    extra = DictTier()
    writer = TieredSegmentStore("cpu", [MemoryTier("host", "cpu", 0)], stored=[extra])
    writer.insert(key_of(e), e)
    writer.flush()
    assert len(extra.values) == 1 and writer.stats().tiers["dict"].writes == 1
    store = TieredSegmentStore("cpu", [MemoryTier("host", "cpu", 0)], disk, stored=[extra])
    assert [t.name for t in store.stored] == ["disk", "dict"] and store.tier("dict") is extra
    got = store.lookup(key_of(e), e.token_ids)
    assert got is not None and torch.equal(got.keys[0], e.keys[0])
    store.flush()
    s = store.stats()
    assert s.hits == {"host": 0, "disk": 0, "dict": 1} and s.tier_misses == {"host": 1, "disk": 1, "dict": 0}
    assert s.tiers["disk"].writes == 1 and s.bytes["dict"] == s.tiers["dict"].bytes > 0  # the hit, now on disk too
    assert store.lookup(key_of(e), e.token_ids) is not None and store.stats().hits["disk"] == 1
    extra.up = False
    assert store.lookup(key_of(other), other.token_ids) is None
    s = store.stats()
    assert s.tier_misses["dict"] == 0 and s.misses == 1 and s.tiers["dict"].connected is False
    store.insert(key_of(other), other)
    assert store.stats().tiers["dict"].dropped_writes == 1  # a tier that is down drops writes at once
    store.close()
    assert store.stored == [] and store.disk is None

"""The disk tier: bytes only (no pickle either way), 0700, LRU under size_limit, background writes, I/O faults."""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import resource
import signal
import sqlite3
import stat
import threading
import time

import diskcache
import pytest

from hypic_core.cache import CorruptEntry, DiskTier, MemoryTier, TieredSegmentStore, build_store
from test_cache_serde import make_entry
from test_cache_tiered import key_of


class Boom:
    """Unpickling this creates `path`: proof that a value was (or was not) unpickled."""

    def __init__(self, path: str):
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


def memory_store(disk, **kw) -> TieredSegmentStore:
    return TieredSegmentStore("cpu", [MemoryTier("host", "cpu", 1 << 26)], disk, **kw)


def test_directory_is_created_0700(tmp_path):
    old = os.umask(0o022)
    try:
        fresh = DiskTier(tmp_path / "a" / "cache", size_limit=1 << 20)
        existing = tmp_path / "open"
        existing.mkdir(mode=0o755)
        reused = DiskTier(existing, size_limit=1 << 20)
    finally:
        os.umask(old)
    for d in (fresh, reused):
        assert stat.S_IMODE(os.stat(d.directory).st_mode) == 0o700
        d.close()


def test_only_str_keys_and_bytes_values_are_written(tmp_path):
    d = DiskTier(tmp_path / "c", size_limit=1 << 20)
    for key, value in [("k", bytearray(b"x")), ("k", "text"), ("k", {"a": 1}), (1, b"x"), (("t",), b"x")]:
        with pytest.raises(TypeError):
            d.put(key, value)
    with pytest.raises(TypeError):  # also through diskcache itself: nothing gets pickled
        d._cache.set("k", [1, 2])
    assert d.put("k", b"v") and d.get("k") == b"v" and d.get("missing") is None
    d.close()


@pytest.mark.parametrize("value", ["small_pickle", "file_pickle", "text", "int"])
def test_pickled_or_other_values_are_refused_on_read(tmp_path, value, caplog):
    marker = tmp_path / "unpickled"
    payload = {"small_pickle": Boom(str(marker)), "file_pickle": [Boom(str(marker)), b"x" * 100_000],
               "text": "t" * 100_000, "int": 7}[value]
    e = make_entry(n=40)
    d = DiskTier(tmp_path / "c", size_limit=1 << 30)
    store = memory_store(d)
    dk = store.disk_key(key_of(e))
    with diskcache.Cache(d.directory) as foreign:  # someone else wrote into our directory
        foreign.set(dk, payload)
    with pytest.raises(CorruptEntry) as info:
        d.get(dk)
    assert info.value.reason == "refused"
    with caplog.at_level(logging.WARNING, logger="hypic_core"):
        assert store.lookup(key_of(e), e.token_ids) is None
    assert not marker.exists()  # never unpickled
    assert store.stats().corrupt == 1 and dk not in d and len(caplog.records) == 1
    d.close()


def test_least_recently_used_values_leave_first_under_size_limit(tmp_path):
    d = DiskTier(tmp_path / "c", size_limit=1 << 30)
    index = d.stats().bytes
    d.close()
    value = b"v" * 100_000
    d = DiskTier(tmp_path / "c", size_limit=index + 350_000)
    for k in "abc":
        assert d.put(k, value)
        time.sleep(0.01)
    assert d.get("a") == value  # a is now more recent than b
    assert d.put("d", value)
    assert "b" not in d and all(k in d for k in "acd")
    assert d.stats().bytes <= index + 350_000
    d.close()


def test_put_later_drops_when_the_queue_is_full_and_never_blocks(tmp_path):
    d = DiskTier(tmp_path / "c", size_limit=1 << 30, write_queue=1)
    started, gate = threading.Event(), threading.Event()

    def slow() -> bytes:
        started.set()
        gate.wait(10)
        return b"a"

    assert d.put_later("a", slow)
    assert started.wait(10)  # the writer holds "a"; the queue has one free slot
    t = time.perf_counter()
    assert d.put_later("b", lambda: b"b")
    assert not d.put_later("c", lambda: b"c")
    assert time.perf_counter() - t < 0.5
    gate.set()
    d.flush()
    assert d.get("a") == b"a" and d.get("b") == b"b" and "c" not in d
    assert d.stats().dropped_writes == 1 and d.stats().writes == 2
    d.close()


def test_writer_survives_a_failing_value(tmp_path, caplog):
    d = DiskTier(tmp_path / "c", size_limit=1 << 30)
    with caplog.at_level(logging.WARNING, logger="hypic_core"):
        d.put_later("bad", lambda: 1 // 0)
        d.put_later("bad2", lambda: 1 // 0)
        d.put_later("good", lambda: b"ok")
        d.flush()
    assert d.get("good") == b"ok" and d.stats().errors == 2 and len(caplog.records) == 1
    d.close()


def test_failing_disk_degrades_to_memory(tmp_path, monkeypatch, caplog):
    """A directory that turns read-only (or full) under a running store: writes, and reads of a
    present value, fail inside diskcache; the store keeps answering from memory, counts the
    errors and logs each kind once."""
    d = DiskTier(tmp_path / "c", size_limit=1 << 30)
    store = memory_store(d)
    before = make_entry(n=40, seed=99)
    store.insert(key_of(before), before)
    store.flush()

    def readonly(*args, **kwargs):
        raise sqlite3.OperationalError("attempt to write a readonly database")

    monkeypatch.setattr(diskcache.Cache, "add", readonly)
    monkeypatch.setattr(diskcache.Cache, "get", readonly)
    entries = [make_entry(n=40, seed=i) for i in range(3)]
    with caplog.at_level(logging.WARNING, logger="hypic_core"):
        for e in entries:
            store.insert(key_of(e), e)
        store.flush()
        assert all(store.lookup(key_of(e), e.token_ids) is not None for e in entries)
        fresh = memory_store(d)
        assert all(fresh.lookup(key_of(e), e.token_ids) is None for e in [before, before, *entries])
    s, f = store.stats(), fresh.stats()
    assert s.hits["host"] == 3 and s.dropped_writes == 3 and s.disk_errors == 5
    assert f.misses == 5 and f.corrupt == 0 and f.tier_misses["disk"] == 5
    assert len(caplog.records) == 2  # one line for writes, one for reads
    monkeypatch.undo()
    d.close()


def test_unusable_directory_degrades_to_memory(tmp_path, caplog):
    blocker = tmp_path / "file"
    blocker.write_bytes(b"not a directory")
    with caplog.at_level(logging.WARNING, logger="hypic_core"):
        store = build_store(1 << 26, directory=blocker / "cache")
    assert isinstance(store, TieredSegmentStore) and store.disk is None and len(caplog.records) == 1
    e = make_entry(n=40)
    store.insert(key_of(e), e)
    assert store.lookup(key_of(e), e.token_ids) is not None and store.stats().hits == {"host": 1}


def _fill_disk(directory: str, conn) -> None:
    """Child process: a store whose disk runs out of space (RLIMIT_FSIZE: writes fail with EFBIG)."""
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    store = build_store(1 << 28, directory=directory)
    resource.setrlimit(resource.RLIMIT_FSIZE, (64 << 10, 64 << 10))
    entries = [make_entry(n=400, width=64, seed=i) for i in range(3)]
    for e in entries:
        store.insert(key_of(e), e)
    store.flush()
    warm = [store.lookup(key_of(e), e.token_ids) is not None for e in entries]
    fresh = build_store(1 << 28, directory=directory)
    cold = [fresh.lookup(key_of(e), e.token_ids) is None for e in entries]
    s = store.stats()
    conn.send({"warm": all(warm), "cold": all(cold), "dropped": s.dropped_writes, "errors": s.disk_errors,
               "corrupt": s.corrupt + fresh.stats().corrupt})


def test_disk_full_degrades_to_memory(tmp_path):
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    p = ctx.Process(target=_fill_disk, args=(str(tmp_path / "c"), child))
    p.start()
    assert parent.poll(60), "child did not report"
    out = parent.recv()
    p.join(10)
    assert p.exitcode == 0
    assert out == {"warm": True, "cold": True, "dropped": 3, "errors": 3, "corrupt": 0}

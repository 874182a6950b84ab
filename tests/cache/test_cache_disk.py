"""The disk tier: bytes only (no pickle either way), 0700, LRU under size_limit, background writes, I/O faults,
a damaged index moved aside, a lost value file rewritten."""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import random
import shutil
import resource
import signal
import sqlite3
import stat
import threading
import time

import diskcache
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hypic_core.cache import CorruptEntry, DiskTier, MemoryTier, TieredSegmentStore, build_store
from hypic_core.cache.disk import journal_reserve
from test_cache_serde import make_entry, tensors_equal
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
    value = b"v" * 1_000_000
    limit = index + journal_reserve(index + 3_500_000) + 3_500_000  # room for three values, not four
    d = DiskTier(tmp_path / "c", size_limit=limit)
    for k in "abc":
        assert d.put(k, value)
        time.sleep(0.01)
    assert d.get("a") == value  # a is now more recent than b
    assert d.put("d", value)
    assert "b" not in d and all(k in d for k in "acd")
    assert d.stats().bytes <= limit
    d.close()


def files_bytes(directory) -> int:
    return sum(os.path.getsize(os.path.join(root, f)) for root, _, files in os.walk(directory) for f in files)


@pytest.mark.parametrize("value_bytes", [1_000, 20_000, 100_000], ids=["small-in-index", "in-index", "value-files"])
def test_the_budget_holds_every_file_including_sqlites_log(tmp_path, value_bytes):
    """Before: SQLite's write-ahead log (cache.db-wal) was outside the budget and grew to 4 MB
    (a 3 MB budget held 6.8 MB). Now every file in the directory, the log included, stays under
    it while writing, and `stats().bytes` counts them all."""
    budget = 3 << 20
    d = DiskTier(tmp_path / "c", size_limit=budget)
    most = 0
    for i in range(3 * budget // value_bytes):
        assert d.put(f"k{i}", os.urandom(value_bytes))
        if i % 7 == 0:
            most = max(most, files_bytes(tmp_path / "c"))
    on_disk = files_bytes(tmp_path / "c")
    assert max(most, on_disk) <= budget, f"{max(most, on_disk)} bytes on disk, budget {budget}"
    assert d.stats().bytes == on_disk
    assert f"k{3 * budget // value_bytes - 1}" in d  # the newest values are kept, not everything culled
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
    assert isinstance(store, TieredSegmentStore) and not store.disk.available and len(caplog.records) == 1
    e = make_entry(n=40)
    store.insert(key_of(e), e)
    assert store.lookup(key_of(e), e.token_ids) is not None and store.stats().hits == {"host": 1, "disk": 0}
    store.close()


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


def in_child(target, *args):
    """Run `target(*args, conn)` in a spawned process; (what it sent on `conn` within 60 s, its exit code)."""
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    p = ctx.Process(target=target, args=(*args, child))
    p.start()
    assert parent.poll(60), "child did not report"
    out = parent.recv()
    p.join(10)
    return out, p.exitcode


def test_disk_full_degrades_to_memory(tmp_path):
    out, exitcode = in_child(_fill_disk, str(tmp_path / "c"))
    assert exitcode == 0
    assert out == {"warm": True, "cold": True, "dropped": 3, "errors": 3, "corrupt": 0}


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(budget=st.integers(1 << 20, 4 << 20), ops=st.lists(st.tuples(st.booleans(), st.integers(0, 39), st.integers(100, 300_000)),
                                                           min_size=20, max_size=80))
def test_no_mix_of_writes_and_reads_passes_the_budget(tmp_path_factory, budget, ops):
    """Values of any size from 100 bytes (in cache.db) to 300 KB (value files), written and read
    in any order: the directory never holds more than the budget."""
    directory = tmp_path_factory.mktemp("budget")
    d = DiskTier(directory, size_limit=budget)
    try:
        for write, key, size in ops:
            if write:
                d.put(f"k{key}-{size}", os.urandom(size))
                assert files_bytes(directory) <= budget
            else:
                d.get(f"k{key}-{size}")
    finally:
        d.close()
    assert files_bytes(directory) <= budget


def _cut_while_open(directory: str, size: str, conn) -> None:
    """Child process: a store in use whose cache.db is cut short under it, then read and written."""
    store = build_store(1 << 26, directory=directory)
    entries = [make_entry(n=200, width=64, seed=i) for i in range(12)]
    for e in entries:
        store.insert(key_of(e), e)
    store.flush()
    index = os.path.join(directory, "cache.db")
    os.truncate(index, 0 if size == "0" else os.path.getsize(index) // 2)
    found = [store.lookup(key_of(e), e.token_ids) is not None for e in entries]
    late = make_entry(n=200, width=64, seed=99)
    store.insert(key_of(late), late)
    store.flush()
    s = store.stats()
    conn.send({"found": sum(found), "errors": s.disk_errors})
    store.close()


@pytest.mark.parametrize("size", ["0", "half"])
def test_an_index_cut_short_while_open_is_no_crash(tmp_path, size):
    """Before: diskcache maps 64 MB of cache.db into memory, so the first read after the file
    was cut short under a running tier was a SIGBUS that killed the whole process (the gateway).
    Now the tier reads with read() calls: reads and writes go on (from SQLite's log and cache,
    or as counted errors), and the next open moves the damaged directory aside."""
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    p = ctx.Process(target=_cut_while_open, args=(str(tmp_path / "c"), size, child))
    p.start()
    p.join(120)
    assert p.exitcode == 0, f"the process died (exit code {p.exitcode}; -7 is SIGBUS)"
    assert parent.poll(1)
    out = parent.recv()
    assert 0 <= out["found"] <= 12 and out["errors"] >= 0
    reopened = build_store(1 << 26, directory=tmp_path / "c")
    s = reopened.stats()
    assert s.disk_errors == 0  # damage found at open is moved aside (or the cut left SQLite a valid file)
    reopened.close()


def _filled_cache(directory) -> None:
    """A disk tier holding entries as a gateway's does (values over 32 KB are files beside the
    index, one small row each in cache.db) and one small entry (its value in cache.db), closed."""
    store = build_store(1 << 26, directory=directory)
    for e in [make_entry(n=200, width=64, seed=i) for i in range(12)] + [make_entry(n=40, seed=99)]:
        store.insert(key_of(e), e)
    store.close()


def _damage(path, how: str) -> bytes:
    """Overwrite 8 random runs of up to 64 bytes ("bytes-<seed>") or cut the file ("cut-<bytes>")."""
    if how == "deleted":
        path.unlink()
        return b""
    data = bytearray(path.read_bytes())
    kind, arg = how.split("-")
    if kind == "cut":
        data = data[: int(arg) if int(arg) >= 0 else len(data) + int(arg)]
    else:
        rng = random.Random(int(arg))
        for _ in range(8):
            at, n = rng.randrange(len(data)), rng.randrange(1, 64)
            data[at : at + n] = rng.randbytes(min(n, len(data) - at))
    path.write_bytes(bytes(data))
    return bytes(data)


def _open_damaged(tmp_path, how: str, caplog) -> tuple[TieredSegmentStore, bool]:
    """Fill a disk tier, damage its cache.db (`_damage`), open it again as the gateway does.
    Checks what must hold either way; returns the store and whether the directory was moved aside."""
    d = tmp_path / how / "cache"
    _filled_cache(d)
    index = d / "cache.db"
    damaged = _damage(index, how.replace("half", str(index.stat().st_size // 2)))
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="hypic_core"):
        store = build_store(1 << 26, directory=d)  # before: raised (UnicodeDecodeError, AttributeError) or had no disk tier
    assert isinstance(store, TieredSegmentStore) and store.disk is not None
    aside = list(d.parent.glob("cache.damaged-*"))
    moved = store.stats().disk_damaged == 1
    if moved:
        assert len(aside) == 1 and ((aside[0] / "cache.db").read_bytes() if damaged else b"") == damaged  # kept for inspection
        assert [r.levelname for r in caplog.records if "is damaged" in r.message] == ["ERROR"]
    else:  # the damage missed every page SQLite reads (bytes of a value, free space): the tier is kept
        assert not aside
    e = make_entry(n=200, width=64, seed=77)
    store.insert(key_of(e), e)
    store.close()
    fresh = build_store(1 << 26, directory=d)  # the tier serves, across restarts
    assert fresh.lookup(key_of(e), e.token_ids) is not None
    s = fresh.stats()
    assert s.hits["disk"] == 1 and s.disk_errors == 0 and s.disk_damaged == 0 and len(list(d.parent.glob("cache.damaged-*"))) == int(moved)
    fresh.close()
    return store, moved


@pytest.mark.parametrize("how", ["cut-half", "cut-100", "cut-0", "deleted"])
def test_truncated_index_is_moved_aside_and_the_tier_starts_empty(tmp_path, how, caplog):
    """cut-0: cache.db emptied; deleted: cache.db gone. Before, SQLite opened either as a new,
    empty index and the value files it had named stayed in the directory for good, uncounted by
    the disk budget; now the directory is moved aside like any damaged one, so none are left
    behind."""
    _, moved = _open_damaged(tmp_path, how, caplog)
    assert moved
    assert len(list((tmp_path / how / "cache").rglob("*.val"))) == 1  # the one entry written since


def test_randomly_damaged_index_opens_and_serves(tmp_path, caplog):
    """Random damage (8 runs of up to 64 bytes) to cache.db. Before, most such damages kept the
    tier from opening (sqlite3.DatabaseError: memory only; UnicodeDecodeError or AttributeError:
    the gateway never became ready) or made every later read fail ("database disk image is
    malformed"). Now each is found at open and moved aside, or missed what SQLite reads."""
    outcomes = {seed: _open_damaged(tmp_path, f"bytes-{seed}", caplog)[1] for seed in range(12)}
    assert sum(outcomes.values()) >= 6, outcomes  # measured: 31 of 40 seeds, the rest hit value bytes or free space


def test_a_second_damage_replaces_the_first_damaged_copy(tmp_path):
    d = tmp_path / "cache"
    for round_ in range(2):
        _filled_cache(d)
        _damage(d / "cache.db", "cut-100")
        build_store(1 << 26, directory=d).close()
        time.sleep(1.1 if round_ == 0 else 0)  # copies are named by the second
    assert len(list(tmp_path.glob("cache.damaged-*"))) == 1


def test_a_deleted_value_file_is_a_counted_miss_and_is_written_again(tmp_path, caplog):
    """Before: the row stayed, so the lookup was a plain miss and the rewrite was skipped
    (the key was "present"): a permanent, uncounted miss."""
    d = tmp_path / "cache"
    e = make_entry(n=200, width=64)
    store = build_store(1 << 26, directory=d)
    store.insert(key_of(e), e)
    store.close()
    (value_file,) = d.rglob("*.val")
    value_file.unlink()
    store = build_store(1 << 26, directory=d)
    with caplog.at_level(logging.WARNING, logger="hypic_core"):
        assert store.lookup(key_of(e), e.token_ids) is None
    s = store.stats()
    assert s.corrupt == 1 and s.misses == 1 and s.tier_misses["disk"] == 1 and "missing" in caplog.text
    store.insert(key_of(e), e)  # what the engine does with the segment it recomputed
    store.close()
    fresh = build_store(1 << 26, directory=d)
    back = fresh.lookup(key_of(e), e.token_ids)
    assert back is not None and tensors_equal(back, e) and fresh.stats().hits["disk"] == 1 and fresh.stats().corrupt == 0
    fresh.close()


@pytest.mark.parametrize("name", ["nul", "parent", "absolute", "symlink"])
def test_a_row_naming_a_file_outside_the_cache_is_a_dropped_miss(tmp_path, name, caplog):
    """A row whose value-file name passes SQLite's integrity check but is damaged. Before: a NUL
    gave "embedded null byte" (ValueError) on every lookup, a 500 per request, and the row was
    never dropped; `../outside/victim.val` (or an absolute name, or a symbolic link out) was read
    as the entry and then deleted with its directory. Now each is a counted miss, the row is
    dropped, and the file outside is neither served nor removed."""
    d = tmp_path / "cache"
    e = make_entry(n=200, width=64)
    store = build_store(1 << 26, directory=d)
    store.insert(key_of(e), e)
    store.close()
    (value_file,) = d.rglob("*.val")
    outside = tmp_path / "outside" / "victim.val"
    outside.parent.mkdir()
    outside.write_bytes(value_file.read_bytes())  # a valid entry: serving it would be a hit
    bad = {"nul": "ab/cd/x\0y.val", "parent": "../outside/victim.val", "absolute": str(outside),
           "symlink": "ab/link.val"}[name]
    if name == "symlink":
        (d / "ab").mkdir(exist_ok=True)
        (d / "ab" / "link.val").symlink_to(outside)
    with sqlite3.connect(d / "cache.db") as db:
        assert db.execute("UPDATE Cache SET filename = ?", (bad,)).rowcount == 1
    db.close()
    store = build_store(1 << 26, directory=d)
    with caplog.at_level(logging.WARNING, logger="hypic_core"):
        assert store.lookup(key_of(e), e.token_ids) is None
        assert store.lookup(key_of(e), e.token_ids) is None  # still a miss, and now a plain one: the row is gone
    s = store.stats()
    assert s.corrupt == 1 and s.misses == 2, s
    assert outside.read_bytes() == value_file.read_bytes()
    store.insert(key_of(e), e)  # recomputed: written again, into the cache directory
    store.close()
    fresh = build_store(1 << 26, directory=d)
    assert fresh.lookup(key_of(e), e.token_ids) is not None and fresh.stats().corrupt == 0
    fresh.close()
    assert outside.exists()


def _stored_once(d, n=200):
    """A cache directory holding one entry in a value file; returns (entry, the value file)."""
    e = make_entry(n=n, width=64)
    store = build_store(1 << 26, directory=d)
    store.insert(key_of(e), e)
    store.close()
    (value_file,) = d.rglob("*.val")
    return e, value_file


def _served_after_rewrite(d, e) -> bool:
    """Whether the entry, recomputed and inserted again, is then served from the disk by a fresh store."""
    store = build_store(1 << 26, directory=d)
    store.insert(key_of(e), e)
    store.close()
    fresh = build_store(1 << 26, directory=d)
    try:
        return fresh.lookup(key_of(e), e.token_ids) is not None and fresh.stats().hits["disk"] == 1
    finally:
        fresh.close()


def _plant_links(d, outside) -> None:
    """A symbolic link to `outside` in place of each of the 256 first-level value directories."""
    for i in range(256):
        link = d / f"{i:02x}"
        if link.exists() or link.is_symlink():
            shutil.rmtree(link) if link.is_dir() and not link.is_symlink() else link.unlink()
        link.symlink_to(outside, target_is_directory=True)


def test_symbolic_links_under_the_directory_are_removed_at_open_and_never_written_through(tmp_path):
    """Before: diskcache's store followed a linked subdirectory (`makedirs` + `open`), creating
    value files outside the cache directory. Now links are removed when the tier opens, and a
    link planted while it runs is removed by the write that meets it; nothing lands outside."""
    d, outside = tmp_path / "cache", tmp_path / "outside"
    outside.mkdir()
    d.mkdir()
    _plant_links(d, outside)
    tier = DiskTier(d, size_limit=1 << 30)
    assert tier.stats().repaired == 256 and not any(p.is_symlink() for p in d.iterdir())
    _plant_links(d, outside)  # again, under the open tier
    values = [os.urandom(40_000 + i) for i in range(8)]  # over diskcache's 32 KB: value files
    for i, value in enumerate(values):
        assert tier.put(f"k{i}", value)
    assert list(outside.iterdir()) == []
    assert [tier.get(f"k{i}") for i in range(8)] == values
    first_levels = {p.relative_to(d).parts[0] for p in d.rglob("*.val")}  # two writes may share one
    assert tier.stats().repaired - 256 == len(first_levels)  # one link removed per first-level directory written
    assert sorted(p.parent.parent.name for p in d.rglob("*.val")) and all(
        not p.parent.parent.is_symlink() for p in d.rglob("*.val"))
    tier.close()
    assert list(outside.iterdir()) == []


def test_a_read_never_follows_a_link_planted_in_a_value_path(tmp_path):
    d, outside = tmp_path / "cache", tmp_path / "outside"
    e, value_file = _stored_once(d)
    sub = value_file.parent
    outside.mkdir()
    shutil.move(str(sub), str(outside / "moved"))
    sub.symlink_to(outside / "moved", target_is_directory=True)  # the same file, now reached through a link
    tier = DiskTier(d, size_limit=1 << 30)  # its open removes the link: the row's file is then missing
    store = memory_store(tier)
    assert store.lookup(key_of(e), e.token_ids) is None and store.stats().corrupt == 1
    tier.close()
    assert (outside / "moved" / value_file.name).exists()
    assert _served_after_rewrite(d, e)


def test_a_huge_sparse_value_file_is_a_counted_miss_without_reading_it(tmp_path, caplog):
    """The issue's 3 GB sparse file froze the gateway 57 s and took 6.9 GB: the row's size was
    never compared with the file. Now a file not of its row's size is refused before any read."""
    d = tmp_path / "cache"
    e, value_file = _stored_once(d)
    os.truncate(value_file, 1 << 30)  # sparse: no disk space
    tier = DiskTier(d, size_limit=1 << 30)
    store = memory_store(tier)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    with pytest.raises(CorruptEntry) as info:
        tier.get(store.disk_key(key_of(e)))
    assert info.value.reason == "refused" and "its row says" in str(info.value)
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before < 256 << 10  # KiB: nothing near 1 GiB read
    with caplog.at_level(logging.WARNING, logger="hypic_core"):
        assert store.lookup(key_of(e), e.token_ids) is None
    assert store.stats().corrupt == 1 and store.stats().misses == 1
    tier.close()
    assert _served_after_rewrite(d, e)


def test_a_fifo_in_place_of_a_value_file_is_a_counted_miss_not_a_hang(tmp_path):
    """Before: `open()` of the FIFO blocked the lookup forever."""
    d = tmp_path / "cache"
    e, value_file = _stored_once(d)
    value_file.unlink()
    os.mkfifo(value_file)
    store = build_store(1 << 26, directory=d)
    found = []
    lookup = threading.Thread(target=lambda: found.append(store.lookup(key_of(e), e.token_ids)), daemon=True)
    lookup.start()
    lookup.join(20)
    if lookup.is_alive():  # unblock the reader (a writer opening the FIFO) before failing
        os.close(os.open(value_file, os.O_WRONLY | os.O_NONBLOCK))
        lookup.join(5)
        pytest.fail("the lookup blocked on the FIFO")
    assert found == [None] and store.stats().corrupt == 1
    store.close()
    assert _served_after_rewrite(d, e)


def test_a_row_naming_a_directory_is_a_counted_miss_and_heals(tmp_path):
    """Before: diskcache's `get` turned the IsADirectoryError into a plain miss: silent, uncounted,
    and the row stayed (the key counted as present, so the value was never written again)."""
    d = tmp_path / "cache"
    e, value_file = _stored_once(d)
    value_file.unlink()
    value_file.mkdir()
    store = build_store(1 << 26, directory=d)
    assert store.lookup(key_of(e), e.token_ids) is None
    assert store.stats().corrupt == 1 and store.stats().misses == 1
    store.close()
    assert _served_after_rewrite(d, e)


def test_a_row_of_bad_utf8_is_a_counted_miss_removed_and_written_again(tmp_path):
    """Before: SQLite's text decoding failed inside every lookup (an I/O error each time, never a
    corrupt entry) and the row stayed, so the recomputed value was never stored."""
    d = tmp_path / "cache"
    e, value_file = _stored_once(d)
    with sqlite3.connect(d / "cache.db") as db:
        assert db.execute("UPDATE Cache SET filename = CAST(X'61622F63642F78FF2E76616C' AS TEXT)").rowcount == 1
    db.close()
    store = build_store(1 << 26, directory=d)
    assert store.lookup(key_of(e), e.token_ids) is None
    assert store.lookup(key_of(e), e.token_ids) is None  # a plain miss now: the row is gone
    s = store.stats()
    assert s.corrupt == 1 and s.misses == 2 and s.disk_errors == 0, s
    store.close()
    assert _served_after_rewrite(d, e)


def _full_at_start(directory: str, conn) -> None:
    """Child process: the disk tier opens on a full disk (RLIMIT_FSIZE 0: every write fails with
    EFBIG), then space comes back (the soft limit raised again)."""
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (0, hard))
    tier = DiskTier(directory, size_limit=1 << 30, retry_s=(0.05, 0.2))
    store = memory_store(tier)
    down = tier.stats()
    e = make_entry(n=40)
    store.insert(key_of(e), e)
    served_down = store.lookup(key_of(e), e.token_ids) is not None
    resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    deadline = time.monotonic() + 30
    while not tier.available and time.monotonic() < deadline:
        time.sleep(0.05)
    store.insert(key_of(e), e)
    store.flush()
    up = tier.stats()
    conn.send({"down": (down.available, down.errors > 0), "served_down": served_down,
               "up": (up.available, up.writes)})


def test_a_disk_tier_that_cannot_open_at_start_is_retried_and_shown(tmp_path):
    """Before: a full disk at start-up dropped the disk tier for good, and /metrics showed nothing
    of it. Now the tier is down (counted, `available` False, the store serves from memory) and
    opens once the disk has space again."""
    out, _ = in_child(_full_at_start, str(tmp_path / "c"))
    assert out == {"down": (False, True), "served_down": True, "up": (True, 1)}


def test_unusable_directory_shows_in_metrics_and_opens_once_fixed(tmp_path):
    from app.service.metrics import Metrics

    blocker = tmp_path / "file"
    blocker.write_bytes(b"not a directory")
    tier = DiskTier(blocker / "cache", size_limit=1 << 26, retry_s=(0.05, 0.1))
    store = memory_store(tier)
    metrics = Metrics("m")
    metrics.watch_store(store)
    assert 'hypic_cache_tier_available{model_name="m",tier="disk"} 0.0' in metrics.render().decode()
    assert 'hypic_cache_tier_errors_total{model_name="m",tier="disk"} 1.0' in metrics.render().decode()
    blocker.unlink()
    deadline = time.monotonic() + 20
    while not tier.available and time.monotonic() < deadline:
        time.sleep(0.05)
    assert 'hypic_cache_tier_available{model_name="m",tier="disk"} 1.0' in metrics.render().decode()
    tier.close()

"""Several processes on one cache directory: sharing, racing inserts, no torn reads, SIGKILL mid-write."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import time

import diskcache

from hypic_core.cache import DiskTier, MemoryTier, TieredSegmentStore, decode, encode
from test_cache_serde import make_entry, tensors_equal
from test_cache_tiered import key_of

CTX = mp.get_context("spawn")  # children import torch fresh: no forked thread pools


def disk_store(directory: str) -> TieredSegmentStore:
    """A store with an empty memory tier: every lookup goes to disk."""
    return TieredSegmentStore("cpu", [MemoryTier("host", "cpu", 0)], DiskTier(directory, size_limit=1 << 30))


def run_beside_child(target, parent_args, child_args, timeout=90) -> None:
    """Run `target` in a spawned child and, at the same time, here (two processes, one directory)."""
    p = CTX.Process(target=target, args=child_args)
    p.start()
    try:
        target(*parent_args)
    finally:
        p.join(timeout)
    assert p.exitcode == 0


def _share(directory: str, mine: list[int], everyone: list[int], barrier, results) -> None:
    store = disk_store(directory)
    for seed in mine:
        e = make_entry(n=300, seed=seed)
        store.insert(key_of(e), e)
    store.flush()
    barrier.wait(60)  # both have written: each must now read the other's entries
    found = []
    for seed in everyone:
        e = make_entry(n=300, seed=seed)
        got = store.lookup(key_of(e), e.token_ids)
        found.append(got is not None and tensors_equal(got, e))
    results.put((os.getpid(), found, store.stats().corrupt))
    store.close()


def test_two_processes_share_a_directory(tmp_path):
    barrier, results = CTX.Barrier(2), CTX.Queue()
    d = str(tmp_path / "c")
    run_beside_child(_share, (d, [0, 1, 2], list(range(6)), barrier, results),
                     (d, [3, 4, 5], list(range(6)), barrier, results))
    reports = [results.get(timeout=10) for _ in range(2)]
    assert [r[1] for r in reports] == [[True] * 6] * 2 and [r[2] for r in reports] == [0, 0]


def _race(directory: str, seeds: list[int], barrier) -> None:
    store = disk_store(directory)
    for seed in seeds:
        e = make_entry(n=300, seed=seed)
        barrier.wait(60)  # every process inserts this segment at the same moment
        store.insert(key_of(e), e)
        store.flush()
    store.close()


def test_concurrent_inserts_of_one_segment_leave_one_valid_entry(tmp_path):
    d, seeds, barrier = str(tmp_path / "c"), [10, 11, 12, 13], CTX.Barrier(2)
    run_beside_child(_race, (d, seeds, barrier), (d, seeds, barrier))
    with diskcache.Cache(d) as raw:
        assert len(raw) == len(seeds)
        assert raw.check() == []  # every row's file exists, no stray files from the losers
    values = 0
    for root, _, files in os.walk(d):
        values += sum(f.endswith(".val") for f in files)
    assert values == len(seeds)
    store = disk_store(d)
    for seed in seeds:
        e = make_entry(n=300, seed=seed)
        got = store.lookup(key_of(e), e.token_ids)
        assert got is not None and tensors_equal(got, e)
    store.close()


def _rewrite(directory: str, dk: str, versions: list[bytes], seconds: float, ready) -> None:
    disk = DiskTier(directory, size_limit=1 << 30)
    ready.set()
    end, i = time.monotonic() + seconds, 0
    while time.monotonic() < end:
        disk.delete(dk)
        disk.put(dk, versions[i % 2])
        i += 1
        time.sleep(0.005)  # let readers take the SQLite lock (their LRU bookkeeping writes too)
    disk.close()


def test_no_torn_reads_while_another_process_rewrites(tmp_path):
    base = make_entry(n=600, width=64, seed=1)
    other = type(base)(base.token_ids, base.seam, tuple(k + 1 for k in base.keys), base.values, base.operators,
                       base.conv_tails)
    key = key_of(base)
    versions = [encode(base, key), encode(other, key)]
    d = str(tmp_path / "c")
    reader = DiskTier(d, size_limit=1 << 30)
    dk = "segment"
    ready = CTX.Event()
    p = CTX.Process(target=_rewrite, args=(d, dk, versions, 2.5, ready))
    p.start()
    assert ready.wait(60)
    reads, end = 0, time.monotonic() + 1.5
    while time.monotonic() < end:
        data = reader.get(dk)
        if data is not None:
            got = decode(data, key, base.token_ids)  # raises CorruptEntry on a torn value
            assert tensors_equal(got, base) or tensors_equal(got, other)
            reads += 1
    p.join(30)
    assert p.exitcode == 0 and reads > 5 and reader.stats().errors == 0
    reader.close()


def _write_forever(directory: str, progress) -> None:
    store = disk_store(directory)
    seed = 0
    while True:
        e = make_entry(n=1000, width=64, seed=seed)
        store.insert(key_of(e), e)
        store.flush()
        progress.put(seed)
        seed += 1


def test_process_killed_mid_write_leaves_a_consistent_cache(tmp_path):
    d = str(tmp_path / "c")
    progress = CTX.Queue()
    p = CTX.Process(target=_write_forever, args=(d, progress))
    p.start()
    done = [progress.get(timeout=60) for _ in range(3)]
    time.sleep(0.013)  # land somewhere inside a later write
    os.kill(p.pid, signal.SIGKILL)
    p.join(10)
    assert p.exitcode == -signal.SIGKILL
    store = disk_store(d)
    for seed in range(max(done) + 3):  # written, being written, or never started
        e = make_entry(n=1000, width=64, seed=seed)
        got = store.lookup(key_of(e), e.token_ids)
        if seed in done:
            assert got is not None and tensors_equal(got, e)
        elif got is not None:
            assert tensors_equal(got, e)
    assert store.stats().corrupt == 0
    # Rows all name complete files. A killed write may leave an orphan file or the empty directory
    # it made for one (diskcache's UnknownFileWarning / EmptyDirWarning): leftovers, never damage.
    leftovers = (diskcache.core.UnknownFileWarning, diskcache.core.EmptyDirWarning)
    with diskcache.Cache(d) as raw:
        problems = [str(w.message) for w in raw.check() if not issubclass(w.category, leftovers)]
        assert problems == []
    e = make_entry(n=50, seed=999)  # the restarted cache takes new writes
    store.insert(key_of(e), e)
    store.flush()
    assert disk_store(d).lookup(key_of(e), e.token_ids) is not None


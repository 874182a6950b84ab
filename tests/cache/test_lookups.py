"""The lookup pool (hypic_core/engine/lookups.py) on its own, over a store whose stored reads wait on a gate:
a warm request never queues, one lookup serves every request that wants its key, a request stops waiting at
its deadline (or when aborted) and a lookup that returns later leaves its entry in memory, never in the
request that stopped waiting. The same against a real Redis server: test_slow_lookups.py."""

from __future__ import annotations

import threading
import time

from hypic_core.algebra.keys import SegmentKey
from hypic_core.engine.lookups import Lookups
from hypic_core.engine.sequence import AbortHandle, Status


class GatedStore:
    """Memory and stored dicts of key -> entry; `lookup_stored` waits for `gate`, then places a hit in memory."""

    def __init__(self) -> None:
        self.memory: dict[str, object] = {}
        self.stored: dict[str, object] = {}
        self.gate = threading.Event()
        self.stored_calls: list[str] = []

    def lookup_memory(self, key, token_ids):
        return self.memory.get(key.to_str())

    def reads_stored(self, token_ids) -> bool:
        return True

    def lookup_stored(self, key, token_ids):
        self.stored_calls.append(key.to_str())
        self.gate.wait(30)
        entry = self.stored.get(key.to_str())
        if entry is not None:
            self.memory[key.to_str()] = entry
        return entry


class _Request:
    def __init__(self, context) -> None:
        self.context, self.exact_prefix = context, 0


class _Seq:
    """What the pool reads and writes of a `Sequence`."""

    def __init__(self, *segments) -> None:
        self.request = _Request(segments)
        self.found = None
        self.status = Status.WAITING
        self.abort = AbortHandle()


def key(segment) -> SegmentKey:
    return SegmentKey.of("model", 4, segment)


def pool(store, deadline_s: float = 30.0):
    ready: list = []
    lookups = Lookups(store, lambda seq: [(i, key(s), s) for i, s in enumerate(seq.request.context)], ready.append,
                      deadline_s=deadline_s)
    return lookups, ready


def until(condition, timeout: float = 10.0) -> None:
    end = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < end, "timed out"
        time.sleep(0.01)


A, B = (1, 2, 3), (4, 5, 6)


def test_a_request_found_in_memory_goes_to_the_scheduler_at_once():
    store = GatedStore()
    store.memory = {key(A).to_str(): "a", key(B).to_str(): "b"}
    lookups, ready = pool(store)
    seq = _Seq(A, B)
    lookups.submit(seq)
    assert ready == [seq] and seq.found == ["a", "b"] and seq.status is Status.WAITING
    assert store.stored_calls == [] and lookups.pending == 0


def test_one_stored_lookup_serves_every_request_waiting_for_its_key():
    store = GatedStore()
    store.memory = {key(A).to_str(): "a"}
    store.stored = {key(B).to_str(): "b"}
    lookups, ready = pool(store)
    first, second = _Seq(A, B), _Seq(B)
    lookups.submit(first)
    lookups.submit(second)
    assert first.status is second.status is Status.LOOKING_UP and lookups.pending == 2 and ready == []
    store.gate.set()
    until(lambda: len(ready) == 2)
    assert store.stored_calls == [key(B).to_str()]
    assert first.found == ["a", "b"] and second.found == ["b"] and first.status is second.status is Status.WAITING
    assert lookups.wait(1.0) and lookups.late == 0


def test_a_request_stops_waiting_at_its_deadline_and_the_late_entry_lands_in_memory_only():
    store = GatedStore()
    store.stored = {key(B).to_str(): "b"}
    lookups, ready = pool(store, deadline_s=0.3)
    seq = _Seq(A, B)
    lookups.submit(seq)
    assert lookups.expire() == 0 and ready == []
    assert not lookups.wait(5.0)  # returns at the deadline, the lookups still out
    assert lookups.expire() == 1 and ready == [seq] and lookups.late == 1
    assert seq.found == [None, None] and seq.status is Status.WAITING
    store.gate.set()
    until(lambda: key(B).to_str() in store.memory)  # for this request's plan if in time, else the next request's
    time.sleep(0.05)
    assert seq.found == [None, None] and ready == [seq]  # never written into a request that stopped waiting


def test_an_aborted_request_stops_waiting_at_once():
    store = GatedStore()
    lookups, ready = pool(store)
    seq = _Seq(A)
    lookups.submit(seq)
    seq.abort.abort()
    assert lookups.expire() == 1 and ready == [seq] and lookups.pending == 0
    store.gate.set()

"""Stored-tier lookups of arriving requests, off the engine thread, each request waiting at most a deadline.

A stitched request (`hypic`, `pic-naive`) looks its segments up in the segment store before it is
laid out. The memory tiers answer at once; the stored tiers (disk, a shared Redis) may take a disk
read or a network round trip, up to the Redis timeout when the server is stopped. Run on the engine
thread, that time would stop every running stream; run where the request is added (the HTTP event
loop), it would stop HTTP. So:

1. `submit(seq)` asks the memory tiers on the caller's thread (no I/O). A sequence found there
   whole (a warm request), or whose misses no stored tier would be asked about (segments too
   short, tiers down), goes to the scheduler at once: it never queues behind a slow lookup.
2. Otherwise the sequence waits in its own state, `Status.LOOKING_UP`, and each missing segment's
   stored lookup runs on a small pool of daemon threads, in parallel (one lookup per key, shared by
   every sequence waiting for it), each call bounded by its tier's own timeout.
3. The sequence is handed to the scheduler when its last lookup returns, or when its deadline
   (`deadline_s` after it arrived) passes first (`expire`, called by the engine at each step): what
   is still out counts as a miss, computed as a canonical entry, the same bytes a hit would have
   held, so the answer does not change. A lookup that returns later still lands its entry in the
   memory tier (the store places every stored hit there): this request's plan takes it if it is
   there by then (`CacheManager.lookup` asks the memory tier again), the next request does.

Meanwhile the engine steps the sequences it has. Daemon threads, not an executor: a read that
never returns (a damaged store) must not keep the process from exiting.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Sequence as Seq

from ..algebra.keys import SegmentKey
from ..cache.store import SegmentStore
from .sequence import Sequence, Status

log = logging.getLogger(__name__)

# How long a step with nothing to run waits for the lookups in flight (then it runs what it has).
LOOKUP_WAIT_S = 1.0

# (slot in the request's context, key, token ids) of each segment a request looks up
Wanted = tuple[int, SegmentKey, tuple[int, ...]]


@dataclass(eq=False)
class _Waiting:
    """A sequence in LOOKING_UP: its lookups still out, and when it stops waiting for them."""

    seq: Sequence
    left: int
    deadline: float  # time.monotonic()


@dataclass(eq=False)
class _Job:
    """One stored lookup, shared by every waiting sequence that wants its key."""

    key: SegmentKey
    segment: tuple[int, ...]
    waiters: list[tuple[_Waiting, list[int]]] = field(default_factory=list)  # (sequence, its context slots)


class Lookups:
    """Stored-tier lookups on `threads` daemon threads (module docstring).

    `wanted(seq)` names the segments a sequence looks up; `ready(seq)` hands it to the scheduler
    (thread-safe: it may be called from a lookup thread or from `expire`'s). `ready` is called exactly
    once per submitted sequence, before which `seq.found` holds one entry or None per context segment.
    A lookup that raises is logged and counts as a miss. Thread-safe.
    """

    def __init__(self, store: SegmentStore, wanted: Callable[[Sequence], Seq[Wanted]], ready: Callable[[Sequence], None],
                 deadline_s: float = 1.0, threads: int = 4):
        if threads < 1:
            raise ValueError(f"threads must be >= 1, got {threads}")
        if not deadline_s > 0:
            raise ValueError(f"deadline_s must be > 0, got {deadline_s}")
        self.store, self._wanted, self._ready = store, wanted, ready
        self.deadline_s = deadline_s
        self.late = 0  # sequences handed over at their deadline with lookups still out (since start)
        self._threads = threads
        self._queue: queue.SimpleQueue[_Job] = queue.SimpleQueue()
        self._lock = threading.Condition()
        self._waiting: dict[Sequence, _Waiting] = {}
        self._jobs: dict[str, _Job] = {}  # key -> its lookup, queued or running
        self._started: list[threading.Thread] = []

    @property
    def pending(self) -> int:
        """Sequences submitted and not yet handed over."""
        with self._lock:
            return len(self._waiting)

    def submit(self, seq: Sequence) -> None:
        """Look `seq`'s segments up: the memory tiers now, the stored tiers on the pool (module docstring)."""
        found: list = [None] * len(seq.request.context)
        todo: dict[str, tuple[SegmentKey, tuple[int, ...], list[int]]] = {}
        for i, key, segment in self._wanted(seq):
            entry = self.store.lookup_memory(key, segment)
            if entry is not None:
                found[i] = entry
            elif self.store.reads_stored(segment):
                todo.setdefault(key.to_str(), (key, segment, []))[2].append(i)
            else:
                found[i] = self.store.lookup_stored(key, segment)  # no stored tier asked: counts the miss, no I/O
        seq.found = found
        if not todo:
            self._ready(seq)
            return
        with self._lock:
            waiting = self._waiting[seq] = _Waiting(seq, len(todo), time.monotonic() + self.deadline_s)
            seq.status = Status.LOOKING_UP
            for k, (key, segment, slots) in todo.items():
                job = self._jobs.get(k)
                if job is None:
                    job = self._jobs[k] = _Job(key, segment)
                    self._queue.put(job)
                job.waiters.append((waiting, slots))
            if len(self._started) < min(self._threads, len(self._jobs)):
                t = threading.Thread(target=self._work, name=f"hypic-lookup-{len(self._started)}", daemon=True)
                self._started.append(t)
                t.start()

    def settle(self, idle: bool) -> None:
        """(The engine, at each step.) With nothing to run (`idle`), wait briefly for the lookups in flight, so
        requests added together are admitted together (with sequences running a step never waits); then hand
        over every sequence past its deadline."""
        if idle and self.pending:
            self.wait(LOOKUP_WAIT_S)
        self.expire()

    def expire(self) -> int:
        """Hand over every sequence whose deadline passed (or that was aborted) with lookups still out; how many."""
        now = time.monotonic()
        with self._lock:
            due = [w for w in self._waiting.values() if w.deadline <= now or w.seq.abort.aborted]
            for w in due:
                del self._waiting[w.seq]
            self.late += len(due)
        for w in due:
            self._hand_over(w.seq)
        return len(due)

    def wait(self, timeout: float) -> bool:
        """Block until no sequence is waiting for lookups, or the first one's deadline passes, or `timeout`
        seconds; whether none is waiting (then call `expire`)."""
        with self._lock:
            if self._waiting:
                first = min(w.deadline for w in self._waiting.values())
                timeout = max(0.0, min(timeout, first - time.monotonic()))
            return self._lock.wait_for(lambda: not self._waiting, timeout)

    def _hand_over(self, seq: Sequence) -> None:
        seq.status = Status.WAITING
        try:
            self._ready(seq)
        finally:
            with self._lock:
                self._lock.notify_all()

    def _work(self) -> None:
        while True:
            job = self._queue.get()
            try:
                entry = self.store.lookup_stored(job.key, job.segment)
            except Exception:  # noqa: BLE001 - a failed lookup is a miss
                log.exception("stored lookup of segment %s failed; counted as a miss", job.key.to_str())
                entry = None
            done = []
            with self._lock:
                del self._jobs[job.key.to_str()]
                for waiting, slots in job.waiters:
                    if self._waiting.get(waiting.seq) is not waiting:
                        continue  # handed over at its deadline: the entry is in the memory tier for its plan
                    for i in slots:
                        waiting.seq.found[i] = entry
                    waiting.left -= 1
                    if waiting.left == 0:
                        del self._waiting[waiting.seq]
                        done.append(waiting.seq)
            for seq in done:
                self._hand_over(seq)

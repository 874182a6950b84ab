"""Cache lookups of arriving requests, off the engine thread.

A stitched request (`hypic`, `pic-naive`) looks its segments up in the segment store before it
is laid out. With stored tiers (disk, a shared Redis) one lookup can take a disk read or a
network round trip, up to the Redis timeout when the server is stopped. Run on the engine
thread, that time would stop every running stream; run where the request is added (the HTTP
event loop), it would stop HTTP. So `Lookups` runs them on its own daemon threads and hands
each sequence to the scheduler once its lookups are done (`CacheManager.prefetch` keeps
what it found on the sequence, and `plan` uses it). Meanwhile the engine steps the sequences
it already has.

A daemon thread, not an executor: a read that never returns (a damaged store) must not keep
the process from exiting.
"""

from __future__ import annotations

import logging
import queue
import threading
from typing import Callable

from .sequence import Sequence

log = logging.getLogger(__name__)


class Lookups:
    """`submit(seq)`: run `prefetch(seq)` on a worker thread, then `ready(seq)`.

    `ready` is called exactly once per submitted sequence, also when `prefetch` raises (the
    sequence is then laid out with lookups of its own, on the engine thread). `pending` counts
    sequences submitted and not yet handed over; `wait` blocks until none is, or a timeout.
    """

    def __init__(self, prefetch: Callable[[Sequence], None], ready: Callable[[Sequence], None], threads: int = 2):
        if threads < 1:
            raise ValueError(f"threads must be >= 1, got {threads}")
        self._prefetch, self._ready = prefetch, ready
        self._queue: queue.SimpleQueue[Sequence] = queue.SimpleQueue()
        self._done = threading.Condition()
        self._pending = 0
        self._threads = threads
        self._started: list[threading.Thread] = []

    @property
    def pending(self) -> int:
        with self._done:
            return self._pending

    def submit(self, seq: Sequence) -> None:
        with self._done:
            self._pending += 1
            if len(self._started) < min(self._threads, self._pending):
                t = threading.Thread(target=self._work, name=f"hypic-lookup-{len(self._started)}", daemon=True)
                self._started.append(t)
                t.start()
        self._queue.put(seq)

    def wait(self, timeout: float) -> bool:
        """Block until no lookup is pending, at most `timeout` seconds; whether none is."""
        with self._done:
            return self._done.wait_for(lambda: self._pending == 0, timeout)

    def _work(self) -> None:
        while True:
            seq = self._queue.get()
            try:
                self._prefetch(seq)
            except Exception:  # noqa: BLE001 - the sequence looks up on its own at plan time
                log.exception("cache lookups of %s failed; its prefill looks up again", seq.request_id)
                seq.found = None
            try:
                self._ready(seq)
            finally:
                with self._done:
                    self._pending -= 1
                    self._done.notify_all()

"""A pool of prefill workers that compute cold segments' canonical entries in parallel.

A canonical entry depends only on its segment (computed alone, from an empty state), so the
cold segments of a request, and of every request scheduled in the same engine step, can be
computed at the same time on different model replicas. The pool:

1. takes a step's cold segments at once (`submit`) and queues them longest first;
2. gives the longest queued segment to a worker that is idle, i.e. least loaded: each worker
   holds one segment at a time, so this is LPT list scheduling (Graham), done online so that a
   slower worker simply takes fewer segments;
3. turns the bytes a worker sends back into an entry with `cache.serde.decode` (checksum, key
   and token ids checked): bit-for-bit what `ModelRunner.compute_entries([segment])` gives here;
4. when a worker dies (killed, crashed, failed to load), requeues its segment for the others and
   starts a replacement (at most `max_restarts` in the pool's life); a segment no worker can take
   (none alive, a worker raised on it, its bytes did not decode) is computed locally, in the
   engine's thread, with the engine's own runner.

Every method is called from the engine's thread (under its step lock); the workers run in
other processes. `compute_entries` has `ModelRunner.compute_entries`'s signature and result.
"""

from __future__ import annotations

import hashlib
import itertools
import logging
import time
from collections import Counter
from dataclasses import dataclass
from typing import Sequence

from ..algebra.entry import SegmentEntry
from ..algebra.keys import SegmentKey
from ..cache.serde import CorruptEntry, decode
from .backends import BACKENDS, Backend, Event, make_backend
from .replica import ReplicaSpec, Task, weights_digest
from .split import MIN_PIECE, join_pieces, split_points

log = logging.getLogger("hypic.prefill_pool")

__all__ = ["BACKENDS", "PrefillPool", "ReplicaSpec"]


@dataclass
class _Worker:
    state: str = "starting"  # "starting" | "idle" | "busy" | "dead"
    task: int | None = None


class PrefillPool:
    """`workers` replicas of `spec`'s checkpoint on `backend` ("processes" or "ray").

    `split_tokens` > 0 (off by default) cuts a segment longer than that into pieces computed on
    different workers and joined (`split.join_pieces`): faster, but an approximation of the
    segment's entry, so an engine with such a pool names its entries apart (`Engine`).

    Workers start loading at construction; `wait_ready` blocks until they have (until then, work
    that must be waited for is computed locally, one segment at a time). Call `bind` once with
    the engine's fingerprint and runner before submitting (`Engine` does).
    """

    def __init__(self, spec: ReplicaSpec, workers: int, backend: str = "processes", max_restarts: int | None = None,
                 ray_address: str | None = None, split_tokens: int = 0):
        if workers < 1:
            raise ValueError(f"a prefill pool needs >= 1 worker, got {workers}")
        if backend not in BACKENDS:
            raise ValueError(f"prefill backend must be one of {', '.join(BACKENDS)}, got {backend!r}")
        if split_tokens and split_tokens < MIN_PIECE:
            raise ValueError(f"split_tokens must be 0 (off) or >= {MIN_PIECE}, got {split_tokens}")
        self.spec, self.backend_name, self.size, self.split_tokens = spec, backend, workers, split_tokens
        self.threads = spec.threads_for(workers)
        self.max_restarts = 2 * workers if max_restarts is None else max_restarts
        self.stats: Counter[str] = Counter()  # remote, local, requeued, deaths, restarts, corrupt, errors
        self._fingerprint: str | None = None
        self._runner = None
        self._weights: str | None = None
        self._ids = itertools.count()
        self._tasks: dict[int, Task] = {}  # submitted, not yet finished, not cancelled
        self._queue: list[int] = []  # task ids waiting for a worker, longest first
        self._done: dict[int, SegmentEntry] = {}
        self._pieces: dict[int, list[int]] = {}  # a split segment's ticket -> its pieces' task ids
        self._backend: Backend = make_backend(backend, spec, self.threads, ray_address)
        self._workers = {w: _Worker() for w in range(workers)}
        for w in self._workers:
            self._backend.start(w)

    # --- setup -----------------------------------------------------------------------------
    def bind(self, fingerprint: str, runner) -> str:
        """Serve the engine of model `fingerprint`; `runner` (a ModelRunner on the same weights) computes
        what no worker can. A replica whose weights differ is never used. Returns the name of the
        entries it computes: `fingerprint`, unless it splits segments (its entries then approximate
        the canonical ones, and are kept apart). Refuses an entry prefix (ValueError): its replicas
        compute entries alone."""
        if runner.entry_prefix:
            raise ValueError("entry_prefix is not supported with a prefill pool yet (its replicas compute entries alone)")
        if self.split_tokens:
            fingerprint = hashlib.sha256(f"{fingerprint}/split{self.split_tokens}".encode()).hexdigest()
        self._fingerprint, self._runner = fingerprint, runner
        self._weights = weights_digest(runner.model)
        return fingerprint

    @classmethod
    def for_checkpoint(cls, path: str, dtype, device: str, workers: int, backend: str = "processes",
                       threads: int | None = None, ray_address: str | None = None, split_tokens: int = 0) -> "PrefillPool":
        """A pool of `workers` replicas of the checkpoint directory `path` (see the class docstring)."""
        return cls(ReplicaSpec(str(path), dtype, device, threads), workers, backend, ray_address=ray_address,
                   split_tokens=split_tokens)

    def wait_ready(self, timeout: float | None = None) -> int:
        """Block until no worker is still loading (or `timeout` s pass); return how many are ready."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while any(w.state == "starting" for w in self._workers.values()):
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                break
            self._handle(self._backend.events(left))
        return sum(w.state in ("idle", "busy") for w in self._workers.values())

    @property
    def alive(self) -> int:
        return sum(w.state != "dead" for w in self._workers.values())

    def workers(self, busy_only: bool = False) -> list[int]:
        """Numbers of the workers that are up (busy only: computing a segment right now)."""
        states = ("busy",) if busy_only else ("idle", "busy")
        return [i for i, w in list(self._workers.items()) if w.state in states]

    def pids(self, busy_only: bool = False) -> list[int]:
        """Process ids of the workers that are up (busy only: computing a segment right now)."""
        return [pid for pid in (self._backend.pid(i) for i in self.workers(busy_only)) if pid is not None]

    # --- work ------------------------------------------------------------------------------
    def submit(self, work: Sequence[tuple[tuple[int, ...], int]]) -> list[int]:
        """Queue `(segment, seam)` pairs; returns one ticket per pair, in order. Starts them on idle workers."""
        if self._runner is None:
            raise RuntimeError("PrefillPool.bind must be called before submit")
        tickets = []
        for segment, seam in work:
            segment = tuple(segment)
            tid = next(self._ids)
            points = split_points(len(segment), self.split_tokens) if self.split_tokens else [(0, len(segment))]
            if len(points) > 1 and points[0][1] > seam:  # the first piece holds the seam head and a body
                parts = [segment[a:b] for a, b in points]
                self._pieces[tid] = [self._task(part, seam if i == 0 else 0) for i, part in enumerate(parts)]
            else:
                self._task(segment, seam, tid)
            tickets.append(tid)
        self._queue.sort(key=lambda t: -len(self._tasks[t].segment))
        self.poll()
        return tickets

    def _task(self, segment: tuple[int, ...], seam: int, tid: int | None = None) -> int:
        tid = next(self._ids) if tid is None else tid
        self._tasks[tid] = Task(tid, segment, seam, SegmentKey.of(self._fingerprint, seam, segment))
        self._queue.append(tid)
        return tid

    def poll(self) -> None:
        """Collect finished work and start queued work on idle workers, without waiting."""
        self._handle(self._backend.events(0))
        self._dispatch()

    def wait_any(self, tickets: Sequence[int]) -> None:
        """Block until at least one of `tickets` is done (or none is pending)."""
        pending = [t for t in tickets if t in self._tasks or t in self._pieces]
        while pending and not any(self._ready(t) for t in pending):
            self._dispatch()
            if self._queue and not any(w.state in ("idle", "busy") for w in self._workers.values()):
                # No worker can take it now (all loading, or gone): the engine's thread computes the
                # longest queued segment itself, then looks again (a replica may be ready by then).
                self._compute_here(self._queue.pop(0))
                self._handle(self._backend.events(0))
                continue
            self._handle(self._backend.events(1.0))
            pending = [t for t in pending if t in self._tasks or t in self._done or t in self._pieces]

    def _ready(self, ticket: int) -> bool:
        parts = self._pieces.get(ticket)
        return ticket in self._done if parts is None else all(p in self._done for p in parts)

    def take(self, ticket: int) -> SegmentEntry | None:
        """The entry of `ticket` once done (it is then forgotten), else None."""
        parts = self._pieces.get(ticket)
        if parts is not None:
            if not self._ready(ticket):
                return None
            del self._pieces[ticket]
            for p in parts:
                self._tasks.pop(p, None)
            return join_pieces([self._done.pop(p) for p in parts], self._runner.adapter)
        entry = self._done.pop(ticket, None)
        if entry is not None:
            self._tasks.pop(ticket, None)
        return entry

    def cancel(self, ticket: int) -> None:
        """Forget `ticket`: not started, it never will be; started, its result is dropped."""
        for part in self._pieces.pop(ticket, ()):
            self.cancel(part)
        self._tasks.pop(ticket, None)
        self._done.pop(ticket, None)
        if ticket in self._queue:
            self._queue.remove(ticket)

    def compute_entries(self, segments: Sequence[tuple[int, ...]], seam: int, max_batch_tokens: int = 0) -> list[SegmentEntry]:
        """Canonical entries of `segments` computed on the workers (blocks until all are done).
        Same result as `ModelRunner.compute_entries`, byte for byte per segment; `max_batch_tokens`
        is accepted for the same signature (workers compute one segment at a time)."""
        return self.collect(self.submit([(tuple(s), seam) for s in segments]))

    def collect(self, tickets: Sequence[int]) -> list[SegmentEntry]:
        """The entries of `tickets` (none cancelled), in order; blocks until all are done."""
        out: dict[int, SegmentEntry] = {}
        while len(out) < len(tickets):
            self.wait_any([t for t in tickets if t not in out])
            for t in tickets:
                if t not in out:
                    entry = self.take(t)
                    if entry is not None:
                        out[t] = entry
        return [out[t] for t in tickets]

    def close(self) -> None:
        """Stop every worker. Idempotent; the pool computes nothing afterwards."""
        self._backend.close()
        for w in self._workers.values():
            w.state = "dead"

    def __enter__(self) -> "PrefillPool":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # --- internals -------------------------------------------------------------------------
    def _dispatch(self) -> None:
        idle = [i for i, w in self._workers.items() if w.state == "idle"]
        while idle and self._queue:
            tid = self._queue.pop(0)
            task = self._tasks.get(tid)
            if task is None:
                continue
            i = idle.pop(0)
            self._workers[i].state, self._workers[i].task = "busy", tid
            self._backend.send(i, task)

    def _compute_here(self, tid: int) -> None:
        import torch

        task = self._tasks.get(tid)
        if task is None:
            return
        try:
            with torch.inference_mode():
                entry = self._runner.compute_entries([task.segment], task.seam, max(1, len(task.segment)))[0]
        except BaseException:
            self._tasks.pop(tid, None)  # its requester fails with this error; nobody waits for it
            raise
        self._done[tid] = entry
        self.stats["local"] += 1

    def _handle(self, events: list[Event]) -> None:
        """Apply `events`; then compute here what a worker failed to deliver (which may raise: the
        segment's own error, as without a pool)."""
        redo: list[int] = []
        for e in events:
            w = self._workers[e.worker]
            if e.kind == "ready":
                if self._weights is not None and e.payload != self._weights:
                    log.error("prefill worker %d loaded other weights than the engine's; not used", e.worker)
                    w.state = "dead"
                    self._backend.stop(e.worker)
                    continue
                w.state = "idle"
            elif e.kind == "done":
                w.state, w.task = "idle", None
                task = self._tasks.get(e.task)
                if task is None:  # cancelled meanwhile
                    continue
                try:
                    entry = decode(e.payload, task.key, task.segment)
                except CorruptEntry as exc:
                    log.warning("prefill worker %d sent a bad entry (%s); computing it locally", e.worker, exc.reason)
                    self.stats["corrupt"] += 1
                    redo.append(e.task)
                    continue
                device = getattr(self._runner, "device", None)
                self._done[e.task] = entry if device is None or str(device) == "cpu" else entry.to(device)
                self.stats["remote"] += 1
            elif e.kind == "error":
                w.state, w.task = "idle", None
                log.warning("prefill worker %d failed on a segment (%s); computing it locally", e.worker, e.payload)
                self.stats["errors"] += 1
                redo.append(e.task)
            elif e.kind == "dead":
                was = w.state
                w.state, w.task = "dead", None
                self.stats["deaths"] += 1
                log.warning("prefill worker %d is gone (%s)", e.worker, e.payload)
                if e.task is not None and e.task in self._tasks and e.task not in self._done:
                    self._queue.insert(0, e.task)  # it was among the longest still to do
                    self._queue.sort(key=lambda t: -len(self._tasks[t].segment) if t in self._tasks else 0)
                    self.stats["requeued"] += 1
                if was != "starting" and self.stats["restarts"] < self.max_restarts:
                    self.stats["restarts"] += 1
                    w.state = "starting"
                    self._backend.start(e.worker)
        for tid in redo:
            self._compute_here(tid)

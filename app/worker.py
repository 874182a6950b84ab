"""The engine worker: one dedicated thread that runs every generation, off the event loop.

`Worker.submit` admits a request (or raises `QueueFullError` when `max_running + max_queue` are
already admitted) and returns a `TokenStream` that the async endpoint reads. The engine thread
loops schedule -> run -> hand off: it starts waiting requests while fewer than `max_running`
run (prefill), then advances every running generation by one token, round-robin, so
concurrent streams interleave token by token and none blocks another. The engine serialises
model calls anyway; one thread keeps the order fair and predictable and gives torch a single
caller. Events cross to the event loop through `loop.call_soon_threadsafe`; the thread never
waits for a slow client.

Closing a stream early (client disconnect, cancelled task) fires its `AbortHandle`: a waiting
request is dropped without running, a running one stops at its next step and frees its slot.
"""

from __future__ import annotations

import asyncio
import collections
import contextvars
import logging
import threading
import time
from dataclasses import dataclass
from typing import AsyncIterator, Iterator

from hypic_core.config import GenerationRequest
from hypic_core.engine import AbortHandle, Engine, PrefillStats, StepEvent
from hypic_core.errors import RequestAborted

from .metrics import Metrics

log = logging.getLogger("hypic.worker")
_END = object()


class QueueFullError(Exception):
    """Admission refused: the worker already holds `capacity` requests."""

    def __init__(self, capacity: int) -> None:
        super().__init__(f"server busy: {capacity} requests running or queued; retry later")


class TokenStream:
    """One generation's events, read on the event loop.

    `batches()` yields lists of `StepEvent`s (everything produced since the last read); the last
    event of the last batch has `finish_reason`. Engine errors are raised from `batches()`.
    Fields written by the engine thread before the matching event is queued, so they are valid
    once that event has been read: `stats` (after the first batch), `first_token_at` (a
    `time.perf_counter()` value), `completion_tokens` (EOS excluded).
    """

    def __init__(self, loop: asyncio.AbstractEventLoop, started: float) -> None:
        self.abort = AbortHandle()
        self.started = started
        self.stats: PrefillStats | None = None
        self.first_token_at: float | None = None
        self.completion_tokens = 0
        self._loop = loop
        self._queue: asyncio.Queue = asyncio.Queue()
        self._done = False

    async def batches(self) -> AsyncIterator[list[StepEvent]]:
        """Yield event batches until the generation ends; abort it if the reader stops first."""
        try:
            while True:
                items = [await self._queue.get()]
                while not self._queue.empty():
                    items.append(self._queue.get_nowait())
                events, error = [], None
                for item in items:
                    if item is _END:
                        self._done = True
                    elif isinstance(item, BaseException):
                        self._done, error = True, item
                    elif isinstance(item, PrefillStats):
                        self.stats = item
                    else:
                        events.append(item)
                if events:  # tokens produced before an error are still delivered
                    yield events
                if error is not None:
                    raise error
                if self._done:
                    return
        finally:
            if not self._done:
                self.abort.abort()

    def _push(self, item: object) -> None:
        """Hand an item to the event loop (called from the worker thread)."""
        try:
            self._loop.call_soon_threadsafe(self._queue.put_nowait, item)
        except RuntimeError:  # the loop is closed: the server is shutting down
            self.abort.abort()


@dataclass(eq=False)  # compared by identity
class _Job:
    engine: Engine
    request: GenerationRequest
    stream: TokenStream
    route: str
    context: contextvars.Context  # the submitting request's, so log lines carry its request id
    events: Iterator[StepEvent] | None = None
    last_token_at: float | None = None
    reason: str = "error"


class Worker:
    """Admission control and the engine thread. `submit` is called on the event loop; the rest
    of the state belongs to the engine thread, except the waiting queue (under `_lock`)."""

    def __init__(self, max_running: int, max_queue: int, metrics: Metrics) -> None:
        self.max_running = max_running
        self.capacity = max_running + max_queue
        self.metrics = metrics
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._waiting: collections.deque[_Job] = collections.deque()
        self._running: list[_Job] = []
        self._closed = False
        self._thread = threading.Thread(target=self._loop, name="hypic-engine", daemon=True)
        self._thread.start()

    def has_room(self) -> bool:
        """Whether `submit` would admit a request now (a hint: it checks again)."""
        with self._lock:
            return len(self._waiting) + len(self._running) < self.capacity

    def submit(self, engine: Engine, request: GenerationRequest, started: float, route: str) -> TokenStream:
        """Admit and queue `request`; call on the event loop. Raises `QueueFullError` when full.

        `started` (a `time.perf_counter()` value) is the request's arrival, for TTFT and
        end-to-end latency under the metrics label `route`.
        """
        stream = TokenStream(asyncio.get_running_loop(), started)
        with self._lock:
            if len(self._waiting) + len(self._running) >= self.capacity:
                self.metrics.rejected.inc()
                raise QueueFullError(self.capacity)
            self._waiting.append(_Job(engine, request, stream, route, contextvars.copy_context()))
            self._publish()
            self._wake.notify()
        return stream

    def close(self) -> None:
        """Abort every admitted generation and stop the engine thread (waits up to 10 s)."""
        with self._lock:
            self._closed = True
            for job in (*self._waiting, *self._running):
                job.stream.abort.abort()
            self._wake.notify()
        self._thread.join(timeout=10)

    # --- engine thread ------------------------------------------------------------------
    def _loop(self) -> None:
        while True:
            with self._lock:
                while not self._closed and not self._waiting and not self._running:
                    self._wake.wait()
                if self._closed and not self._waiting and not self._running:
                    return
                starting = []
                while self._waiting and len(self._running) + len(starting) < self.max_running:
                    starting.append(self._waiting.popleft())
                dropped = [job for job in self._waiting if job.stream.abort.aborted]
                for job in dropped:
                    self._waiting.remove(job)
                self._running += starting
                self._publish()
            for job in dropped:
                job.context.run(self._finish, job, abort=True)
            for job in starting:
                job.context.run(self._start, job)
            for job in list(self._running):
                if job.events is not None:
                    job.context.run(self._step, job)

    def _start(self, job: _Job) -> None:
        """Prefill; on success the job decodes from the next round."""
        try:
            job.stream.abort.check()
            result = job.engine.prefill(job.request, job.stream.abort)
        except RequestAborted:
            return self._finish(job, abort=True)
        except Exception as exc:
            return self._finish(job, error=exc)
        self.metrics.observe_prefill(result.stats)
        job.stream._push(result.stats)
        job.events = job.engine.generate(job.request, job.stream.abort, prefilled=result)

    def _step(self, job: _Job) -> None:
        """Produce one token of `job` and hand it to its stream."""
        try:
            event = next(job.events)
        except Exception as exc:
            return self._finish(job, error=exc)
        now = time.perf_counter()
        stream = job.stream
        if event.token_id is not None:
            if job.last_token_at is None:
                stream.first_token_at = now
                self.metrics.ttft.labels(job.route).observe(now - stream.started)
            else:
                self.metrics.itl.observe(now - job.last_token_at)
            job.last_token_at = now
            if event.token_id not in job.engine.eos_ids:
                stream.completion_tokens += 1
                self.metrics.generated_tokens.inc()
        if event.finish_reason is None:
            return stream._push(event)
        job.reason = event.finish_reason
        self.metrics.e2e.labels(job.route).observe(now - stream.started)
        stream._push(event)
        self._finish(job)

    def _finish(self, job: _Job, abort: bool = False, error: Exception | None = None) -> None:
        """End `job`'s stream (with an abort event or an error if given) and free its slot."""
        if abort:
            job.reason = "abort"
            job.stream._push(StepEvent(0, None, "", finish_reason="abort"))
        if error is not None:
            log.warning("generation failed", extra={"error": repr(error)})
            job.stream._push(error)
        self.metrics.finished.labels(job.reason).inc()
        with self._lock:
            if job in self._running:
                self._running.remove(job)
            self._publish()
        job.stream._push(_END)

    def _publish(self) -> None:
        self.metrics.running.set(len(self._running))
        self.metrics.waiting.set(len(self._waiting))

"""The engine worker: runs generations on dedicated threads, off the event loop.

`Worker.submit` admits a request (or raises `QueueFullError` when `max_running + max_queue`
are already admitted), queues it on a pool of `max_running` threads, and returns a
`TokenStream` that the async endpoint reads. Each thread runs `engine.prefill` then
`engine.generate`; the engine serialises model calls per step, so running generations
interleave token by token and none blocks another's streaming. Events cross to the event loop
through `loop.call_soon_threadsafe`, never blocking the thread on a slow client.

Closing a stream early (client disconnect, cancelled task) fires its `AbortHandle`: a waiting
request never starts, a running one stops at its next model call and frees its slot.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import AsyncIterator

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
    Fields written by the worker thread before the matching event is queued, so they are valid
    once that event has been read: `stats` (after the first batch), `first_token_at`,
    `completion_tokens` (EOS excluded), `finished_at` (`time.perf_counter()` values).
    """

    def __init__(self, loop: asyncio.AbstractEventLoop, started: float) -> None:
        self.abort = AbortHandle()
        self.started = started
        self.stats: PrefillStats | None = None
        self.first_token_at: float | None = None
        self.finished_at: float | None = None
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
                events = []
                for item in items:
                    if item is _END:
                        self._done = True
                    elif isinstance(item, BaseException):
                        self._done = True
                        raise item
                    elif isinstance(item, PrefillStats):
                        self.stats = item
                    else:
                        events.append(item)
                if events:
                    yield events
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


class Worker:
    """Admission control and the engine thread pool. Thread-safe."""

    def __init__(self, max_running: int, max_queue: int, metrics: Metrics) -> None:
        self.max_running = max_running
        self.capacity = max_running + max_queue
        self.metrics = metrics
        self._pool = ThreadPoolExecutor(max_running, thread_name_prefix="hypic-engine")
        self._lock = threading.Lock()
        self._admitted: set[TokenStream] = set()
        self._running = 0

    @property
    def running(self) -> int:
        return self._running

    @property
    def waiting(self) -> int:
        return len(self._admitted) - self._running

    def submit(self, engine: Engine, request: GenerationRequest, started: float, route: str) -> TokenStream:
        """Admit and queue `request`; call on the event loop. Raises `QueueFullError` when full.

        `started` (a `time.perf_counter()` value) is the request's arrival, for TTFT and
        end-to-end latency under the metrics label `route`.
        """
        stream = TokenStream(asyncio.get_running_loop(), started)
        with self._lock:
            if len(self._admitted) >= self.capacity:
                self.metrics.rejected.inc()
                raise QueueFullError(self.capacity)
            self._admitted.add(stream)
            self._publish()
        # The thread runs in the caller's context, so its log lines carry the request id.
        self._pool.submit(contextvars.copy_context().run, self._run, engine, request, stream, route)
        return stream

    def close(self) -> None:
        """Abort every admitted generation and stop the threads (does not wait for them)."""
        with self._lock:
            for stream in self._admitted:
                stream.abort.abort()
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _run(self, engine: Engine, request: GenerationRequest, stream: TokenStream, route: str) -> None:
        with self._lock:
            self._running += 1
            self._publish()
        reason = "error"
        try:
            if stream.abort.aborted:
                raise RequestAborted("aborted while queued")
            result = engine.prefill(request, stream.abort)
            self.metrics.observe_prefill(result.stats)
            stream._push(result.stats)
            last = None
            for event in engine.generate(request, stream.abort, prefilled=result):
                now = time.perf_counter()
                if event.token_id is not None:
                    if stream.first_token_at is None:
                        stream.first_token_at = now
                        self.metrics.ttft.labels(route).observe(now - stream.started)
                    else:
                        self.metrics.itl.observe(now - last)
                    last = now
                    if event.token_id not in engine.eos_ids:
                        stream.completion_tokens += 1
                        self.metrics.generated_tokens.inc()
                if event.finish_reason is not None:
                    reason = event.finish_reason
                    stream.finished_at = now
                    self.metrics.e2e.labels(route).observe(now - stream.started)
                stream._push(event)
        except RequestAborted:
            reason = "abort"
            stream._push(StepEvent(0, None, "", finish_reason="abort"))
        except BaseException as exc:  # handed to the reader, which maps it to a response
            log.warning("generation failed", extra={"error": repr(exc)})
            stream._push(exc)
        finally:
            self.metrics.finished.labels(reason).inc()
            with self._lock:
                self._running -= 1
                self._admitted.discard(stream)
                self._publish()
            stream._push(_END)

    def _publish(self) -> None:
        self.metrics.running.set(self._running)
        self.metrics.waiting.set(len(self._admitted) - self._running)

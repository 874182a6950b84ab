"""The bridge between the engine's step loop and the async endpoints.

`EngineThread.submit` admits a request (or raises `QueueFullError` when `max_running + max_queue`
are already admitted), hands it to `Engine.add_request` (which validates it and raises
`InvalidRequestError` for a bad one), and returns the `TokenStream` the endpoint reads. One
engine thread calls `Engine.step()` while the engine has work and routes each `StepOutput` to
its stream through `loop.call_soon_threadsafe`; it never waits for a slow client. Scheduling,
batching and chunked prefill all live in the engine (hypic_core/engine/scheduler.py).

The engine thread claims its engine (`attach`, `Engine.driver`) and frees it when it stops: a
second gateway over the same engine fails to load with a message saying so, where its steps
would otherwise take this one's outputs and drop them (a request that never answers).

Closing a stream early (client disconnect, cancelled task) fires its `AbortHandle`: the engine
drops the request at its next step and frees its slot.

Idle work (`run_when_idle`, the accuracy guard) starts on the engine thread only while no
request is admitted and the engine has nothing unfinished. The guard's shadow checks are
requests too (`submit_internal`: not counted against `capacity`, their outputs handed to a
callback on the engine thread), stepped by the same loop, so a request admitted while one runs
shares its steps.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import threading
import time
from dataclasses import dataclass
from typing import AsyncIterator, Callable, Protocol

from hypic_core.config import GenerationRequest
from hypic_core.engine.engine import Engine
from hypic_core.engine.sequence import AbortHandle, PrefillStats, StepOutput

from .errors import QueueFullError
from .metrics import Metrics

log = logging.getLogger("hypic.engine_thread")
_END = object()


class IdleTask(Protocol):
    """Work the engine thread does while it serves nothing (app/service/guard.py's `Guard`)."""

    def pending(self) -> bool: ...

    def run_one(self) -> None:
        """One unit of work; may call the engine (it holds no request meanwhile)."""


class TokenStream:
    """One generation's outputs, read on the event loop.

    `batches()` yields lists of `StepOutput`s (everything produced since the last read); the
    last output of the last batch has `finish_reason`. Engine errors are raised from
    `batches()`. Fields written by the engine thread before the matching output is queued, so
    they are valid once that output has been read: `stats` (after the first batch),
    `first_token_at` (a `time.perf_counter()` value), `completion_tokens` (EOS excluded).
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

    async def batches(self) -> AsyncIterator[list[StepOutput]]:
        """Yield output batches until the generation ends; abort it if the reader stops first."""
        try:
            while True:
                items = [await self._queue.get()]
                while not self._queue.empty():
                    items.append(self._queue.get_nowait())
                outputs, error = [], None
                for item in items:
                    if item is _END:
                        self._done = True
                    elif isinstance(item, BaseException):
                        self._done, error = True, item
                    elif isinstance(item, PrefillStats):
                        self.stats = item
                    else:
                        outputs.append(item)
                if outputs:  # tokens produced before an error are still delivered
                    yield outputs
                if error is not None:
                    raise error
                if self._done:
                    return
        finally:
            if not self._done:
                self.abort.abort()



class _Outbox:
    """Items for the event loop collected over one engine step, handed over in one wake-up per loop
    (one `call_soon_threadsafe` per step, not one per token per stream)."""

    def __init__(self) -> None:
        self._items: dict[TokenStream, list[object]] = {}

    def push(self, stream: TokenStream, item: object) -> None:
        self._items.setdefault(stream, []).append(item)

    def flush(self) -> None:
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[TokenStream, list[object]]]] = {}
        for stream, items in self._items.items():
            by_loop.setdefault(stream._loop, []).append((stream, items))
        self._items = {}
        for loop, batch in by_loop.items():
            try:
                loop.call_soon_threadsafe(_put_all, batch)
            except RuntimeError:  # the loop is closed: the server is shutting down
                for stream, _ in batch:
                    stream.abort.abort()


def _put_all(batch: list[tuple[TokenStream, list[object]]]) -> None:
    for stream, items in batch:
        for item in items:
            stream._queue.put_nowait(item)


@dataclass(eq=False)
class _Route:
    """Where one sequence's outputs go, and what its metrics need."""

    stream: TokenStream
    route: str
    context: contextvars.Context  # the submitting request's, so log lines carry its request id
    eos_ids: frozenset[int]
    last_token_at: float | None = None
    tenant: str | None = None  # the `tenant` label of its prompt tokens (app/service/tenants.py)


class EngineThread:
    """Admission control and the engine thread. `submit` runs on the event loop; `_routes` is
    shared with the engine thread under `_lock`."""

    def __init__(self, max_running: int, max_queue: int, metrics: Metrics) -> None:
        self.capacity = max_running + max_queue
        self.metrics = metrics
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._routes: dict[str, _Route] = {}
        self._internal: dict[str, tuple[AbortHandle, Callable[[StepOutput], None]]] = {}  # shadow checks
        self._engine: Engine | None = None
        self._idle: IdleTask | None = None
        self._closed = False
        self._started = time.strftime("%H:%M:%S")
        self._thread = threading.Thread(target=self._loop, name="hypic-engine", daemon=True)
        self._thread.start()

    def __repr__(self) -> str:
        return f"the engine thread of a gateway started at {self._started}"

    def attach(self, engine: Engine) -> None:
        """Claim `engine` for this thread (`Engine.driver`; raises EngineBusyError while another gateway's
        thread holds it); it is freed when this thread stops (`close`). Idempotent."""
        with self._lock:
            self._attach(engine)

    def _attach(self, engine: Engine) -> None:
        """`attach`, under `_lock`: so a claim lands either before the thread stops (which frees it)
        or not at all (a closed thread claims nothing: RuntimeError)."""
        if self._closed:
            raise RuntimeError("the engine thread is closed: the gateway is shutting down")
        if self._engine is engine:
            return
        engine.driver.claim(self)
        if self._engine is not None:
            self._engine.driver.release(self)
        self._engine = engine

    @property
    def alive(self) -> bool:
        """Whether the engine thread runs (it only stops on `close`, or on a bug that escaped it)."""
        return self._thread.is_alive()

    def has_room(self) -> bool:
        """Whether `submit` would admit a request now (a hint: it checks again)."""
        with self._lock:
            return len(self._routes) < self.capacity

    def submit(self, engine: Engine, request: GenerationRequest, started: float, route: str,
               tenant: str | None = None) -> TokenStream:
        """Admit `request`; call on the event loop. Raises `QueueFullError` when full and the
        engine's `InvalidRequestError` for a request it refuses.

        `started` (a `time.perf_counter()` value) is the request's arrival, for TTFT and
        end-to-end latency under the metrics label `route`; `tenant`, the label its prompt tokens
        are counted under per tenant.
        """
        stream = TokenStream(asyncio.get_running_loop(), started)
        with self._lock:
            if len(self._routes) >= self.capacity:
                self.metrics.rejected.inc()
                raise QueueFullError(self.capacity)
            self._attach(engine)
            seq = engine.add_request(request, abort=stream.abort)
            self._routes[seq.request_id] = _Route(stream, route, contextvars.copy_context(), engine.eos_ids, tenant=tenant)
            self._publish()
            self._wake.notify()
        return stream

    def submit_internal(self, engine: Engine, request: GenerationRequest, deliver: Callable[[StepOutput], None]) -> None:
        """Add `request` for the gateway itself (the guard's checks): stepped like any other, outside
        `capacity`; `deliver(output)` is called on the engine thread for each of its outputs."""
        abort = AbortHandle()
        with self._lock:
            self._attach(engine)
            seq = engine.add_request(request, abort=abort)
            self._internal[seq.request_id] = (abort, deliver)
            self._wake.notify()

    def run_when_idle(self, task: IdleTask) -> None:
        """Run `task` whenever the engine is idle (see the module docstring); replaces any earlier one."""
        with self._lock:
            self._idle = task
            self._wake.notify()

    def wake(self) -> None:
        """Make an idle engine thread look for idle work again (call after queuing some)."""
        with self._lock:
            self._wake.notify()

    def close(self) -> None:
        """Abort every admitted generation and stop the engine thread (waits up to 10 s)."""
        with self._lock:
            self._closed = True
            for r in self._routes.values():
                r.stream.abort.abort()
            for abort, _ in self._internal.values():
                abort.abort()
            self._wake.notify()
        self._thread.join(timeout=10)

    # --- engine thread ------------------------------------------------------------------
    def _loop(self) -> None:
        try:
            self._serve()
        finally:  # stopped (closed, or a bug escaped): another gateway may drive the engine now
            with self._lock:
                if self._engine is not None:
                    self._engine.driver.release(self)

    def _serve(self) -> None:
        while True:
            with self._lock:
                while (not self._closed and not self._routes and not self._internal and not self._idle_work()
                       and not self._background_work()):
                    self._wake.wait()
                if self._closed and not self._routes and not self._internal:
                    return
                engine = self._engine
                idle = None if self._routes or self._internal or self._background_work() else self._idle
            if idle is not None:  # one task, then look again: a request may have arrived meanwhile
                try:
                    idle.run_one()
                except Exception:
                    log.exception("idle task failed")
                continue
            outbox = _Outbox()
            try:
                outputs = engine.step()
            except Exception:  # the engine failed outside any one request: end every stream
                log.exception("engine step failed")
                outputs = []
                with self._lock:
                    failed = list(self._routes)
                    internal = list(self._internal)
                for rid in failed:
                    self._end(rid, outbox, error=RuntimeError("engine step failed"))
                outputs = [StepOutput(rid, 0, None, "", finish_reason="error", error=RuntimeError("engine step failed"))
                           for rid in internal]
            for out in outputs:
                with self._lock:
                    route = self._routes.get(out.request_id)
                    internal = self._internal.get(out.request_id) if route is None else None
                    if internal is not None and out.finish_reason is not None:
                        del self._internal[out.request_id]
                if route is not None:
                    route.context.run(self._deliver, route, out, outbox)
                elif internal is not None:
                    try:
                        internal[1](out)
                    except Exception:
                        log.exception("internal request's output handler failed")
            outbox.flush()
            with self._lock:
                self._publish()

    def _background_work(self) -> bool:
        """Whether the engine has deferred cold work (entries a cold request served exactly left missing),
        which its steps compute before any idle task runs (call under `_lock`)."""
        return self._engine is not None and self._engine.has_background_work()

    def _idle_work(self) -> bool:
        """Whether an idle task is waiting and the engine is idle (call under `_lock`)."""
        engine = self._engine
        return (self._idle is not None and not self._internal and (engine is None or not engine.has_unfinished())
                and self._idle.pending())

    def _deliver(self, route: _Route, out: StepOutput, outbox: _Outbox) -> None:
        stream, now = route.stream, time.perf_counter()
        if out.stats is not None:
            outbox.push(stream, out.stats)
            self.metrics.observe_prefill(out.stats, route.tenant)
        if out.token_id is not None:
            if route.last_token_at is None:
                stream.first_token_at = now
                self.metrics.ttft.labels(route.route).observe(now - stream.started)
            else:
                self.metrics.itl.observe(now - route.last_token_at)
            route.last_token_at = now
            if out.token_id not in route.eos_ids:
                stream.completion_tokens += 1
                self.metrics.generated_tokens.inc()
        if out.finish_reason is None:
            return outbox.push(stream, out)
        if out.finish_reason != "error":
            outbox.push(stream, out)
            self.metrics.e2e.labels(route.route).observe(now - stream.started)
        else:
            # With its traceback: a failure seen once (a stream error in 80 requests under Ray's pow2
            # routing) is explained by the log it left, not by a rerun that may not reproduce it.
            log.warning("generation failed", extra={"error": repr(out.error), "request_id": out.request_id},
                        exc_info=(type(out.error), out.error, out.error.__traceback__) if out.error is not None else None)
        self._end(out.request_id, outbox, error=out.error if out.finish_reason == "error" else None)
        self.metrics.finished.labels(out.finish_reason).inc()

    def _end(self, request_id: str, outbox: _Outbox, error: BaseException | None = None) -> None:
        with self._lock:
            route = self._routes.pop(request_id, None)
        if route is None:
            return
        if error is not None:
            outbox.push(route.stream, error)
        outbox.push(route.stream, _END)

    def _publish(self) -> None:
        engine = self._engine
        if engine is not None:
            self.metrics.running.set(engine.scheduler.num_active)
            self.metrics.waiting.set(engine.scheduler.num_waiting)

"""The guard of one served model: it queues shadow checks of admitted requests, runs them on the engine
thread while the engine is idle, and feeds their results to the policy, whose actions change what
default-mode requests get.

A sampled request is queued (bounded; a full queue drops its oldest check) once admitted: every admitted
request while the guard is *dense* (its first `dense_checks` checks after documents are added and after
each widening; after start, a full window of them when the model has no faithfulness threshold, so its
estimate is known from the first requests; `dense_checks` 0 turns all of it off), else a `sample_rate` share of them. The engine thread starts
one queued check at a time, and only while the engine holds no request: a check is requests like any
other, at the lowest priority, stepped by the same `Engine.step()` as served ones. A request that arrives
while a check runs shares its steps. Requests that name a mode, a seam or a recompute budget are never
overridden.
"""

from __future__ import annotations

import logging
import random
import threading
from collections import deque
from typing import Callable

from prometheus_client import CollectorRegistry

from hypic_core.config import GenerationRequest, Mode
from hypic_core.engine.engine import Engine
from hypic_core.engine.sequence import StepOutput

from .checks import InFlight, ShadowCheck, check_requests, compare, run_check
from .metrics import GuardMetrics
from .policy import EXACT_MODES, CheckResult, Choice, GuardConfig, GuardPolicy, Release

log = logging.getLogger("hypic.guard")


class Guard:
    """Shadow checks of one served model and the policy they drive. Thread-safe: `serving`,
    `offer` and `health` run on the event loop, `pending` and `run_one` on the engine thread.

    `wake` is called (without the guard's lock) after a check is queued, so an idle engine
    thread looks again. `submit(request, deliver)` hands a check's request to the step loop
    (`EngineThread.submit_internal`), which calls `deliver(output)` on the engine thread for each
    of its outputs; without it `run_one` runs the check at once (`run_check`). `release`: the model's
    release measurement (app/service/guard/release.py), the faithfulness threshold unless the config names one.
    """

    def __init__(self, config: GuardConfig, engine: Engine, model: str, base: Choice, registry: CollectorRegistry,
                 wake: Callable[[], None] = lambda: None, rng: random.Random | None = None,
                 submit: Callable[[GenerationRequest, Callable[[StepOutput], None]], object] | None = None,
                 release: Release | None = None) -> None:
        self.config = config
        self.engine = engine
        self.model = model
        self.policy = GuardPolicy(base, config, release)
        self._wake = wake
        self._rng = rng or random.Random()
        self._lock = threading.Lock()
        self._queue: deque[ShadowCheck] = deque()
        self._submit = submit
        self._in_flight: InFlight | None = None
        self._checks = self._dropped = self._errors = 0
        # checks still queued from every request (not sampled): without a threshold, a whole window first (so the
        # estimate is known from the first requests), unless the operator turned dense checking off (0)
        unmeasured = self.policy.threshold is None and config.dense_checks > 0
        self._dense = max(config.dense_checks, config.window) if unmeasured else config.dense_checks
        self._metrics = GuardMetrics(registry, model)
        self._metrics.serving(self.policy.state, base)
        self._metrics.faithful(None, self.policy.threshold)

    @classmethod
    def for_engine(cls, settings, engine: Engine, model: str, registry: CollectorRegistry,
                   wake: Callable[[], None] = lambda: None, submit=None, release: Release | None = None) -> "Guard":
        """A guard over `settings.default_mode` at the engine's seam and recompute budget (what a request naming
        none of mode, seam and recompute gets)."""
        base = Choice(Mode.parse(settings.default_mode), engine.config.seam, engine.config.recompute_ratio)
        return cls(GuardConfig.from_settings(settings), engine, model, base, registry, wake, submit=submit, release=release)

    # --- event loop ----------------------------------------------------------------------
    def serving(self) -> Choice:
        """The configuration a request that names none of mode, seam and recompute runs with now."""
        with self._lock:
            return self.policy.serving

    def new_corpus(self) -> None:
        """Documents were added: check the next `dense_checks` requests, so what reuse costs on them
        is judged within the first few dozen requests instead of after hundreds."""
        with self._lock:
            self._dense = max(self._dense, self.config.dense_checks)

    def offer(self, request: GenerationRequest) -> bool:
        """Maybe queue a shadow check of an admitted `request` (every one while dense, else sampled at
        `sample_rate`); True if queued.

        It checks the configurations the guard answers for: the base and, when approximate and
        different, the one default-mode requests get now; not a configuration a request named
        for itself (so windows and metric labels stay a small set whatever seams clients send).
        A prompt with fewer than two context segments is not checked: its
        one segment is computed where it lands, so every mode is exact on it, and its
        agreement would only flatter the window. Nor is a request that keeps nothing (`cache_store`
        False): its check would store entries of its segments. A check runs under the request's
        `cache_salt`, so what it stores is the same tenant's.
        """
        if not self.config.enabled or len(request.context) < 2 or not request.cache_store:
            return False
        with self._lock:
            choices = tuple(c for c in dict.fromkeys((self.policy.base, self.policy.serving)) if c.mode not in EXACT_MODES)
            if not choices:
                return False
            if self._dense > 0:
                self._dense -= 1
            elif self._rng.random() >= self.config.sample_rate:
                return False
            greedy = self._rng.random() < self.config.greedy_sample
            if len(self._queue) >= self.config.queue_size:
                self._queue.popleft()
                self._dropped += 1
                self._metrics.dropped.inc()
            self._queue.append(ShadowCheck(request.segments, choices, greedy, request.exact_prefix, request.cache_salt))
            self._metrics.pending.set(len(self._queue))
        self._wake()
        return True

    def health(self) -> dict:
        """The `guard` object of GET /health."""
        with self._lock:
            p = self.policy
            base = p.window(p.base)
            windows = [{**c.as_dict(), "checks": len(w), "top1_agreement": _round(w.top1_agreement),
                        "greedy_agreement": _round(w.greedy_agreement), "mean_kl": _round(w.mean_kl)}
                       for c, w in sorted(p.windows.items(), key=lambda item: (item[0].mode.value, item[0].seam, item[0].recompute))
                       if len(w)]
            f = base.faithfulness
            faithfulness = {"estimate": _round(f and f.estimate), "low": _round(f and f.low), "high": _round(f and f.high),
                            "answers": base.answers, "answer_tokens": self.config.answer_tokens,
                            "threshold": p.threshold, "threshold_from": p.threshold_source,
                            "release": p.release.as_dict() if p.release else None}
            return {"enabled": self.config.enabled, "state": p.state.value, **p.serving.as_dict(),
                    "base": p.base.as_dict(), "agreement": _round(base.top1_agreement),
                    "greedy_agreement": _round(base.greedy_agreement), "faithfulness": faithfulness, "window_checks": len(base),
                    "checks": self._checks, "dense_left": self._dense, "pending": len(self._queue), "dropped": self._dropped, "errors": self._errors,
                    "windows": windows, "last_action": p.last_action.as_dict() if p.last_action else None}

    # --- engine thread -------------------------------------------------------------------
    def pending(self) -> bool:
        """Whether a queued check can start (one runs at a time)."""
        with self._lock:
            return bool(self._queue) and self._in_flight is None

    def run_one(self) -> None:
        """Start the oldest queued check (call only while the engine holds no request): its requests go
        to the step loop, and the results are recorded as its last output arrives."""
        with self._lock:
            if not self._queue or self._in_flight is not None:
                return
            check = self._queue.popleft()
            self._metrics.pending.set(len(self._queue))
        if self._submit is None:
            try:
                results = run_check(self.engine, check, self.config.answer_tokens)
            except Exception:
                return self._failed()
            return self._record(results)
        requests = check_requests(check, self.config.answer_tokens)
        flight = InFlight(check, len(requests))
        with self._lock:
            self._in_flight = flight
        try:
            for i, request in enumerate(requests):
                self._submit(request, lambda out, i=i: self._deliver(flight, i, out))
        except Exception:
            with self._lock:
                self._in_flight = None
            self._failed()

    def _deliver(self, flight: InFlight, i: int, out: StepOutput) -> None:
        """One output of a check's request (engine thread)."""
        flight.outputs[i].append(out)
        if out.finish_reason is None:
            return
        flight.left -= 1
        if flight.left:
            return
        with self._lock:
            self._in_flight = None
        try:
            results = compare(flight.check, flight.outputs)
        except Exception:
            self._failed()
        else:
            self._record(results)
        self._wake()  # the next queued check may start

    def _failed(self) -> None:
        log.exception("shadow check failed", extra={"model": self.model})
        with self._lock:
            self._errors += 1
        self._metrics.errors.inc()

    def _record(self, results: list[CheckResult]) -> None:
        with self._lock:
            self._checks += 1
            for result in results:
                action = self.policy.record(result)
                self._metrics.observe(result, self.policy.window(result.choice))
                if action is not None:
                    if action.action == "widen":
                        self._dense = self.config.dense_checks  # the wider configuration's window starts empty
                    self._metrics.serving(action.state, action.choice)
                    log.warning(f"accuracy guard: {action.action}", extra={
                        "model": self.model, "guard_action": action.action, "guard_state": action.state.value,
                        "from_mode": action.previous.mode.value, "from_seam": action.previous.seam,
                        "to_mode": action.choice.mode.value, "to_seam": action.choice.seam,
                        "from_recompute": action.previous.recompute, "to_recompute": action.choice.recompute,
                        "reason": action.reason})
            self._metrics.faithful(self.policy.window(self.policy.base).faithfulness, self.policy.threshold)


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 6)

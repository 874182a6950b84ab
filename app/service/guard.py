"""The online accuracy guard: shadow checks of approximate reuse against full prefill, and the
policy that widens the seam or falls back to exact reuse when agreement drops.

A sampled request is queued (bounded; a full queue drops its oldest check) once admitted: every
admitted request while the guard is *dense* (its first `dense_checks` checks after start, after
documents are added, and after each widening: so it can judge a new corpus or a new seam within
the first few dozen requests), else a `sample_rate` share of them. The
engine thread starts one queued check at a time, and only while the engine holds no
request: a check is requests like any other, at the lowest priority, stepped by the same
`Engine.step()` as served ones: the request's segments in `full` and in each approximate
configuration under watch, greedy, keeping their first-token logits. It compares the
first-token distributions (KL(full || served), top-1 agreement); a sampled share of checks
also compares the first `greedy_tokens` greedy tokens. Results go into a rolling window per
(mode, seam). A request that arrives while a check runs shares its steps (no second model path).

`GuardPolicy` (pure: results in, decisions out) watches the configured default (the "base"):
when its rolling top-1 agreement over at least `min_checks` checks falls below
`min_agreement`, default-mode requests get wider reuse: each widening doubles the seam (up to
`max_seam`) and the query-aware recompute budget (from 0.05, up to `max_recompute`:
hypic_core/engine/recompute.py, the documents nearest the question recomputed in context), each
new configuration judged on its own window; then `prefix` (exact) once the widest is no better. The base
configuration stays under watch in every state, and when its window is good again (a full
window, `window` checks, at or above `min_agreement`: recovery needs more evidence than
tripping, so the guard does not flap) it returns to it. Requests that name a mode, a seam or a
recompute budget are never overridden.
"""

from __future__ import annotations

import enum
import logging
import random
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Callable, NamedTuple

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from hypic_core.config import GenerationRequest, Mode, SamplingParams
from hypic_core.engine.engine import Engine
from hypic_core.engine.sequence import StepOutput
from hypic_core.errors import InvalidRequestError

log = logging.getLogger("hypic.guard")

EXACT_MODES = frozenset({Mode.FULL, Mode.PREFIX})
CHECK_PRIORITY = 1 << 20  # after every served request (priority 0) when the engine schedules by priority
_KL_BUCKETS = (1e-6, 1e-5, 1e-4, 1e-3, 0.01, 0.03, 0.1, 0.3, 1.0, 3.0, 10.0)


class GuardState(str, enum.Enum):
    OK = "ok"  # default-mode requests run as configured
    WIDENED = "widened"  # ... with a wider seam and recompute budget
    EXACT = "exact"  # ... with `prefix` (exact reuse)


_STATE_VALUE = {GuardState.OK: 0, GuardState.WIDENED: 1, GuardState.EXACT: 2}


class Choice(NamedTuple):
    """A serving configuration: how context segments are reused (seam width, recompute budget)."""

    mode: Mode
    seam: int
    recompute: float = 0.0

    def describe(self) -> str:
        if self.mode in EXACT_MODES:
            return self.mode.value
        return f"{self.mode.value} seam {self.seam}" + (f" recompute {self.recompute:g}" if self.recompute else "")

    def as_dict(self) -> dict:
        return {"mode": self.mode.value, "seam": self.seam, "recompute": self.recompute}

    def wider(self, max_seam: int, max_recompute: float) -> "Choice | None":
        """The next configuration up the guard's ladder: the seam doubled (at least 1, at most `max_seam`) and
        the recompute budget doubled (0.05 first, at most `max_recompute`); None when neither can widen."""
        seam = min(max_seam, max(1, 2 * self.seam)) if self.seam < max_seam else self.seam
        recompute = (min(max_recompute, 2 * self.recompute if self.recompute else FIRST_RECOMPUTE)
                     if self.recompute < max_recompute else self.recompute)
        if (seam, recompute) == (self.seam, self.recompute):
            return None
        return Choice(self.mode, seam, recompute)


FIRST_RECOMPUTE = 0.05  # the guard's first recompute budget (docs/accuracy.md: rung 3's smallest)


def exact_mode(mode: str | None) -> Mode:
    """The mode of a request with `exact: true`: `prefix`, or `full` when it names full.
    Raises InvalidRequestError (field "exact") when it names an approximate mode."""
    if mode is None:
        return Mode.PREFIX
    parsed = Mode.parse(mode)
    if parsed not in EXACT_MODES:
        raise InvalidRequestError("exact", f"exact: true asks for exact reuse; mode {parsed.value!r} is approximate "
                                  "(use full or prefix, or leave mode out)")
    return parsed


@dataclass(frozen=True)
class GuardConfig:
    """Thresholds of the guard (app/service/settings.py `guard_*`). Raises ValueError for values out of range."""

    enabled: bool = True
    sample_rate: float = 0.05  # share of admitted requests checked
    greedy_sample: float = 0.2  # share of checks that also compare greedy tokens
    greedy_tokens: int = 8
    window: int = 50  # checks kept per configuration (mode, seam, recompute)
    min_checks: int = 20  # checks in a window before the policy judges it
    min_agreement: float = 0.9  # rolling top-1 agreement below this trips the guard
    max_seam: int = 64
    max_recompute: float = 0.2  # largest recompute budget the guard widens to; 0: the seam alone
    queue_size: int = 64  # checks waiting for an idle engine
    # Checks queued from every admitted request (not a sample) after start, after documents are added and
    # after each widening, before `sample_rate` applies again; 0: always sampled.
    dense_checks: int = 20

    def __post_init__(self) -> None:
        for name in ("sample_rate", "greedy_sample", "min_agreement", "max_recompute"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ValueError(f"guard {name} must be in [0, 1], got {getattr(self, name)!r}")
        if self.dense_checks < 0:
            raise ValueError(f"guard dense_checks must be >= 0, got {self.dense_checks}")
        for name in ("greedy_tokens", "window", "min_checks", "queue_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"guard {name} must be >= 1, got {getattr(self, name)!r}")
        if self.min_checks > self.window:
            raise ValueError(f"guard min_checks ({self.min_checks}) must be <= window ({self.window})")
        if self.max_seam < 0:
            raise ValueError(f"guard max_seam must be >= 0, got {self.max_seam}")

    @classmethod
    def from_settings(cls, settings) -> "GuardConfig":
        return cls(settings.guard_enabled, settings.guard_sample_rate, settings.guard_greedy_sample,
                   settings.guard_greedy_tokens, settings.guard_window, settings.guard_min_checks,
                   settings.guard_min_agreement, settings.guard_max_seam, settings.guard_max_recompute,
                   settings.guard_queue_size, settings.guard_dense_checks)


@dataclass(frozen=True)
class CheckResult:
    """One configuration compared with full prefill on one request."""

    choice: Choice
    kl: float  # KL(full || served) of the first-token distributions, nats
    top1: bool  # same most likely first token
    greedy: bool | None = None  # same first N greedy tokens; None: not compared


class Window:
    """The last `size` check results of one configuration."""

    def __init__(self, size: int) -> None:
        self._results: deque[CheckResult] = deque(maxlen=size)

    def add(self, result: CheckResult) -> None:
        self._results.append(result)

    def clear(self) -> None:
        self._results.clear()

    def __len__(self) -> int:
        return len(self._results)

    @property
    def top1_agreement(self) -> float | None:
        return sum(r.top1 for r in self._results) / len(self._results) if self._results else None

    @property
    def greedy_agreement(self) -> float | None:
        greedy = [r.greedy for r in self._results if r.greedy is not None]
        return sum(greedy) / len(greedy) if greedy else None

    @property
    def mean_kl(self) -> float | None:
        return sum(r.kl for r in self._results) / len(self._results) if self._results else None


@dataclass(frozen=True)
class Action:
    """A change of what default-mode requests get."""

    action: str  # "widen", "exact" or "recover"
    state: GuardState
    previous: Choice
    choice: Choice
    reason: str
    at: float  # time.time()

    def as_dict(self) -> dict:
        return {"action": self.action, "state": self.state.value, "from": self.previous.as_dict(),
                "to": self.choice.as_dict(), "reason": self.reason,
                "at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(self.at))}


class GuardPolicy:
    """Windows of check results and the decisions they lead to; no I/O, not thread-safe.

    `record` adds a result and returns the `Action` it triggered, if any. Only the base
    configuration (the configured default) and the one being served are judged; results of
    other configurations are kept for reporting.
    """

    def __init__(self, base: Choice, config: GuardConfig) -> None:
        self.base = base
        self.config = config
        self.state = GuardState.OK
        self.serving = base
        self.windows: dict[Choice, Window] = {}
        self.last_action: Action | None = None

    @property
    def active(self) -> bool:
        """Whether the base configuration is approximate (an exact one has nothing to guard)."""
        return self.config.enabled and self.base.mode not in EXACT_MODES

    def window(self, choice: Choice) -> Window:
        if choice not in self.windows:
            self.windows[choice] = Window(self.config.window)
        return self.windows[choice]

    def record(self, result: CheckResult, now: float | None = None) -> Action | None:
        self.window(result.choice).add(result)
        if not self.active:
            return None
        action = self._decide(time.time() if now is None else now)
        if action is not None:
            self.state, self.serving, self.last_action = action.state, action.choice, action
            if action.action == "widen":
                self.window(action.choice).clear()  # a wider configuration is judged on fresh checks only
        return action

    def _decide(self, now: float) -> Action | None:
        base = self.window(self.base)
        if self.state is not GuardState.OK:
            if len(base) >= self.config.window and base.top1_agreement >= self.config.min_agreement:
                return Action("recover", GuardState.OK, self.serving, self.base,
                              f"{self._summary(self.base)} >= {self.config.min_agreement}", now)
            if self.state is GuardState.EXACT:
                return None
        current = self.serving
        if not self._bad(self.window(current)):
            return None
        why = f"{self._summary(current)} < {self.config.min_agreement}"
        wider = current.wider(self.config.max_seam, self.config.max_recompute)
        if wider is not None:
            return Action("widen", GuardState.WIDENED, current, wider, why, now)
        return Action("exact", GuardState.EXACT, current, Choice(Mode.PREFIX, self.base.seam),
                      f"{why} at the widest reuse (seam {self.config.max_seam}, recompute {self.config.max_recompute:g})", now)

    def _judged(self, window: Window) -> bool:
        return len(window) >= self.config.min_checks

    def _bad(self, window: Window) -> bool:
        return self._judged(window) and window.top1_agreement < self.config.min_agreement

    def _summary(self, choice: Choice) -> str:
        w = self.window(choice)
        return f"top-1 agreement {w.top1_agreement:.3f} over the last {len(w)} checks of {choice.describe()}"


@dataclass(frozen=True)
class ShadowCheck:
    """A request queued for checking: its segments and the approximate configurations to compare."""

    segments: tuple[tuple[int, ...], ...]
    choices: tuple[Choice, ...]
    greedy: bool
    exact_prefix: int = 0  # leading segments the served request reused exactly (checked as served)
    cache_salt: str = ""  # the served request's (its tenant's): a check's entries are that tenant's


def check_requests(check: ShadowCheck, greedy_tokens: int) -> list[GenerationRequest]:
    """A check as requests: `full` first, then one per configuration in `check.choices`; greedy, the
    first-token logits kept, `greedy_tokens` tokens (to the first EOS, inclusive) when the check
    compares them. exact_runs=False: the check judges composition, so a run the served request may
    have reused exactly (a repeat) is composed here, and the check records no sighting of it."""
    sampling = SamplingParams(max_tokens=greedy_tokens if check.greedy else 1)
    full = GenerationRequest(check.segments, Mode.FULL, sampling=sampling, keep_logits=True, priority=CHECK_PRIORITY,
                             cache_salt=check.cache_salt)
    return [full] + [GenerationRequest(check.segments, c.mode, c.seam, sampling, exact_prefix=check.exact_prefix,
                                       exact_runs=False, keep_logits=True, priority=CHECK_PRIORITY, cache_salt=check.cache_salt,
                                       recompute=c.recompute)
                     for c in check.choices]


def compare(check: ShadowCheck, outputs: list[list[StepOutput]]) -> list[CheckResult]:
    """Each configuration's outputs against full prefill's (`outputs` in `check_requests` order).
    Raises RuntimeError when a request of the check failed."""
    for outs in outputs:
        if not outs or outs[-1].finish_reason == "error" or outs[0].logits is None:
            error = outs[-1].error if outs else None
            raise RuntimeError(f"a shadow-check request failed: {error!r}") from error
    full, *served = outputs
    reference = full[0].logits.log_softmax(-1)
    full_tokens = [o.token_id for o in full if o.token_id is not None]
    results = []
    for choice, outs in zip(check.choices, served):
        logits = outs[0].logits
        logq = logits.log_softmax(-1)
        kl = max(0.0, float((reference.exp() * (reference - logq)).sum()))
        top1 = int(logits.argmax()) == int(full[0].logits.argmax())
        greedy = [o.token_id for o in outs if o.token_id is not None] == full_tokens if check.greedy else None
        results.append(CheckResult(choice, kl, top1, greedy))
    return results


def run_check(engine: Engine, check: ShadowCheck, greedy_tokens: int) -> list[CheckResult]:
    """Run `check` at once through `engine.step()` (tests, benchmarks; the gateway's checks go through
    the engine thread's step loop instead). Call only while no other caller steps the engine."""
    seqs = [engine.add_request(r, collect=True) for r in check_requests(check, greedy_tokens)]
    outputs: list[list[StepOutput]] = [[] for _ in seqs]
    while not all(s.finished for s in seqs):
        engine.step()
    for outs, seq in zip(outputs, seqs):
        outs.extend(seq.outbox)
    return compare(check, outputs)


class _InFlight:
    """A check whose requests the engine thread's step loop is running."""

    def __init__(self, check: ShadowCheck, n: int) -> None:
        self.check = check
        self.outputs: list[list[StepOutput]] = [[] for _ in range(n)]
        self.left = n


class _GuardMetrics:
    def __init__(self, registry: CollectorRegistry, model: str) -> None:
        r, labels = registry, ["model", "mode", "seam", "recompute"]
        self.model = model
        self.checks = Counter("hypic_guard_checks", "Shadow checks run against full prefill, by configuration.",
                              labels, registry=r)
        self.kl = Histogram("hypic_guard_kl", "KL(full || served) of the first-token distributions, nats.",
                            labels, buckets=_KL_BUCKETS, registry=r)
        self.top1 = Gauge("hypic_guard_top1_agreement", "Rolling top-1 first-token agreement with full prefill.",
                          labels, registry=r)
        self.greedy = Gauge("hypic_guard_greedy_agreement", "Rolling share of greedy-compared checks whose first "
                            "N greedy tokens equal full prefill's.", labels, registry=r)
        self.dropped = Counter("hypic_guard_dropped_checks", "Shadow checks dropped (the queue was full).",
                               ["model"], registry=r).labels(model)
        self.errors = Counter("hypic_guard_check_errors", "Shadow checks that failed.", ["model"], registry=r).labels(model)
        self.pending = Gauge("hypic_guard_pending_checks", "Shadow checks waiting for an idle engine.",
                             ["model"], registry=r).labels(model)
        self.state = Gauge("hypic_guard_state", "What default-mode requests get: 0 ok (as configured), 1 widened "
                           "seam and recompute budget, 2 exact (prefix).", ["model"], registry=r).labels(model)
        self.seam = Gauge("hypic_guard_seam", "Seam default-mode requests get.", ["model"], registry=r).labels(model)
        self.recompute = Gauge("hypic_guard_recompute", "Recompute budget default-mode requests get.", ["model"],
                               registry=r).labels(model)

    def observe(self, result: CheckResult, window: Window) -> None:
        labels = (self.model, result.choice.mode.value, str(result.choice.seam), f"{result.choice.recompute:g}")
        self.checks.labels(*labels).inc()
        self.kl.labels(*labels).observe(result.kl)
        self.top1.labels(*labels).set(window.top1_agreement)
        if window.greedy_agreement is not None:
            self.greedy.labels(*labels).set(window.greedy_agreement)

    def serving(self, state: GuardState, choice: Choice) -> None:
        self.state.set(_STATE_VALUE[state])
        self.seam.set(choice.seam)
        self.recompute.set(choice.recompute)


class Guard:
    """Shadow checks of one served model and the policy they drive. Thread-safe: `serving`,
    `offer` and `health` run on the event loop, `pending` and `run_one` on the engine thread.

    `wake` is called (without the guard's lock) after a check is queued, so an idle engine
    thread looks again. `submit(request, deliver)` hands a check's request to the step loop
    (`EngineThread.submit_internal`), which calls `deliver(output)` on the engine thread for each
    of its outputs; without it `run_one` runs the check at once (`run_check`).
    """

    def __init__(self, config: GuardConfig, engine: Engine, model: str, base: Choice, registry: CollectorRegistry,
                 wake: Callable[[], None] = lambda: None, rng: random.Random | None = None,
                 submit: Callable[[GenerationRequest, Callable[[StepOutput], None]], object] | None = None) -> None:
        self.config = config
        self.engine = engine
        self.model = model
        self.policy = GuardPolicy(base, config)
        self._wake = wake
        self._rng = rng or random.Random()
        self._lock = threading.Lock()
        self._queue: deque[ShadowCheck] = deque()
        self._submit = submit
        self._in_flight: _InFlight | None = None
        self._checks = self._dropped = self._errors = 0
        self._dense = config.dense_checks  # checks still queued from every request (not sampled)
        self._metrics = _GuardMetrics(registry, model)
        self._metrics.serving(self.policy.state, base)

    @classmethod
    def for_engine(cls, settings, engine: Engine, model: str, registry: CollectorRegistry,
                   wake: Callable[[], None] = lambda: None, submit=None) -> "Guard":
        """A guard over `settings.default_mode` at the engine's seam and recompute budget (what a request naming
        none of mode, seam and recompute gets)."""
        base = Choice(Mode.parse(settings.default_mode), engine.config.seam, engine.config.recompute_ratio)
        return cls(GuardConfig.from_settings(settings), engine, model, base, registry, wake, submit=submit)

    # --- event loop ----------------------------------------------------------------------
    def serving(self) -> Choice:
        """The configuration a request that names none of mode, seam and recompute runs with now."""
        with self._lock:
            return self.policy.serving

    def new_corpus(self) -> None:
        """Documents were added: check the next `dense_checks` requests, so what reuse costs on them
        is judged within the first few dozen requests instead of after hundreds."""
        with self._lock:
            self._dense = self.config.dense_checks

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
            return {"enabled": self.config.enabled, "state": p.state.value, **p.serving.as_dict(),
                    "base": p.base.as_dict(), "agreement": _round(base.top1_agreement),
                    "greedy_agreement": _round(base.greedy_agreement), "window_checks": len(base),
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
                results = run_check(self.engine, check, self.config.greedy_tokens)
            except Exception:
                return self._failed()
            return self._record(results)
        requests = check_requests(check, self.config.greedy_tokens)
        flight = _InFlight(check, len(requests))
        with self._lock:
            self._in_flight = flight
        try:
            for i, request in enumerate(requests):
                self._submit(request, lambda out, i=i: self._deliver(flight, i, out))
        except Exception:
            with self._lock:
                self._in_flight = None
            self._failed()

    def _deliver(self, flight: _InFlight, i: int, out: StepOutput) -> None:
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


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 6)

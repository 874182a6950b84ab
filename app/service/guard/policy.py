"""The guard's decisions, pure: check results in, actions out (no I/O, no threads, no clock but `now`).

Two watches on the base configuration's rolling window (its last `window` checks):
- top-1 agreement: the share of checks whose most likely first token is `full`'s; below `min_agreement`
  over at least `min_checks` checks, the guard acts;
- faithfulness: the share of checks whose first `answer_tokens` greedy tokens equal `full`'s, with its
  Wilson 95% interval. The guard acts when the interval's upper end falls below the threshold (the
  operator's `min_faithfulness`, else the lower end of the model's release measurement's interval, from
  its model card): so a model behaving as it did at release does not trip on either measurement's noise,
  and one that answers differently from `full` clearly more often than at release trips within a window.

Acting walks the ladder: each widening doubles the seam (up to `max_seam`) and the recompute budget
(0.05 first, up to `max_recompute`), each new configuration judged on its own fresh window; then `prefix`
(exact) once the widest is no better. The base stays under watch in every state, and the guard returns
to it when a full window of it is good again on both watches (recovery needs more evidence than
tripping, so the guard does not flap).
"""

from __future__ import annotations

import enum
import math
import time
from collections import deque
from dataclasses import dataclass
from typing import NamedTuple

from hypic_core.config import Mode
from hypic_core.errors import InvalidRequestError

EXACT_MODES = frozenset({Mode.FULL, Mode.PREFIX})
FIRST_RECOMPUTE = 0.05  # the guard's first recompute budget (docs/accuracy.md: rung 3's smallest)


class GuardState(str, enum.Enum):
    OK = "ok"  # default-mode requests run as configured
    WIDENED = "widened"  # ... with a wider seam and recompute budget
    EXACT = "exact"  # ... with `prefix` (exact reuse)


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


class Interval(NamedTuple):
    """A share and its 95% interval."""

    estimate: float
    low: float
    high: float


def wilson_interval(successes: int, n: int, z: float = 1.96) -> Interval:
    """`successes / n` with its Wilson score interval. Raises ValueError unless 0 <= successes <= n and n >= 1."""
    if n < 1 or not 0 <= successes <= n:
        raise ValueError(f"wilson_interval: need 0 <= successes <= n and n >= 1, got {successes}/{n}")
    p = successes / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return Interval(p, max(0.0, centre - half), min(1.0, centre + half))


@dataclass(frozen=True)
class Release:
    """A model's faithfulness as measured at release (bench/faithfulness.py), from its model card: the share
    of prompts whose first `answer_tokens` greedy tokens under `config` equal `full`'s."""

    identical: float
    low: float
    high: float
    n: int
    answer_tokens: int
    config: str  # e.g. "hypic:8"
    source: str  # the file it was read from

    def as_dict(self) -> dict:
        return {"identical": self.identical, "low": self.low, "high": self.high, "n": self.n,
                "answer_tokens": self.answer_tokens, "config": self.config, "source": self.source}


@dataclass(frozen=True)
class GuardConfig:
    """Thresholds of the guard (app/service/settings/guard.py `guard_*`). Raises ValueError for values out of range."""

    enabled: bool = True
    sample_rate: float = 0.05  # share of admitted requests checked
    greedy_sample: float = 1.0  # share of checks that compare whole answers (the rest: the first token only)
    answer_tokens: int = 32  # greedy tokens an answer check compares with full's
    window: int = 50  # checks kept per configuration (mode, seam, recompute)
    min_checks: int = 20  # checks in a window before the policy judges it
    min_agreement: float = 0.9  # rolling top-1 agreement below this trips the guard
    max_seam: int = 64
    max_recompute: float = 0.2  # largest recompute budget the guard widens to; 0: the seam alone
    queue_size: int = 64  # checks waiting for an idle engine
    # Checks queued from every admitted request (not a sample) after start, after documents are added and
    # after each widening, before `sample_rate` applies again; 0: always sampled.
    dense_checks: int = 20
    # The faithfulness threshold (share of identical answers); None: the model's release measurement.
    min_faithfulness: float | None = None

    def __post_init__(self) -> None:
        for name in ("sample_rate", "greedy_sample", "min_agreement", "max_recompute"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ValueError(f"guard {name} must be in [0, 1], got {getattr(self, name)!r}")
        if self.min_faithfulness is not None and not 0.0 <= self.min_faithfulness <= 1.0:
            raise ValueError(f"guard min_faithfulness must be in [0, 1] or None, got {self.min_faithfulness!r}")
        if self.dense_checks < 0:
            raise ValueError(f"guard dense_checks must be >= 0, got {self.dense_checks}")
        for name in ("answer_tokens", "window", "min_checks", "queue_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"guard {name} must be >= 1, got {getattr(self, name)!r}")
        if self.min_checks > self.window:
            raise ValueError(f"guard min_checks ({self.min_checks}) must be <= window ({self.window})")
        if self.max_seam < 0:
            raise ValueError(f"guard max_seam must be >= 0, got {self.max_seam}")

    @classmethod
    def from_settings(cls, settings) -> "GuardConfig":
        return cls(settings.guard_enabled, settings.guard_sample_rate, settings.guard_greedy_sample,
                   settings.guard_answer_tokens, settings.guard_window, settings.guard_min_checks,
                   settings.guard_min_agreement, settings.guard_max_seam, settings.guard_max_recompute,
                   settings.guard_queue_size, settings.guard_dense_checks, settings.guard_min_faithfulness)


@dataclass(frozen=True)
class CheckResult:
    """One configuration compared with full prefill on one request."""

    choice: Choice
    kl: float  # KL(full || served) of the first-token distributions, nats
    top1: bool  # same most likely first token
    greedy: bool | None = None  # same first `answer_tokens` greedy tokens; None: not compared


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
    def answers(self) -> int:
        """Checks in the window that compared whole answers."""
        return sum(r.greedy is not None for r in self._results)

    @property
    def greedy_agreement(self) -> float | None:
        """The share of answer-compared checks whose answers equal full's (the faithfulness estimate)."""
        f = self.faithfulness
        return None if f is None else f.estimate

    @property
    def faithfulness(self) -> Interval | None:
        """The share of identical answers with its Wilson 95% interval; None before any answer was compared."""
        greedy = [r.greedy for r in self._results if r.greedy is not None]
        return wilson_interval(sum(greedy), len(greedy)) if greedy else None

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
    other configurations are kept for reporting. `release` is the model's release measurement: the
    faithfulness threshold when the config names none (and it was measured over `answer_tokens` tokens).
    """

    def __init__(self, base: Choice, config: GuardConfig, release: Release | None = None) -> None:
        self.base = base
        self.config = config
        self.release = release
        self.state = GuardState.OK
        self.serving = base
        self.windows: dict[Choice, Window] = {}
        self.last_action: Action | None = None

    @property
    def active(self) -> bool:
        """Whether the base configuration is approximate (an exact one has nothing to guard)."""
        return self.config.enabled and self.base.mode not in EXACT_MODES

    @property
    def threshold(self) -> float | None:
        """The faithfulness below which the guard acts: the operator's, else the lower end of the release
        measurement's 95% interval; None when neither is known (the guard then reports faithfulness, and acts on
        top-1 agreement alone)."""
        if self.config.min_faithfulness is not None:
            return self.config.min_faithfulness
        if self.release is not None and self.release.answer_tokens == self.config.answer_tokens:
            return self.release.low
        return None

    @property
    def threshold_source(self) -> str | None:
        if self.config.min_faithfulness is not None:
            return "operator"
        return "release" if self.threshold is not None else None

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
            if len(base) >= self.config.window and self._good(base):
                return Action("recover", GuardState.OK, self.serving, self.base, self._summary(self.base, ">="), now)
            if self.state is GuardState.EXACT:
                return None
        current = self.serving
        if not self._bad(self.window(current)):
            return None
        why = self._summary(current, "<")
        wider = current.wider(self.config.max_seam, self.config.max_recompute)
        if wider is not None:
            return Action("widen", GuardState.WIDENED, current, wider, why, now)
        return Action("exact", GuardState.EXACT, current, Choice(Mode.PREFIX, self.base.seam),
                      f"{why} at the widest reuse (seam {self.config.max_seam}, recompute {self.config.max_recompute:g})", now)

    def unfaithful(self, window: Window) -> bool:
        """Whether the window's faithfulness is below the threshold beyond its noise: at least `min_checks`
        answers compared and the upper end of their 95% interval under the threshold."""
        f, threshold = window.faithfulness, self.threshold
        return threshold is not None and f is not None and window.answers >= self.config.min_checks and f.high < threshold

    def _bad(self, window: Window) -> bool:
        if len(window) < self.config.min_checks:
            return False
        return window.top1_agreement < self.config.min_agreement or self.unfaithful(window)

    def _good(self, window: Window) -> bool:
        f, threshold = window.faithfulness, self.threshold
        faithful = threshold is None or (f is not None and f.estimate >= threshold)
        return window.top1_agreement >= self.config.min_agreement and faithful

    def _summary(self, choice: Choice, relation: str) -> str:
        """Why the guard acts on `choice`'s window: the watches that say so (`relation` "<"), or both (">=")."""
        w = self.window(choice)
        top1 = f"top-1 agreement {w.top1_agreement:.3f} {relation} {self.config.min_agreement}"
        f, threshold = w.faithfulness, self.threshold
        faith = None if f is None or threshold is None else (
            f"identical {self.config.answer_tokens}-token answers {f.estimate:.3f} (95% CI {f.low:.3f}-{f.high:.3f}) "
            f"{relation} {threshold:.3f} ({self.threshold_source})")
        if relation == "<":
            parts = ([top1] if w.top1_agreement < self.config.min_agreement else []) + ([faith] if self.unfaithful(w) else [])
        else:
            parts = [top1] + ([faith] if faith else [])
        return f"{' and '.join(parts)} over the last {len(w)} checks of {choice.describe()}"

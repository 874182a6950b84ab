"""Prompt-lookup drafts for speculative decoding: the next tokens guessed from the sequence's own text.

RAG answers copy from their documents (names, numbers, phrases). `PromptLookup` finds the
longest suffix of the sequence (its prompt, then what it generated) of n = max_n..1 tokens that
occurred earlier, and proposes what followed its latest earlier occurrence: up to k tokens. The
engine feeds them after the last sampled token in one verification forward
(hypic_core/runner/verify_step.py) and keeps the prefix the model agrees with.

`DraftBudget` sets k from how drafts fared and what a drafted token costs in the verification
forward: long drafts while a sequence copies, none (a one-token probe now and then) while it
does not, so a sequence that does not copy pays little.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable


class PromptLookup:
    """n-gram index over one sequence's tokens. `extend` appends tokens; `propose(k)` drafts.

    For each n, `_next[n]` maps an n-gram to the index just after its latest occurrence whose
    continuation is known (the suffix itself is entered only once a token follows it)."""

    def __init__(self, tokens: Iterable[int], max_n: int = 3, min_n: int = 2):
        if not 1 <= min_n <= max_n:
            raise ValueError(f"need 1 <= min_n <= max_n, got {min_n}, {max_n}")
        self.max_n, self.min_n = max_n, min_n
        self.tokens: list[int] = []
        self._next: list[dict[tuple[int, ...], int]] = [{} for _ in range(max_n + 1)]
        self.extend(tokens)

    def extend(self, tokens: Iterable[int]) -> None:
        for tok in tokens:
            i = len(self.tokens)  # the index `tok` lands at: the n-grams ending just before it now have a continuation
            for n in range(self.min_n, self.max_n + 1):
                if i >= n:
                    self._next[n][tuple(self.tokens[i - n:i])] = i
            self.tokens.append(int(tok))

    def propose(self, k: int) -> list[int]:
        """Up to `k` tokens that followed the longest earlier occurrence of the current suffix; [] if none."""
        if k <= 0:
            return []
        toks = self.tokens
        for n in range(min(self.max_n, len(toks)), self.min_n - 1, -1):
            at = self._next[n].get(tuple(toks[len(toks) - n:]))
            if at is not None:
                return toks[at:at + k]
        return []


@dataclass
class DraftBudget:
    """How many tokens to draft next (`k`), from the acceptance of earlier drafts and what a drafted token costs.

    `rate` estimates the chance that a draft token is accepted given the one before it was (a moving
    average over drafted tokens, starting at `prior`). A draft of k tokens then yields
    (1 - rate^(k+1)) / (1 - rate) tokens in a forward that costs 1 + cost * k plain steps (`cost`: the
    price of one more token in the verification forward, which on a CPU whose small matrix products
    are compute-bound is far from free). `next_k` picks the k with the best yield per cost, 0 when
    no k beats plain decoding: then a probe of one token is tried every `probe` steps so that a
    sequence which starts copying later is noticed."""

    max_k: int = 8
    cost: float = 0.3
    prior: float = 0.6
    probe: int = 8
    rate: float = -1.0  # < 0: no draft seen yet (the prior)
    idle: int = 0  # steps since the last draft

    def next_k(self) -> int:
        rate = self.prior if self.rate < 0 else self.rate
        best, best_gain = 0, 1.0
        for k in range(1, self.max_k + 1):
            gain = (1.0 - rate ** (k + 1)) / (1.0 - rate) / (1.0 + self.cost * k) if rate < 1.0 else (k + 1) / (1 + self.cost * k)
            if gain > best_gain + 1e-9:
                best, best_gain = k, gain
        if best == 0:
            self.idle += 1
            if self.idle >= self.probe:
                self.idle = 0
                return 1
        return best

    def record(self, drafted: int, accepted: int) -> None:
        """A draft of `drafted` tokens of which the first `accepted` were kept."""
        if drafted <= 0:
            return
        self.idle = 0
        # per-token outcomes: `accepted` successes, then one failure unless the whole draft was kept
        trials = accepted + (1 if accepted < drafted else 0)
        rate = self.prior if self.rate < 0 else self.rate
        for i in range(trials):
            rate = 0.8 * rate + 0.2 * (1.0 if i < accepted else 0.0)
        self.rate = rate


class DraftCost:
    """The measured price of one drafted token, in plain decode steps, per batch size: how much longer a
    verification forward of B rows takes than a plain step of B rows, per draft token it carried.
    Moving averages from `prior` (EngineConfig.speculation_cost). On a GPU it falls towards 0 (a few
    more rows are free); on a CPU whose small matrix products are compute-bound it is large, and more
    so in a batch, where one row's draft lengthens every row's recurrences. `ready(B)`: a plain step
    of B rows has been timed twice (the engine drafts for a batch size only then), so each size is
    judged against its own baseline.

    The price is a linear model; a verification forward also has costs a draft's length does not
    explain (each row's recurrences stepped to the longest draft). So the result is checked too:
    `pays(B)` is false while verification steps of B rows have produced fewer tokens per second than
    plain steps of B rows (judged after `judge` of them); the engine then drafts nothing at that size
    for `rest` steps and tries again, resting twice as long after each judgment that goes against
    drafting in a row (at most `max_rest` steps), so a workload that never pays (nothing to copy,
    many streams on a CPU) spends ever fewer steps finding that out again; a judgment in its favour
    resets the rest to `rest`."""

    def __init__(self, prior: float, rest: int = 32, judge: int = 8, max_rest: int = 1024):
        self.prior, self.rest, self.judge = prior, rest, judge  # judged after `judge` verification steps
        self.max_rest = max_rest
        self._against: dict[int, int] = {}  # rows -> judgments against drafting in a row
        self._plain: dict[int, tuple[int, float]] = {}  # rows -> (plain steps timed, moving average seconds)
        self._cost: dict[int, float] = {}  # rows -> moving average price of a draft token
        self._rate: dict[int, tuple[int, float]] = {}  # rows -> (verification steps, moving average tokens per second)
        self._resting: dict[int, int] = {}  # rows -> steps left without drafting

    def pays(self, rows: int) -> bool:
        """Whether to draft in a step of `rows` rows (counts a resting step)."""
        left = self._resting.get(rows, 0)
        if left > 0:
            self._resting[rows] = left - 1
            return False
        return True

    def verified(self, rows: int, tokens: int, seconds: float) -> None:
        """A verification step of `rows` rows emitted `tokens` tokens in `seconds` (forward included)."""
        if not self.ready(rows) or seconds <= 0:
            return
        rate = tokens / seconds
        n, seen = self._rate.get(rows, (0, rate))
        n, avg = n + 1, (rate if n == 0 else 0.9 * seen + 0.1 * rate)
        self._rate[rows] = (n, avg)
        if n >= self.judge and avg < rows / self._plain[rows][1]:  # plain steps do better at this size: rest
            against = self._against.get(rows, 0)
            self._resting[rows] = min(self.rest << against, self.max_rest)
            self._against[rows] = against + 1
            self._rate.pop(rows)
        elif n >= self.judge:
            self._against.pop(rows, None)

    def ready(self, rows: int) -> bool:
        return self._plain.get(rows, (0, 0.0))[0] >= 2

    def cost(self, rows: int) -> float:
        return self._cost.get(rows, self.prior)

    def plain(self, rows: int, seconds: float) -> None:
        n, avg = self._plain.get(rows, (0, seconds))
        self._plain[rows] = (n + 1, seconds if n == 0 else 0.8 * avg + 0.2 * seconds)

    def verify(self, rows: int, drafted: int, seconds: float) -> None:
        if not self.ready(rows) or drafted <= 0:
            return
        sample = max(0.0, seconds / self._plain[rows][1] - 1.0) / drafted
        self._cost[rows] = 0.8 * self.cost(rows) + 0.2 * min(sample, 10.0)

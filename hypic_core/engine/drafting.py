"""Prompt-lookup drafts for speculative decoding: the next tokens guessed from the sequence's own text.

RAG answers copy from their documents (names, numbers, phrases). `PromptLookup` finds the
longest suffix of the sequence (its prompt, then what it generated) of n = max_n..1 tokens that
occurred earlier, and proposes what followed its latest earlier occurrence: up to k tokens. The
engine feeds them after the last sampled token in one verification forward
(hypic_core/runner/verify_step.py) and keeps the prefix the model agrees with.

`DraftBudget` sets k from how drafts fared: longer after a draft accepted whole, shorter after a
partial one, and none for a while (doubling) after drafts keep failing, so a sequence that does
not copy pays for a probe now and then, not every step.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable


class PromptLookup:
    """n-gram index over one sequence's tokens. `extend` appends tokens; `propose(k)` drafts.

    For each n, `_next[n]` maps an n-gram to the index just after its latest occurrence whose
    continuation is known (the suffix itself is entered only once a token follows it)."""

    def __init__(self, tokens: Iterable[int], max_n: int = 3, min_n: int = 1):
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
    """How many tokens to draft next (`k`), adapted to the acceptance of earlier drafts."""

    max_k: int = 8
    k: int = 4
    failures: int = 0  # drafts in a row with no token accepted
    pause: int = 0  # steps left without drafting

    def next_k(self) -> int:
        if self.pause > 0:
            self.pause -= 1
            return 0
        return min(self.k, self.max_k)

    def record(self, drafted: int, accepted: int) -> None:
        if drafted <= 0:
            return
        if accepted >= drafted:
            self.k, self.failures = min(self.max_k, self.k + 2), 0
        elif accepted > 0:
            self.k, self.failures = max(1, accepted + 1), 0
        else:
            self.failures += 1
            self.k = max(1, self.k // 2)
            if self.failures >= 2:  # keeps failing: rest, longer each time (at most 64 steps)
                self.pause = min(64, 2 ** (self.failures - 1))

"""The one byte-budget LRU every cache in the engine is built on (segment store, memory tiers, exact snapshots)."""

from __future__ import annotations

from collections import OrderedDict
from typing import Generic, Hashable, Protocol, TypeVar


class Sized(Protocol):
    @property
    def nbytes(self) -> int: ...


K = TypeVar("K", bound=Hashable)
V = TypeVar("V", bound=Sized)


class ByteLRU(Generic[K, V]):
    """An ordered map whose values' `nbytes` sum to at most `budget_bytes`, least recently used
    out first. Not thread-safe: the owner serialises calls. A value's `nbytes` must not change
    while it is held."""

    def __init__(self, budget_bytes: int):
        if budget_bytes < 0:
            raise ValueError(f"budget_bytes must be >= 0, got {budget_bytes}")
        self.budget_bytes = budget_bytes
        self.nbytes = 0
        self._items: OrderedDict[K, V] = OrderedDict()

    def get(self, key: K) -> V | None:
        """The value (now most recently used), or None."""
        value = self._items.get(key)
        if value is not None:
            self._items.move_to_end(key)
        return value

    def peek(self, key: K) -> V | None:
        """The value without touching its recency, or None."""
        return self._items.get(key)

    def put(self, key: K, value: V) -> list[tuple[K, V]]:
        """Hold `value` under `key` (replacing any previous one); return what left to stay in budget:
        least-recently-used items, or `(key, value)` itself when it alone exceeds the budget."""
        self.pop(key)
        if value.nbytes > self.budget_bytes:
            return [(key, value)]
        out = []
        while self.nbytes + value.nbytes > self.budget_bytes:
            out.append(self.pop_oldest())
        self._items[key] = value
        self.nbytes += value.nbytes
        return out

    def pop(self, key: K) -> V | None:
        """Remove and return the value under `key`; None (a no-op) when absent."""
        value = self._items.pop(key, None)
        if value is not None:
            self.nbytes -= value.nbytes
        return value

    def pop_oldest(self) -> tuple[K, V]:
        """Remove and return the least recently used item. Raises KeyError when empty."""
        key, value = self._items.popitem(last=False)
        self.nbytes -= value.nbytes
        return key, value

    def keys(self) -> list[K]:
        """The keys held, least recently used first (a copy: the caller may pop while walking it)."""
        return list(self._items)

    def __contains__(self, key: K) -> bool:
        return key in self._items

    def __len__(self) -> int:
        return len(self._items)

"""Segment stores: where canonical entries live between requests.

The interface is three calls. Stores are thread-safe. Tiered stores (memory, disk) implement
the same interface; the engine never knows which tier answered.
"""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from dataclasses import dataclass, field

from .entry import SegmentEntry
from .keys import SegmentKey
from .lru import ByteLRU


@dataclass
class StoreStats:
    """Counters for metrics. `hits`, `bytes` and the per-tier maps are keyed by tier name."""

    hits: dict[str, int] = field(default_factory=dict)
    misses: int = 0  # lookups no tier answered
    evictions: int = 0  # entries dropped from memory to stay within budget
    corrupt: int = 0  # damaged, foreign or mismatched entries found (each also a miss)
    bytes: dict[str, int] = field(default_factory=dict)
    tier_misses: dict[str, int] = field(default_factory=dict)  # lookups that reached a tier and missed there
    load_seconds: dict[str, float] = field(default_factory=dict)  # total time spent serving hits, per tier
    dropped_writes: int = 0  # disk writes skipped: queue full or I/O failure
    disk_errors: int = 0  # disk I/O failures (the store kept serving from memory)
    disk_damaged: int = 0  # disk-tier directories found damaged at open, moved aside and started empty
    redis_dropped_writes: int = 0  # Redis writes skipped: queue full, server down or the write failed
    redis_errors: int = 0  # failed Redis calls (the store kept serving from its local tiers)
    redis_connected: int | None = None  # 1 while the Redis tier reaches its server, 0 while it is down; None: no Redis tier


class SegmentStore(ABC):
    """Key -> SegmentEntry map with bounded capacity.

    Contract:
    - `lookup` returns the entry or None; it never raises for a damaged or foreign entry
      (that is a miss). A returned entry's token ids equal the key's segment (the caller
      passes them to verify a hash hit). Entries are immutable and may be shared.
    - `insert` may drop the entry (or others) to stay within budget; it never blocks on disk.
    - `evict` removes the key if present; evicting a missing key is a no-op.
    """

    @abstractmethod
    def lookup(self, key: SegmentKey, token_ids: tuple[int, ...]) -> SegmentEntry | None: ...

    @abstractmethod
    def insert(self, key: SegmentKey, entry: SegmentEntry) -> None: ...

    @abstractmethod
    def evict(self, key: SegmentKey) -> None: ...

    @abstractmethod
    def stats(self) -> StoreStats: ...

    def close(self) -> None:
        """Release the store's resources (a tiered store finishes queued disk writes). Default: none."""


class MemorySegmentStore(SegmentStore):
    """A `ByteLRU` of entries on whatever device they were inserted on."""

    def __init__(self, budget_bytes: int, tier: str = "memory"):
        self.budget_bytes = budget_bytes
        self.tier = tier
        self._lru: ByteLRU[str, SegmentEntry] = ByteLRU(budget_bytes)
        self._lock = threading.Lock()
        self._stats = StoreStats(hits={tier: 0}, bytes={tier: 0})

    def lookup(self, key: SegmentKey, token_ids: tuple[int, ...]) -> SegmentEntry | None:
        k = key.to_str()
        with self._lock:
            entry = self._lru.get(k)
            if entry is None:
                self._stats.misses += 1
                return None
            if entry.token_ids != tuple(token_ids):  # hash collision or foreign entry
                self._lru.pop(k)
                self._stats.corrupt += 1
                self._stats.misses += 1
                self._stats.bytes[self.tier] = self._lru.nbytes
                return None
            self._stats.hits[self.tier] += 1
            return entry

    def insert(self, key: SegmentKey, entry: SegmentEntry) -> None:
        with self._lock:
            k = key.to_str()
            self._stats.evictions += sum(1 for k2, _ in self._lru.put(k, entry) if k2 != k)  # not itself (too big)
            self._stats.bytes[self.tier] = self._lru.nbytes

    def evict(self, key: SegmentKey) -> None:
        with self._lock:
            self._lru.pop(key.to_str())
            self._stats.bytes[self.tier] = self._lru.nbytes

    def __len__(self) -> int:
        return len(self._lru)

    def __contains__(self, key: SegmentKey) -> bool:
        return key.to_str() in self._lru

    def stats(self) -> StoreStats:
        with self._lock:
            s = self._stats
            return StoreStats(dict(s.hits), s.misses, s.evictions, s.corrupt, dict(s.bytes))

"""Segment stores: where canonical entries live between requests.

The interface is three calls. Stores are thread-safe. Tiered stores (memory, disk) implement
the same interface; the engine never knows which tier answered.
"""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ..algebra.entry import SegmentEntry
from ..algebra.keys import SegmentKey
from .byte_lru import ByteLRU

if TYPE_CHECKING:
    from .forget import SegmentPattern
    from .tier import TierStats


@dataclass
class StoreStats:
    """Counters for metrics, keyed by tier name: `hits`, `bytes`, `tier_misses`, `load_seconds` over
    every tier, and `tiers`, each stored tier's own counters (hypic_core/cache/tier.py `TierStats`)."""

    hits: dict[str, int] = field(default_factory=dict)
    misses: int = 0  # lookups no tier answered
    evictions: int = 0  # entries dropped from memory to stay within budget
    corrupt: int = 0  # damaged, foreign or mismatched entries found (each also a miss)
    bytes: dict[str, int] = field(default_factory=dict)
    tier_misses: dict[str, int] = field(default_factory=dict)  # lookups that reached a tier and missed there
    load_seconds: dict[str, float] = field(default_factory=dict)  # total time spent serving hits, per tier
    tiers: dict[str, TierStats] = field(default_factory=dict)  # stored tiers (disk, redis, ...)

    # The flat names the gateway's metrics had before the stored tiers were keyed.
    @property
    def dropped_writes(self) -> int:
        return self._of("disk", "dropped_writes")

    @property
    def disk_errors(self) -> int:
        return self._of("disk", "errors")

    @property
    def disk_damaged(self) -> int:
        return self._of("disk", "damaged")

    @property
    def redis_dropped_writes(self) -> int:
        return self._of("redis", "dropped_writes")

    @property
    def redis_errors(self) -> int:
        return self._of("redis", "errors")

    @property
    def redis_connected(self) -> int | None:
        """1 while the Redis tier reaches its server, 0 while it is down; None: no Redis tier."""
        t = self.tiers.get("redis")
        return None if t is None or t.connected is None else int(t.connected)

    def _of(self, tier: str, name: str) -> int:
        t = self.tiers.get(tier)
        return 0 if t is None else getattr(t, name)


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

    @property
    def slow(self) -> bool:
        """Whether a lookup may wait on a disk or network read (the engine then looks up off its
        thread: hypic_core/engine/lookups.py). Default: no, all in memory."""
        return False

    def lookup_memory(self, key: SegmentKey, token_ids: tuple[int, ...]) -> SegmentEntry | None:
        """`lookup` in memory only, never waiting on I/O; a miss is not counted (the caller counted
        one already). Default: `lookup` (a store that is all memory)."""
        return self.lookup(key, token_ids)

    def reads_stored(self, token_ids: tuple[int, ...]) -> bool:
        """Whether a lookup of `token_ids` that misses in memory would wait on a disk or network read now.
        Default: `slow`."""
        return self.slow

    def lookup_stored(self, key: SegmentKey, token_ids: tuple[int, ...]) -> SegmentEntry | None:
        """`lookup` once `lookup_memory` missed: the reads that may block (a hit lands in memory, where a
        later `lookup_memory` finds it); a miss everywhere is counted. Default: `lookup`."""
        return self.lookup(key, token_ids)

    def close(self) -> None:
        """Release the store's resources (a tiered store finishes queued disk writes). Default: none."""

    def forget(self, pattern: SegmentPattern) -> dict[str, int]:
        """Remove every entry `pattern` matches (hypic_core/cache/forget.py: some segments under some salts, at
        every seam width) from every tier; returns the entries removed per tier name. Blocks on the
        stored tiers' I/O; never raises for it. Default: NotImplementedError (a store that cannot list its keys)."""
        raise NotImplementedError(f"{type(self).__name__} cannot forget entries")


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

    def forget(self, pattern: SegmentPattern) -> dict[str, int]:
        with self._lock:
            doomed = [k for k in self._lru.keys() if pattern.matches(k)]
            for k in doomed:
                self._lru.pop(k)
            self._stats.bytes[self.tier] = self._lru.nbytes
        return {self.tier: len(doomed)}

    def __len__(self) -> int:
        return len(self._lru)

    def __contains__(self, key: SegmentKey) -> bool:
        return key.to_str() in self._lru

    def stats(self) -> StoreStats:
        with self._lock:
            s = self._stats
            return StoreStats(dict(s.hits), s.misses, s.evictions, s.corrupt, dict(s.bytes))

"""TieredSegmentStore: memory tiers (device, host) in front of a list of stored tiers (disk, a
shared Redis, ...: hypic_core/cache/tier.py) (docs/cache.md).

Lookup walks the memory tiers in order, then the stored tiers in order (disk before Redis: the
local tier answers without a network round trip and without load on the server every replica
shares, so Redis is asked only for what this process has never computed or loaded). A hit
anywhere is promoted to the first (hot) tier, a stored tier's hit also queued for the stored
tiers before it; entries pushed out of a memory tier by its budget move down to the next one
and fall out of the last. Memory tiers are exclusive (an entry lives in one of them); stored
tiers are write-through: `insert` serializes an entry once and queues the bytes for each
tier's background writer.

A damaged or foreign entry (bad checksum, truncated, other schema or model, token ids that
differ from the lookup's, a value file gone from the disk tier) is a miss: counted in
`stats().corrupt`, logged once, and removed, so the caller recomputes it and the next insert
replaces it.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Sequence

import torch

from ..algebra.entry import SegmentEntry
from ..algebra.keys import SegmentKey
from .forget import SegmentPattern
from .lru import LRUTier, MemoryTier
from .serde import STORAGE_DTYPES, CorruptEntry, decode, encode
from .store import SegmentStore, StoreStats
from .tier import StoredTier

log = logging.getLogger(__name__)
_COLLISION = object()  # a memory entry under the lookup's key holds other token ids


class TieredSegmentStore(SegmentStore):
    """Memory tiers plus stored tiers, behind the `SegmentStore` interface.

    - `device`: every entry returned by `lookup` lives here (the model's device).
    - `memory_tiers`: hot first, e.g. (device, host); at least one.
    - `stored`: `StoredTier`s asked in this order after the memory tiers (a tier that is not
      `available` is skipped); `disk` and `shared` (a Redis tier) are shorthands that go first,
      in that order. Only segments of at least `disk_min_tokens` tokens are written to and
      read from them (below that, recomputing is cheaper than loading: docs/cache.md).
    - `storage_dtype`: "auto" (as computed) or "bf16" precision of K/V and (T, E) in stored tiers. It is
      part of their keys, so stores of different precision sharing a directory never mix entries.

    Thread-safe: memory tiers are guarded by one lock; stored tiers' reads and decoding run
    outside it. `lookup`, `insert` and `evict` never raise for I/O or network failures or
    damaged entries.
    """

    def __init__(self, device: torch.device | str, memory_tiers: Sequence[MemoryTier], disk: StoredTier | None = None,
                 storage_dtype: str = "auto", disk_min_tokens: int = 0, shared: StoredTier | None = None,
                 stored: Sequence[StoredTier] = ()):
        if not memory_tiers:
            raise ValueError("a TieredSegmentStore needs at least one memory tier")
        if storage_dtype not in STORAGE_DTYPES:
            raise ValueError(f"storage_dtype must be one of {sorted(STORAGE_DTYPES)}, got {storage_dtype!r}")
        self.stored: list[StoredTier] = [t for t in (disk, shared, *stored) if t is not None]
        names = [t.name for t in memory_tiers] + [t.name for t in self.stored]
        if len(set(names)) != len(names):
            raise ValueError(f"tier names must be distinct, got {names}")
        self.device = torch.device(device)
        self.storage_dtype = storage_dtype
        self.disk_min_tokens = disk_min_tokens
        self._tiers = [LRUTier(spec) for spec in memory_tiers]
        self._lock = threading.Lock()
        self._stats = StoreStats(hits=dict.fromkeys(names, 0), bytes=dict.fromkeys(names, 0),
                                 tier_misses=dict.fromkeys(names, 0), load_seconds=dict.fromkeys(names, 0.0))

    def tier(self, name: str) -> StoredTier | None:
        """The stored tier called `name`, if any."""
        return next((t for t in self.stored if t.name == name), None)

    @property
    def disk(self) -> StoredTier | None:
        return self.tier("disk")

    @property
    def shared(self) -> StoredTier | None:
        return self.tier("redis")

    def disk_key(self, key: SegmentKey) -> str:
        """The key of `key`'s bytes in every stored tier."""
        return f"{key.to_str()}/{self.storage_dtype}"

    # --- SegmentStore ---------------------------------------------------------------------
    def lookup(self, key: SegmentKey, token_ids: tuple[int, ...]) -> SegmentEntry | None:
        k, token_ids, t0 = key.to_str(), tuple(token_ids), time.perf_counter()
        with self._lock:
            found = self._lookup_memory(k, token_ids, t0)
        if found is not None:
            return self._served(key, found)
        return self._lookup_stored_tiers(key, token_ids, t0)

    def reads_stored(self, token_ids: tuple[int, ...]) -> bool:
        """Whether a lookup of `token_ids` that misses in memory asks a stored tier now (one is available
        and the segment is long enough for them)."""
        return len(token_ids) >= self.disk_min_tokens and any(t.available for t in list(self.stored))

    def lookup_stored(self, key: SegmentKey, token_ids: tuple[int, ...]) -> SegmentEntry | None:
        """`lookup` past the memory tiers (the caller's `lookup_memory` missed): the stored tiers in order,
        a hit placed in the hot tier (so a later `lookup_memory` finds it) and returned; a miss everywhere
        is counted. Blocks on I/O, each tier's call bounded by its own timeout."""
        return self._lookup_stored_tiers(key, tuple(token_ids), time.perf_counter())

    def _lookup_stored_tiers(self, key: SegmentKey, token_ids: tuple[int, ...], t0: float) -> SegmentEntry | None:
        stored = list(self.stored) if len(token_ids) >= self.disk_min_tokens else []
        # I/O, network and decoding run outside the lock.
        dk = self.disk_key(key) if stored else ""
        for i, tier in enumerate(stored):
            if not tier.available:
                continue  # down: not asked, no miss counted
            entry, data = self._lookup_stored(tier, dk, key, token_ids, t0)
            if entry is not None:
                for earlier in stored[:i]:  # checked bytes: the next restart finds them nearer
                    earlier.put_later(dk, lambda: data)
                return entry.to(self.device)
        with self._lock:
            self._stats.misses += 1
        return None

    @property
    def slow(self) -> bool:
        return bool(self.stored)

    def lookup_memory(self, key: SegmentKey, token_ids: tuple[int, ...]) -> SegmentEntry | None:
        k, t0 = key.to_str(), time.perf_counter()
        with self._lock:
            found = self._lookup_memory(k, tuple(token_ids), t0)
        return None if found is None else self._served(key, found)

    def _served(self, key: SegmentKey, found) -> SegmentEntry | None:
        """A memory tier's answer (`_lookup_memory`, not None) on the model's device; a collision, evicted from
        the stored tiers too, is None."""
        if found is _COLLISION:
            log.warning("segment %s: stored token ids differ from the lookup's; evicted", key.to_str())
            self._delete_stored(key)
            return None
        return found.to(self.device)

    def _lookup_memory(self, k: str, token_ids: tuple[int, ...], t0: float):
        """(Lock held.) The memory tiers' entry, promoted to the hot tier; None; or _COLLISION."""
        for tier in self._tiers:
            entry = tier.get(k)
            if entry is None:
                self._stats.tier_misses[tier.spec.name] += 1
                continue
            if entry.token_ids != token_ids:  # a hash collision: never serve it
                self._drop_memory(k)
                self._stats.corrupt += 1
                self._stats.misses += 1
                return _COLLISION
            if tier is not self._tiers[0]:
                tier.pop(k)
                entry = self._place(k, entry)
            self._hit(tier.spec.name, t0)
            return entry
        return None

    def _lookup_stored(self, tier: StoredTier, dk: str, key: SegmentKey, token_ids: tuple[int, ...],
                       t0: float) -> tuple[SegmentEntry | None, bytes | None]:
        """A stored tier's entry, placed in the hot tier, and its bytes; or (None, None): a miss there,
        counted (a damaged or foreign entry is deleted from the tier and counted as corrupt too)."""
        try:
            data = tier.get(dk)
            entry = None if data is None else decode(data, key, token_ids, self.storage_dtype)
        except CorruptEntry as e:
            tier.delete(dk)
            log.warning("segment %s in %s: %s; evicted, will recompute", dk, tier.name, e)
            data = entry = None
            with self._lock:
                self._stats.corrupt += 1
        return self._found(tier.name, key, entry, t0), data

    def _found(self, tier: str, key: SegmentKey, entry: SegmentEntry | None, t0: float) -> SegmentEntry | None:
        """Count a stored tier's answer; a hit goes to the hot tier (returned on its device)."""
        with self._lock:
            if entry is None:
                self._stats.tier_misses[tier] += 1
                return None
            entry = self._place(key.to_str(), entry)
            self._hit(tier, t0)
            return entry

    def insert(self, key: SegmentKey, entry: SegmentEntry) -> None:
        """Hold `entry` in the hot tier and queue its stored tiers' copies (never blocks on I/O)."""
        k = key.to_str()
        with self._lock:
            self._drop_memory(k)
            self._place(k, entry)
        stored = list(self.stored)
        if stored and entry.length >= self.disk_min_tokens:
            value, dk = _Encoded(entry, key, self.storage_dtype), self.disk_key(key)
            for tier in stored:
                tier.put_later(dk, value)

    def evict(self, key: SegmentKey) -> None:
        """Remove `key` from every tier (stored tiers synchronously; failures are logged, not raised)."""
        with self._lock:
            self._drop_memory(key.to_str())
        self._delete_stored(key)

    def forget(self, pattern: SegmentPattern) -> dict[str, int]:
        """Remove every entry `pattern` matches from the memory tiers, then from each stored tier once its
        queued writes are done (so a write queued before this call cannot bring one back). A stored tier
        that is down or cannot list its keys is logged and left out of the result."""
        removed: dict[str, int] = {}
        with self._lock:
            for tier in self._tiers:
                doomed = [k for k in tier.keys() if pattern.matches(k)]
                for k in doomed:
                    tier.pop(k)
                self._stats.bytes[tier.spec.name] = tier.nbytes
                removed[tier.spec.name] = len(doomed)
        for tier in list(self.stored):
            tier.flush()
            n = tier.forget(pattern)
            if n is None:
                log.warning("%s cache tier: could not forget %d segment(s) (down, or it cannot list its keys); "
                            "they stay until evicted", tier.name, len(pattern.tails))
            else:
                removed[tier.name] = n
        return removed

    def _delete_stored(self, key: SegmentKey) -> None:
        for tier in list(self.stored):
            tier.delete(self.disk_key(key))

    def stats(self) -> StoreStats:
        tiers = {t.name: t.stats() for t in list(self.stored)}
        with self._lock:
            s = self._stats
            out = StoreStats(dict(s.hits), s.misses, s.evictions, s.corrupt, dict(s.bytes), dict(s.tier_misses),
                             dict(s.load_seconds), tiers)
        for name, t in tiers.items():
            out.bytes[name] = t.bytes
        return out

    def flush(self) -> None:
        """Block until the stored tiers' queued writes are done (tests, benchmarks, shutdown)."""
        for tier in list(self.stored):
            tier.flush()

    def close(self) -> None:
        """Finish queued writes and detach the stored tiers; the memory tiers stay usable."""
        stored, self.stored = self.stored, []
        for tier in stored:
            tier.close()

    # --- internals (lock held) -------------------------------------------------------------
    def _place(self, k: str, entry: SegmentEntry) -> SegmentEntry:
        """Put `entry` in the hot tier and cascade budget overflow down the memory tiers.

        Returns the copy the memory tiers now hold (on its tier's device), or `entry` when
        it fitted in none of them.
        """
        moving = [(k, entry)]
        for tier in self._tiers:
            moving = [out for k2, e2 in moving for out in tier.put(k2, e2)]
            self._stats.bytes[tier.spec.name] = tier.nbytes
        self._stats.evictions += len(moving)
        for tier in self._tiers:
            held = tier.peek(k)
            if held is not None:
                return held
        return entry

    def _drop_memory(self, k: str) -> None:
        for tier in self._tiers:
            tier.pop(k)
            self._stats.bytes[tier.spec.name] = tier.nbytes

    def _hit(self, tier: str, t0: float) -> None:
        self._stats.hits[tier] += 1
        self._stats.load_seconds[tier] += time.perf_counter() - t0


class _Encoded:
    """`encode(entry, key, storage_dtype)` made once, on the first writer thread that asks for it."""

    def __init__(self, entry: SegmentEntry, key: SegmentKey, storage_dtype: str):
        self._args: tuple | None = (entry, key, storage_dtype)
        self._value: bytes | None = None
        self._lock = threading.Lock()

    def __call__(self) -> bytes:
        with self._lock:
            if self._value is None:
                self._value = encode(*self._args)
                self._args = None  # the entry may leave memory once both copies are written
            return self._value

"""The protocol of a stored tier of the segment store (disk, Redis, ...), and the write-behind base they share.

A stored tier maps `str` keys to checked `bytes` values (hypic_core/cache/serde.py makes and
checks them); `TieredSegmentStore` asks its stored tiers in order after the memory tiers.
Adding a tier is one file (a `WriteBehindTier` subclass with `name`, `get`, `put`, `delete`,
`stats`, and `forget` where it can list its keys) and one line in `build_store`.
"""

from __future__ import annotations

import logging
import queue
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Protocol, runtime_checkable

if TYPE_CHECKING:
    from .forget import SegmentPattern

log = logging.getLogger(__name__)

_STOP, _WAKE = object(), object()  # writer thread: finish; look at the schedule again


@dataclass
class TierStats:
    """One stored tier's counters."""

    bytes: int = 0  # bytes it holds (values plus index; for a shared tier, all writers together, as last seen)
    writes: int = 0
    dropped_writes: int = 0  # queue full, tier down, or the write failed
    errors: int = 0  # failed I/O or network calls (each kind logged once)
    damaged: int = 0  # 1 when its storage was found damaged at open, moved aside and started empty
    connected: bool | None = None  # a networked tier: whether it reaches its server; None: not networked
    available: bool = True  # False while the tier is skipped (a server not reached, a directory that would not open)
    repaired: int = 0  # damage removed in place (symbolic links under a disk tier's directory)


@runtime_checkable
class StoredTier(Protocol):
    """Contract: no method raises an I/O or network error (failures are counted in `stats()` and
    logged once per kind). `get` raises `CorruptEntry` for a value it refuses (the caller deletes
    it). `put_later` never blocks. Thread-safe."""

    name: str

    @property
    def available(self) -> bool:
        """False while the tier is known to be unreachable (the store skips it)."""

    def get(self, key: str) -> bytes | None: ...

    def put_later(self, key: str, make_value: Callable[[], bytes]) -> bool:
        """Queue a write; `make_value` runs on the writer thread. False: dropped (counted)."""

    def delete(self, key: str) -> None: ...

    def forget(self, pattern: SegmentPattern) -> int | None:
        """Delete every key `pattern.matches_stored`; the number deleted, or None when the tier cannot
        list its keys (or is down). Blocks on I/O."""

    def stats(self) -> TierStats: ...

    def flush(self) -> None:
        """Block until every queued write has been attempted."""

    def close(self) -> None:
        """Finish queued writes and release the tier. Idempotent."""


class WriteBehindTier:
    """Queued writes on one background thread behind a bounded queue, for a tier whose `put(key,
    value) -> bool` blocks on I/O. Subclasses call `_start_writer(write_queue)` once they can
    write, and may override the hooks: `_wants(key)` (skip a write, e.g. already stored),
    `_idle_timeout()` / `_on_idle()` (work for the writer thread between writes),
    `_on_stop()` (on the writer thread, last), `_count_dropped()`, `_write_failed(key, error)`."""

    name = "tier"

    def _start_writer(self, write_queue: int) -> None:
        self._queue: queue.Queue = queue.Queue(maxsize=write_queue)
        self._writer = threading.Thread(target=self._write_loop, name=f"hypic-{self.name}-writer", daemon=True)
        self._writer.start()

    @property
    def available(self) -> bool:
        return True

    def put(self, key: str, value: bytes) -> bool:
        raise NotImplementedError

    def forget(self, pattern: SegmentPattern) -> int | None:
        """Delete the keys `pattern` matches; None: this tier cannot list its keys (the default)."""
        return None

    def put_later(self, key: str, make_value: Callable[[], bytes]) -> bool:
        """Queue a write; `make_value` runs on the writer thread. Never blocks. False (a dropped
        write, counted) when the queue is full or the tier is unavailable."""
        if not self.available:
            self._count_dropped()
            return False
        try:
            self._queue.put_nowait((key, make_value))
            return True
        except queue.Full:
            self._count_dropped()
            return False

    def flush(self) -> None:
        """Block until every queued write has been attempted."""
        self._queue.join()

    def close(self) -> None:
        """Finish queued writes and stop the writer thread (then `_close`). Idempotent."""
        if self._writer.is_alive():
            self._queue.put(_STOP)
            self._writer.join()
        self._close()

    def _wake_writer(self) -> None:
        """Make a writer waiting for `_idle_timeout` look at its schedule again."""
        try:
            self._queue.put_nowait(_WAKE)
        except queue.Full:
            pass  # it has writes to attempt first, and looks at its schedule after each

    # --- hooks --------------------------------------------------------------------------
    def _close(self) -> None:
        """Release the tier's resources (after the writer stopped)."""

    def _wants(self, key: str) -> bool:
        return True

    def _idle_timeout(self) -> float | None:
        return None

    def _on_idle(self) -> None:
        """Called on the writer thread when `_idle_timeout` passed without a write, and after each write."""

    def _on_stop(self) -> None:
        """Called on the writer thread as it stops."""

    def _count_dropped(self) -> None:
        raise NotImplementedError

    def _write_failed(self, key: str, error: BaseException) -> None:
        log.warning("%s cache tier: encoding %s failed (%s: %s); not stored", self.name, key, type(error).__name__, error)
        self._count_dropped()

    # --- the writer thread ----------------------------------------------------------------
    def _write_loop(self) -> None:
        while True:
            try:
                item = self._queue.get(timeout=self._idle_timeout())
            except queue.Empty:
                self._on_idle()
                continue
            try:
                if item is _STOP:
                    self._on_stop()
                    return
                if item is _WAKE:
                    continue
                key, make_value = item
                if self._wants(key):
                    self.put(key, make_value())
            except Exception as e:  # noqa: BLE001 - the writer thread must outlive any one bad value
                self._write_failed(item[0], e)
            finally:
                self._queue.task_done()
            if item is not _WAKE:
                self._on_idle()

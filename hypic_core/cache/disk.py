"""The disk tier: a diskcache directory holding `str` keys and `bytes` values only.

diskcache pickles any key or value that is not a plain str/bytes/int/float, and unpickles it
on read (CVE-2025-69872: whoever can write the directory can run code in the reader). The
`Disk` subclass here refuses to write anything but str keys and bytes values and refuses to
read anything stored in another mode, so no pickle is ever loaded.

Writes run on one background thread behind a bounded queue: `put_later` never blocks and
drops the value when the queue is full. Every I/O failure (disk full, read-only directory,
lock timeout) is counted and logged once per kind; a read failure is a miss, a write
failure drops that value. Nothing raises into the caller except `CorruptEntry` from `get`.

Several threads and several processes may share one directory: diskcache keeps its index
in SQLite (transactions, WAL) and writes each value to a fresh file before the row that
names it is committed, so a reader never sees a half-written value and a process killed
mid-write leaves at worst an orphan file that no row names.
"""

from __future__ import annotations

import logging
import os
import queue
import sqlite3
import threading
from dataclasses import dataclass
from typing import Callable

import diskcache

from .serde import CorruptEntry

log = logging.getLogger(__name__)

_IO_ERRORS = (OSError, sqlite3.Error, diskcache.Timeout)
_STOP = object()


class _RefusedValue(Exception):
    """Raised inside diskcache when a row holds a value in a mode other than raw bytes."""


class BytesDisk(diskcache.Disk):
    """A diskcache `Disk` that only stores str keys and bytes values, and never unpickles."""

    def put(self, key):
        if type(key) is not str:
            raise TypeError(f"disk cache keys must be str, got {type(key).__name__}")
        return super().put(key)

    def get(self, key, raw):
        if not raw:  # a pickled key: written by something else
            raise _RefusedValue("pickled key")
        return super().get(key, raw)

    def store(self, value, read, key=diskcache.core.UNKNOWN):
        if type(value) is not bytes or read:
            raise TypeError(f"disk cache values must be bytes, got {type(value).__name__}")
        return super().store(value, read, key)

    def fetch(self, mode, filename, value, read):
        if mode not in (diskcache.core.MODE_RAW, diskcache.core.MODE_BINARY) or read:
            raise _RefusedValue(f"stored in mode {mode}")
        out = super().fetch(mode, filename, value, read)
        if type(out) is not bytes:
            raise _RefusedValue(f"raw value of type {type(out).__name__}")
        return out


@dataclass
class DiskStats:
    bytes: int = 0  # on-disk volume: values plus the SQLite index
    writes: int = 0
    dropped_writes: int = 0  # queue full, or write failed
    errors: int = 0  # I/O failures (each kind logged once)


class DiskTier:
    """A least-recently-used diskcache directory of bytes values under `size_limit` bytes.

    Raises OSError or sqlite3.Error from the constructor when the directory cannot be created
    or opened (the caller degrades to memory tiers); no other method raises an I/O error.
    Thread-safe; several processes may open the same directory.
    """

    def __init__(self, directory: str | os.PathLike, size_limit: int, write_queue: int = 64, timeout: float = 2.0):
        self.directory = os.fspath(directory)
        os.makedirs(self.directory, mode=0o700, exist_ok=True)
        os.chmod(self.directory, 0o700)  # makedirs honours the umask; an existing dir keeps its mode otherwise
        # cull_limit=1: a write evicts one least-recently-used value when over the limit (diskcache's
        # default evicts ten at once); `put` culls further in the rare case one was not enough.
        self._cache = diskcache.Cache(self.directory, timeout=timeout, disk=BytesDisk, size_limit=size_limit,
                                      eviction_policy="least-recently-used", cull_limit=1, statistics=False)
        self._queue: queue.Queue = queue.Queue(maxsize=write_queue)
        self._stats = DiskStats()
        self._lock = threading.Lock()
        self._logged: set[str] = set()
        self._writer = threading.Thread(target=self._write_loop, name="hypic-disk-writer", daemon=True)
        self._writer.start()

    # --- reads ----------------------------------------------------------------------------
    def get(self, key: str) -> bytes | None:
        """The stored bytes, or None on a miss or an I/O failure.

        Raises CorruptEntry(reason="refused") when the row holds a non-bytes (e.g. pickled)
        value; the caller should `delete` it.
        """
        try:
            # A plain SELECT first: a miss (every cold segment) then never takes SQLite's write
            # lock, which `get` needs to record the access time of a hit.
            if key not in self._cache:
                return None
            return self._cache.get(key)
        except _RefusedValue as e:
            raise CorruptEntry("refused", f"{key}: {e}") from None
        except _IO_ERRORS as e:
            self._failed("read", e)
            return None

    def __contains__(self, key: str) -> bool:
        try:
            return key in self._cache
        except _IO_ERRORS as e:
            self._failed("read", e)
            return False

    # --- writes ---------------------------------------------------------------------------
    def put(self, key: str, value: bytes) -> bool:
        """Store `value` unless `key` is present (first writer wins). Blocks on I/O; False on failure.

        Raises TypeError for a non-str key or non-bytes value.
        """
        if type(key) is not str or type(value) is not bytes:
            raise TypeError("disk cache takes str keys and bytes values only")
        try:
            added = self._cache.add(key, value)
            if added and self._cache.volume() > self._cache.size_limit:
                self._cache.cull()
        except _IO_ERRORS as e:
            self._failed("write", e)
            with self._lock:
                self._stats.dropped_writes += 1
            return False
        if added:
            with self._lock:
                self._stats.writes += 1
        return True

    def put_later(self, key: str, make_value: Callable[[], bytes]) -> bool:
        """Queue a write; `make_value` runs on the writer thread. Never blocks.

        Returns False (and counts a dropped write) when the queue is full. Keys already on
        disk are skipped without calling `make_value`.
        """
        try:
            self._queue.put_nowait((key, make_value))
            return True
        except queue.Full:
            with self._lock:
                self._stats.dropped_writes += 1
            return False

    def flush(self) -> None:
        """Block until every queued write has been attempted."""
        self._queue.join()

    def delete(self, key: str) -> None:
        """Remove `key` if present; missing keys and I/O failures are ignored (logged once)."""
        try:
            self._cache.delete(key)
        except _IO_ERRORS as e:
            self._failed("delete", e)

    def close(self) -> None:
        """Finish queued writes, stop the writer thread and close the index. Idempotent."""
        if self._writer.is_alive():
            self._queue.put(_STOP)
            self._writer.join()
        self._cache.close()

    def _write_loop(self) -> None:
        while True:
            item = self._queue.get()
            try:
                if item is _STOP:
                    return
                key, make_value = item
                if key not in self:
                    self.put(key, make_value())
            except Exception as e:  # noqa: BLE001 - the writer thread must outlive any one bad value
                self._failed("encode", e)
                with self._lock:
                    self._stats.dropped_writes += 1
            finally:
                self._queue.task_done()

    # --- accounting -----------------------------------------------------------------------
    def stats(self) -> DiskStats:
        try:
            volume = self._cache.volume()
        except _IO_ERRORS as e:
            self._failed("read", e)
            volume = 0
        with self._lock:
            s = self._stats
            return DiskStats(volume, s.writes, s.dropped_writes, s.errors)

    def _failed(self, op: str, error: BaseException) -> None:
        kind = f"{op}:{type(error).__name__}"
        with self._lock:
            self._stats.errors += 1
            first = kind not in self._logged
            self._logged.add(kind)
        if first:
            log.warning("disk cache %s failed in %s (%s: %s); serving from memory tiers, further %s errors not logged",
                        op, self.directory, type(error).__name__, error, kind)

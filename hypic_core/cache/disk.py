"""The disk tier: a diskcache directory holding `str` keys and `bytes` values only.

diskcache pickles any key or value that is not a plain str/bytes/int/float, and unpickles it
on read (CVE-2025-69872: whoever can write the directory can run code in the reader). The
`Disk` subclass here refuses to write anything but str keys and bytes values and refuses to
read anything stored in another mode, so no pickle is ever loaded.

Writes run on one background thread behind a bounded queue (`WriteBehindTier`, shared with the
other stored tiers): `put_later` never blocks and drops the value when the queue is full. Every
I/O failure (disk full, read-only directory, lock timeout) is counted and logged once per kind;
a read failure is a miss, a write failure drops that value. Nothing raises into the caller except `CorruptEntry` from `get`,
which also reports a row whose value file has gone (deleted by hand, lost in a crash) or whose
value-file name is not a file inside the directory (a NUL byte, `../x`, an absolute path, a
symbolic link out: `BytesDisk.owns`), so that the row is removed and the value written again.
No file outside the directory is ever read or removed.

A damaged index (`cache.db`) is found when the tier opens: SQLite's `integrity_check` fails, or
diskcache itself fails to open it (with `sqlite3.DatabaseError`, but also `UnicodeDecodeError`
or `AttributeError` from a mangled Settings table). The directory is then renamed to
`<directory>.damaged-<time>-<pid>` (kept for inspection, one such copy at a time; an index
emptied to 0 bytes or deleted beside value files counts as damaged, so those files are not orphaned), logged,
counted in `DiskStats.damaged`, and the tier starts empty. Failures of the environment (no
permission, disk full, a lock held too long) are not damage: the constructor raises them.

The budget covers every file in the directory: value files, `cache.db` and SQLite's `-wal` and
`-shm` files beside it. The write-ahead log grows between checkpoints (SQLite's default lets it
reach 4 MB and never shrinks it, so a 3 MB budget once held 6.8 MB), so the tier checkpoints it
every few pages, truncates it after each checkpoint, and keeps `journal_reserve(size_limit)` of
the budget for it: values and index get the rest.

Several threads and several processes may share one directory: diskcache keeps its index
in SQLite (transactions, WAL) and writes each value to a fresh file before the row that
names it is committed, so a reader never sees a half-written value and a process killed
mid-write leaves at worst an orphan file that no row names.
"""

from __future__ import annotations

import glob
import logging
import os
import shutil
import sqlite3
import threading
import time
from pathlib import Path

import diskcache

from .serde import CorruptEntry
from .tier import TierStats, WriteBehindTier

log = logging.getLogger(__name__)

_IO_ERRORS = (OSError, sqlite3.Error, diskcache.Timeout)
CHECK_MAX_BYTES = 1 << 30  # a larger index is not integrity-checked at open (startup time)


class _RefusedValue(Exception):
    """Raised inside diskcache when a row holds a value in a mode other than raw bytes."""


class _MissingValue(Exception):
    """Raised inside diskcache when a row names a value file that is not there. (Under the LRU
    policy diskcache reads a row and its file in one transaction, and removes a file only after
    the transaction that deleted its row, so this is damage, not a race; diskcache's own
    `IOError` handling would make it a silent miss that keeps the row.)"""


class _Damaged(Exception):
    """The index database failed SQLite's integrity check."""


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
        if filename is not None and not self.owns(filename):
            raise _RefusedValue(f"value file name {filename!r} is not a file inside the cache directory")
        try:
            out = super().fetch(mode, filename, value, read)
        except FileNotFoundError:
            raise _MissingValue(f"value file {filename} is missing") from None
        if type(out) is not bytes:
            raise _RefusedValue(f"raw value of type {type(out).__name__}")
        return out

    def remove(self, file_path):
        """Remove a value file, as diskcache does, but only one `owns` names: a damaged row's
        `../x` or absolute name is never removed (nor its directories)."""
        if self.owns(file_path):
            super().remove(file_path)

    def owns(self, filename) -> bool:
        """Whether a row's value-file name names a file inside the cache directory: a relative
        str path without NUL, `..` or `.` parts that stays inside the directory once symbolic
        links are resolved. (diskcache writes `ab/cd/<28 hex>.val`; any other name is damage.)"""
        if type(filename) is not str or not filename or "\0" in filename or os.path.isabs(filename):
            return False
        parts = filename.replace(os.sep, "/").split("/")
        if any(part in ("", ".", "..") for part in parts):
            return False
        root = os.path.realpath(self._directory)
        try:
            return os.path.commonpath([root, os.path.realpath(os.path.join(root, filename))]) == root
        except ValueError:
            return False


DiskStats = TierStats  # `bytes`: on-disk volume, values plus the SQLite index


class DiskTier(WriteBehindTier):
    """A least-recently-used diskcache directory of bytes values under `size_limit` bytes.

    A damaged directory is moved aside (`moved_aside` names where) and replaced by an empty
    one. Raises from the constructor when the directory cannot be created or opened for other
    reasons (OSError, sqlite3.Error; the caller degrades to memory tiers); no other method
    raises an I/O error. Thread-safe; several processes may open the same directory.
    """

    name = "disk"

    def __init__(self, directory: str | os.PathLike, size_limit: int, write_queue: int = 64, timeout: float = 2.0):
        self.directory = os.fspath(directory)
        self.moved_aside: str | None = None
        try:
            self._cache = self._open(size_limit, timeout)
        except Exception as e:  # noqa: BLE001 - whatever a damaged index makes diskcache raise
            if not _is_damage(e) or not self._move_aside(e):
                raise
            self._cache = self._open(size_limit, timeout)
        self._stats = TierStats(damaged=int(self.moved_aside is not None))
        self._lock = threading.Lock()
        self._logged: set[str] = set()
        self._start_writer(write_queue)

    def _open(self, size_limit: int, timeout: float) -> diskcache.Cache:
        os.makedirs(self.directory, mode=0o700, exist_ok=True)
        os.chmod(self.directory, 0o700)  # makedirs honours the umask; an existing dir keeps its mode otherwise
        self._inode = os.stat(self.directory).st_ino
        _check_index(os.path.join(self.directory, "cache.db"), timeout)
        reserve = journal_reserve(size_limit)
        pages = max(1, (reserve - _SHM) // (2 * _PAGE))  # a transaction past the checkpoint may add as many again
        # cull_limit=1: a write evicts one least-recently-used value when over the limit (diskcache's
        # default evicts ten at once); `put` culls further in the rare case one was not enough.
        # The sqlite_ settings are pragmas diskcache sets on every connection. mmap_size=0: diskcache
        # maps 64 MB of cache.db by default, and a read through the map of a file cut short under
        # it (truncated by hand, a full disk's repair) is a SIGBUS that kills the process; read()
        # calls see a short file and SQLite reports it as damage instead (a counted miss).
        return diskcache.Cache(self.directory, timeout=timeout, disk=BytesDisk, size_limit=max(0, size_limit - reserve),
                               eviction_policy="least-recently-used", cull_limit=1, statistics=False,
                               sqlite_wal_autocheckpoint=pages, sqlite_journal_size_limit=pages * _PAGE, sqlite_mmap_size=0)

    def _move_aside(self, error: BaseException) -> bool:
        """Rename the damaged directory to `<directory>.damaged-<time>-<pid>`, removing an older
        damaged copy; True if it is out of the way (another process may have moved it first)."""
        base = os.path.normpath(self.directory)
        aside = f"{base}.damaged-{time.strftime('%Y%m%dT%H%M%S')}-{os.getpid()}"
        try:
            if os.stat(self.directory).st_ino != self._inode:
                return True  # another process opening the same directory moved it first and made a new one
            os.rename(self.directory, aside)
        except FileNotFoundError:
            return True  # moved by another process, not yet replaced
        except OSError as e:
            log.error("disk cache at %s is damaged (%s: %s) and cannot be moved aside (%s)",
                      self.directory, type(error).__name__, error, e)
            return False
        self.moved_aside = aside
        for older in glob.glob(f"{glob.escape(base)}.damaged-*"):
            if older != aside:
                shutil.rmtree(older, ignore_errors=True)
        log.error("disk cache at %s is damaged (%s: %s); moved it to %s and started an empty one",
                  self.directory, type(error).__name__, error, aside)
        return True

    # --- reads ----------------------------------------------------------------------------
    def get(self, key: str) -> bytes | None:
        """The stored bytes, or None on a miss or an I/O failure.

        Raises CorruptEntry(reason="refused") when the row holds a non-bytes (e.g. pickled)
        value, CorruptEntry(reason="missing") when its value file is gone; the caller should
        `delete` it.
        """
        try:
            # A plain SELECT first: a miss (every cold segment) then never takes SQLite's write
            # lock, which `get` needs to record the access time of a hit.
            if key not in self._cache:
                return None
            return self._cache.get(key)
        except _RefusedValue as e:
            raise CorruptEntry("refused", f"{key}: {e}") from None
        except _MissingValue as e:
            raise CorruptEntry("missing", f"{key}: {e}") from None
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

    def delete(self, key: str) -> None:
        """Remove `key` if present; missing keys and I/O failures are ignored (logged once)."""
        try:
            self._cache.delete(key)
        except _IO_ERRORS as e:
            self._failed("delete", e)

    # --- the writer thread's hooks (WriteBehindTier) ----------------------------------------
    def _wants(self, key: str) -> bool:
        return key not in self  # already on disk: `make_value` is never called

    def _on_stop(self) -> None:
        self._cache.close()  # the writer thread's connection (diskcache keeps one per thread)

    def _close(self) -> None:
        self._cache.close()

    def _count_dropped(self) -> None:
        with self._lock:
            self._stats.dropped_writes += 1

    def _write_failed(self, key: str, error: BaseException) -> None:
        self._failed("encode", error)
        self._count_dropped()

    # --- accounting -----------------------------------------------------------------------
    def stats(self) -> TierStats:
        try:
            volume = self._cache.volume() + sum(_size(os.path.join(self.directory, f"cache.db-{s}")) for s in ("wal", "shm"))
        except _IO_ERRORS as e:
            self._failed("read", e)
            volume = 0
        with self._lock:
            s = self._stats
            return TierStats(volume, s.writes, s.dropped_writes, s.errors, s.damaged)

    def _failed(self, op: str, error: BaseException) -> None:
        kind = f"{op}:{type(error).__name__}"
        with self._lock:
            self._stats.errors += 1
            first = kind not in self._logged
            self._logged.add(kind)
        if first:
            log.warning("disk cache %s failed in %s (%s: %s); serving from memory tiers, further %s errors not logged",
                        op, self.directory, type(error).__name__, error, kind)


_PAGE = 4096 + 24  # one WAL frame: an SQLite page (diskcache keeps the 4 KiB default) and its header
_SHM = 32 << 10  # the -shm file of a WAL that stays under a few thousand frames


def journal_reserve(size_limit: int) -> int:
    """Bytes of a `size_limit` budget kept for SQLite's -wal and -shm files: a sixteenth, at
    least room for 8 pages between checkpoints, at most what SQLite's default (1000) would use."""
    return min(max(size_limit // 16, 16 * _PAGE + _SHM), 2000 * _PAGE + _SHM)


def _size(path: str) -> int:
    try:
        return os.path.getsize(path)
    except FileNotFoundError:
        return 0


# SQLite errors that say the environment is in the way (permissions, space, another process's
# lock), not that the files are damaged: moving the directory aside would not help.
_ENVIRONMENT_SQLITE = ("locked", "busy", "disk is full", "readonly", "unable to open")


def _is_damage(error: BaseException) -> bool:
    """Whether a failure to open the tier says its files are damaged: anything diskcache or
    SQLite raises on reading them, but not an OSError, a lock timeout or an environment error."""
    if isinstance(error, (OSError, diskcache.Timeout)):
        return False
    if isinstance(error, sqlite3.OperationalError):
        return not any(marker in str(error).lower() for marker in _ENVIRONMENT_SQLITE)
    return True


def _check_index(path: str, timeout: float) -> None:
    """Raise `_Damaged` (or what SQLite raises on a file that is no database) if the SQLite file
    at `path` fails `PRAGMA integrity_check`, one read of the file: milliseconds for a cache of
    segment entries (values over 32 KB are files, the index holds a small row per value; 0.15 s
    for 200 MB of small values stored in it, measured warm). `quick_check` is not enough: it
    misses damaged index b-trees, which make every later read fail. A missing file or one over
    CHECK_MAX_BYTES is not checked, nor one a lock keeps from being read: diskcache's open decides."""
    size = os.path.getsize(path) if os.path.exists(path) else 0
    if size == 0 and glob.glob(os.path.join(glob.escape(os.path.dirname(path)), "*", "*", "*.val")):
        # An emptied (truncated to 0 bytes) or deleted index opens as a new one: the value files
        # it named would stay, orphaned and outside the budget, for good.
        raise _Damaged(f"cache.db is {'empty' if os.path.exists(path) else 'missing'} but value files are present")
    if size == 0 or size > CHECK_MAX_BYTES:
        return
    try:
        db = sqlite3.connect(f"{Path(os.path.abspath(path)).as_uri()}?mode=ro", uri=True, timeout=timeout)
        try:
            rows = db.execute("PRAGMA integrity_check").fetchall()
        finally:
            db.close()
    except sqlite3.OperationalError as e:
        if _is_damage(e):
            raise
        return
    if rows != [("ok",)]:
        raise _Damaged("; ".join(str(row[0]) for row in rows[:3]))

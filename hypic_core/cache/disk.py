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

import contextlib
import errno
import glob
import logging
import os
import shutil
import sqlite3
import stat
import threading
import time
from pathlib import Path
from typing import Callable

import diskcache

from .forget import SegmentPattern
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
    """A diskcache `Disk` that only stores str keys and bytes values, never unpickles, and never
    follows a symbolic link below its directory.

    Value files are written and read by walking their path one directory at a time with
    `O_NOFOLLOW` (`_open_below`): a link planted where diskcache keeps a subdirectory can
    neither send a write out of the directory (diskcache's own `makedirs` + `open` follow it)
    nor a read. A write that meets such a link removes it and goes on (`repaired` counts them).
    A read checks the file before reading it: a regular file (not a FIFO, whose read would
    block forever, nor a directory, a device or a socket) of exactly the size its row records
    (`expecting`), so a damaged row costs at most one value's bytes.
    """

    def __init__(self, directory, *args, **kwargs):
        super().__init__(directory, *args, **kwargs)
        self.repaired = 0  # links (or other non-directories) removed where a value subdirectory belongs
        self._expected = threading.local()

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
        if len(value) < self.min_file_size:
            return super().store(value, read, key)  # held in the index itself
        filename, _ = self.filename(key, value)
        self._write_below(filename, value)
        return len(value), diskcache.core.MODE_BINARY, filename, None

    @contextlib.contextmanager
    def expecting(self, size: int | None):
        """Within this block, on this thread, a value file read must be `size` bytes (its row's size)."""
        self._expected.size = size
        try:
            yield
        finally:
            self._expected.size = None

    def fetch(self, mode, filename, value, read):
        if mode not in (diskcache.core.MODE_RAW, diskcache.core.MODE_BINARY) or read:
            raise _RefusedValue(f"stored in mode {mode}")
        if filename is None:
            out = super().fetch(mode, filename, value, read)
        elif not self.owns(filename):
            raise _RefusedValue(f"value file name {filename!r} is not a file inside the cache directory")
        else:
            out = self._read_below(filename, getattr(self._expected, "size", None))
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

    def _read_below(self, filename: str, expected: int | None) -> bytes:
        """The bytes of value file `filename`, if it is a regular file of `expected` bytes (any
        size when None). Raises _MissingValue (gone) or _RefusedValue (anything else)."""
        try:
            fd = _open_below(self._directory, filename, os.O_RDONLY | os.O_NONBLOCK)
        except FileNotFoundError:
            raise _MissingValue(f"value file {filename} is missing") from None
        except OSError as e:  # ELOOP / ENOTDIR: a link on the way; ENXIO: a socket; ...
            raise _RefusedValue(f"value file {filename} cannot be opened inside the directory ({e.strerror})") from None
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise _RefusedValue(f"value file {filename} is not a regular file ({stat.filemode(st.st_mode)})")
            if expected is not None and st.st_size != expected:
                raise _RefusedValue(f"value file {filename} is {st.st_size} bytes, its row says {expected}")
        except BaseException:
            os.close(fd)
            raise
        with open(fd, "rb") as reader:
            out = reader.read(st.st_size + 1)
        if len(out) != st.st_size:
            raise _RefusedValue(f"value file {filename} changed size while read")
        return out

    def _write_below(self, filename: str, value: bytes) -> None:
        """Write a new value file `filename` (`ab/cd/<hex>.val`), creating its directories, without
        following a link at any step; a non-directory where a directory belongs is removed
        (counted in `repaired`). Retries as diskcache does when another process removes an
        emptied directory under it. Raises OSError."""
        for attempt in range(10):
            try:
                fd = _open_below(self._directory, filename, os.O_WRONLY | os.O_CREAT | os.O_EXCL,
                                 make_dirs=True, on_blocked=self._repair)
            except FileNotFoundError:
                if attempt == 9:
                    raise
                continue
            with open(fd, "wb") as writer:
                writer.write(value)
            return

    def _repair(self, parent_fd: int, name: str) -> None:
        """Remove `name` (a link or a file where a value subdirectory belongs) from `parent_fd`."""
        os.unlink(name, dir_fd=parent_fd)
        self.repaired += 1
        log.warning("disk cache at %s: removed %r, a link or file where a value directory belongs", self._directory, name)


def _open_below(directory: str, filename: str, flags: int, make_dirs: bool = False,
                on_blocked: Callable[[int, str], None] | None = None) -> int:
    """A descriptor of `directory`/`filename` (a relative `/`-separated path), opened one component
    at a time relative to its parent with `O_NOFOLLOW`, so no symbolic link below `directory` is
    followed (a link where a directory belongs raises ELOOP or ENOTDIR). With `make_dirs`,
    missing directories are created (0700); `on_blocked(parent_fd, name)` is then called for a
    non-directory in the way, which it should remove (tried once per component). Raises OSError."""
    *dirs, name = filename.split("/")
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        for part in dirs:
            for attempt in (0, 1):
                if make_dirs:
                    try:
                        os.mkdir(part, 0o700, dir_fd=fd)
                    except FileExistsError:
                        pass
                try:
                    below = os.open(part, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=fd)
                    break
                except OSError as e:
                    if on_blocked is None or attempt or e.errno not in (errno.ELOOP, errno.ENOTDIR):
                        raise
                    on_blocked(fd, part)
            os.close(fd)
            fd = below
        return os.open(name, flags | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=fd)
    finally:
        os.close(fd)


def remove_links(directory: str) -> int:
    """Remove every symbolic link at the top three levels of a cache directory (where diskcache
    keeps `cache.db`, `ab/`, `ab/cd/` and `ab/cd/<hex>.val`), never what they point to. Returns
    how many. (A link in place of `cache.db` leaves value files without an index: that
    directory is then found damaged and moved aside.)"""
    removed, level = 0, [directory]
    for _ in range(3):
        below = []
        for path in level:
            try:
                entries = list(os.scandir(path))
            except OSError:
                continue
            for entry in entries:
                if entry.is_symlink():
                    os.unlink(entry.path)
                    removed += 1
                    log.warning("disk cache: removed symbolic link %s (to %s)", entry.path, _target(entry.path))
                elif entry.is_dir(follow_symlinks=False):
                    below.append(entry.path)
        level = below
    return removed


def _target(path: str) -> str:
    try:
        return os.readlink(path)
    except OSError:
        return "?"


DiskStats = TierStats  # `bytes`: on-disk volume, values plus the SQLite index


class DiskTier(WriteBehindTier):
    """A least-recently-used diskcache directory of bytes values under `size_limit` bytes.

    A damaged directory is moved aside (`moved_aside` names where) and replaced by an empty
    one; symbolic links under it are removed at open (`remove_links`, counted in
    `stats().repaired`). A directory that cannot be opened for other reasons (a full disk, no
    permission, a file in its place: the environment, not damage) leaves the tier down
    (`available` False, `stats().available` False, the failure counted in `errors` and logged):
    the store serves from memory while the writer thread tries again after `retry_s[0]`
    seconds, doubling up to `retry_s[1]`, and the tier serves once it opens. No method raises
    an I/O error. Thread-safe; several processes may open the same directory.
    """

    name = "disk"

    def __init__(self, directory: str | os.PathLike, size_limit: int, write_queue: int = 64, timeout: float = 2.0,
                 retry_s: tuple[float, float] = (1.0, 60.0)):
        if not 0 < retry_s[0] <= retry_s[1]:
            raise ValueError(f"retry_s must be (first, longest) with 0 < first <= longest, got {retry_s}")
        self.directory = os.fspath(directory)
        self.moved_aside: str | None = None
        self._size_limit, self._timeout = size_limit, timeout
        self._stats = TierStats()
        self._lock = threading.Lock()
        self._logged: set[str] = set()
        self._cache: diskcache.Cache | None = None
        self._retry_first, self._retry_max = retry_s
        self._backoff, self._retry_at = retry_s[0], 0.0
        self._try_open()
        self._start_writer(write_queue)

    @property
    def available(self) -> bool:
        """False while the directory could not be opened (the writer thread keeps trying)."""
        return self._cache is not None

    def _try_open(self) -> None:
        """Open the directory (moving it aside if damaged); on failure, schedule the next try."""
        try:
            try:
                cache = self._open()
            except Exception as e:  # noqa: BLE001 - whatever a damaged index makes diskcache raise
                if not _is_damage(e) or not self._move_aside(e):
                    raise
                cache = self._open()
        except Exception as e:  # noqa: BLE001 - the environment is in the way: serve from memory, try again
            wait = self._backoff
            self._backoff = min(self._retry_max, wait * 2)
            self._retry_at = time.monotonic() + wait
            with self._lock:
                self._stats.errors += 1
                first = not self._logged
                self._logged.add(f"open:{type(e).__name__}")
            log.log(logging.WARNING if first else logging.DEBUG, "disk cache at %s unusable (%s: %s); serving from memory "
                    "tiers, trying again in %gs", self.directory, type(e).__name__, e, wait)
            return
        was_down = bool(self._stats.errors)
        with self._lock:
            self._stats.damaged = int(self.moved_aside is not None)
            self._stats.repaired += self._links_removed
        self._cache = cache
        if was_down:
            log.warning("disk cache at %s opened; using it", self.directory)

    def _open(self) -> diskcache.Cache:
        os.makedirs(self.directory, mode=0o700, exist_ok=True)
        os.chmod(self.directory, 0o700)  # makedirs honours the umask; an existing dir keeps its mode otherwise
        self._inode = os.stat(self.directory).st_ino
        self._links_removed = remove_links(self.directory)
        _check_index(os.path.join(self.directory, "cache.db"), self._timeout)
        size_limit = self._size_limit
        reserve = journal_reserve(size_limit)
        pages = max(1, (reserve - _SHM) // (2 * _PAGE))  # a transaction past the checkpoint may add as many again
        # cull_limit=1: a write evicts one least-recently-used value when over the limit (diskcache's
        # default evicts ten at once); `put` culls further in the rare case one was not enough.
        # The sqlite_ settings are pragmas diskcache sets on every connection. mmap_size=0: diskcache
        # maps 64 MB of cache.db by default, and a read through the map of a file cut short under
        # it (truncated by hand, a full disk's repair) is a SIGBUS that kills the process; read()
        # calls see a short file and SQLite reports it as damage instead (a counted miss).
        return diskcache.Cache(self.directory, timeout=self._timeout, disk=BytesDisk, size_limit=max(0, size_limit - reserve),
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
        """The stored bytes, or None on a miss, an I/O failure or while the tier is down.

        Raises CorruptEntry for a row that must not be read, and removes what the caller's
        `delete` could not: reason "refused" (a value stored in another mode, e.g. pickled; a
        value file that is no regular file inside the directory, or not of its row's size),
        "missing" (its value file is gone), "size" (a row larger than the whole budget, not
        read), "format" (a row whose text is not UTF-8: deleted here, as diskcache cannot read it).
        """
        cache = self._cache
        if cache is None:
            return None
        try:
            # A plain SELECT first: a miss (every cold segment) then never takes SQLite's write
            # lock, which `get` needs to record the access time of a hit.
            rows = cache._sql("SELECT size, typeof(value), CAST(filename AS BLOB) FROM Cache WHERE key = ? AND raw = 1",
                              (key,)).fetchall()
            if not rows:
                return None
            ((size, value_type, filename),) = rows
            if value_type == "text" or not _utf8(filename):
                cache._sql("DELETE FROM Cache WHERE key = ? AND raw = 1", (key,))  # its value file: named by no row
                raise CorruptEntry("format", f"{key}: a row whose text is not UTF-8; removed")
            if size > cache.size_limit:
                raise CorruptEntry("size", f"{key}: a row of {size} bytes, over the {cache.size_limit}-byte budget")
            with cache.disk.expecting(size):
                return cache.get(key)
        except _RefusedValue as e:
            raise CorruptEntry("refused", f"{key}: {e}") from None
        except _MissingValue as e:
            raise CorruptEntry("missing", f"{key}: {e}") from None
        except _IO_ERRORS as e:
            self._failed("read", e)
            return None

    def __contains__(self, key: str) -> bool:
        cache = self._cache
        if cache is None:
            return False
        try:
            return key in cache
        except _IO_ERRORS as e:
            self._failed("read", e)
            return False

    # --- writes ---------------------------------------------------------------------------
    def put(self, key: str, value: bytes) -> bool:
        """Store `value` unless `key` is present (first writer wins). Blocks on I/O; False on failure
        or while the tier is down.

        Raises TypeError for a non-str key or non-bytes value.
        """
        if type(key) is not str or type(value) is not bytes:
            raise TypeError("disk cache takes str keys and bytes values only")
        cache = self._cache
        if cache is None:
            self._count_dropped()
            return False
        try:
            added = cache.add(key, value)
            if added and cache.volume() > cache.size_limit:
                cache.cull()
        except _IO_ERRORS as e:
            self._failed("write", e)
            self._count_dropped()
            return False
        if added:
            with self._lock:
                self._stats.writes += 1
        return True

    def delete(self, key: str) -> None:
        """Remove `key` if present; missing keys and I/O failures are ignored (logged once)."""
        cache = self._cache
        if cache is None:
            return
        try:
            cache.delete(key)
        except _IO_ERRORS as e:
            self._failed("delete", e)

    def forget(self, pattern: SegmentPattern) -> int | None:
        """Delete every row (and its value file) whose key `pattern.matches_stored`: one scan of the index
        over the model's keys (a GLOB on their common head), then one delete per match. None while the
        tier is down or when the scan fails (logged once)."""
        cache = self._cache
        if cache is None:
            return None
        head = "".join(f"[{c}]" if c in "*?[" else c for c in pattern.head)  # GLOB has no escape character
        try:
            rows = cache._sql("SELECT CAST(key AS BLOB) FROM Cache WHERE raw = 1 AND key GLOB ?", (head + "*",)).fetchall()
            doomed = [k for k in (_text(key) for (key,) in rows) if k is not None and pattern.matches_stored(k)]
            return sum(bool(cache.delete(k)) for k in doomed)
        except _IO_ERRORS as e:
            self._failed("delete", e)
            return None

    # --- the writer thread's hooks (WriteBehindTier) ----------------------------------------
    def _wants(self, key: str) -> bool:
        return key not in self  # already on disk: `make_value` is never called

    def _idle_timeout(self) -> float | None:
        return None if self._cache is not None else max(0.0, self._retry_at - time.monotonic())

    def _on_idle(self) -> None:
        if self._cache is None and time.monotonic() >= self._retry_at:
            self._try_open()

    def _on_stop(self) -> None:
        if self._cache is not None:
            self._cache.close()  # the writer thread's connection (diskcache keeps one per thread)

    def _close(self) -> None:
        if self._cache is not None:
            self._cache.close()

    def _count_dropped(self) -> None:
        with self._lock:
            self._stats.dropped_writes += 1

    def _write_failed(self, key: str, error: BaseException) -> None:
        self._failed("encode", error)
        self._count_dropped()

    # --- accounting -----------------------------------------------------------------------
    def stats(self) -> TierStats:
        cache, volume = self._cache, 0
        if cache is not None:
            try:
                volume = cache.volume() + sum(_size(os.path.join(self.directory, f"cache.db-{s}")) for s in ("wal", "shm"))
            except _IO_ERRORS as e:
                self._failed("read", e)
        with self._lock:
            s = self._stats
            repaired = s.repaired + (cache.disk.repaired if cache is not None else 0)
            return TierStats(volume, s.writes, s.dropped_writes, s.errors, s.damaged, available=cache is not None,
                             repaired=repaired)

    def _failed(self, op: str, error: BaseException) -> None:
        kind = f"{op}:{type(error).__name__}"
        with self._lock:
            self._stats.errors += 1
            first = kind not in self._logged
            self._logged.add(kind)
        if first:
            log.warning("disk cache %s failed in %s (%s: %s); serving from memory tiers, further %s errors not logged",
                        op, self.directory, type(error).__name__, error, kind)


def _text(data: bytes | None) -> str | None:
    """A key read as bytes, as text; None for one that is not UTF-8 (no key this tier writes)."""
    try:
        return None if data is None else bytes(data).decode("utf-8")
    except UnicodeDecodeError:
        return None


def _utf8(data: bytes | None) -> bool:
    try:
        data is None or data.decode("utf-8")
        return True
    except UnicodeDecodeError:
        return False


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

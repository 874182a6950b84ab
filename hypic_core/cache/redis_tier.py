"""The shared tier: serialized segment entries in a Redis server that several gateways use.

Values are the bytes `serde.encode` makes (the same checksummed safetensors the disk tier
holds, never pickle), under `<prefix>e:<disk key>`, each signed with the deployment's secret:

    b"HYPICMAC" | HMAC-SHA256(secret, "hypic redis entry" NUL <disk key> NUL <bytes>) | <bytes>

Every replica must reach the server, so whoever can write to it could otherwise plant an entry
that passes the checksum (computed over the planted bytes) and make every replica answer from
it. Without the secret no one can make a tag that verifies, and the tag binds the value to its
key (an entry copied under another key fails too): an unsigned or forged value is
`CorruptEntry("unsigned" / "forged")`, a counted miss that the store deletes. Redis's own `maxmemory-policy` is
server-wide, so the tier keeps its own accounting beside the values, all under `prefix`:

    <prefix>lru    sorted set: disk key -> time of last use (the server's clock)
    <prefix>sizes  hash: disk key -> value bytes
    <prefix>bytes  total value bytes held

Every write, read and delete is one Lua script, so replicas sharing a prefix keep one
consistent account: a write that takes the total past `max_bytes` removes least-recently-used
entries until it fits; a value unused for `ttl_s` seconds expires (Redis `EX`, refreshed on
every hit) and is dropped from the account by the next write. A value Redis lost on its own
(a restart without persistence, a server-wide eviction) is dropped from the account when a
read or write finds it gone. Use a standalone server (or one shard): the scripts touch keys
they do not declare.

Faults never reach the caller. A failed call (refused, timed out, reset) marks the tier down:
one warning per outage, then reads and writes are skipped at no cost while a background
thread probes the server with exponential backoff and logs when it is back. Writes run on
that thread behind a bounded queue (`put_later` never blocks); socket timeouts bound what a
read can cost the caller.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import re
import threading
import time

from .forget import SegmentPattern
from .serde import CorruptEntry
from .tier import TierStats, WriteBehindTier

log = logging.getLogger(__name__)

_STATS_EVERY_S = 10.0  # while up, the writer thread refreshes the shared byte count this often
SIGNED = b"HYPICMAC"  # the first bytes of every value the tier writes, then the 32-byte tag
_TAG_DOMAIN = b"hypic redis entry\0"

_FORGET = """
local function forget(m)
  local n = tonumber(redis.call('HGET', KEYS[2], m) or '0')
  redis.call('HDEL', KEYS[2], m)
  redis.call('ZREM', KEYS[1], m)
  redis.call('DEL', ARGV[1] .. m)
  if n > 0 then redis.call('DECRBY', KEYS[3], n) end
end
local function now()
  local t = redis.call('TIME')
  return tonumber(t[1]) + tonumber(t[2]) / 1000000
end
"""

# KEYS: lru, sizes, bytes, value key. ARGV: entry prefix, member, value, ttl (0: none), budget.
# Returns {1 stored | 0 already there | -1 larger than the budget, total bytes held}.
_PUT = _FORGET + """
local member, value, ttl, budget = ARGV[2], ARGV[3], tonumber(ARGV[4]), tonumber(ARGV[5])
local t = now()
if ttl > 0 then
  for _, m in ipairs(redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', t - ttl, 'LIMIT', 0, 64)) do forget(m) end
end
if redis.call('EXISTS', KEYS[4]) == 1 then
  redis.call('ZADD', KEYS[1], t, member)
  if ttl > 0 then redis.call('EXPIRE', KEYS[4], ttl) end
  return {0, tonumber(redis.call('GET', KEYS[3]) or '0')}
end
forget(member)
local n = string.len(value)
if n > budget then return {-1, tonumber(redis.call('GET', KEYS[3]) or '0')} end
if ttl > 0 then redis.call('SET', KEYS[4], value, 'EX', ttl) else redis.call('SET', KEYS[4], value) end
redis.call('ZADD', KEYS[1], t, member)
redis.call('HSET', KEYS[2], member, n)
local held = redis.call('INCRBY', KEYS[3], n)
while held > budget do
  local victim = redis.call('ZRANGE', KEYS[1], 0, 0)[1]
  if not victim or victim == member then break end
  forget(victim)
  held = tonumber(redis.call('GET', KEYS[3]) or '0')
end
return {1, held}
"""

# KEYS: lru, sizes, bytes, value key. ARGV: entry prefix, member, ttl. Returns the value or nil.
_GET = _FORGET + """
local v = redis.call('GET', KEYS[4])
if not v then
  forget(ARGV[2])
  return false
end
local ttl = tonumber(ARGV[3])
if redis.call('HEXISTS', KEYS[2], ARGV[2]) == 0 then  -- written without the account: count it now
  redis.call('HSET', KEYS[2], ARGV[2], string.len(v))
  redis.call('INCRBY', KEYS[3], string.len(v))
end
redis.call('ZADD', KEYS[1], now(), ARGV[2])
if ttl > 0 then redis.call('EXPIRE', KEYS[4], ttl) end
return v
"""

# KEYS: lru, sizes, bytes. ARGV: entry prefix, member. Returns the total bytes held.
_DELETE = _FORGET + """
forget(ARGV[2])
return tonumber(redis.call('GET', KEYS[3]) or '0')
"""


RedisStats = TierStats  # `bytes`: value bytes under the prefix, all writers together (last known)


def _tag(secret: bytes, key: str, value: bytes | memoryview) -> bytes:
    mac = hmac.new(secret, _TAG_DOMAIN, hashlib.sha256)
    mac.update(key.encode("utf-8") + b"\0")
    mac.update(value)
    return mac.digest()


def sign(secret: bytes, key: str, value: bytes) -> bytes:
    """`value`, to be stored under `key`, with its signature header (`SIGNED` and its HMAC tag)."""
    return SIGNED + _tag(secret, key, value) + value


def verified(secret: bytes, key: str, signed: bytes) -> bytes:
    """The value inside `signed` (what `sign(secret, key, value)` made). Raises
    CorruptEntry("unsigned") when it has no signature header, CorruptEntry("forged") when its
    tag does not verify (another secret, another key, or bytes changed)."""
    data = memoryview(signed)
    head = len(SIGNED) + hashlib.sha256().digest_size
    if len(data) < head or data[: len(SIGNED)] != SIGNED:
        raise CorruptEntry("unsigned", f"{key}: a value without the tier's signature (written without the secret, "
                                       "or not by a gateway)")
    body = data[head:]
    if not hmac.compare_digest(_tag(secret, key, body), data[len(SIGNED) : head]):
        raise CorruptEntry("forged", f"{key}: the value's signature does not verify (another secret, or forged)")
    return bytes(body)


def redacted(url: str) -> str:
    """`url` with its password (in the authority or a `password=` query field) replaced by `***`, for logs."""
    url = re.sub(r"^([A-Za-z][A-Za-z0-9+.-]*://[^/@:?#]*):[^/?#]*@", r"\1:***@", url)
    return re.sub(r"([?&])password=[^&#]*", r"\1password=***", url)


class RedisTier(WriteBehindTier):
    """A Redis-backed map of `str` disk keys to `bytes` values within `max_bytes`, shared by every
    process using the same server and `prefix`.

    - `url`: `redis://[user:password@]host:port/db`, `rediss://...` (TLS) or `unix:///path?db=0`.
    - `max_bytes`: value bytes held under `prefix` by all writers together; least recently used go first.
    - `ttl_s`: a value unused this long expires; 0: never (the budget alone bounds the tier).
    - `timeout_s`: connect and per-call socket timeout, the most a read can block its caller.
    - `retry_s`: (first, longest) wait between reconnection attempts while the server is down.
    - `secret`: the deployment's secret (str or bytes, the same on every replica; required),
      the key of the HMAC that signs each value.

    Raises ValueError for a malformed URL, bad numbers or an empty secret; never raises from a
    call afterwards: an unreachable server is logged once and skipped until it answers again.
    `get` raises `CorruptEntry` for a value that is not signed with this secret. Thread-safe.
    """

    name = "redis"

    def __init__(self, url: str, max_bytes: int, ttl_s: int = 0, prefix: str = "hypic:", timeout_s: float = 0.5,
                 write_queue: int = 64, retry_s: tuple[float, float] = (1.0, 30.0), *, secret: str | bytes):
        try:
            import redis
            from redis.backoff import NoBackoff
            from redis.retry import Retry
        except ImportError:
            raise ImportError("a Redis cache tier needs the redis package: pip install 'hypic-gateway[redis]'") from None

        if max_bytes < 0 or ttl_s < 0 or timeout_s <= 0 or write_queue < 1:
            raise ValueError(f"bad redis tier settings: max_bytes={max_bytes}, ttl_s={ttl_s}, timeout_s={timeout_s}, "
                             f"write_queue={write_queue}")
        if not prefix:
            raise ValueError("the redis key prefix must not be empty")
        if not secret:
            raise ValueError("a shared Redis tier needs a secret to sign its entries (HYPIC_CACHE_SECRET)")
        self._secret = secret.encode("utf-8") if isinstance(secret, str) else bytes(secret)
        if not 0 < retry_s[0] <= retry_s[1]:
            raise ValueError(f"retry_s must be (first, longest) with 0 < first <= longest, got {retry_s}")
        self.url, self.max_bytes, self.ttl_s, self.prefix = redacted(url), max_bytes, int(ttl_s), prefix
        self._keys = [f"{prefix}lru", f"{prefix}sizes", f"{prefix}bytes"]
        self._entry_prefix = f"{prefix}e:"
        # One attempt per call (redis-py retries three times by default): a failure marks the
        # tier down at once, and the writer thread owns reconnecting.
        self._client = redis.Redis.from_url(url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s,
                                            retry=Retry(NoBackoff(), 0), health_check_interval=0)
        if self._client.connection_pool.connection_kwargs.get("decode_responses"):
            raise ValueError("the redis URL must not set decode_responses: the tier stores bytes")
        self._errors = (redis.RedisError, OSError)
        self._unreachable = (redis.ConnectionError, redis.TimeoutError, OSError)  # others: the server answered
        self._logged: set[str] = set()
        self._put, self._get, self._delete = (self._client.register_script(s) for s in (_PUT, _GET, _DELETE))
        self._lock = threading.Lock()
        self._stats = TierStats()
        self._retry_first, self._retry_max = retry_s
        self._backoff = retry_s[0]
        self._down_until: float | None = None  # None: up; else when the writer thread probes next
        self._next_refresh = 0.0
        self._start_writer(write_queue)
        self._probe()

    # --- calls ----------------------------------------------------------------------------
    @property
    def available(self) -> bool:
        """Whether the last call reached the server (calls are skipped while it is down)."""
        return self._down_until is None

    def get(self, key: str) -> bytes | None:
        """The stored bytes, their signature checked (the entry counts as used), or None: absent,
        tier down, or the call failed. Raises CorruptEntry("unsigned") for a value without this
        tier's signature header, CorruptEntry("forged") for one whose tag does not verify."""
        if not self.available:
            return None
        try:
            value = self._get(keys=[*self._keys, self._entry_prefix + key], args=[self._entry_prefix, key, self.ttl_s])
        except self._errors as e:
            self._failed("read", e)
            return None
        return None if value is None else verified(self._secret, key, value)

    def put(self, key: str, value: bytes) -> bool:
        """Store `value` unless `key` is held (first writer wins; it counts as a use) and trim
        the least recently used past `max_bytes`. Blocks for one round trip. False when not
        stored: larger than the budget, tier down, or the call failed. Raises TypeError for a
        non-str key or non-bytes value."""
        if type(key) is not str or type(value) is not bytes:
            raise TypeError("the redis tier takes str keys and bytes values only")
        if not self.available:
            self._count_dropped()
            return False
        signed = sign(self._secret, key, value)
        try:
            stored, held = self._put(keys=[*self._keys, self._entry_prefix + key],
                                     args=[self._entry_prefix, key, signed, self.ttl_s, self.max_bytes])
        except self._errors as e:
            self._failed("write", e)
            self._count_dropped()
            return False
        with self._lock:
            self._stats.bytes = int(held)
            self._stats.writes += int(stored) == 1
        return int(stored) >= 0

    def delete(self, key: str) -> None:
        """Remove `key` and its account if present; failures are counted, not raised."""
        if not self.available:
            return
        try:
            held = self._delete(keys=self._keys, args=[self._entry_prefix, key])
        except self._errors as e:
            self._failed("delete", e)
            return
        with self._lock:
            self._stats.bytes = int(held)

    def forget(self, pattern: SegmentPattern) -> int | None:
        """Delete every entry (value and account) whose key `pattern.matches_stored`: one SCAN over the
        values of the model's keys (`<prefix>e:<head>*`), then one delete per match. None while the tier
        is down or when a call fails (counted)."""
        if not self.available:
            return None
        match = "".join(f"\\{c}" if c in "*?[]\\" else c for c in self._entry_prefix + pattern.head) + "*"
        try:
            doomed = []
            for name in self._client.scan_iter(match=match, count=1000):
                key = bytes(name)[len(self._entry_prefix.encode()):].decode("utf-8", "replace")
                if pattern.matches_stored(key):
                    doomed.append(key)
            held = None
            for key in doomed:
                held = self._delete(keys=self._keys, args=[self._entry_prefix, key])
        except self._errors as e:
            self._failed("delete", e)
            return None
        if held is not None:
            with self._lock:
                self._stats.bytes = int(held)
        return len(doomed)

    def stats(self) -> TierStats:
        """Counters of this process; `bytes` is the shared total as last seen (no network call)."""
        with self._lock:
            s = self._stats
            return TierStats(s.bytes, s.writes, s.dropped_writes, s.errors, connected=self.available, available=self.available)

    # --- the writer thread: queued writes, reconnection, the shared byte count ---------------
    def _idle_timeout(self) -> float:
        down_until = self._down_until
        return _STATS_EVERY_S if down_until is None else max(0.0, down_until - time.monotonic())

    def _on_idle(self) -> None:
        if self.available:
            if time.monotonic() >= self._next_refresh:
                self._refresh_bytes()
        elif time.monotonic() >= (self._down_until or 0.0):
            self._probe()

    def _close(self) -> None:
        self._client.close()

    def _probe(self) -> None:
        """Ping the server: mark the tier up, or schedule the next attempt with a longer wait."""
        try:
            self._client.ping()
        except self._errors as e:
            self._failed("connect", e)
            return
        was_down = not self.available
        with self._lock:
            self._down_until, self._backoff = None, self._retry_first
        if was_down and self._stats.errors:
            log.warning("redis cache tier at %s reachable again; using it", self.url)
        self._refresh_bytes()

    def _refresh_bytes(self) -> None:
        try:
            held = self._client.get(self._keys[2])
        except self._errors as e:
            self._failed("read", e)
            return
        with self._lock:
            self._stats.bytes = int(held or 0)
        self._next_refresh = time.monotonic() + _STATS_EVERY_S

    # --- accounting -----------------------------------------------------------------------
    def _failed(self, op: str, error: BaseException) -> None:
        """Count a failed call. A server that cannot be reached marks the tier down (the first
        failure of an outage is logged); one that answered with an error (out of memory, a
        read-only replica, a key of another type) leaves it up, logged once per kind."""
        if not isinstance(error, self._unreachable):
            kind = f"{op}:{type(error).__name__}"
            with self._lock:
                self._stats.errors += 1
                first = kind not in self._logged
                self._logged.add(kind)
            if first:
                log.warning("redis cache tier at %s: %s refused (%s: %s); further %s errors not logged", self.url, op,
                            type(error).__name__, error, kind)
            return
        with self._lock:
            self._stats.errors += 1
            first = self._down_until is None
            if not first and op != "connect":
                return  # another caller's failure already scheduled the next probe
            wait = self._retry_first if first else self._backoff
            self._backoff = min(self._retry_max, wait * 2)
            self._down_until = time.monotonic() + wait
        if first:
            self._wake_writer()  # it may be waiting for its next byte-count refresh
            log.warning("redis cache tier at %s unreachable (%s failed: %s: %s); skipping it, reconnecting in the "
                        "background (first retry in %gs, backoff up to %gs)", self.url, op, type(error).__name__, error,
                        wait, self._retry_max)

    def _count_dropped(self) -> None:
        with self._lock:
            self._stats.dropped_writes += 1

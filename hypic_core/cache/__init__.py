"""Tiered segment cache: memory tiers (device, host) and a list of stored tiers (a disk tier, a shared
Redis tier) behind one protocol (`tier.py`), with checked serialization.

`build_store` turns settings into a store; the engine only sees the `SegmentStore` interface.
"""

from __future__ import annotations

import os

import torch

from .disk import BytesDisk, DiskStats, DiskTier
from .lru import LRUTier, MemoryTier
from .redis_tier import RedisStats, RedisTier
from .serde import STORAGE_DTYPES, CorruptEntry, decode, encode
from .store import MemorySegmentStore, SegmentStore
from .tier import StoredTier, TierStats, WriteBehindTier
from .tiered import TieredSegmentStore

__all__ = ["BytesDisk", "CorruptEntry", "DiskStats", "DiskTier", "LRUTier", "MemoryTier", "RedisStats", "RedisTier",
           "STORAGE_DTYPES", "StoredTier", "TierStats", "TieredSegmentStore", "WriteBehindTier", "build_store", "decode",
           "encode", "DISK_MIN_TOKENS"]

DISK_MIN_TOKENS = 0  # set from bench/cache_tiers.py: below this, recompute beats a disk load


def build_store(host_bytes: int, device: torch.device | str = "cpu", device_bytes: int = 0,
                directory: str | os.PathLike | None = None, disk_bytes: int = 16 << 30,
                storage_dtype: str = "auto", disk_min_tokens: int = DISK_MIN_TOKENS,
                write_queue: int = 64, redis_url: str | None = None, redis_bytes: int = 4 << 30, redis_ttl_s: int = 0,
                redis_prefix: str = "hypic:", redis_timeout_s: float = 0.5,
                redis_secret: str | bytes | None = None) -> SegmentStore:
    """The segment store for these settings.

    - No `directory`, no `redis_url` and a CPU `device`: a MemorySegmentStore of `host_bytes`.
    - Otherwise a TieredSegmentStore: a "device" tier of `device_bytes` when `device` is
      not the CPU and `device_bytes` > 0, a "host" tier of `host_bytes`, when `directory` is
      given a "disk" tier of `disk_bytes` there (created mode 0700), and when `redis_url` is
      given a "redis" tier shared with every store using that server and `redis_prefix`
      (`redis_bytes` of values all together, unused ones expire after `redis_ttl_s`, 0: never),
      its values signed with `redis_secret` (required with `redis_url`: `RedisTier`).
    A damaged directory is moved aside and replaced by an empty one (`DiskTier`); one that
    cannot be created or opened for any other reason (read-only, full, not a directory) is
    logged and skipped while the tier tries again in the background: the store serves from
    memory until it opens. A Redis server that does not answer is
    logged and skipped until it does (`RedisTier`). Raises ValueError for bad settings (a
    malformed `redis_url`, or one without `redis_secret`, included).
    """
    device = torch.device(device)
    if directory is None and redis_url is None and device.type == "cpu":
        return MemorySegmentStore(host_bytes, tier="host")
    tiers = [MemoryTier("host", torch.device("cpu"), host_bytes)]
    if device.type != "cpu" and device_bytes > 0:
        tiers.insert(0, MemoryTier("device", device, device_bytes))
    shared = None  # first: a malformed URL raises before the disk tier starts its writer
    if redis_url is not None:
        shared = RedisTier(redis_url, redis_bytes, ttl_s=redis_ttl_s, prefix=redis_prefix, timeout_s=redis_timeout_s,
                           write_queue=write_queue, secret=redis_secret or b"")
    disk = None if directory is None else DiskTier(directory, size_limit=disk_bytes, write_queue=write_queue)
    return TieredSegmentStore(device, tiers, disk, storage_dtype=storage_dtype, disk_min_tokens=disk_min_tokens,
                              shared=shared)

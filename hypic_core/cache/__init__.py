"""Tiered segment cache: memory tiers (device, host) and a disk tier, with checked serialization.

`build_store` turns settings into a store; the engine only sees the `SegmentStore` interface.
"""

from __future__ import annotations

import logging
import os

import torch

from ..store import MemorySegmentStore, SegmentStore
from .disk import BytesDisk, DiskStats, DiskTier
from .lru import LRUTier, MemoryTier
from .serde import STORAGE_DTYPES, CorruptEntry, decode, encode
from .tiered import TieredSegmentStore

__all__ = ["BytesDisk", "CorruptEntry", "DiskStats", "DiskTier", "LRUTier", "MemoryTier", "STORAGE_DTYPES",
           "TieredSegmentStore", "build_store", "decode", "encode", "DISK_MIN_TOKENS"]

log = logging.getLogger(__name__)

DISK_MIN_TOKENS = 0  # set from bench/cache_tiers.py: below this, recompute beats a disk load


def build_store(host_bytes: int, device: torch.device | str = "cpu", device_bytes: int = 0,
                directory: str | os.PathLike | None = None, disk_bytes: int = 16 << 30,
                storage_dtype: str = "auto", disk_min_tokens: int = DISK_MIN_TOKENS,
                write_queue: int = 64) -> SegmentStore:
    """The segment store for these settings.

    - No `directory` and a CPU `device`: a MemorySegmentStore of `host_bytes`.
    - Otherwise a TieredSegmentStore: a "device" tier of `device_bytes` when `device` is
      not the CPU and `device_bytes` > 0, a "host" tier of `host_bytes`, and, when
      `directory` is given, a "disk" tier of `disk_bytes` there (created mode 0700).
    A damaged directory is moved aside and replaced by an empty one (`DiskTier`); one that
    cannot be created or opened for any other reason (read-only, full, not a directory) is
    logged and skipped: the store serves from memory. Raises ValueError for bad settings.
    """
    device = torch.device(device)
    if directory is None and device.type == "cpu":
        return MemorySegmentStore(host_bytes, tier="host")
    tiers = [MemoryTier("host", torch.device("cpu"), host_bytes)]
    if device.type != "cpu" and device_bytes > 0:
        tiers.insert(0, MemoryTier("device", device, device_bytes))
    disk = None
    if directory is not None:
        try:
            disk = DiskTier(directory, size_limit=disk_bytes, write_queue=write_queue)
        except Exception as e:  # noqa: BLE001 - whatever the disk does, the gateway serves from memory
            log.warning("disk cache at %s unusable (%s: %s); serving from memory tiers only",
                        directory, type(e).__name__, e)
    return TieredSegmentStore(device, tiers, disk, storage_dtype=storage_dtype, disk_min_tokens=disk_min_tokens)

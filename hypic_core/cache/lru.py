"""One memory tier: entries on one device, least-recently-used under a byte budget (`ByteLRU`)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..algebra.entry import SegmentEntry
from .byte_lru import ByteLRU


@dataclass(frozen=True)
class MemoryTier:
    """Where a memory tier keeps its entries and how many bytes it may hold."""

    name: str
    device: torch.device
    budget_bytes: int

    def __post_init__(self) -> None:
        if self.budget_bytes < 0:
            raise ValueError(f"tier {self.name!r}: budget_bytes must be >= 0, got {self.budget_bytes}")
        object.__setattr__(self, "device", torch.device(self.device))


class LRUTier(ByteLRU[str, SegmentEntry]):
    """A `ByteLRU` of entries kept on `spec.device` within `spec.budget_bytes`. Not thread-safe:
    the owning store serialises every call."""

    def __init__(self, spec: MemoryTier):
        super().__init__(spec.budget_bytes)
        self.spec = spec

    def put(self, key: str, entry: SegmentEntry) -> list[tuple[str, SegmentEntry]]:
        """Hold `entry` moved to this tier's device; return what left to stay in budget (see `ByteLRU.put`)."""
        if entry.nbytes > self.budget_bytes:
            self.pop(key)
            return [(key, entry)]
        return super().put(key, entry.to(self.spec.device))

"""One memory tier: entries on one device, least-recently-used under a byte budget."""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import torch

from ..entry import SegmentEntry


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


class LRUTier:
    """An ordered map str -> SegmentEntry within `spec.budget_bytes`. Not thread-safe: the
    owning store serialises every call."""

    def __init__(self, spec: MemoryTier):
        self.spec = spec
        self._entries: OrderedDict[str, SegmentEntry] = OrderedDict()
        self.nbytes = 0

    def get(self, key: str) -> SegmentEntry | None:
        """The entry (now most recently used), or None."""
        entry = self._entries.get(key)
        if entry is not None:
            self._entries.move_to_end(key)
        return entry

    def peek(self, key: str) -> SegmentEntry | None:
        """The entry without touching its recency, or None."""
        return self._entries.get(key)

    def put(self, key: str, entry: SegmentEntry) -> list[tuple[str, SegmentEntry]]:
        """Hold `entry` (moved to this tier's device); return what left to stay in budget.

        The returned list holds least-recently-used entries pushed out, or `entry` itself when
        it alone exceeds the budget. A previous entry under `key` is replaced.
        """
        self.pop(key)
        if entry.nbytes > self.spec.budget_bytes:
            return [(key, entry)]
        out = []
        while self.nbytes + entry.nbytes > self.spec.budget_bytes:
            out.append(self._pop_oldest())
        self._entries[key] = entry.to(self.spec.device)
        self.nbytes += entry.nbytes
        return out

    def pop(self, key: str) -> SegmentEntry | None:
        entry = self._entries.pop(key, None)
        if entry is not None:
            self.nbytes -= entry.nbytes
        return entry

    def _pop_oldest(self) -> tuple[str, SegmentEntry]:
        key, entry = self._entries.popitem(last=False)
        self.nbytes -= entry.nbytes
        return key, entry

    def __contains__(self, key: str) -> bool:
        return key in self._entries

    def __len__(self) -> int:
        return len(self._entries)

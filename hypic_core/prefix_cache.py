"""Exact prefix reuse (`prefix` mode): what vLLM/SGLang offer for hybrid models.

A snapshot holds a whole context's attention K/V plus every linear layer's state at each
segment boundary. A later request reuses the longest run of leading segments it shares
with a snapshot, exactly; everything after that is recomputed.
"""

from __future__ import annotations

import hashlib
import threading
from dataclasses import dataclass
from typing import NamedTuple

import torch

from .lru import ByteLRU


class PrefixMatch(NamedTuple):
    snapshot: "PrefixSnapshot | None"
    segments: int  # leading segments the snapshot covers (0: no match)


@dataclass(frozen=True)
class PrefixSnapshot:
    keys: tuple[torch.Tensor, ...]  # per attention layer [H, N, D], N = boundaries[-1]
    values: tuple[torch.Tensor, ...]
    boundaries: tuple[int, ...]  # token count after each segment
    linear: tuple[tuple[tuple[torch.Tensor, torch.Tensor], ...], ...]  # [boundary][layer] -> (conv, state)

    @property
    def nbytes(self) -> int:
        ts = [*self.keys, *self.values] + [t for b in self.linear for pair in b for t in pair]
        return sum(t.numel() * t.element_size() for t in ts)


def chain_hashes(segment_digests: list[str]) -> list[str]:
    """h_j identifies the first j+1 segments in order."""
    out, h = [], b""
    for d in segment_digests:
        h = hashlib.sha256(h + d.encode()).digest()
        out.append(h.hex())
    return out


class PrefixCache:
    """A `ByteLRU` of snapshots, indexed by every boundary's chain hash. Thread-safe."""

    def __init__(self, budget_bytes: int):
        self.budget_bytes = budget_bytes
        self._snaps: ByteLRU[int, PrefixSnapshot] = ByteLRU(budget_bytes)
        self._chains: dict[int, list[str]] = {}
        self._index: dict[str, tuple[int, int]] = {}
        self._next = 0
        self._lock = threading.Lock()

    def longest(self, chain: list[str]) -> PrefixMatch:
        """The snapshot holding the longest matching run of leading segments (`segments` 0: none)."""
        with self._lock:
            for j in range(len(chain), 0, -1):
                hit = self._index.get(chain[j - 1])
                if hit is not None:
                    sid, n = hit
                    return PrefixMatch(self._snaps.get(sid), n)
            return PrefixMatch(None, 0)

    def insert(self, chain: list[str], snap: PrefixSnapshot) -> None:
        with self._lock:
            if snap.nbytes > self.budget_bytes or not chain:
                return
            sid, self._next = self._next, self._next + 1
            self._chains[sid] = chain
            for j, h in enumerate(chain, start=1):
                self._index[h] = (sid, j)
            for old, _ in self._snaps.put(sid, snap):
                for h in self._chains.pop(old):
                    if self._index.get(h, (None,))[0] == old:
                        del self._index[h]

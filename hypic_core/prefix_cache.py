"""Exact prefix reuse (`prefix` mode): what vLLM/SGLang offer for hybrid models.

A snapshot holds a whole context's attention K/V plus every linear layer's state at each
segment boundary. A later request reuses the longest run of leading segments it shares
with a snapshot, exactly; everything after that is recomputed.
"""

from __future__ import annotations

import hashlib
import threading
from collections import OrderedDict
from dataclasses import dataclass

import torch


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
    """LRU of snapshots under a byte budget, indexed by every boundary's chain hash. Thread-safe."""

    def __init__(self, budget_bytes: int):
        self.budget_bytes = budget_bytes
        self._snaps: OrderedDict[int, tuple[PrefixSnapshot, list[str]]] = OrderedDict()
        self._index: dict[str, tuple[int, int]] = {}
        self._bytes = 0
        self._next = 0
        self._lock = threading.Lock()

    def longest(self, chain: list[str]) -> tuple[PrefixSnapshot | None, int]:
        """(snapshot, j): the snapshot holding the longest matching run of j leading segments."""
        with self._lock:
            for j in range(len(chain), 0, -1):
                hit = self._index.get(chain[j - 1])
                if hit is not None:
                    sid, n = hit
                    self._snaps.move_to_end(sid)
                    return self._snaps[sid][0], n
            return None, 0

    def insert(self, chain: list[str], snap: PrefixSnapshot) -> None:
        size = snap.nbytes
        with self._lock:
            if size > self.budget_bytes or not chain:
                return
            while self._bytes + size > self.budget_bytes and self._snaps:
                self._drop(next(iter(self._snaps)))
            sid, self._next = self._next, self._next + 1
            self._snaps[sid] = (snap, chain)
            self._bytes += size
            for j, h in enumerate(chain, start=1):
                self._index[h] = (sid, j)

    def _drop(self, sid: int) -> None:
        snap, chain = self._snaps.pop(sid)
        self._bytes -= snap.nbytes
        for h in chain:
            if self._index.get(h, (None,))[0] == sid:
                del self._index[h]

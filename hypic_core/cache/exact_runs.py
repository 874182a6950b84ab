"""Exact reuse of runs of leading segments: a trie over segments, each node named by the chained hash
of its path (vLLM's block hashes, at segment granularity).

A node stands for the first j segments of a context, in order: `h_j = sha256(h_{j-1} + digest_j)`.
A snapshot holds a context's attention K/V plus every linear layer's state at each segment
boundary, computed exactly (plain forwards in context, never composed); every boundary of it
becomes a node pointing into it. A later request restores the longest run of leading segments
it shares with a snapshot, exactly: identical to recomputing them.

Nodes are also *seen*: `see(chain)` records that a request had these leading segments in this
order. The engine computes a run exactly (and snapshots it) when an earlier request already had
it (`EngineConfig.exact_repeats`), so a run repeated in the same order is reused exactly from
its second sighting on, and a run seen once (a new order) is composed. Sightings are a bounded
LRU of hashes (no tensors).
"""

from __future__ import annotations

import hashlib
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Iterable, NamedTuple

import torch

from .byte_lru import ByteLRU


class ExactMatch(NamedTuple):
    snapshot: "ExactSnapshot | None"
    segments: int  # leading segments the snapshot covers (0: no match)
    seen: int = 0  # leading segments an earlier request had in this order (>= segments)


@dataclass(frozen=True)
class ExactSnapshot:
    keys: tuple[torch.Tensor, ...]  # per attention layer [H, N, D], N = boundaries[-1]
    values: tuple[torch.Tensor, ...]
    boundaries: tuple[int, ...]  # token count after each segment
    linear: tuple[tuple[tuple[torch.Tensor, torch.Tensor], ...], ...]  # [boundary][layer] -> (conv, state)

    @property
    def nbytes(self) -> int:
        ts = [*self.keys, *self.values] + [t for b in self.linear for pair in b for t in pair]
        return sum(t.numel() * t.element_size() for t in ts)


def chain_hashes(segment_digests: list[str]) -> list[str]:
    """h_j names the first j+1 segments in order (a path in the trie)."""
    out, h = [], b""
    for d in segment_digests:
        h = hashlib.sha256(h + d.encode()).digest()
        out.append(h.hex())
    return out


class ExactRuns:
    """Snapshots in a `ByteLRU` (`budget_bytes`), every boundary of each indexed by its chain hash,
    and the sightings of up to `max_seen` paths. Thread-safe."""

    def __init__(self, budget_bytes: int, max_seen: int = 1 << 16):
        self.budget_bytes = budget_bytes
        self.max_seen = max_seen
        self._snaps: ByteLRU[int, ExactSnapshot] = ByteLRU(budget_bytes)
        self._chains: dict[int, list[str]] = {}
        self._index: dict[str, tuple[int, int]] = {}  # chain hash -> (snapshot id, segments it covers)
        self._seen: OrderedDict[str, None] = OrderedDict()
        self._next = 0
        self._lock = threading.Lock()

    def longest(self, chain: list[str]) -> ExactMatch:
        """The snapshot holding the longest matching run of leading segments (`segments` 0: none),
        and how many leading segments of `chain` were seen before (not counting this call)."""
        with self._lock:
            seen = next((j for j in range(len(chain), 0, -1) if chain[j - 1] in self._seen), 0)
            for j in range(len(chain), 0, -1):
                hit = self._index.get(chain[j - 1])
                if hit is not None:
                    sid, n = hit
                    return ExactMatch(self._snaps.get(sid), n, max(seen, n))
            return ExactMatch(None, 0, seen)

    def see(self, chain: list[str]) -> None:
        """Record that a request had every leading run of `chain` (the least recently seen are forgotten)."""
        with self._lock:
            for h in chain:
                self._seen[h] = None
                self._seen.move_to_end(h)
            while len(self._seen) > self.max_seen:
                self._seen.popitem(last=False)

    def forget(self, segment_digests: Iterable[str]) -> int:
        """Drop every snapshot one of whose segments is one of `segment_digests` (the strings `chain_hashes`
        was given), and the sightings of its paths through one; returns how many. A path's hash names its last segment only
        through its parent (h_j = sha256(h_{j-1} + d_j)), so each boundary of each snapshot is checked
        against each digest. Sightings that never became a snapshot hold hashes only (no text) and stay."""
        wanted = [d.encode() for d in set(segment_digests)]
        with self._lock:
            doomed: dict[int, int] = {}  # snapshot id -> position of its first forgotten segment
            for sid, chain in self._chains.items():
                parent = b""
                for j, h in enumerate(chain):
                    if any(hashlib.sha256(parent + d).hexdigest() == h for d in wanted):
                        doomed[sid] = j
                        break
                    parent = bytes.fromhex(h)
            for sid, first in doomed.items():
                self._snaps.pop(sid)
                chain = self._chains.pop(sid)
                for h in chain:
                    if self._index.get(h, (None,))[0] == sid:
                        del self._index[h]
                for h in chain[first:]:  # the paths through a forgotten segment
                    self._seen.pop(h, None)
            return len(doomed)

    def insert(self, chain: list[str], snap: ExactSnapshot) -> None:
        """Index `snap` (its boundaries are `chain`'s segments); it may push older snapshots out, or
        be dropped itself when larger than the budget."""
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

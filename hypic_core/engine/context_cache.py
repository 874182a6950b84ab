"""The context-cache manager: what the scheduler asks, as it admits a sequence, about the work already cached.

It owns the segment store (canonical entries), the trie of exact snapshots (exact_runs.py),
the cold work in flight (a missing entry computed once for every sequence that needs it) and
its prefill-pool tickets. `plan(seq)` lays out a sequence's `PrefillProgress` with the strategy
of its mode (hypic_core/engine/prefill.py), which asks back for lookups (`exact_run`, `entries`);
`hand_over` gives finished cold entries to their sequences and the store; `keep_exact_run`
snapshots a newly computed exact run; `release` drops a finished sequence's claims. It runs no
model forward (restoring a snapshot copies tensors) and holds no queue (vLLM's `KVCacheManager`
beside its scheduler).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from ..algebra.entry import SegmentEntry
from ..algebra.keys import SegmentKey
from ..cache.exact_runs import ExactRuns, chain_hashes
from ..cache.store import SegmentStore
from ..config import EngineConfig
from ..runner.model_runner import ModelRunner, PartialEntry
from .prefill import strategy_for
from .sequence import PrefillProgress, Run, Sequence


@dataclass(eq=False)
class ColdWork:
    """A missing canonical entry being computed, shared by every sequence that needs it."""

    key: SegmentKey
    segment: tuple[int, ...]
    seam: int
    holders: int = 0  # sequences waiting for it
    part: PartialEntry | None = None  # set when computed piece by piece
    entry: SegmentEntry | None = None
    ticket: int | None = None  # set while a prefill pool computes it

    @property
    def left(self) -> int:
        if self.entry is not None:
            return 0
        return self.part.left if self.part is not None else len(self.segment)


class ContextCacheManager:
    def __init__(self, runner: ModelRunner, store: SegmentStore, config: EngineConfig, fingerprint: str):
        self.runner = runner
        self.store = store
        self.config = config
        self.fingerprint = fingerprint
        self.exact_runs = ExactRuns(config.exact_budget_bytes)
        self.pool = None  # a PrefillPool computing cold entries (hypic_core/prefill_pool), set by the engine
        self._cold: dict[str, ColdWork] = {}

    # --- the scheduler's questions ----------------------------------------------------------
    def plan(self, seq: Sequence) -> None:
        """Lay out `seq`'s prefill (sets `seq.prefill` and `seq.prefill_left`, the tokens it really has
        to run); a failure is kept in `seq.error` (the engine ends it with "error" in this step)."""
        if seq.prefill is not None:
            return
        stats = seq.stats
        stats.timings_ms["queue"] = _ms(seq.arrival, seq.first_scheduled)
        t = time.perf_counter()
        try:
            progress = PrefillProgress(self.runner.new_cache())
            strategy_for(seq.mode).plan(self, seq, progress)
        except Exception as exc:  # noqa: BLE001 - reported on the sequence, never raised into the scheduler
            seq.error, seq.prefill_left = exc, 0
            return
        stats.timings_ms["lookup"] = _ms(t)
        seq.prefill = progress
        seq.prefill_left = progress.tokens_left(seq)

    # --- lookups the strategies make ----------------------------------------------------------
    def exact_run(self, seq: Sequence, progress: PrefillProgress, n_exact: int, longer: bool) -> int:
        """Lay out the leading context segments done exactly: at least the first `n_exact`; with
        `longer`, as many as a snapshot holds or an earlier request had in this order. The longest run a snapshot holds is restored, the rest become runs
        (kept by `keep_exact_run` once computed). Sets `progress.exact`; returns the position after them."""
        request, stats = seq.request, seq.stats
        considered = request.context if longer else request.context[:n_exact]
        if not considered:
            return 0
        chain = chain_hashes([SegmentKey.of(self.fingerprint, 0, s).tokens for s in considered])
        snap, n, seen = self.exact_runs.longest(chain)
        if longer:
            self.exact_runs.see(chain)
            repeat = seen if self.exact_runs.budget_bytes > 0 else 0
            n_exact = max(n_exact, n, repeat)
        progress.chain, progress.exact = chain[:n_exact], n_exact
        pos = 0
        if snap is not None:
            pos = self.runner.restore_exact(progress.cache, snap, n)
            progress.boundaries, progress.linear = list(snap.boundaries[:n]), list(snap.linear[:n])
            stats.exact_tokens, stats.segment_hits = pos, n
        progress.reused = n
        stats.segment_misses += n_exact - n
        for seg in request.context[n:n_exact]:
            progress.runs.append(Run(seg, pos, boundary=True))
            pos += len(seg)
        return pos

    def entries(self, seq: Sequence, progress: PrefillProgress, first: int) -> None:
        """Look up the canonical entries of context segments `first`.. (a hit is verified against its
        token ids); each miss becomes cold work, shared with any other sequence that needs it."""
        request, stats = seq.request, seq.stats
        progress.entries = [None] * len(request.context)
        wanted: dict[str, tuple[ColdWork, list[int]]] = {}
        for i, seg in enumerate(request.context[first:], start=first):
            key = SegmentKey.of(self.fingerprint, seq.seam, seg)
            entry = self.store.lookup(key, seg)
            if entry is not None:
                progress.entries[i] = entry
                stats.segment_hits += 1
                stats.composed_tokens += entry.body_length
                continue
            stats.segment_misses += 1
            k = key.to_str()
            if k not in wanted:
                cw = self._cold.get(k)
                if cw is None:
                    cw = self._cold[k] = ColdWork(key, seg, seq.seam)
                cw.holders += 1
                wanted[k] = (cw, [])
            wanted[k][1].append(i)
        progress.cold = list(wanted.values())

    # --- results handed back ---------------------------------------------------------------
    def hand_over(self, seqs) -> None:
        """Give finished cold entries to the sequences waiting for them, and to the store."""
        for seq in seqs:
            progress = seq.prefill
            still = []
            for cw, slots in progress.cold:
                if cw.entry is None:
                    still.append((cw, slots))
                    continue
                for i in slots:
                    progress.entries[i] = cw.entry
                if self._cold.pop(cw.key.to_str(), None) is cw:
                    self.store.insert(cw.key, cw.entry)
            progress.cold = still

    def keep_exact_run(self, progress: PrefillProgress) -> None:
        """Snapshot the exact run just computed in `progress.cache` for later requests."""
        self.exact_runs.insert(progress.chain, self.runner.exact_snapshot(progress.cache, progress.boundaries,
                                                                             progress.linear))
        progress.reused = progress.exact

    def release(self, seq: Sequence) -> None:
        """Drop a finished sequence's claims on cold work (work nobody waits for is cancelled)."""
        if seq.prefill is None:
            return
        for cw, _ in seq.prefill.cold:
            cw.holders -= 1
            if cw.holders <= 0 and self._cold.get(cw.key.to_str()) is cw:
                del self._cold[cw.key.to_str()]
                if cw.ticket is not None and self.pool is not None:
                    self.pool.cancel(cw.ticket)


def _ms(t0: float, t1: float | None = None) -> float:
    return round(((time.perf_counter() if t1 is None else t1) - t0) * 1000.0, 3)


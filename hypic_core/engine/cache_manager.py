"""The cache manager: what the scheduler asks, as it admits a sequence, about the work already cached.

It owns the segment store (canonical entries), the trie of exact snapshots (exact_runs.py),
the cold work in flight (a missing entry computed once for every sequence that needs it) and
its prefill-pool tickets. `plan(seq)` lays out a sequence's `PrefillProgress` with the strategy
of its mode (hypic_core/engine/plan.py), which asks back for lookups (`exact_run`, `entries`);
`hand_over` gives finished cold entries to their sequences and the store; `keep_exact_run`
snapshots a newly computed exact run; `release` drops a finished sequence's claims. A cold request
served by one exact forward (`exact_rest`) leaves its missing entries to `defer`: background cold
work, computed by the engine after its first token, off the critical path (`background`,
`job_done`). It runs no model forward (restoring a snapshot copies tensors) and holds no
queue of requests (vLLM's `KVCacheManager` beside its scheduler).
"""

from __future__ import annotations

import time
from collections import deque
from contextlib import AbstractContextManager
from typing import NamedTuple

import torch

from ..algebra.entry import SegmentEntry
from ..algebra.keys import SegmentKey
from ..cache.exact_runs import ExactRuns, chain_hashes
from ..cache.store import SegmentStore
from ..config import EngineConfig
from ..runner.model_runner import ModelRunner, PartialEntry
from .entry_builder import EntryBuilder, EntryJob, JobState
from .plan import CostModel, exact_wins, strategy_for
from .sequence import PrefillProgress, Run, Sequence


class EntryLookup(NamedTuple):
    entries: list[SegmentEntry]
    hits: list[bool]  # whether each entry came from the store


class CacheManager:
    def __init__(self, runner: ModelRunner, store: SegmentStore, config: EngineConfig, fingerprint: str):
        self.runner = runner
        self.store = store
        self.config = config
        self.fingerprint = fingerprint
        self.exact_runs = ExactRuns(config.exact_budget_bytes)
        self.builder: EntryBuilder | None = None  # computes the jobs (entry_builder.py), set by the engine
        self._cold: dict[str, EntryJob] = {}
        self.cost: CostModel | None = None  # set by the engine (cold_prefill "auto")
        self.background: deque[EntryJob] = deque()  # deferred cold work, oldest first
        self.background_dropped = 0  # deferred segments dropped (past `config.background_tokens`, or failed)
        self.background_error: BaseException | None = None  # the last failure of background work

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

    def segment_entries(self, segments: tuple[tuple[int, ...], ...], seam: int, salt: str,
                        lock: AbstractContextManager) -> EntryLookup:
        """Canonical entries for `segments` under `salt`, with hit flags: misses computed together by the
        builder (under `lock`, the engine's step lock) and stored."""
        keys = [SegmentKey.of(self.fingerprint, seam, s, salt, self.config.entry_prefix) for s in segments]
        found = [self.store.lookup(k, s) for k, s in zip(keys, segments)]
        hits = [e is not None for e in found]
        todo = list(dict.fromkeys(s for s, e in zip(segments, found) if e is None))
        if todo:
            with lock, torch.inference_mode():
                computed = dict(zip(todo, self.builder.compute(todo, seam)))
            for i, (k, s) in enumerate(zip(keys, segments)):
                if found[i] is None:
                    found[i] = computed[s]
                    self.store.insert(k, computed[s])
        return EntryLookup(found, hits)  # type: ignore[arg-type]

    # --- lookups the strategies make ----------------------------------------------------------
    def exact_run(self, seq: Sequence, progress: PrefillProgress, n_exact: int, longer: bool) -> int:
        """Lay out the leading context segments done exactly: at least the first `n_exact`; with
        `longer`, as many as a snapshot holds or an earlier request had in this order. The longest run a snapshot holds is restored, the rest become runs
        (kept by `keep_exact_run` once computed). Sets `progress.exact`; returns the position after them."""
        request, stats = seq.request, seq.stats
        considered = request.context if longer else request.context[:n_exact]
        if not considered:
            return 0
        chain = chain_hashes([self.key(seq, s, 0).to_str() for s in considered])
        snap, n, seen = self.exact_runs.longest(chain)
        if longer and request.cache_store:
            self.exact_runs.see(chain)
            repeat = seen if self.exact_runs.budget_bytes > 0 else 0
            n_exact = max(n_exact, n, repeat)
        progress.chain, progress.exact = (chain[:n_exact] if request.cache_store else []), n_exact
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

    def key(self, seq: Sequence, segment: tuple[int, ...], seam: int | None = None) -> SegmentKey:
        """The cache key of `segment` for `seq`: its seam head (`head`, or `seam`), its request's
        `cache_salt` and the engine's entry prefix (an entry computed after another is never served)."""
        seam = self.head(seq, segment) if seam is None else seam
        return SegmentKey.of(self.fingerprint, seam, segment, seq.request.cache_salt, self.config.entry_prefix)

    def head(self, seq: Sequence, segment: tuple[int, ...]) -> int:
        """The seam head `segment` gets in `seq`: its seam width, or `config.seam_fraction` of it (entries
        of one head width are the same bytes whichever rule gave it, so they share a key)."""
        return self.config.head_width(seq.seam, len(segment))

    def lookup(self, seq: Sequence, first: int) -> list[SegmentEntry | None]:
        """The canonical entries of context segments `first`.. in the store (a hit is verified against
        its token ids), one per context segment (None before `first` and for a miss)."""
        context, prefetched = seq.request.context, seq.found
        found: list[SegmentEntry | None] = [None] * len(context)
        for i, seg in enumerate(context[first:], start=first):
            if prefetched is None:
                found[i] = self.store.lookup(self.key(seq, seg), seg)
            else:  # looked up as it arrived; a miss then may have been computed since (memory only)
                found[i] = prefetched[i] or self.store.lookup_memory(self.key(seq, seg), seg)
        return found

    def prefetch(self, seq: Sequence) -> None:
        """(Any thread.) Look up `seq`'s stitched segments before it is laid out, keeping what was
        found in `seq.found` for `lookup`: the disk and network reads of a slow store then run
        outside the engine thread (hypic_core/engine/lookups.py). For a mode that looks up (`plan.looks_up`);
        `first` of every later `lookup` is at least `exact_prefix`."""
        seq.found = self.lookup(seq, seq.request.exact_prefix)

    def entries(self, seq: Sequence, progress: PrefillProgress, found: list[SegmentEntry | None]) -> None:
        """Take the entries `lookup` found for the stitched segments (`progress.exact`..); each miss
        becomes cold work, shared with any other sequence that needs it."""
        request, stats = seq.request, seq.stats
        progress.entries = [None] * len(request.context)
        wanted: dict[str, tuple[EntryJob, list[int]]] = {}
        for i, seg in enumerate(request.context[progress.exact:], start=progress.exact):
            entry = found[i]
            if entry is not None:
                progress.entries[i] = entry
                stats.segment_hits += 1
                stats.composed_tokens += entry.body_length
                continue
            stats.segment_misses += 1
            key = self.key(seq, seg)
            k = key.to_str()
            if k not in wanted:
                cw = self._cold.get(k)
                if cw is None:
                    cw = self._cold[k] = EntryJob(key, seg, key.seam)
                cw.holders += 1
                cw.keep = cw.keep or request.cache_store
                wanted[k] = (cw, [])
            wanted[k][1].append(i)
        progress.cold = list(wanted.values())

    def exact_forward_wins(self, seq: Sequence, progress: PrefillProgress, found: list[SegmentEntry | None]) -> bool:
        """Whether `seq` (a stitched request) runs the rest of its prompt as one exact forward instead of
        cold entries and the stitch (`EngineConfig.cold_prefill`): "exact" when every stitched
        segment misses; "auto" when the cost model says the cold work (the misses, less what other
        requests computed of them already) and the stitch cost more. Never for a request that
        measures composition (`exact_runs` False: the accuracy guard's)."""
        request, choice = seq.request, self.config.cold_prefill
        stitched = found[progress.exact:]
        if choice == "stitch" or not request.exact_runs or not stitched or all(e is not None for e in stitched):
            return False
        if choice == "exact":
            return all(e is None for e in stitched)
        if self.cost is None:
            return False
        cold: dict[str, tuple[int, int]] = {}
        for seg, entry in zip(request.context[progress.exact:], stitched):
            if entry is None:
                k = self.key(seq, seg).to_str()
                cw = self._cold.get(k)
                done = 0 if cw is None or cw.part is None else cw.part.done
                cold[k] = (len(seg), len(seg) if cw is not None and cw.entry is not None else done)
        heads = sum(min(self.head(seq, s), len(s)) for s in request.context[progress.exact:]) + len(request.question)
        workers = self.builder.workers if self.builder is not None else 1
        return exact_wins(self.cost, progress.start, request.prompt_tokens, list(cold.values()), heads, workers)

    def exact_rest(self, seq: Sequence, progress: PrefillProgress, found: list[SegmentEntry | None]) -> None:
        """Lay out the rest of `seq`'s prompt after its exact run as ONE run, as `full` runs its prompt
        (cut only by the step budget), all of it fresh work. It leaves no exact snapshot: the linear
        states at each segment boundary would need the forward cut there, which costs more than
        full (with exact_repeats a repeat in this order is computed exactly at its second sighting
        and kept then, as any run is). The missing entries are deferred (`defer`, once its first
        token is due)."""
        request, stats = seq.request, seq.stats
        first = progress.exact
        deferred: dict[str, tuple[SegmentKey, tuple[int, ...]]] = {}
        for seg, entry in zip(request.context[first:], found[first:]):
            if entry is not None:
                stats.segment_hits += 1  # found, not used: the forward computes it exactly
                continue
            stats.segment_misses += 1
            key = self.key(seq, seg)
            deferred.setdefault(key.to_str(), (key, seg))
        progress.runs.append(Run(tuple(t for s in request.segments[first:] for t in s), progress.start))
        progress.timing = "forward"
        progress.deferred = [(key, seg, key.seam) for key, seg in deferred.values()] if request.cache_store else []
        stats.exact_forward = True

    def defer(self, progress: PrefillProgress) -> None:
        """Queue the entries a cold request served exactly left missing as background cold work
        (shared with cold work already in flight for them); past `config.background_tokens`
        queued, the oldest is dropped."""
        for key, seg, seam in progress.deferred:
            k = key.to_str()
            cw = self._cold.get(k)
            if cw is None:
                cw = self._cold[k] = EntryJob(key, seg, seam)
            cw.keep = True
            if not cw.background:
                cw.background = True
                self.background.append(cw)
        progress.deferred = []
        queued = sum(len(cw.segment) for cw in self.background)
        while self.background and queued > self.config.background_tokens:
            cw = self.background.popleft()
            queued -= len(cw.segment)
            cw.background = False
            self.background_dropped += 1
            self._drop_if_unclaimed(cw)

    def pending_background(self) -> list[EntryJob]:
        """Background cold work still to compute, oldest first (finished or abandoned work leaves the queue)."""
        if any(cw.entry is not None or self._cold.get(cw.key.to_str()) is not cw for cw in self.background):
            keep = deque()
            for cw in self.background:
                if cw.entry is None and self._cold.get(cw.key.to_str()) is cw:
                    keep.append(cw)
                else:
                    cw.background = False
            self.background = keep
        return list(self.background)

    def abandon_background(self, error: BaseException) -> None:
        """Computing background work failed (`error`, kept in `background_error`): drop it all. Work a
        sequence waits for stays in flight (its own prefill computes it, and fails there if it must)."""
        self.background_error = error
        while self.background:
            cw = self.background.popleft()
            cw.background = False
            if cw.holders <= 0 and cw.state is JobState.PIECES:
                cw.state, cw.part = JobState.WAITING, None
            self.background_dropped += 1
            self._drop_if_unclaimed(cw)

    # --- the builder's reports (entry_builder.JobSink): the only places a job's state changes ---------
    def job_pieces(self, cw: EntryJob, part: PartialEntry) -> None:
        """`cw` is computed piece by piece; `part` holds what is done."""
        cw.state, cw.part = JobState.PIECES, part

    def job_submitted(self, cw: EntryJob, ticket: int) -> None:
        """`cw` is on the prefill pool as `ticket`."""
        cw.state, cw.ticket = JobState.POOL, ticket

    def job_done(self, cw: EntryJob, entry: SegmentEntry) -> None:
        """`cw` has its entry. Work nobody waits for (background work) is stored now; sequences that
        wait for it take it with `hand_over` (which stores it)."""
        cw.state, cw.entry, cw.part, cw.ticket = JobState.DONE, entry, None, None
        if cw.holders <= 0 and self._cold.get(cw.key.to_str()) is cw:
            del self._cold[cw.key.to_str()]
            self.store.insert(cw.key, cw.entry)

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
                if self._cold.pop(cw.key.to_str(), None) is cw and cw.keep:
                    self.store.insert(cw.key, cw.entry)
            progress.cold = still

    def keep_exact_run(self, progress: PrefillProgress) -> None:
        """Snapshot the exact run just computed in `progress.cache` for later requests (none for a
        request that keeps nothing: its `chain` is empty)."""
        if progress.chain:
            self.exact_runs.insert(progress.chain, self.runner.exact_snapshot(progress.cache, progress.boundaries,
                                                                                 progress.linear))
        progress.reused = progress.exact

    def release(self, seq: Sequence) -> None:
        """Drop a finished sequence's claims on cold work (work nobody waits for is cancelled)."""
        if seq.prefill is None:
            return
        for cw, _ in seq.prefill.cold:
            cw.holders -= 1
            self._drop_if_unclaimed(cw)

    def _drop_if_unclaimed(self, cw: EntryJob) -> None:
        """Cancel cold work nobody waits for and no background queue holds."""
        if cw.holders <= 0 and not cw.background and self._cold.get(cw.key.to_str()) is cw:
            del self._cold[cw.key.to_str()]
            if self.builder is not None:
                self.builder.cancel(cw)


def _ms(t0: float, t1: float | None = None) -> float:
    return round(((time.perf_counter() if t1 is None else t1) - t0) * 1000.0, 3)


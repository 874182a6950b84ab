"""The cache manager: what the scheduler asks, as it admits a sequence, about the work already cached.

It owns the segment store (canonical entries), the trie of exact snapshots (exact_runs.py), the
entry jobs in flight (a missing entry computed once for every sequence that needs it) and the
background queue. `plan(seq)` asks the planner (plan.py, pure) for the sequence's `Plan` through
a read-only `CacheView`, with no lock held, and carries it out into the sequence's
`PrefillProgress` (restores the snapshot, queues the runs, registers each miss as an `EntryJob`).
`hand_over` gives finished entries to their sequences and the store; `keep_exact_run` snapshots a
newly computed exact run; `release` drops a finished sequence's claims. A cold request served by
one exact forward leaves its missing entries to `defer`: background work, computed after its first
token (`pending_background`). A job's state changes only here (`job_pieces`, `job_submitted`,
`job_done`, reported by the entry builder). It runs no model forward (restoring a snapshot copies
tensors) and holds no queue of requests (vLLM's `KVCacheManager` beside its scheduler).
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
from .plan import CostModel, Plan, RunHit, make_plan
from .sequence import PrefillProgress, Run, SegmentUse, Sequence


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
        """Lay out `seq`'s prefill (sets `seq.prefill`; a restored snapshot moves its cursor, as a prefix
        hit does); a failure is kept in `seq.error` (the engine ends it with "error" in this step)."""
        if seq.prefill is not None:
            return
        stats = seq.stats
        stats.timings_ms["queue"] = _ms(seq.arrival, seq.first_scheduled)
        t = time.perf_counter()
        try:
            view = SequenceView(self, seq)
            progress = self._carry_out(seq, make_plan(seq.request, view), view.chain)
        except Exception as exc:  # noqa: BLE001 - reported on the sequence, never raised into the scheduler
            seq.error = exc
            return
        stats.timings_ms["lookup"] = _ms(t)
        seq.prefill = progress

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

    # --- carrying a plan out ------------------------------------------------------------------
    def _carry_out(self, seq: Sequence, p: Plan, chain: list[str]) -> PrefillProgress:
        """`seq`'s prefill work for plan `p` (`chain`: the hashes of the leading segments the view looked up)."""
        request = seq.request
        progress = PrefillProgress(self.runner.new_cache())
        seq.stats.segments = [SegmentUse("computed", len(seg)) for seg in request.context]  # the steps below say what was reused
        if p.rest == "whole":
            progress.runs.append(Run(tuple(t for s in request.segments for t in s), 0))
            progress.timing = "forward"
            return progress
        pos = self._exact_run(seq, p, chain, progress)
        if p.rest == "question":
            progress.runs.append(Run(request.question, pos))
        elif p.rest == "forward":
            progress.start = pos
            self._forward_rest(seq, p, progress)
        else:
            progress.start, progress.transition = pos, p.transition
            self._stitch(seq, p, progress)
        return progress

    def _exact_run(self, seq: Sequence, p: Plan, chain: list[str], progress: PrefillProgress) -> int:
        """The leading context segments done exactly: the snapshot's restored, the rest queued as runs (kept
        by `keep_exact_run` once computed). Returns the position after them."""
        request, stats = seq.request, seq.stats
        if p.see:
            self.exact_runs.see(chain)
        progress.chain, progress.exact = (chain[:p.exact] if request.cache_store else []), p.exact
        pos = 0
        if p.snapshot is not None:
            pos = self.runner.restore_exact(progress.cache, p.snapshot, p.restored)
            progress.boundaries, progress.linear = list(p.snapshot.boundaries[:p.restored]), list(p.snapshot.linear[:p.restored])
            stats.exact_tokens, stats.segment_hits = pos, p.restored
            stats.segments[:p.restored] = [SegmentUse("exact", len(seg), len(seg)) for seg in request.context[:p.restored]]
        progress.in_cache, progress.reused = pos, p.restored  # the cursor moves past them in the first step's update
        stats.segment_misses += p.exact - p.restored
        for seg in request.context[p.restored:p.exact]:
            progress.runs.append(Run(seg, pos, boundary=True))
            pos += len(seg)
        return pos

    def _stitch(self, seq: Sequence, p: Plan, progress: PrefillProgress) -> None:
        """Take the entries found for the stitched segments; each miss becomes an entry job, shared with
        any other sequence that needs it; the stitch is due once they are done."""
        request, stats = seq.request, seq.stats
        progress.entries = [None] * len(request.context)
        wanted: dict[str, tuple[EntryJob, list[int]]] = {}
        for i, (seg, head) in enumerate(zip(request.context[p.exact:], p.heads), start=p.exact):
            entry = p.found[i]
            if entry is not None:
                progress.entries[i] = entry
                stats.segment_hits += 1
                stats.composed_tokens += entry.body_length
                stats.segments[i] = SegmentUse("composed", len(seg), entry.body_length, min(head, len(seg)))
                continue
            stats.segments[i] = SegmentUse("computed", len(seg), 0, min(head, len(seg)))
            stats.segment_misses += 1
            key = self.key(seq, seg, head)
            k = key.to_str()
            if k not in wanted:
                job = self._cold.get(k)
                if job is None:
                    job = self._cold[k] = EntryJob(key, seg, key.seam)
                job.holders += 1
                job.keep = job.keep or request.cache_store
                wanted[k] = (job, [])
            wanted[k][1].append(i)
        progress.cold = list(wanted.values())
        progress.stitch_end = request.prompt_tokens - len(request.question)
        stats.seam_tokens = sum(min(head, len(seg)) for seg, head in zip(request.context[p.exact:], p.heads))

    def _forward_rest(self, seq: Sequence, p: Plan, progress: PrefillProgress) -> None:
        """The rest of the prompt after the exact run as ONE run, as `full` runs it (cut only by the step
        budget), all of it fresh work. It leaves no exact snapshot: the linear states at each segment
        boundary would need the forward cut there, which costs more than full (with exact_repeats a
        repeat in this order is computed exactly at its second sighting and kept then, as any run is).
        The missing entries are deferred (`defer`, once its first token is due)."""
        request, stats = seq.request, seq.stats
        deferred: dict[str, tuple[SegmentKey, tuple[int, ...]]] = {}
        for seg, entry, head in zip(request.context[p.exact:], p.found[p.exact:], p.heads):
            if entry is not None:
                stats.segment_hits += 1  # found, not used: the forward computes it exactly
                continue
            stats.segment_misses += 1
            key = self.key(seq, seg, head)
            deferred.setdefault(key.to_str(), (key, seg))
        progress.runs.append(Run(tuple(t for s in request.segments[p.exact:] for t in s), progress.start))
        progress.timing = "forward"
        progress.deferred = [(key, seg, key.seam) for key, seg in deferred.values()] if request.cache_store else []
        stats.exact_forward = True

    # --- lookups --------------------------------------------------------------------------------
    def key(self, seq: Sequence, segment: tuple[int, ...], seam: int | None = None) -> SegmentKey:
        """The cache key of `segment` for `seq`: its seam head (`head`, or `seam`), its request's
        `cache_salt` and the engine's entry prefix (an entry computed after another is never served)."""
        seam = self.head(seq, segment) if seam is None else seam
        return SegmentKey.of(self.fingerprint, seam, segment, seq.request.cache_salt, self.config.entry_prefix)

    def head(self, seq: Sequence, segment: tuple[int, ...]) -> int:
        """The seam head `segment` gets in `seq`: its seam width, or `config.seam_fraction` of it, or what the
        request's recompute budget widened it to (`seq.heads`; entries of one head width are the same
        bytes whichever rule gave it, so they share a key)."""
        if seq.heads is not None and segment in seq.heads:
            return seq.heads[segment]
        return self.config.head_width(seq.seam, len(segment))

    def lookup(self, seq: Sequence, first: int) -> list[SegmentEntry | None]:
        """The canonical entries of context segments `first`.. in the store (a hit is verified against
        its token ids), one per context segment (None before `first` and for a miss). A sequence looked
        up as it arrived (`seq.found`, hypic_core/engine/lookups.py) asks the memory tiers only: an entry
        computed since, or a stored lookup that returned after its deadline, is there by now."""
        context, prefetched = seq.request.context, seq.found
        found: list[SegmentEntry | None] = [None] * len(context)
        for i, seg in enumerate(context[first:], start=first):
            if prefetched is None:
                found[i] = self.store.lookup(self.key(seq, seg), seg)
            else:
                found[i] = prefetched[i] or self.store.lookup_memory(self.key(seq, seg), seg)
        return found

    def lookup_keys(self, seq: Sequence) -> list[tuple[int, SegmentKey, tuple[int, ...]]]:
        """(Any thread.) (context slot, key, token ids) of each segment `seq`'s plan may look up: its context
        from `exact_prefix` on (the `first` of every later `lookup`), for a mode that looks up
        (`plan.looks_up`). What hypic_core/engine/lookups.py looks up as the sequence arrives."""
        context = seq.request.context
        return [(i, self.key(seq, seg), seg) for i, seg in enumerate(context) if i >= seq.request.exact_prefix]

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


class SequenceView:
    """The planner's read-only window on the cache for one sequence (plan.CacheView)."""

    def __init__(self, manager: CacheManager, seq: Sequence):
        self.manager, self.seq = manager, seq
        self.config, self.cost = manager.config, manager.cost
        self.workers = manager.builder.workers if manager.builder is not None else 1
        self.chain: list[str] = []  # hashes of the segments `longest_run` was asked about

    def longest_run(self, segments) -> RunHit:
        manager = self.manager
        self.chain = chain_hashes([manager.key(self.seq, s, 0).to_str() for s in segments])
        snap, n, seen = manager.exact_runs.longest(self.chain)
        return RunHit(snap, n if snap is not None else 0, seen if manager.exact_runs.budget_bytes > 0 else 0)

    def find(self, first: int) -> list[SegmentEntry | None]:
        return self.manager.lookup(self.seq, first)

    def head(self, segment: tuple[int, ...]) -> int:
        return self.manager.head(self.seq, segment)

    def in_flight(self, segment: tuple[int, ...]) -> tuple[int, bool] | None:
        job = self.manager._cold.get(self.manager.key(self.seq, segment).to_str())
        if job is None:
            return None
        return (job.part.done if job.part is not None else 0), job.entry is not None

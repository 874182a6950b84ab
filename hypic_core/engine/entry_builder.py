"""Entry builders: how missing canonical entries get computed, here or on a prefill pool.

An `EntryJob` is one missing entry, shared by every sequence that needs it. A builder advances
jobs; the engine picks ONE builder when it is made (`builder_for`) and never asks which:

- `LocalEntryBuilder` computes them in this thread, inside a token budget: whole segments batched
  together (per seam width) or one forward each (`alone`), a segment longer than what is left of the
  budget piece by piece over steps (`ModelRunner.start_entry` / `advance_entry`);
- `PoolEntryBuilder` hands them to a prefill pool (hypic_core/prefill_pool), whole, outside the
  budget (its replicas are other processes), and takes back what has arrived.

A builder never writes a job's fields: it reports each change to the job's owner (`JobSink`, the
cache manager), which alone moves a job between its states.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass
from typing import Protocol, Sequence

from ..algebra.entry import SegmentEntry
from ..algebra.keys import SegmentKey
from ..config import EngineConfig
from ..runner.model_runner import ModelRunner, PartialEntry


class JobState(enum.Enum):
    """WAITING -> PIECES -> DONE (local, piece by piece), WAITING -> DONE (local, whole),
    WAITING -> POOL -> DONE (on a prefill pool). A job given up on returns to WAITING."""

    WAITING = "waiting"  # nothing computed yet
    PIECES = "pieces"  # computed piece by piece: `part` holds the work so far
    POOL = "pool"  # on a prefill pool: `ticket`
    DONE = "done"  # `entry` is set


@dataclass(eq=False)
class EntryJob:
    """A missing canonical entry being computed, shared by every sequence that needs it. Its `state`
    (and `part`, `ticket`, `entry` with it) changes only in the cache manager."""

    key: SegmentKey
    segment: tuple[int, ...]
    seam: int
    state: JobState = JobState.WAITING
    part: PartialEntry | None = None  # PIECES
    ticket: int | None = None  # POOL
    entry: SegmentEntry | None = None  # DONE
    holders: int = 0  # sequences waiting for it
    background: bool = False  # in the background queue: kept even when nobody waits for it
    keep: bool = False  # stored once computed (some sequence that needs it stores: `cache_store`)

    @property
    def left(self) -> int:
        """Tokens of it still to compute here."""
        if self.entry is not None:
            return 0
        return self.part.left if self.part is not None else len(self.segment)


class JobSink(Protocol):
    """Where a builder reports progress (the cache manager)."""

    def job_pieces(self, job: EntryJob, part: PartialEntry) -> None: ...

    def job_submitted(self, job: EntryJob, ticket: int) -> None: ...

    def job_done(self, job: EntryJob, entry: SegmentEntry) -> None: ...


@dataclass
class Built:
    """What one group's jobs got in one `advance`."""

    left: int  # what is left of its budget
    tokens: int = 0  # tokens computed for it (a job shared by groups counts in each)
    seconds: float = 0.0  # time spent on its jobs


class EntryBuilder(Protocol):
    workers: int  # how many entries it computes at once (the cost model shares cold work by it)

    def advance(self, groups: Sequence[Sequence[EntryJob]], budgets: Sequence[int], sink: JobSink,
                opening: int = 0, wait: bool = False) -> list[Built]:
        """Advance the unfinished jobs of each group, in order, within that group's budget; a job
        several groups share is advanced once. A whole segment may exceed the budget when it is the
        first work of the call and at most `opening` tokens long (one pass costs less than pieces).
        `wait`: block until a job finishes if no group could advance otherwise (the pool)."""

    def compute(self, segments: Sequence[tuple[int, ...]], seam: int) -> list[SegmentEntry]:
        """Entries of `segments`, whole, now (no budget, no jobs)."""

    def cancel(self, job: EntryJob) -> None:
        """Stop work on `job` nobody needs any more."""


class LocalEntryBuilder:
    """Entries computed in this thread: the single copy of "batched whole, piece by piece when long".

    `alone` (EngineConfig.entry_batching "alone"): each whole entry in a forward of its own, as a prefill
    pool replica computes it. In a padded batch beside other misses a row's entry differs from the same
    segment's computed alone (the linear layers' chunked scans read a padded row's end mid-chunk: up to
    ~1e-6 on the tiny hybrids, 9e-5 on smollm2-hybrid-135m), so which segments happened to miss together
    (timing) changes the cache's bytes and, at a near tie, a greedy answer; alone, an entry is a function
    of its segment and seam only (tests/cache/test_batch_invariance.py), at ~2.2-2.6x the time of the
    batch (measured on the hybrid, four segments of 200-260 tokens, 2 threads on a loaded machine)."""

    workers = 1

    def __init__(self, runner: ModelRunner, max_batch_tokens: int, alone: bool = False):
        self.runner, self.max_batch_tokens, self.alone = runner, max_batch_tokens, alone

    def advance(self, groups, budgets, sink, opening=0, wait=False) -> list[Built]:
        built = [Built(left=b) for b in budgets]
        whole: dict[int, list[EntryJob]] = {}
        chosen: set[int] = set()
        spent = 0  # tokens given out in this call so far
        for jobs, out in zip(groups, built):
            budget = out.left
            for job in jobs:
                if budget <= 0:
                    break
                if job.entry is not None or id(job) in chosen:
                    continue
                chosen.add(id(job))
                n = len(job.segment)
                if job.part is None and (n <= budget or (spent == 0 and n <= opening)):
                    whole.setdefault(job.seam, []).append(job)
                else:
                    t = time.perf_counter()
                    part = job.part or self.runner.start_entry(job.segment, job.seam)
                    before = part.done
                    entry = self.runner.advance_entry(part, min(budget, part.left))
                    n = part.done - before
                    if entry is None:
                        sink.job_pieces(job, part)
                    else:
                        sink.job_done(job, entry)
                    out.tokens += n
                    out.seconds += time.perf_counter() - t
                budget -= n
                spent += n
            out.left = max(budget, 0)
        for seam, jobs in whole.items():
            t = time.perf_counter()
            for job, entry in zip(jobs, self.compute([job.segment for job in jobs], seam)):
                sink.job_done(job, entry)
            dt = time.perf_counter() - t
            for group, out in zip(groups, built):
                mine = [job for job in group if job in jobs]
                if mine:
                    out.tokens += sum(len(job.segment) for job in mine)
                    out.seconds += dt
        return built

    def compute(self, segments, seam) -> list[SegmentEntry]:
        if self.alone:
            return [self.runner.compute_entries([segment], seam, self.max_batch_tokens)[0] for segment in segments]
        return self.runner.compute_entries(list(segments), seam, self.max_batch_tokens)

    def cancel(self, job: EntryJob) -> None:
        pass


class PoolEntryBuilder:
    """Entries computed on a prefill pool: every new job is submitted at once (the pool orders them
    longest first), whole and outside the budgets; finished ones are taken back each call."""

    def __init__(self, pool, max_batch_tokens: int):
        self.pool, self.max_batch_tokens = pool, max_batch_tokens

    @property
    def workers(self) -> int:
        return self.pool.alive

    def advance(self, groups, budgets, sink, opening=0, wait=False) -> list[Built]:
        pending = list({id(job): job for jobs in groups for job in jobs if job.entry is None}.values())
        t = time.perf_counter()
        blocked = all(any(job.entry is None for job in jobs) for jobs in groups)
        self._exchange(pending, sink, wait=wait and bool(pending) and blocked)
        dt = time.perf_counter() - t
        return [Built(left=b, tokens=sum(len(job.segment) for job in jobs if job.entry is not None),
                      seconds=dt if jobs else 0.0) for jobs, b in zip(groups, budgets)]

    def _exchange(self, jobs: list[EntryJob], sink: JobSink, wait: bool) -> None:
        """One round with the pool: submit the jobs not yet on it, block until one is done (`wait`)
        or just poll, and report every finished entry."""
        new = [job for job in jobs if job.ticket is None]
        for job, ticket in zip(new, self.pool.submit([(job.segment, job.seam) for job in new])):
            sink.job_submitted(job, ticket)
        if wait:
            self.pool.wait_any([job.ticket for job in jobs])
        else:
            self.pool.poll()
        for job in jobs:
            entry = self.pool.take(job.ticket)
            if entry is not None:
                sink.job_done(job, entry)

    def compute(self, segments, seam) -> list[SegmentEntry]:
        return self.pool.compute_entries(list(segments), seam, self.max_batch_tokens)

    def cancel(self, job: EntryJob) -> None:
        if job.ticket is not None:
            self.pool.cancel(job.ticket)


def builder_for(runner: ModelRunner, pool, config: EngineConfig) -> EntryBuilder:
    """The builder of an engine: on `pool` when there is one (each entry alone there), else here, batched as
    `config.entry_batching` says (chosen when the engine is made)."""
    if pool is not None:
        return PoolEntryBuilder(pool, config.max_cold_batch_tokens)
    return LocalEntryBuilder(runner, config.max_cold_batch_tokens, alone=config.entry_batching == "alone")

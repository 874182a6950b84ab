"""The scheduler: which sequences prefill and which decode in the next engine step.

It holds the waiting queue (a policy object: hypic_core/engine/request_queue.py) and the active set
(prefilling + running) and never touches a tensor. Each step it hands every running sequence
one decode token and gives prefill work a token budget (`max_step_tokens` minus the decode
tokens), first to sequences already part-way through their prefill, then to waiting ones in
the queue's order. As it admits one it asks the cache manager to lay out its prefill
(hypic_core/engine/cache_manager.py), which says how many tokens it really has to run. A long prefill therefore runs
over several steps while the running streams keep producing a token per step (chunked
prefill). Admission is bounded by a count (`max_running`) and by memory: the bytes of
attention K/V and linear state each sequence can hold at most (`Sequence.reserved_bytes`)
must fit in `running_budget_bytes` together; a sequence that does not fit now waits.

Thread-safety: the scheduler belongs to the engine thread and holds no lock. `add` may be called
from any thread (the HTTP event loop, the lookup threads): it only puts the sequence in a
thread-safe inbox, which `schedule` empties into the waiting queue at the start of each step, so
`add` never waits for the engine, let alone for a disk or Redis read made while laying out a
prefill. `len()`, `has_work` and `num_waiting` are exact on the engine thread (which is where the
engine and the gateway's engine thread read them); read from another thread (a metrics scrape)
they may be off, for an instant, by a sequence on its way from the inbox to the waiting queue.
"""

from __future__ import annotations

import queue
import time
from dataclasses import dataclass
from typing import Protocol

from ..errors import InvalidRequestError
from .request_queue import queue_for
from .sequence import Sequence, Status


@dataclass(frozen=True)
class SchedulerConfig:
    max_running: int = 8  # sequences prefilling or decoding at once
    max_step_tokens: int = 512  # tokens of model work per step (decode tokens + prefill chunk)
    running_budget_bytes: int = 4 << 30  # K/V + linear state of the active sequences

    def __post_init__(self) -> None:
        for name in ("max_running", "max_step_tokens", "running_budget_bytes"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")


class CachePlanner(Protocol):
    def plan(self, seq: Sequence) -> None:
        """Lay out `seq.prefill` (a restored snapshot moves `seq.num_computed_tokens`), or set `seq.error`;
        never raises. `seq.prefill_left` then says the tokens of work it really has."""


@dataclass(frozen=True)
class ScheduledStep:
    """What the engine runs in one step."""

    aborted: list[Sequence]  # to finish with "abort" (never run again)
    prefills: list[tuple[Sequence, int]]  # (sequence, prefill tokens it may run this step)
    decodes: list[Sequence]  # running sequences: one token each


class Scheduler:
    def __init__(self, config: SchedulerConfig | None = None, cache: CachePlanner | None = None,
                 policy: str = "fcfs") -> None:
        self.config = config or SchedulerConfig()
        self.cache = cache  # None: sequences are admitted as they are (tests)
        self.waiting = queue_for(policy)  # engine thread only, as `active`
        self.active: list[Sequence] = []  # prefilling or running, in admission order
        self._inbox: queue.SimpleQueue[Sequence] = queue.SimpleQueue()  # added, not yet in `waiting`

    # --- any thread ------------------------------------------------------------------------
    def can_ever_fit(self, seq: Sequence) -> bool:
        """Whether `seq` fits the memory budget on its own (else it would wait forever)."""
        return seq.reserved_bytes <= self.config.running_budget_bytes

    def check_fits(self, seq: Sequence) -> None:
        """Raise InvalidRequestError (naming `max_tokens`) when `seq` can never fit the memory budget."""
        if not self.can_ever_fit(seq):
            raise InvalidRequestError(
                "max_tokens", f"the prompt ({seq.request.prompt_tokens} tokens) plus max_tokens ({seq.max_new_tokens}) need "
                f"{seq.reserved_bytes / 2**20:.1f} MiB of cache; the engine holds at most "
                f"{self.config.running_budget_bytes / 2**20:.1f} MiB")

    def add(self, seq: Sequence) -> None:
        """Queue `seq` (status WAITING) for admission (it joins the waiting queue at the next `schedule`)."""
        self._inbox.put(seq)

    def __len__(self) -> int:
        """Sequences not finished: added, waiting or active (exact on the engine thread: module docstring)."""
        return self._inbox.qsize() + len(self.waiting) + len(self.active)

    def has_work(self) -> bool:
        return len(self) > 0

    @property
    def num_waiting(self) -> int:
        return self._inbox.qsize() + len(self.waiting)

    @property
    def num_active(self) -> int:
        return len(self.active)

    # --- engine thread ---------------------------------------------------------------------
    @property
    def reserved_bytes(self) -> int:
        return sum(s.reserved_bytes for s in self.active)

    def schedule(self) -> ScheduledStep:
        """Pick this step's work (see the module docstring). Aborted sequences leave every queue.

        Each sequence admitted is laid out by the cache manager before its budget is decided (a
        warm request needs a small part of its prompt).
        """
        cfg = self.config
        self._take_inbox()
        aborted = [s for s in (*self.waiting, *self.active) if s.abort.aborted]
        for s in aborted:
            self._remove(s)
        decodes = [s for s in self.active if s.status is Status.RUNNING]
        budget = cfg.max_step_tokens - len(decodes) if decodes else cfg.max_step_tokens
        prefills: list[tuple[Sequence, int]] = []
        for s in self.active:
            if s.status is Status.PREFILLING and budget > 0:
                grant = min(max(s.prefill_left, 1), budget)
                prefills.append((s, grant))
                budget -= grant
        reserved = self.reserved_bytes
        while budget > 0 and len(self.active) < cfg.max_running:
            s = self.waiting.peek() if self.waiting else None
            if s is None or reserved + s.reserved_bytes > cfg.running_budget_bytes:
                break  # in the queue's order: later ones do not overtake it
            self.waiting.pop()
            self.active.append(s)
            reserved += s.reserved_bytes
            s.status, s.first_scheduled = Status.PREFILLING, time.perf_counter()
            if self.cache is not None:
                # May read the disk or a shared tier; `add` (the HTTP event loop's) never waits for it.
                self.cache.plan(s)
            grant = min(max(s.prefill_left, 1), budget)
            prefills.append((s, grant))
            budget -= grant
        return ScheduledStep(aborted, prefills, decodes)

    def finish(self, seq: Sequence) -> None:
        """Remove a finished sequence (it frees its slot and memory)."""
        self._take_inbox()
        self._remove(seq)

    def _take_inbox(self) -> None:
        """Move what `add` queued since the last step into the waiting queue, in arrival order."""
        while True:
            try:
                self.waiting.add(self._inbox.get_nowait())
            except queue.Empty:
                return

    def _remove(self, seq: Sequence) -> None:
        if seq in self.active:
            self.active.remove(seq)
        else:
            self.waiting.remove(seq)
